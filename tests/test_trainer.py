"""The trainer on real SST-2/STS-B text with a tiny GPT-2: sharded equals single-device, accumulation equals
a big batch, evaluation keeps every example, resume continues exactly, every optimizer trains."""

import dataclasses
import json
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

transformers = pytest.importorskip("transformers")

from jaxseq import partition  # noqa: E402
from jaxseq.data.glue import encode, get_task, load_split  # noqa: E402
from jaxseq.data.rows import ArrayRows  # noqa: E402
from jaxseq.mesh import make_mesh  # noqa: E402
from jaxseq.models import decide, from_config  # noqa: E402
from jaxseq.train.objectives import SequenceClassification  # noqa: E402
from jaxseq.train.optim import OPTIMIZERS, OptimizerConfig  # noqa: E402
from jaxseq.train.spec import RunSpec  # noqa: E402
from jaxseq.train.trainer import Trainer  # noqa: E402
from jaxseq.train.trainer_config import TrainerConfig  # noqa: E402

TASK = "sequence-classification"
from tests.conftest import shared_asset  # noqa: E402
from tests.tiny import tiny_config  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer():
    folder = shared_asset("data/tokenizers/gpt2")
    tok = transformers.GPT2TokenizerFast(vocab=str(folder / "vocab.json"), merges=str(folder / "merges.txt"))
    assert len(tok) == 50257
    tok.pad_token = tok.eos_token
    return tok


@pytest.fixture(scope="module")
def sst2(tokenizer):
    glue = shared_asset("data/glue")
    task = get_task("sst2")
    train = encode(task, load_split(task, "train", data_dir=glue)[:96], tokenizer, 32)
    dev = encode(task, load_split(task, "validation", data_dir=glue)[:37], tokenizer, 32)
    return task, train, dev


def tiny_classifier(tokenizer, num_labels=2, mesh=None, vocab=50264, dropout=0.1):
    config = transformers.GPT2Config(
        n_layer=2,
        n_embd=64,
        n_head=4,
        n_positions=64,
        vocab_size=vocab,
        num_labels=num_labels,
        pad_token_id=tokenizer.pad_token_id,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
    )
    return from_config(config, "sequence-classification", mesh=mesh, seed=0)


def make_trainer(tmp_path, tokenizer, data, mesh_spec="dp=8", devices=None, **kw):
    task, train, dev = data
    mesh = make_mesh(mesh_spec, devices=devices)
    trainer_kw = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        per_device_eval_batch_size=4,
        max_steps=6,
        logging_steps=1,
        eval_steps=3,
        seed=0,
    )
    trainer_kw.update({k: v for k, v in kw.items() if k in {f.name for f in dataclasses.fields(TrainerConfig)}})
    optim_kw = {k: v for k, v in kw.items() if k in {f.name for f in dataclasses.fields(OptimizerConfig)}}
    optim = OptimizerConfig(**{"learning_rate": 1e-3, "weight_decay": 0.01, **optim_kw})
    model = tiny_classifier(tokenizer, task.num_labels, mesh=mesh, dropout=kw.get("dropout", 0.1))
    spec = RunSpec(
        mesh, model.config, TASK, SequenceClassification(task), TrainerConfig(**trainer_kw), optim, pack=kw.get("pack")
    )
    if "build" in kw:  # the spec's own model (as a job's): given built, or (build="lazy") built by the Trainer
        model = spec.build_model if kw["build"] == "lazy" else spec.build_model()
    return Trainer(spec, model, train, {"": dev}, predict_sets=kw.get("predict_sets"))


def train_losses(trainer):
    trainer.train()
    trainer.close()
    return [r["train/loss"] for r in trainer.logger.records if "train/loss" in r]


