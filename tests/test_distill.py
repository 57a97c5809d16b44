"""``jaxseq distill`` against TRL (installed with the test extra): a tiny Llama student and a wider, deeper
Llama teacher of the same vocabulary, both perturbed. Rows are TRL's ``DataCollatorForChatML``'s (multi-turn
conversations, prompt-completion records, non-ASCII text, --max_length keeping the last tokens); the loss and
every gradient equal ``GKDTrainer.compute_loss``'s for beta 0, 0.5 and 1; with a temperature the divergence is
TRL's ``generalized_jsd_loss``'s, and at --lmbda 1 the loss is ``DistillationTrainer``'s chunked one; the
chunked loss equals the whole one; on-policy rows are GKD's ``generate_on_policy_outputs``'; the job's flags
shape its data and loss; a plan lowers the run's own step, the teacher included; and the installed command
in a fresh process trains, step for step, as TRL's GKDTrainer does, and exports a folder transformers loads."""

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

from trl.experimental.gkd import GKDConfig, GKDTrainer  # noqa: E402
from trl.experimental.utils import DataCollatorForChatML  # noqa: E402
from trl.trainer.distillation_trainer import _chunked_divergence_loss  # noqa: E402

from jaxseq.commands import distill  # noqa: E402
from jaxseq.data.distill import DistillDataConfig, load_distill_rows  # noqa: E402
from jaxseq.errors import JaxseqError  # noqa: E402
from jaxseq.mesh import make_mesh  # noqa: E402
from jaxseq.models import load_pretrained  # noqa: E402
from jaxseq.runner import Setup, parse_job  # noqa: E402
from jaxseq.train.distill import Distill, DistillConfig, OnPolicy, generalized_jsd  # noqa: E402
from jaxseq.train.objectives import CausalLM  # noqa: E402
from tests.reference import assert_gradients_match, perturb  # noqa: E402
from tests.test_reward import dataset  # noqa: E402
from tests.tiny import tiny_config  # noqa: E402

TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
CHATS = [
    {"messages": [{"role": "user", "content": "What colour is the sky?"},
                  {"role": "assistant", "content": "Blue, mostly."}]},
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Two plus two?"},
                  {"role": "assistant", "content": "Four."}, {"role": "user", "content": "And three more?"},
                  {"role": "assistant", "content": "Seven, I am told."}]},
    {"messages": [{"role": "user", "content": "Un café, s'il vous plaît ☕"},
                  {"role": "assistant", "content": "Voilà, un café crème — très bon."}]},
    {"prompt": [{"role": "user", "content": "Name a fruit."}],
     "completion": [{"role": "assistant", "content": "An apple, or a pear."}]},
    {"prompt": "Capital of France?", "completion": "Paris."},
    {"messages": [{"role": "user", "content": "Opposite of hot?"}, {"role": "assistant", "content": "Cold."}]},
]  # fmt: skip
BETAS = (0.0, 0.5, 1.0)


def as_messages(record: dict) -> dict:
    """A record as TRL's GKD collator reads it: one conversation, its last message the completion."""
    if "messages" in record:
        return record
    turn = lambda value, role: [{"role": role, "content": value}] if isinstance(value, str) else value
    return {"messages": turn(record["prompt"], "user") + turn(record["completion"], "assistant")}


@pytest.fixture(scope="module")
def tok():
    folder = shared_asset("data/tokenizers/gpt2")
    tokenizer = transformers.GPT2TokenizerFast(vocab=str(folder / "vocab.json"), merges=str(folder / "merges.txt"))
    tokenizer.chat_template = TEMPLATE
    tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


@pytest.fixture(scope="module")
def folders(tok, tmp_path_factory):
    """A tiny Llama student and a wider, deeper Llama teacher of its vocabulary, perturbed, as folders."""
    root = tmp_path_factory.mktemp("distill-models")
    common = {"vocab_size": len(tok), "max_position_embeddings": 128, "eos_token_id": tok.eos_token_id,
              "pad_token_id": tok.eos_token_id}  # fmt: skip
    teacher = {"hidden_size": 48, "intermediate_size": 80, "num_hidden_layers": 3}
    for name, overrides, seed in (("student", {}, 0), ("teacher", teacher, 1)):
        torch.manual_seed(seed)
        model = transformers.LlamaForCausalLM(tiny_config("llama", **common, **overrides))
        perturb(model, std=0.05, seed=seed).save_pretrained(root / name)
        tok.save_pretrained(root / name)
    return root / "student", root / "teacher"


