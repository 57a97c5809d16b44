"""``jaxseq kto`` against TRL's KTOTrainer (installed with the test extra), on a tiny GPT-2 whose policy and
reference weights are perturbed apart: rows are tokenised as TRL tokenises them (strings, conversations and
paired records, with --max_length's cut and left-out rows) and the step's sequences, the KL ones included
(each prompt with the completion of the row before it among its device's rows, one device or two), are TRL's
collated batches; for each loss type, with unequal desirable and undesirable weights, the loss, TRL's logged
figures and every gradient equal TRL's ``compute_loss`` on the same batch; LoRA's implicit reference (the
base, adapters off) equals a frozen copy's; the job's flags shape its data and loss; a plan lowers the run's
own step; and the installed ``jaxseq kto`` as a fresh process on one CPU device trains a tiny Llama for 2
steps, logs TRL's names and exports a folder transformers loads whose log-probs are jaxseq's."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.conftest import shared_asset

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from jaxseq import sharding  # noqa: E402
from jaxseq.commands import kto  # noqa: E402
from jaxseq.data.kto import encode_unpaired_rows, kto_rows, unpair  # noqa: E402
from jaxseq.errors import JaxseqError  # noqa: E402
from jaxseq.mesh import make_mesh  # noqa: E402
from jaxseq.models import load_pretrained  # noqa: E402
from jaxseq.runner import Setup, parse_job  # noqa: E402
from jaxseq.train.kto import KTO, LOSS_TYPES, METRICS, KTOConfig  # noqa: E402
from jaxseq.train.lora import LoraConfig  # noqa: E402
from jaxseq.train.optim import OptimizerConfig  # noqa: E402
from jaxseq.train.step import TrainProgram  # noqa: E402
from tests.reference import assert_gradients_match, perturb  # noqa: E402
from tests.test_reward import dataset  # noqa: E402
from tests.tiny import tiny_config  # noqa: E402

TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
ROWS = [
    {"prompt": "The sky on a clear day is", "completion": " blue.", "label": True},
    {"prompt": "Two plus two is", "completion": " five, or so I heard.", "label": False},
    {"prompt": "Water at sea level boils at", "completion": " 100 degrees.", "label": True},
    {"prompt": "The opposite of hot is", "completion": " cold.", "label": True},
    {"prompt": "Paris is the capital of", "completion": " Spain.", "label": False},
    {"prompt": "A week has", "completion": " seven days, Monday first.", "label": True},
]
CONVERSATIONS = [
    {
        "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"}],
        "completion": [{"role": "assistant", "content": "Paris."}],
        "label": True,
    },
    {
        "prompt": [{"role": "user", "content": "Say hi"}],
        "completion": [{"role": "assistant", "content": "No, I would rather not."}],
        "label": False,
    },
    {
        "prompt": [{"role": "user", "content": "Two plus two?"}],
        "completion": [{"role": "assistant", "content": "Four."}],
        "label": True,
    },
]
PAIRED = [  # no prompt in the first: TRL extracts it, then unpairs
    {"chosen": "The sky is blue.", "rejected": "The sky is green."},
    {"chosen": "Two plus two is four.", "rejected": "Two plus two is five, surely."},
]
RECORDS = {"strings": ROWS, "conversations": CONVERSATIONS, "paired": PAIRED}
CASES = {"kto": {"beta": 0.3, "desirable_weight": 1.33, "undesirable_weight": 0.7},
         "apo_zero_unpaired": {"beta": 0.5, "desirable_weight": 0.8, "undesirable_weight": 1.5}}  # fmt: skip


@pytest.fixture(scope="module")
def tok():
    folder = shared_asset("data/tokenizers/gpt2")
    tokenizer = transformers.GPT2TokenizerFast(vocab=str(folder / "vocab.json"), merges=str(folder / "merges.txt"))
    tokenizer.chat_template = TEMPLATE
    return tokenizer


@pytest.fixture(scope="module")
def folders(tok, tmp_path_factory):
    """A tiny GPT-2 reference (perturbed) and a policy perturbed further from it, as Hugging Face folders."""
    root = tmp_path_factory.mktemp("kto-models")
    config = tiny_config("gpt2", n_positions=64, vocab_size=len(tok))
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
    torch.manual_seed(0)
    model = perturb(transformers.GPT2LMHeadModel(config), std=0.05, seed=0)
    model.save_pretrained(root / "ref")
    tok.save_pretrained(root / "ref")
    perturb(model, std=0.02, seed=1).save_pretrained(root / "policy")
    tok.save_pretrained(root / "policy")
    return root / "policy", root / "ref"


def trl_trainer(tok, folders, rows, tmp_path, **config):
    """TRL's KTOTrainer on ``rows`` in float32 on the CPU, the whole set one batch."""
    args = trl.KTOConfig(
        output_dir=str(tmp_path / "trl"),
        per_device_train_batch_size=len(unpair(rows)),
        bf16=False,
        use_cpu=True,
        gradient_checkpointing=False,
        report_to=[],
        save_strategy="no",
        **config,
    )
    policy, ref = (transformers.AutoModelForCausalLM.from_pretrained(f) for f in folders)
    return trl.KTOTrainer(
        model=policy, ref_model=ref, args=args, train_dataset=datasets.Dataset.from_list(rows), processing_class=tok
    )