def test_the_first_step_compiles_while_the_trainer_builds_the_model(tmp_path, tokenizer, sst2):
    """Trainer(spec, build) (as a job runs): the first step's program compiles once, on the background thread,
    while ``build()`` makes the model; the first step finds it compiled, and the run is the one given the model."""
    compiles = []

    def count(event, seconds, fun_name="", **_):
        if event == "/jax/core/compile/backend_compile_duration" and "train_step" in fun_name:
            compiles.append(threading.current_thread().name)

    runs = {}
    for build in ("lazy", "built"):
        jax.monitoring.register_event_duration_secs_listener(count)
        try:
            trainer = make_trainer(tmp_path / build, tokenizer, sst2, "dp=2", devices=jax.devices()[:2], build=build)
            runs[build] = train_losses(trainer)
        finally:
            jax.monitoring.unregister_event_duration_listener(count)
        if build == "lazy":
            assert len(compiles) == 1 and compiles[0].startswith("jaxseq-compile"), compiles
            assert trainer.program.step._cache_size() == 1  # every step's call found it compiled
    assert len(runs["lazy"]) == 6
    np.testing.assert_array_equal(runs["lazy"], runs["built"])


def test_sharded_training_follows_single_device(tmp_path, tokenizer, sst2):
    # AdamW's epsilon at 1e-6: at 1e-8, an embedding row whose gradient nearly cancels (|g| ~ 1e-8) takes a step of
    # up to lr in the direction of its float noise, which differs between reduction orders (seen: one element of
    # 3.2M off by 2 lr after 6 steps, all others within 2e-5)
    single = make_trainer(
        tmp_path / "one",
        tokenizer,
        sst2,
        "dp=1",
        devices=jax.devices()[:1],
        per_device_train_batch_size=16,
        adam_epsilon=1e-6,
    )
    sharded = make_trainer(
        tmp_path / "many", tokenizer, sst2, "dp=2,mp=4", per_device_train_batch_size=8, adam_epsilon=1e-6
    )
    a, b = train_losses(single), train_losses(sharded)
    assert len(a) == 6 and a[-1] < a[0]
    np.testing.assert_allclose(b, a, atol=1e-4)
    pa, pb = partition.gather(single.state.params), partition.gather(sharded.state.params)
    assert max(jax.tree.leaves(jax.tree.map(lambda x, y: float(np.abs(x - y).max()), pa, pb))) <= 1e-4


def test_gradient_accumulation_equals_one_big_batch(tmp_path, tokenizer, sst2):
    # without dropout (micro-batches draw their own dropout masks)
    big = make_trainer(tmp_path / "big", tokenizer, sst2, per_device_train_batch_size=2, max_steps=3, dropout=0.0)
    accumulated = make_trainer(
        tmp_path / "acc",
        tokenizer,
        sst2,
        per_device_train_batch_size=1,
        gradient_accumulation_steps=2,
        max_steps=3,
        dropout=0.0,
    )
    np.testing.assert_allclose(train_losses(accumulated), train_losses(big), atol=1e-5)


def test_evaluation_covers_every_example(tmp_path, tokenizer, sst2):
    _task, _, dev = sst2
    trainer = make_trainer(tmp_path, tokenizer, sst2, max_steps=1)
    n = len(dev["labels"])
    assert n % trainer.feed.eval_batch != 0  # the last batch is padded
    outputs = []
    metrics = trainer.evaluate()
    # recompute directly, batch by batch, with no padding
    model = trainer.model()
    logits = np.concatenate(
        [np.asarray(model(dev["input_ids"][i : i + 8], dev["attention_mask"][i : i + 8])) for i in range(0, n, 8)]
    )
    outputs = logits.argmax(-1)
    assert metrics["accuracy"] == pytest.approx(float(np.mean(outputs == dev["labels"])))
    trainer.close()


def test_resume_continues_exactly(tmp_path, tokenizer, sst2):
    straight = make_trainer(tmp_path / "straight", tokenizer, sst2, max_steps=6)
    train_losses(straight)
    first = make_trainer(tmp_path / "resumed", tokenizer, sst2, max_steps=6, save_steps=3)
    step = first._train_step

    def crash_after_step_three(state, batch):
        if int(state.step) == 3:
            raise RuntimeError("simulated crash")
        return step(state, batch)

    first._train_step = crash_after_step_three
    with pytest.raises(RuntimeError, match="simulated crash"):
        first.train()
    first.close()
    second = make_trainer(tmp_path / "resumed", tokenizer, sst2, max_steps=6, save_steps=3)
    second.train()
    second.close()
    a, b = partition.gather(straight.state.params), partition.gather(second.state.params)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(x, y)
    records = [json.loads(line) for line in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "train/loss" in r] == [1, 2, 3, 4, 5, 6]