def rows_of(tok, records, tmp_path, max_length=1024, prompts_only=False):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    config = DistillDataConfig(train_file=str(path), max_length=max_length)
    train, _ = load_distill_rows(config, tok, prompts_only=prompts_only, progress=False, evaluate=False)
    return train


def trl_trainer(tok, folders, tmp_path, **config):
    """TRL's GKDTrainer in float32 on the CPU, on the data's completions."""
    args = GKDConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=len(CHATS), bf16=False,
                     use_cpu=True, report_to=[], save_strategy="no", lmbda=0.0, **config)  # fmt: skip
    student, teacher = (transformers.AutoModelForCausalLM.from_pretrained(f) for f in folders)
    records = [as_messages(r) for r in CHATS]
    return GKDTrainer(model=student, teacher_model=teacher, args=args, processing_class=tok,
                      train_dataset=datasets.Dataset.from_list(records))  # fmt: skip


@pytest.mark.parametrize("max_length", [1024, 32])
def test_rows_are_trls_collated_ones(tok, tmp_path, max_length):
    """Tokens, the completion's mask and the prompt: TRL's collator's (left-padded), ours right-padded; a row
    longer than --max_length keeps its last tokens."""
    rows = rows_of(tok, CHATS, tmp_path, max_length)
    want = DataCollatorForChatML(tokenizer=tok, max_length=max_length)([as_messages(r) for r in CHATS])
    assert (rows["input_ids"].shape[1] == 32) == (max_length == 32)
    for i in range(len(CHATS)):
        real = want["attention_mask"][i].numpy() == 1
        n = int(real.sum())
        np.testing.assert_array_equal(rows["input_ids"][i, :n], want["input_ids"][i].numpy()[real])
        np.testing.assert_array_equal(rows["attention_mask"][i], np.arange(rows["input_ids"].shape[1]) < n)
        np.testing.assert_array_equal(rows["loss_mask"][i, :n], want["labels"][i].numpy()[real] != -100)
        prompt = want["prompts"][i].numpy()[want["prompt_attention_mask"][i].numpy() == 1]
        np.testing.assert_array_equal(rows["input_ids"][i, : rows["prompt_length"][i]], prompt)
    assert rows["loss_mask"].sum(1).min() > 0
    # the second conversation's first answer is prompt; its last, with its end-of-turn tokens, the completion
    second = rows["input_ids"][1, rows["loss_mask"][1] == 1]
    assert tok.decode(second) == "Seven, I am told.<|endoftext|>\n"


def jaxseq_loss(objective, student, batch):
    graphdef, state = nnx.split(student)
    return jax.jit(jax.value_and_grad(lambda s: objective.loss(nnx.merge(graphdef, s), batch)))(state)