def trl_batch(trainer):
    return trainer.data_collator([trainer.train_dataset[i] for i in range(len(trainer.train_dataset))])


def jaxseq_batch(tok, records, max_length=None):
    records = unpair(records)
    rows = kto_rows(encode_unpaired_rows(tok, records, progress=False), [r["label"] for r in records], max_length,
                    tok.eos_token_id)  # fmt: skip
    return {k: jnp.asarray(v) for k, v in rows.items()}


def trl_prepared(trainer, records, tok, max_length=None, per_device=None):
    """TRL's collated batch of ``records`` prepared with ``max_length`` and its KL pairs made in runs of
    ``per_device`` rows (default: all)."""
    trainer.args.max_length = trainer.data_collator.max_length = max_length
    trainer.args.per_device_train_batch_size = per_device or len(unpair(records))
    dataset = trainer._prepare_dataset(datasets.Dataset.from_list(records), tok, trainer.args, "x")
    return trainer.data_collator(list(dataset))


def assert_sequences_are_trls(objective, batch, want) -> None:
    """The objective's sequences of ``batch`` (each row's own, and the KL ones) are TRL's collated ``want``."""
    for prefix, kl in (("", False), ("KL_", True)):
        ids, mask, completion = (np.asarray(x) for x in objective._sequences(batch, kl))
        width = want[f"{prefix}input_ids"].shape[1]
        assert not mask[:, width:].any()
        np.testing.assert_array_equal(mask[:, :width], want[f"{prefix}attention_mask"].numpy())
        np.testing.assert_array_equal(completion[:, :width], want[f"{prefix}completion_mask"].numpy())
        real = mask[:, :width] == 1
        np.testing.assert_array_equal(ids[:, :width][real], want[f"{prefix}input_ids"].numpy()[real])