def test_regression_head_reports_correlations(tmp_path, tokenizer):
    glue = shared_asset("data/glue")
    task = get_task("stsb")
    train = encode(task, load_split(task, "train", data_dir=glue)[:64], tokenizer, 32)
    dev = encode(task, load_split(task, "validation", data_dir=glue)[:24], tokenizer, 32)
    trainer = make_trainer(tmp_path, tokenizer, (task, train, dev), max_steps=2)
    results = trainer.train()
    trainer.close()
    assert {"eval_pearson", "eval_spearmanr", "eval_loss", "eval_combined_score"} <= set(results)
    assert all(np.isfinite(v) for v in results.values())


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_every_optimizer_lowers_the_loss(tmp_path, tokenizer, sst2, optimizer):
    lr = {"sgd": 0.1, "adafactor": 1e-2}.get(optimizer, 3e-3)
    trainer = make_trainer(
        tmp_path,
        tokenizer,
        sst2,
        optimizer=optimizer,
        learning_rate=lr,
        max_steps=8,
        eval_steps=100,
        lr_scheduler_type="constant",
    )
    # the same batch every step: the loss must go down
    first = trainer.feed.train_data.take(np.arange(16))
    trainer.feed.train_data = ArrayRows({k: np.tile(v, (8,) + (1,) * (v.ndim - 1)) for k, v in first.items()})
    losses = train_losses(trainer)
    assert losses[-1] < losses[0]


def test_loss_scale_skips_overflow_and_grows_after_a_finite_run():
    import jax.numpy as jnp

    from jaxseq.train.precision import LossScale

    scale = LossScale.create(initial=1024.0, period=3)
    scale = scale.adjust(jnp.bool_(False))
    assert float(scale.scale) == 512.0 and int(scale.skipped) == 1 and int(scale.good_steps) == 0
    for _ in range(2):
        scale = scale.adjust(jnp.bool_(True))
    assert float(scale.scale) == 512.0 and int(scale.good_steps) == 2
    scale = scale.adjust(jnp.bool_(True))
    assert float(scale.scale) == 1024.0 and int(scale.good_steps) == 0