@pytest.mark.parametrize("beta", BETAS)
def test_loss_and_gradients_equal_gkds(tok, folders, tmp_path, beta):
    trainer = trl_trainer(tok, folders, tmp_path, beta=beta)
    model = trainer.model.train()
    loss = trainer.compute_loss(model, trainer.data_collator(list(trainer.train_dataset)))
    loss.backward()
    want_grads = {n: p.grad.numpy() for n, p in model.named_parameters()}

    student, teacher = (load_pretrained(f, "causal-lm") for f in folders)
    batch = {k: jnp.asarray(v) for k, v in rows_of(tok, CHATS, tmp_path).items()}
    objective = Distill(DistillConfig(lmbda=0.0, beta=beta), lm=CausalLM(None)).with_teacher(teacher)
    got, grads = jaxseq_loss(objective, student, batch)
    assert loss.item() > 1e-3
    assert abs(float(got) - loss.item()) <= 1e-5 * max(1.0, loss.item()), (float(got), loss.item())
    assert_gradients_match(student, grads, want_grads)
    # chunks of 8 positions a device: the same loss and gradients
    chunked = Distill(DistillConfig(lmbda=0.0, beta=beta), lm=CausalLM(8)).with_teacher(teacher)
    again, chunk_grads = jaxseq_loss(chunked, student, batch)
    assert float(again) == pytest.approx(float(got), rel=1e-6)
    for a, b in zip(jax.tree.leaves(chunk_grads), jax.tree.leaves(grads)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
    # evaluation: the same loss, pooled over the rows' tokens
    outputs = jax.tree.map(np.asarray, objective.predict(student, batch))
    assert objective.metrics(outputs)["loss"] == pytest.approx(loss.item(), rel=1e-5)


@pytest.mark.parametrize("beta", BETAS)
def test_a_temperature_divides_both_distributions_as_trl(beta):
    """GKD's ``generalized_jsd_loss`` at temperature 2, position by position."""
    rng = np.random.default_rng(0)
    student, teacher = (rng.normal(size=(2, 5, 40)).astype(np.float32) * 3 for _ in range(2))
    want = GKDTrainer.generalized_jsd_loss(torch.tensor(student), torch.tensor(teacher), beta=beta, temperature=2.0,
                                           reduction="none").sum(-1)  # fmt: skip
    got = generalized_jsd(jnp.asarray(student), jnp.asarray(teacher), beta, temperature=2.0)
    np.testing.assert_allclose(np.asarray(got), want.numpy(), rtol=1e-5, atol=1e-7)
    assert float(jnp.abs(got - generalized_jsd(jnp.asarray(student), jnp.asarray(teacher), beta)).max()) > 1e-3


@pytest.mark.parametrize("beta", BETAS)
def test_at_lmbda_1_the_loss_is_the_distillation_trainers(tok, folders, tmp_path, beta):
    """``DistillationTrainer``'s chunked loss (its temperature in the loss) on the two models' hidden states at
    the positions that predict the completion tokens."""
    rows = rows_of(tok, CHATS, tmp_path)
    torch_models = [transformers.AutoModelForCausalLM.from_pretrained(f).eval() for f in folders]
    ids, mask = torch.tensor(rows["input_ids"], dtype=torch.long), torch.tensor(rows["attention_mask"])
    scored = np.roll(rows["loss_mask"], -1, axis=1).astype(bool)
    scored[:, -1] = False
    with torch.no_grad():
        hidden = [m.model(input_ids=ids, attention_mask=mask).last_hidden_state[torch.tensor(scored)][None]
                  for m in torch_models]  # fmt: skip
    want, _, _ = _chunked_divergence_loss(hidden[0], hidden[1], torch_models[0].lm_head.weight,
                                          torch_models[1].lm_head.weight, torch.ones(hidden[0].shape[:2]), beta,
                                          temperature=2.0)  # fmt: skip
    config = DistillConfig(lmbda=1.0, beta=beta, temperature=2.0)
    assert config.loss_temperature == 2.0 and DistillConfig(lmbda=0.5, temperature=2.0).loss_temperature == 1.0
    student, teacher = (load_pretrained(f, "causal-lm") for f in folders)
    got = Distill(config).with_teacher(teacher).loss(student, {k: jnp.asarray(v) for k, v in rows.items()})
    assert float(got) == pytest.approx(want.item(), rel=1e-5)


def test_on_policy_rows_are_gkds(tok, folders, tmp_path):
    """Near-greedy samples (temperature 1e-4) equal transformers' greedy ones, and the rows made of them are
    GKD's ``generate_on_policy_outputs``': left-padded prompts, each completion to its first EOS, the rest
    masked; the steps that sample are a function of the seed and the step, ``lmbda`` of them."""
    rows = rows_of(tok, CHATS, tmp_path)
    width = int(rows["prompt_length"].max())
    collated = DataCollatorForChatML(tokenizer=tok)([as_messages(r) for r in CHATS])
    assert collated["prompts"].shape[1] == width
    model = transformers.AutoModelForCausalLM.from_pretrained(folders[0]).eval()
    config = transformers.GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=tok.eos_token_id,
                                           pad_token_id=tok.eos_token_id)  # fmt: skip
    with torch.no_grad():
        want_ids, want_mask, want_labels = GKDTrainer.generate_on_policy_outputs(model, collated, config)
    sampler = OnPolicy(DistillConfig(lmbda=1.0, temperature=1e-4, max_new_tokens=6), width, [tok.eos_token_id],
                       tok.eos_token_id, seed=0)  # fmt: skip
    got = sampler.sample(load_pretrained(folders[0], "causal-lm"), rows["input_ids"], rows["prompt_length"], seed=3)
    np.testing.assert_array_equal(got["attention_mask"], want_mask.numpy())
    real = want_mask.numpy() == 1
    np.testing.assert_array_equal(got["input_ids"][real], want_ids.numpy()[real])
    np.testing.assert_array_equal(got["loss_mask"] == 1, want_labels.numpy() != -100)
    draws = [OnPolicy(DistillConfig(lmbda=lmbda), 4, [0], 0, seed=7).on_policy for lmbda in (0.0, 0.3, 1.0)]
    steps = range(400)
    assert [sum(map(draw, steps)) for draw in draws][::2] == [0, 400]
    assert 80 <= sum(map(draws[1], steps)) <= 160 and [draws[1](s) for s in steps] == [draws[1](s) for s in steps]