@pytest.mark.parametrize("kind", RECORDS)
def test_rows_and_kl_sequences_are_trls(tok, folders, tmp_path, kind):
    records = RECORDS[kind]
    trainer = trl_trainer(tok, folders, records, tmp_path)
    batch = jaxseq_batch(tok, records)
    prepared = trainer.train_dataset
    assert [r["label"] for r in unpair(records)] == prepared["label"]
    for i, (prompt, completion) in enumerate(encode_unpaired_rows(tok, unpair(records), progress=False)):
        assert (prompt, completion) == (prepared[i]["prompt_ids"], prepared[i]["completion_ids"])
        assert tok.eos_token_id in completion  # appended, or the template's
    assert_sequences_are_trls(KTO(), batch, trl_batch(trainer))
    # two devices' rows: each pairs its own half, as TRL's batches of half the rows
    if len(prepared) % 2 == 0:
        assert_sequences_are_trls(
            KTO(batch_shards=2), batch, trl_prepared(trainer, records, tok, None, len(prepared) // 2)
        )
    # --max_length: the longest prompt's rows are left out, the others cut on the right, before the KL pairing
    cut = max(len(p) for p in prepared["prompt_ids"])
    want = trl_prepared(trainer, records, tok, cut)
    got = jaxseq_batch(tok, records, cut)
    kept = sum(len(p) < cut for p in prepared["prompt_ids"])
    assert 2 <= len(got["label"]) == len(want["label"]) == kept < len(prepared)
    assert_sequences_are_trls(KTO(max_length=cut), got, want)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_loss_metrics_and_gradients_equal_trl(tok, folders, tmp_path, loss_type):
    case = CASES[loss_type]
    trainer = trl_trainer(tok, folders, ROWS, tmp_path, loss_type=loss_type, **case)
    model = trainer.model.train()
    loss = trainer.compute_loss(model, trl_batch(trainer))
    loss.backward()
    want_grads = {n: p.grad.numpy() for n, p in model.named_parameters()}
    want = {k: trainer._metrics["train"][k][-1] for k in METRICS}

    objective = KTOConfig(loss_type=loss_type, **case).objective()
    assert objective.needs_reference and not objective.precomputes_reference
    policy, ref = (load_pretrained(folder, "causal-lm") for folder in folders)
    batch = jaxseq_batch(tok, ROWS)
    batch.update(objective.reference(ref, batch))
    assert set(batch) >= ({"ref_logps", "ref_KL_logps"} if loss_type == "kto" else {"ref_logps"})
    graphdef, state = nnx.split(policy)
    (got, metrics), grads = jax.jit(
        jax.value_and_grad(lambda s: objective.loss_and_metrics(nnx.merge(graphdef, s), batch), has_aux=True)
    )(state)
    assert abs(float(got) - loss.item()) <= 1e-5 * max(1.0, abs(loss.item())), (float(got), loss.item())
    assert abs(want["rewards/margins"]) > 1e-3 and (loss_type != "kto" or want["kl"] > 1e-4)  # policy != ref
    assert set(metrics) == set(want)
    for key, value in want.items():
        assert abs(float(metrics[key]) - value) <= 1e-4 * max(1.0, abs(value)), (key, float(metrics[key]), value)
    assert_gradients_match(policy, grads, want_grads)
    outputs = jax.tree.map(np.asarray, objective.predict(policy, batch))  # evaluation: the same figures
    assert objective.metrics(outputs) == pytest.approx({"loss": loss.item(), **want}, rel=1e-4, abs=1e-6)


def test_lora_reference_is_the_base_with_adapters_off(tok, folders):
    """With LoRA the reference columns (the KL sequences' included) are the base's, adapters off: the eval
    step's rows equal those of the merged weights against a frozen copy of the base."""
    mesh = make_mesh("dp=1", devices=jax.devices()[:1])
    objective = KTO("kto", 0.3, 1.33, 0.7)
    batch = jaxseq_batch(tok, ROWS)
    base = load_pretrained(folders[1], "causal-lm", mesh=mesh)
    lora = LoraConfig(lora_rank=4, lora_alpha=8.0, lora_dropout=0.0)
    program = TrainProgram(base, objective, mesh, OptimizerConfig(), total_steps=1, seed=0, lora=lora)
    frozen = program.training.freeze(nnx.state(base))
    adapters = program.training.init(nnx.state(base))
    leaves, treedef = jax.tree_util.tree_flatten_with_path(adapters)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    adapters = jax.tree.unflatten(
        treedef,
        [x + 0.3 * jax.random.normal(k, x.shape) if "lora_B" in jax.tree_util.keystr(p) else x
         for (p, x), k in zip(leaves, keys)],
    )  # fmt: skip
    with_lora = program.eval_step(adapters, frozen, batch)
    start = load_pretrained(folders[1], "causal-lm", mesh=mesh)
    full = TrainProgram(start, objective, mesh, OptimizerConfig(), total_steps=1, seed=0)
    merged = sharding.shard(program.training.lora.merged(adapters, frozen), full.state_shardings.params)
    with_copy = full.eval_step(merged, full.training.freeze(nnx.state(start)), batch)
    assert np.abs(np.asarray(with_lora["rewards"])).max() > 1e-3 and float(with_lora["kl"][0]) > 0
    for key in ("row_loss", "kl", "rewards", "logps"):
        np.testing.assert_allclose(np.asarray(with_lora[key]), np.asarray(with_copy[key]), rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------- the job's flags


def test_kto_flags_shape_the_rows_and_the_loss(folders, tmp_path, monkeypatch):
    """--dataset_name/--dataset_config_name (--dataset_config), --validation_split_percentage,
    --max_train_samples and --max_eval_samples pick the rows, paired ones unpaired; --max_length leaves out
    rows whose prompt fills it; --chat_template renders conversations; --beta, --loss_type, --desirable_weight,
    --undesirable_weight, --precompute_ref_log_probs and --loss_chunk_tokens are the objective's; kto with one
    row a device, precomputing kto's reference, --do_eval without validation rows and a bad label stop in one
    line."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-datasets")
    plain = [{"prompt": f"Question {i}" + " more" * (i % 3), "completion": f" answer {i}", "label": i % 3 != 0}
             for i in range(12)]  # fmt: skip
    chats = [{"prompt": [{"role": "user", "content": "hi"}], "completion": [{"role": "assistant", "content": "yo"}],
              "label": True}] * 4  # fmt: skip
    data = dataset(tmp_path / "rows", {"plain": plain, "chats": chats, "pairs": PAIRED * 3})
    base = ["--model_name_or_path", folders[0], "--dataset_name", data, "--output_dir", tmp_path / "out"]
    argv = [str(a) for a in [*base, "--dataset_config_name", "plain", "--validation_split_percentage", "25"]]

    def prepare(*flags, start=argv):
        setup = Setup(kto.JOB, parse_job(kto.JOB, [*map(str, start), *map(str, flags)]))
        return setup, kto.prepare(setup)

    _, whole = prepare("--beta", 0.2, "--desirable_weight", 2.0, "--undesirable_weight", 0.5, "--loss_chunk_tokens", 0)
    assert (len(whole.train["label"]), len(whole.evals[""]["label"])) == (9, 3)
    objective = whole.objective
    assert (objective.beta, objective.desirable_weight, objective.undesirable_weight) == (0.2, 2.0, 0.5)
    assert objective.loss_type == "kto" and objective.lm.chunk_tokens is None and objective.needs_reference
    _, cut = prepare("--max_train_samples", 4, "--max_eval_samples", 2, "--loss_type", "apo_zero_unpaired",
                     "--precompute_ref_log_probs", "--per_device_train_batch_size", 1)  # fmt: skip
    assert (len(cut.train["label"]), len(cut.evals[""]["label"])) == (4, 2)
    assert cut.objective.precomputes_reference and not cut.objective.needs_reference
    # "Question i" is 2 tokens, with " more" 3 or more: those rows are left out
    _, short = prepare("--max_length", 3, "--do_train", "--validation_split_percentage", 0)
    assert short.train["prompt_length"].tolist() == [2] * 4 and not short.evals and short.seq_len == 3
    _, pairs = prepare("--dataset_config", "pairs")
    assert pairs.train["label"].tolist() == [1] * 5 + [0] * 5  # 5 pairs (1 held out): chosen, then rejected
    (tmp_path / "t.jinja").write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    setup, rendered = prepare("--dataset_config", "chats", "--chat_template", tmp_path / "t.jinja")
    row = rendered.train
    ids = row["input_ids"][0, : row["prompt_length"][0] + row["completion_length"][0]]
    assert setup.tokenizer.decode(ids) == "[hi][yo]" and row["prompt_length"][0] == 2  # "[hi]": no EOS added
    with pytest.raises(JaxseqError, match="at least 2"):
        prepare("--per_device_train_batch_size", 1)
    with pytest.raises(JaxseqError, match="needs --loss_type apo_zero_unpaired"):
        prepare("--precompute_ref_log_probs")
    files = ["--model_name_or_path", folders[0], "--output_dir", tmp_path / "out"]
    (tmp_path / "one.jsonl").write_text(json.dumps(ROWS[0]) + "\n" + json.dumps(ROWS[1]) + "\n")
    with pytest.raises(JaxseqError, match="--do_eval needs validation rows"):
        prepare("--train_file", tmp_path / "one.jsonl", "--do_eval", start=files)
    (tmp_path / "bad.jsonl").write_text(json.dumps({**ROWS[0], "label": "yes"}) + "\n")
    with pytest.raises(JaxseqError, match="label must be true or false"):
        prepare("--train_file", tmp_path / "bad.jsonl", "--validation_file", tmp_path / "one.jsonl", start=files)


def test_a_kto_plan_lowers_the_runs_own_step(tok, folders, tmp_path):
    """The run's train step on a dp=4, mp=2 mesh and the plan's, from abstract weights and rows of --max_length
    tokens (here the rows' width: the longest prompt plus the longest completion), lower to the same program:
    the same policy, frozen reference and KL sequences."""
    from tests.test_run_spec import lowered_texts

    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS * 2))
    width = jaxseq_batch(tok, ROWS)["input_ids"].shape[1]
    argv = [
        "--model_name_or_path", folders[0], "--train_file", tmp_path / "rows.jsonl", "--max_length", width,
        "--output_dir", tmp_path / "out", "--max_steps", 1, "--per_device_train_batch_size", 2, "--report_to", "none",
    ]  # fmt: skip
    run, plan, names = lowered_texts(kto.JOB, [str(a) for a in argv], make_mesh("dp=4,mp=2"))
    assert names == {"input_ids", "prompt_length", "completion_length", "label"} and run == plan


# --------------------------------------------------------------------------- the installed command, one device

JAXSEQ = Path(sys.executable).with_name("jaxseq")


@pytest.fixture(scope="module")
def run(tok, tmp_path_factory):
    """``jaxseq kto`` (the installed command, a fresh process on one CPU device) on a tiny Llama: 2 steps of 3
    rows, then evaluated."""
    root = tmp_path_factory.mktemp("kto-run")
    config = tiny_config("llama", vocab_size=len(tok), max_position_embeddings=64, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    perturb(transformers.LlamaForCausalLM(config), std=0.05).save_pretrained(root / "llama")
    tok.save_pretrained(root / "llama")
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (root / "dev.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS[:4]))
    out = root / "out"
    args = [
        "--model_name_or_path", root / "llama", "--train_file", root / "train.jsonl",
        "--validation_file", root / "dev.jsonl", "--output_dir", out, "--do_train", "--do_eval",
        "--max_steps", 2, "--per_device_train_batch_size", 3, "--per_device_eval_batch_size", 4,
        "--learning_rate", 1e-3, "--beta", 0.2, "--undesirable_weight", 1.2, "--max_length", 64,
        "--logging_steps", 1, "--report_to", "none", "--save_strategy", "no",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1")
    result = subprocess.run([str(JAXSEQ), "kto", *map(str, args)], capture_output=True, text=True, env=env,
                            timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return out, result


def test_the_command_trains_and_logs_trls_names(run):
    out, result = run
    assert "Traceback" not in result.stderr
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in logged if "train/loss" in r]
    assert [r["step"] for r in train] == [1, 2]
    assert {f"train/{k}" for k in ("loss", *METRICS)} <= set(train[0])
    results = json.loads((out / "eval_results.json").read_text())
    assert {f"eval_{k}" for k in ("loss", *METRICS)} <= set(results) and results["eval_samples"] == 4


def test_the_export_loads_in_transformers_with_jaxseqs_log_probs(tok, run):
    out, _ = run
    results = json.loads((out / "eval_results.json").read_text())
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    saved = transformers.AutoTokenizer.from_pretrained(out)
    logps = []
    for prompt, completion in encode_unpaired_rows(saved, ROWS[:4], progress=False):
        ids = torch.tensor([prompt + completion])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, :-1].log_softmax(-1)
        picked = logits.gather(-1, ids[0, 1:, None])[:, 0]
        logps.append(picked[len(prompt) - 1 :].sum().item())
    chosen = [lp for lp, r in zip(logps, ROWS, strict=False) if r["label"]]
    rejected = [lp for lp, r in zip(logps, ROWS, strict=False) if not r["label"]]
    want = {"eval_logps/chosen": np.mean(chosen), "eval_logps/rejected": np.mean(rejected)}
    assert {k: results[k] for k in want} == pytest.approx(want, rel=1e-4, abs=1e-4)