def test_float16_training_with_loss_scaling(tmp_path, tokenizer, sst2):
    import jax.numpy as jnp

    task, train, dev = sst2
    mesh = make_mesh("dp=8")
    config = transformers.GPT2Config(
        n_layer=2,
        n_embd=64,
        n_head=4,
        n_positions=64,
        vocab_size=50264,
        num_labels=2,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = from_config(config, "sequence-classification", mesh=mesh, dtype=jnp.float16)
    spec = RunSpec(
        mesh,
        config,
        TASK,
        SequenceClassification(task),
        TrainerConfig(
            output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=6, logging_steps=1, eval_steps=6, seed=0
        ),
        OptimizerConfig(learning_rate=3e-3, lr_scheduler_type="constant"),
        dtype="float16",
    )
    trainer = Trainer(
        spec, model, {k: np.tile(v[:16], (2,) + (1,) * (v.ndim - 1)) for k, v in train.items()}, {"": dev}
    )
    assert trainer.state.params["score"]["kernel"][...].dtype == jnp.float32  # master weights
    losses = train_losses(trainer)
    records = [r for r in trainer.logger.records if "train/loss_scale" in r]
    assert records[0]["train/loss_scale"] == 2.0**15 and records[-1]["train/skipped_updates"] == 0
    assert np.isfinite(losses).all() and losses[-1] < losses[0]


@jax.jit
def slow_on_device(x):
    """``x`` after tens of milliseconds of device work: dispatch returns at once, the result comes later."""
    m = jnp.full((256, 256), 1e-3, jnp.float32)
    y = jax.lax.fori_loop(0, 200, lambda i, a: jnp.tanh(a @ m), jnp.ones((256, 256), jnp.float32))
    return x + 0 * y[0, 0]


def test_progress_bars_count_finished_steps_not_dispatched_ones(tmp_path, tokenizer, sst2):
    trainer = make_trainer(tmp_path, tokenizer, sst2, max_steps=12, logging_steps=6, eval_steps=6)
    losses, outputs = [], []  # every dispatched step's loss / eval batch's outputs, in order
    step, eval_step = trainer._train_step, trainer._eval_step

    def slow_step(state, batch):
        state, metrics = step(state, batch)
        losses.append(slow_on_device(metrics["loss"]))
        return state, {**metrics, "loss": losses[-1]}

    def slow_eval_step(params, frozen, batch):
        out = eval_step(params, frozen, batch)
        outputs.append(slow_on_device(out["loss"]))
        return {**out, "loss": outputs[-1]}

    trainer._train_step, trainer._eval_step = slow_step, slow_eval_step
    seen = {"train": [], "eval": []}

    def counting(bar, kind, done):
        update, first = bar.update, len(done)  # this bar counts the work dispatched from now on

        def counted(n=1):
            update(n)
            # when the bar shows n, the first n steps (batches) it counts have finished on the devices
            seen[kind].append((bar.n, len(done) - first, all(x.is_ready() for x in done[first : first + bar.n])))

        bar.update = counted
        return bar

    counting(trainer.logger.bar, "train", losses)
    progress = trainer.logger.progress
    trainer.logger.progress = lambda *a, **kw: counting(progress(*a, **kw), "eval", outputs)
    trainer.train()
    trainer.close()
    assert [n for n, _, _ in seen["train"]] == list(range(1, 13))
    assert all(finished for _, _, finished in seen["train"]), seen["train"]
    assert any(n < dispatched for n, dispatched, _ in seen["train"])  # the host did run ahead of the devices
    batches = -(-len(sst2[2]["labels"]) // trainer.feed.eval_batch)
    assert [n for n, _, _ in seen["eval"]] == list(range(1, batches + 1)) * 2
    assert all(finished for _, _, finished in seen["eval"]), seen["eval"]


def test_eta_stays_within_a_fifth_of_the_time_left(tmp_path):
    # a simulated run on a fake clock: 30 s compiling the first step, then 1 s a step and 10 s of evaluation
    # after every 100th; from 10% of the run on, the bar's ETA is within 20% of the time really left
    import re

    from jaxseq.train.logs import RunLogger

    total = 500
    finish_times, now = {1: 30.0}, 30.0
    for step in range(2, total + 1):
        now += 1.0
        finish_times[step] = now
        now += 10.0 if step % 100 == 0 else 0.0
    end = now
    logger = RunLogger(tmp_path, total, enabled=True)
    clock = [0.0]
    logger.bar._time = lambda: clock[0]
    logger.bar.start_t = logger.bar.last_print_t = 0.0
    for step in range(1, total + 1):
        if step > 1 and (step - 1) % 100 == 0:  # what the trainer reports after each evaluation
            clock[0] = finish_times[step - 1] + 10.0
            logger.paused(10.0, pauses_left=(total - step + 1) // 100)
        clock[0] = finish_times[step]
        logger.bar.update(1)
        if step == 1:
            logger.restart_clock()
        if step >= total // 10 and step < total:
            eta = re.search(r"<([\d:]+)", str(logger.bar)).group(1)
            seconds = sum(int(part) * 60**i for i, part in enumerate(reversed(eta.split(":"))))
            assert abs(seconds - (end - clock[0])) <= 0.2 * (end - clock[0]), (step, seconds, end - clock[0])
    logger.close()


@pytest.mark.parametrize(
    ("flag", "remat", "platform", "scans"),
    [
        ("auto", "full", "tpu", True),  # full remat: as fast scanned on an H100, no more memory in TPU plans
        ("auto", "none", "gpu", False),  # without remat the scanned step is slower
        ("auto", "dots", "tpu", False),
        ("auto", "none", "cpu", True),  # on CPU half the compilation, the step as fast (masks drawn ahead)
        ("auto", "dots", "cpu", True),
        ("true", "none", "tpu", True),
        ("false", "full", "cpu", False),
    ],
)
def test_scan_layers_auto_scans_on_cpu_and_under_full_remat(flag, remat, platform, scans):
    assert decide.scans(flag, platform, remat, tiny_config("gpt2")) is scans