# --------------------------------------------------------------------------- the job's flags


def test_distill_flags_shape_the_rows_and_the_loss(folders, tmp_path, monkeypatch):
    """--dataset_name/--dataset_config_name (--dataset_config), --validation_split_percentage,
    --max_train_samples, --max_eval_samples and --max_length pick and cut the rows; --chat_template renders
    them; --lmbda, --beta, --temperature, --max_new_tokens (--max_completion_length) and --loss_chunk_tokens
    are the loss's, TRL's defaults for GKD and at --lmbda 1; prompts alone at --lmbda 1; a missing teacher, one
    of another vocabulary, --do_eval without validation rows and a one-message row stop in one line."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-datasets")
    chats = [as_messages(CHATS[i % len(CHATS)]) for i in range(12)]
    prompts = [{"prompt": f"Question {i}?"} for i in range(4)]
    data = dataset(tmp_path / "rows", {"chats": chats, "prompts": prompts})
    student, teacher = map(str, folders)
    base = ["--model_name_or_path", student, "--teacher_model_name_or_path", teacher, "--dataset_name", data,
            "--output_dir", tmp_path / "out"]  # fmt: skip

    def prepare(*flags, start=base):
        setup = Setup(distill.JOB, parse_job(distill.JOB, [*map(str, start), *map(str, flags)]))
        return setup, distill.prepare(setup)

    _, gkd = prepare("--dataset_config_name", "chats", "--validation_split_percentage", 25, "--loss_chunk_tokens", 0)
    assert (len(gkd.train["input_ids"]), len(gkd.evals[""]["input_ids"])) == (9, 3)
    config = gkd.objective.config
    assert (config.lmbda, config.beta, config.temperature, config.max_new_tokens) == (0.5, 0.5, 0.9, 128)
    assert gkd.objective.samples_in_the_loop and gkd.objective.lm.chunk_tokens is None
    assert gkd.teacher.folder == Path(teacher) and gkd.teacher.config.num_hidden_layers == 3
    _, cut = prepare("--dataset_config", "chats", "--max_train_samples", 4, "--max_eval_samples", 2,
                     "--validation_split_percentage", 25, "--max_length", 24, "--lmbda", 0, "--beta", 0.2,
                     "--temperature", 0.7, "--max_new_tokens", 9, "--loss_chunk_tokens", 64)  # fmt: skip
    assert (len(cut.train["input_ids"]), len(cut.evals[""]["input_ids"])) == (4, 2)
    assert cut.train["input_ids"].shape[1] == 24 and not cut.objective.samples_in_the_loop
    config = cut.objective.config
    assert (config.beta, config.temperature, config.max_new_tokens, cut.objective.lm.chunk_tokens) == (0.2, 0.7, 9, 64)
    _, on_policy = prepare("--dataset_config", "prompts", "--lmbda", 1, "--max_completion_length", 5)
    config = on_policy.objective.config
    assert (config.beta, config.temperature, config.max_new_tokens, config.loss_temperature) == (1.0, 1.0, 5, 1.0)
    assert on_policy.train["loss_mask"].sum() == 0 and on_policy.objective.sampler.prompt_width > 0
    (tmp_path / "t.jinja").write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    setup, rendered = prepare("--dataset_config", "chats", "--chat_template", tmp_path / "t.jinja", "--lmbda", 0)
    row = rendered.train
    assert setup.tokenizer.decode(row["input_ids"][0][row["attention_mask"][0] == 1]).startswith("[What colour")
    with pytest.raises(JaxseqError, match="give the teacher"):
        prepare(start=base[:2] + base[4:])
    with pytest.raises(JaxseqError, match="--lmbda must be between 0 and 1"):
        prepare("--lmbda", 1.5)
    with pytest.raises(JaxseqError, match="--beta must be between 0 and 1"):
        prepare("--beta", -0.1)
    files = ["--model_name_or_path", student, "--teacher_model_name_or_path", teacher, "--output_dir", tmp_path / "o"]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats[:3]))
    with pytest.raises(JaxseqError, match="--do_eval needs validation rows"):
        prepare("--train_file", tmp_path / "c.jsonl", "--do_eval", start=files)
    (tmp_path / "one.jsonl").write_text(json.dumps({"messages": [{"role": "assistant", "content": "hi"}]}) + "\n")
    with pytest.raises(JaxseqError, match="needs a prompt"):
        prepare("--train_file", tmp_path / "one.jsonl", start=files)
    other = tmp_path / "other"
    config = transformers.AutoConfig.from_pretrained(teacher)
    config.vocab_size += 8
    transformers.LlamaForCausalLM(config).save_pretrained(other)
    with pytest.raises(JaxseqError, match="pick a teacher of the student's tokenizer"):
        prepare("--train_file", tmp_path / "c.jsonl", start=[*files[:2], "--teacher_model_name_or_path", other,
                                                             *files[4:]])  # fmt: skip


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_a_distill_plan_lowers_the_runs_own_step(folders, tmp_path, quantization):
    """The run's train step on a dp=4, mp=2 mesh and the plan's, from abstract weights (the teacher's too: with
    --teacher_quantization its codes and scales) and rows of --max_length tokens, lower to the same program."""
    from tests.test_run_spec import lowered_texts

    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(as_messages(r)) + "\n" for r in CHATS * 2))
    argv = [
        "--model_name_or_path", folders[0], "--teacher_model_name_or_path", folders[1], "--lmbda", 0,
        "--train_file", tmp_path / "rows.jsonl", "--max_length", 48, "--output_dir", tmp_path / "out",
        "--max_steps", 1, "--per_device_train_batch_size", 2, "--report_to", "none",
        "--teacher_quantization", quantization,
    ]  # fmt: skip
    run, plan, names = lowered_texts(distill.JOB, [str(a) for a in argv], make_mesh("dp=4,mp=2"))
    assert names == {"input_ids", "attention_mask", "loss_mask", "prompt_length"} and run == plan
    assert all(("xi8>" in text) == (quantization == "int8") for text in plan.values())  # the codes are inputs


# --------------------------------------------------------------------------- a quantised teacher


def test_an_int8_teacher_is_its_kernels_quantised_and_dequantised(tok, folders, tmp_path):
    """--teacher_quantization int8 on a dp=4, mp=2 mesh: the teacher's frozen tree holds int8 codes and float32
    scales in place of each of its blocks' 7 dense kernels (3 layers each), nothing else changed; the loss
    against it equals the loss against the teacher whose kernels were quantised and dequantised on the host by
    the same functions, and is a little off the full-precision teacher's."""
    from jaxseq.runner import spec_of
    from jaxseq.train.quantize import dequantize, quantize

    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(as_messages(r)) + "\n" for r in CHATS))
    argv = ["--model_name_or_path", folders[0], "--teacher_model_name_or_path", folders[1], "--lmbda", 0,
            "--teacher_quantization", "int8", "--train_file", tmp_path / "rows.jsonl", "--output_dir", tmp_path / "o",
            "--max_steps", 1, "--report_to", "none"]  # fmt: skip
    setup = Setup(distill.JOB, parse_job(distill.JOB, [str(a) for a in argv]), mesh=make_mesh("dp=4,mp=2"))
    spec = spec_of(setup, distill.prepare(setup))
    assert spec.teacher.quantization == "int8"
    student = spec.build_model(setup.checkpoint, setup.overrides)
    training = spec.program(student, 1).training
    frozen = training.freeze(nnx.state(student))
    stored = {"/".join(map(str, path)): v for path, v in jax.tree_util.tree_flatten_with_path(frozen[1])[0]}
    codes = [v for k, v in stored.items() if k.endswith("['codes']")]  # the blocks stacked: a kernel's 3 layers
    assert len(codes) == 7 and {(c.dtype.name, c.shape[0]) for c in codes} == {("int8", 3)}
    assert {v.dtype.name for k, v in stored.items() if k.endswith("['scales']")} == {"float32"}
    assert not any(k.endswith("['kernel']") and "layers" in k for k in stored)
    assert training.quantizer.kind == "int8" and len(training.quantizer.quantized) == 7

    host = spec.build_teacher()  # the kernels to quantise are left on the host, NumPy arrays
    state = nnx.state(host)
    flat = dict(nnx.to_flat_state(state))
    for path in training.quantizer.quantized:
        kernel = flat[(*path, "kernel")]
        assert isinstance(kernel.get_value(), np.ndarray)
        q = quantize(jnp.asarray(kernel.get_value()), "int8")
        kernel.set_value(np.asarray(dequantize(q["codes"], q["scales"], "int8", jnp.float32)))
    graphdef = nnx.graphdef(host)
    full = load_pretrained(folders[1], "causal-lm", mesh=spec.mesh)
    batch = {k: jnp.asarray(v) for k, v in rows_of(tok, CHATS, tmp_path).items()}
    objective = Distill(DistillConfig(lmbda=0.0, beta=0.5), lm=CausalLM(None))
    loss_of = lambda teacher, tree: float(
        jax.jit(lambda t: objective.with_teacher(teacher(t)).loss(student, batch))(tree)
    )
    quantized = loss_of(training.teacher_model, frozen)
    dequantized = loss_of(lambda s: nnx.merge(graphdef, s), nnx.from_flat_state(flat))
    exact = loss_of(lambda s: nnx.merge(nnx.graphdef(full), s), nnx.state(full))
    assert quantized > 1e-3 and quantized == pytest.approx(dequantized, rel=1e-5, abs=1e-7)
    assert 20 * abs(quantized - dequantized) < abs(quantized - exact) < 0.05 * exact, (quantized, dequantized, exact)


def test_an_nf4_teacher_runs_end_to_end(tok, tmp_path, capsys):
    """--teacher_quantization nf4 (a teacher whose dense layers take inputs in blocks of 64): two steps train,
    the log says how the teacher is stored; nf4 on a layer of other inputs stops in one line."""
    common = {"vocab_size": len(tok), "max_position_embeddings": 128, "eos_token_id": tok.eos_token_id,
              "pad_token_id": tok.eos_token_id}  # fmt: skip
    shapes = {"student": {"hidden_size": 64, "intermediate_size": 64}, "teacher": {"hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 3}}  # fmt: skip
    for name, overrides in shapes.items():
        torch.manual_seed(len(name))
        model = transformers.LlamaForCausalLM(tiny_config("llama", **common, **overrides))
        perturb(model, std=0.05, seed=len(name)).save_pretrained(tmp_path / name)
        tok.save_pretrained(tmp_path / name)
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(as_messages(r)) + "\n" for r in CHATS))
    args = lambda teacher, out: [
        "--model_name_or_path", tmp_path / "student", "--teacher_model_name_or_path", teacher,
        "--teacher_quantization", "nf4", "--train_file", tmp_path / "rows.jsonl", "--output_dir", tmp_path / out,
        "--lmbda", 0, "--max_steps", 2, "--per_device_train_batch_size", 1, "--logging_steps", 1,
        "--save_strategy", "no", "--report_to", "none", "--mesh", "dp=4,mp=2",
    ]  # fmt: skip
    assert distill.main([str(a) for a in args(tmp_path / "teacher", "out")]) == 0
    logged = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    got = [r["train/loss"] for r in logged if "train/loss" in r]
    assert len(got) == 2 and all(np.isfinite(got)) and min(got) > 1e-3
    log = "".join(capsys.readouterr())
    assert "(nf4)" in log and "its blocks' kernels nf4) frozen" in log, log[-3000:]
    assert distill.main([str(a) for a in args(folders_teacher(tmp_path, tok), "odd")]) != 0
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("error: the teacher: --teacher_quantization nf4 needs inputs in blocks of 64"), error


def folders_teacher(root: Path, tok) -> Path:
    """A Llama teacher of ``tok``'s vocabulary whose layers take 48 inputs (not whole blocks of 64)."""
    config = tiny_config("llama", vocab_size=len(tok), hidden_size=48, intermediate_size=80,
                         max_position_embeddings=128)  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(root / "odd-teacher")
    tok.save_pretrained(root / "odd-teacher")
    return root / "odd-teacher"


# --------------------------------------------------------------------------- the installed command, one device

JAXSEQ = Path(sys.executable).with_name("jaxseq")
STEPS = 3


@pytest.fixture(scope="module")
def run(tok, folders, tmp_path_factory):
    """``jaxseq distill`` (the installed command, a fresh process on one CPU device) on the data's completions,
    every row in each step, beside TRL's GKDTrainer with the same settings."""
    root = tmp_path_factory.mktemp("distill-run")
    records = [as_messages(r) for r in CHATS]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    common = {"per_device_train_batch_size": len(records), "max_steps": STEPS, "learning_rate": 1e-3,
              "lr_scheduler_type": "constant", "weight_decay": 0.0, "max_grad_norm": 1.0, "logging_steps": 1,
              "seed": 0, "beta": 0.3, "temperature": 1.0}  # fmt: skip
    out = root / "out"
    args = ["--model_name_or_path", folders[0], "--teacher_model_name_or_path", folders[1], "--lmbda", 0,
            "--train_file", root / "train.jsonl", "--output_dir", out, "--report_to", "none",
            "--save_strategy", "no", *(x for k, v in common.items() for x in (f"--{k}", v))]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1")
    result = subprocess.run([str(JAXSEQ), "distill", *map(str, args)], capture_output=True, text=True, env=env,
                            timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    config = GKDConfig(output_dir=str(root / "trl"), bf16=False, use_cpu=True, report_to=[], save_strategy="no",
                       lmbda=0.0, **common)  # fmt: skip
    student, teacher = (transformers.AutoModelForCausalLM.from_pretrained(f) for f in folders)
    trainer = GKDTrainer(model=student, teacher_model=teacher, args=config, processing_class=tok,
                         train_dataset=datasets.Dataset.from_list(records))  # fmt: skip
    trainer.train()
    return out, result, trainer


def test_the_command_trains_as_trls_gkd_trainer(run):
    out, result, trainer = run
    assert "Traceback" not in result.stderr
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    got = [r["train/loss"] for r in logged if "train/loss" in r]
    want = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(got) == len(want) == STEPS and got[0] > 1e-3
    np.testing.assert_allclose(got, want, rtol=1e-3)


def test_the_export_loads_in_transformers_as_trls_trained_student(tok, run):
    out, _, trainer = run
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert transformers.AutoTokenizer.from_pretrained(out).chat_template == TEMPLATE
    ids = torch.tensor([tok.apply_chat_template(CHATS[0]["messages"], return_dict=True)["input_ids"]])
    with torch.no_grad():
        got, want = model(ids).logits, trainer.model.eval()(ids).logits
    np.testing.assert_allclose(got.numpy(), want.numpy(), atol=2e-4 * float(want.abs().max()))
