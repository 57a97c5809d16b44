"""``jaxseq reward`` against TRL's RewardTrainer (installed with the test extra): pairs are tokenised as TRL
tokenises them (strings and conversations, with and without a prompt; --max_length leaves out what TRL
filters out); on a tiny GPT-2 classifier whose weights are perturbed (its score head too), the loss, TRL's
logged figures and every gradient equal TRL's ``compute_loss`` on the same batch, plain, with a margin column
and with --center_rewards_coefficient; the job's flags shape its data and loss; and the installed ``jaxseq
reward`` as a fresh process on one CPU device trains a tiny Llama from its causal-LM checkpoint for 2 steps,
logs TRL's names and exports a folder that transformers' AutoModelForSequenceClassification loads, scoring
the pairs as jaxseq did."""

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

from jaxseq.commands import reward  # noqa: E402
from jaxseq.data.reward import encode_reward_pairs, reward_rows  # noqa: E402
from jaxseq.errors import JaxseqError  # noqa: E402
from jaxseq.models import load_pretrained  # noqa: E402
from jaxseq.runner import Setup, parse_job  # noqa: E402
from jaxseq.train.reward import METRICS, RewardModeling  # noqa: E402
from tests.reference import assert_gradients_match, perturb  # noqa: E402
from tests.tiny import tiny_config  # noqa: E402

TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
PAIRS = [
    {"prompt": "The sky on a clear day is", "chosen": " blue.", "rejected": " green and very loud.", "margin": 0.5},
    {"prompt": "Two plus two is", "chosen": " four, as everyone knows.", "rejected": " five.", "margin": 1.5},
    {"prompt": "Water boils at", "chosen": " 100 degrees.", "rejected": " room temperature, always.", "margin": 0.0},
    {"prompt": "The opposite of hot is", "chosen": " cold.", "rejected": " a colour.", "margin": -1.0},
]
IMPLICIT = [{"chosen": p["prompt"] + p["chosen"], "rejected": p["prompt"] + p["rejected"]} for p in PAIRS]
CONVERSATIONS = [
    {
        "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"}],
        "chosen": [{"role": "assistant", "content": "Paris."}],
        "rejected": [{"role": "assistant", "content": "Lyon, I think, or maybe Nice."}],
    },
    {
        "prompt": [{"role": "user", "content": "Say hi"}],
        "chosen": [{"role": "assistant", "content": "Hi there!"}],
        "rejected": [{"role": "assistant", "content": "No."}],
    },
]
IMPLICIT_CONVERSATIONS = [
    {"chosen": [*c["prompt"], *c["chosen"]], "rejected": [*c["prompt"], *c["rejected"]]} for c in CONVERSATIONS
]
RECORDS = {
    "strings": PAIRS,
    "implicit strings": IMPLICIT,
    "conversations": CONVERSATIONS,
    "implicit conversations": IMPLICIT_CONVERSATIONS,
}


def gpt2_tokenizer():
    folder = shared_asset("data/tokenizers/gpt2")
    tokenizer = transformers.GPT2TokenizerFast(vocab=str(folder / "vocab.json"), merges=str(folder / "merges.txt"))
    tokenizer.chat_template = TEMPLATE
    return tokenizer


@pytest.fixture(scope="module")
def tok():
    return gpt2_tokenizer()


@pytest.fixture(scope="module")
def classifier(tok, tmp_path_factory):
    """A tiny GPT-2 reward model (one label, EOS its pad token), every weight perturbed, as a folder."""
    root = tmp_path_factory.mktemp("reward-model")
    config = tiny_config("gpt2", n_positions=64, vocab_size=len(tok), num_labels=1, pad_token_id=tok.eos_token_id)
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
    torch.manual_seed(0)
    perturb(transformers.GPT2ForSequenceClassification(config), std=0.05).save_pretrained(root)
    tok.save_pretrained(root)
    return root


@pytest.fixture(scope="module")
def trainer(tok, classifier, tmp_path_factory):
    """TRL's RewardTrainer in float32 on the CPU over PAIRS (with their margins), the whole set one batch."""
    args = trl.RewardConfig(
        output_dir=str(tmp_path_factory.mktemp("trl")),
        per_device_train_batch_size=len(PAIRS),
        bf16=False,
        use_cpu=True,
        gradient_checkpointing=False,
        report_to=[],
        save_strategy="no",
    )
    return trl.RewardTrainer(
        model=transformers.AutoModelForSequenceClassification.from_pretrained(classifier),
        args=args,
        train_dataset=datasets.Dataset.from_list(PAIRS),
        processing_class=tok,
    )


def trl_ids(trainer, records) -> list[tuple[list[int], list[int]]]:
    prepared = trainer._prepare_dataset(
        datasets.Dataset.from_list(records), trainer.processing_class, trainer.args, "x"
    )
    return [(row["chosen_ids"], row["rejected_ids"]) for row in prepared]


@pytest.mark.parametrize("kind", RECORDS)
def test_pairs_are_tokenised_as_trl_tokenises_them(tok, trainer, kind):
    records = RECORDS[kind]
    encoded = encode_reward_pairs(tok, records, progress=False)
    assert encoded == trl_ids(trainer, records)
    assert all(tok.eos_token_id in ids for pair in encoded for ids in pair)  # appended, or the template's
    cut = min(max(map(len, pair)) for pair in encoded)  # the shortest pair stays, the others are longer
    trainer.args.max_length = cut
    try:
        kept = trl_ids(trainer, records)
    finally:
        trainer.args.max_length = 1024
    rows = reward_rows(encoded, cut, tok.eos_token_id)
    assert 0 < len(kept) == len(rows["input_ids"]) < len(records)
    for (chosen, rejected), ids, mask in zip(kept, rows["input_ids"], rows["pair_mask"], strict=True):
        assert [ids[0][mask[0] > 0].tolist(), ids[1][mask[1] > 0].tolist()] == [chosen, rejected]


CASES = {"plain": (False, None), "margin": (True, None), "margin, centred": (True, 0.01), "centred": (False, 0.5)}


@pytest.mark.parametrize("case", CASES)
def test_loss_metrics_and_gradients_equal_trl(tok, classifier, trainer, case):
    with_margin, center = CASES[case]
    examples = [trainer.train_dataset[i] for i in range(len(PAIRS))]
    if not with_margin:
        examples = [{k: v for k, v in e.items() if k != "margin"} for e in examples]
    trainer.args.center_rewards_coefficient = center
    model = trainer.model.train()
    model.zero_grad()
    try:
        loss = trainer.compute_loss(model, trainer.data_collator(examples))
    finally:
        trainer.args.center_rewards_coefficient = None
    loss.backward()
    want_grads = {n: p.grad.numpy() for n, p in model.named_parameters()}
    want = {k: trainer._metrics["train"][k][-1] for k in METRICS}

    objective = RewardModeling(center)
    jaxseq_model = load_pretrained(classifier, "sequence-classification")
    rows = reward_rows(encode_reward_pairs(tok, PAIRS, progress=False), None, tok.eos_token_id,
                       [p["margin"] for p in PAIRS] if with_margin else None)  # fmt: skip
    batch = {k: jnp.asarray(v) for k, v in rows.items()}
    graphdef, state = nnx.split(jaxseq_model)
    (got, metrics), grads = jax.value_and_grad(
        lambda s: objective.loss_and_metrics(nnx.merge(graphdef, s), batch), has_aux=True
    )(state)
    assert abs(float(got) - loss.item()) <= 1e-5 * max(1.0, abs(loss.item())), (float(got), loss.item())
    assert abs(want["margin"]) > 1e-3  # perturbed: the head scores the sequences apart
    for key in METRICS:
        assert abs(float(metrics[key]) - want[key]) <= 1e-5 * max(1.0, abs(want[key])), (key, metrics[key], want[key])
    assert_gradients_match(jaxseq_model, grads, want_grads)
    outputs = jax.tree.map(np.asarray, objective.predict(jaxseq_model, batch))  # evaluation: the same figures
    assert objective.metrics(outputs) == pytest.approx({"loss": loss.item(), **want}, rel=1e-5, abs=1e-6)


# --------------------------------------------------------------------------- the job's flags


def dataset(root: Path, configs: dict[str, list[dict]]) -> Path:
    """A local dataset folder, one train split per config."""
    for name, records in configs.items():
        (root / name).mkdir(parents=True)
        (root / name / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    listed = "".join(f"- config_name: {n}\n  data_files:\n  - split: train\n    path: {n}/*.jsonl\n" for n in configs)
    (root / "README.md").write_text(f"---\nconfigs:\n{listed}---\n")
    return root


def test_reward_flags_shape_the_pairs_and_the_loss(classifier, tmp_path, monkeypatch):
    """--dataset_name/--dataset_config_name, --validation_split_percentage, --max_train_samples and
    --max_eval_samples pick the pairs, --max_length leaves out the longer ones, --chat_template renders
    conversations, --center_rewards_coefficient is the objective's; the model has one label and the pad token
    is the tokenizer's EOS; --do_eval without validation pairs and a margin missing from some pairs stop in
    one line."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-datasets")
    plain = [{"chosen": f"Answer {i} " + "word " * (i % 4), "rejected": f"No {i}", "margin": i} for i in range(12)]
    chats = [{"chosen": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
              "rejected": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "go"}]}] * 4  # fmt: skip
    data = dataset(tmp_path / "pairs", {"plain": plain, "chats": chats})
    base = ["--model_name_or_path", classifier, "--dataset_name", data, "--output_dir", tmp_path / "out"]
    argv = [str(a) for a in [*base, "--dataset_config_name", "plain", "--validation_split_percentage", "25"]]

    def prepare(*flags, start=argv):
        setup = Setup(reward.JOB, parse_job(reward.JOB, [*map(str, start), *map(str, flags)]))
        return setup, reward.prepare(setup)

    setup, whole = prepare("--center_rewards_coefficient", 0.05)
    assert (len(whole.train["input_ids"]), len(whole.evals[""]["input_ids"])) == (9, 3)
    assert whole.objective.center_rewards_coefficient == 0.05 and whole.train["margin"].dtype == np.float32
    assert setup.config.num_labels == 1 and setup.config.pad_token_id == setup.tokenizer.eos_token_id
    _, cut = prepare("--max_train_samples", 4, "--max_eval_samples", 2)
    assert (len(cut.train["input_ids"]), len(cut.evals[""]["input_ids"])) == (4, 2)
    assert cut.objective.center_rewards_coefficient is None
    # "Answer i " + EOS is 4 tokens (i = 0, 4, 8), with a word or more 5 or more: those pairs are left out
    _, short = prepare("--max_length", 4, "--do_train", "--validation_split_percentage", 0)
    assert short.train["margin"].tolist() == [0, 4, 8] and short.train["input_ids"].shape[-1] == 4
    assert not short.evals
    (tmp_path / "t.jinja").write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    setup, rendered = prepare("--dataset_config", "chats", "--chat_template", tmp_path / "t.jinja")
    assert setup.tokenizer.decode(rendered.train["input_ids"][0, 0]) == "[hi][hello]"  # no EOS added
    files = ["--model_name_or_path", classifier, "--output_dir", tmp_path / "out"]
    (tmp_path / "one.jsonl").write_text(json.dumps({"chosen": "a", "rejected": "b"}) + "\n")
    with pytest.raises(JaxseqError, match="--do_eval needs validation pairs"):
        prepare("--train_file", tmp_path / "one.jsonl", "--do_eval", start=files)
    (tmp_path / "some.jsonl").write_text(json.dumps(plain[0]) + "\n" + json.dumps({"chosen": "a", "rejected": "b"}))
    with pytest.raises(JaxseqError, match="1 of 2 training pairs lack 'margin'"):
        prepare("--train_file", tmp_path / "some.jsonl", start=files)


def test_a_reward_plan_compiles_the_runs_own_step(tok, classifier, tmp_path):
    """The run's train step on a dp=4, mp=2 mesh and the plan's, from abstract weights and rows of --max_length
    tokens (here the longest pair's), lower to the same program: the same classifier, pad token and rows."""
    from jaxseq.mesh import make_mesh
    from tests.test_run_spec import lowered_texts

    records = [{k: v for k, v in p.items() if k != "margin"} for p in PAIRS] * 2
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    longest = max(len(ids) for pair in encode_reward_pairs(tok, records, progress=False) for ids in pair)
    argv = [
        "--model_name_or_path", classifier, "--train_file", tmp_path / "pairs.jsonl", "--max_length", longest,
        "--output_dir", tmp_path / "out", "--max_steps", 2, "--per_device_train_batch_size", 1, "--report_to", "none",
    ]  # fmt: skip
    run, plan, names = lowered_texts(reward.JOB, [str(a) for a in argv], make_mesh("dp=4,mp=2"))
    assert names == {"input_ids", "pair_mask"} and run == plan


# --------------------------------------------------------------------------- the installed command, one device

JAXSEQ = Path(sys.executable).with_name("jaxseq")


@pytest.fixture(scope="module")
def run(tok, tmp_path_factory):
    """``jaxseq reward`` (the installed command, a fresh process on one CPU device) from a tiny Llama's
    causal-LM checkpoint: 2 steps on pairs with margins, centred, then evaluated."""
    root = tmp_path_factory.mktemp("reward-run")
    config = tiny_config("llama", vocab_size=len(tok), max_position_embeddings=64, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    perturb(transformers.LlamaForCausalLM(config), std=0.05).save_pretrained(root / "llama")
    tok.save_pretrained(root / "llama")
    (root / "train.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PAIRS))
    (root / "dev.jsonl").write_text("".join(json.dumps(p) + "\n" for p in IMPLICIT))
    out = root / "out"
    args = [
        "--model_name_or_path", root / "llama", "--train_file", root / "train.jsonl",
        "--validation_file", root / "dev.jsonl", "--output_dir", out, "--do_train", "--do_eval",
        "--max_steps", 2, "--per_device_train_batch_size", 2, "--per_device_eval_batch_size", 4,
        "--learning_rate", 1e-3, "--center_rewards_coefficient", 0.01, "--max_length", 64,
        "--logging_steps", 1, "--report_to", "none", "--save_strategy", "no",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1")
    result = subprocess.run([str(JAXSEQ), "reward", *map(str, args)], capture_output=True, text=True, env=env,
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
    assert {f"eval_{k}" for k in ("loss", *METRICS)} <= set(results) and results["eval_samples"] == len(IMPLICIT)


def test_the_export_loads_in_transformers_with_jaxseqs_rewards(tok, run):
    out, _ = run
    results = json.loads((out / "eval_results.json").read_text())
    model = transformers.AutoModelForSequenceClassification.from_pretrained(out).eval()
    assert model.config.num_labels == 1 and model.config.pad_token_id == tok.eos_token_id
    saved = transformers.AutoTokenizer.from_pretrained(out)
    rows = reward_rows(encode_reward_pairs(saved, IMPLICIT, progress=False), None, tok.eos_token_id)
    flat = lambda x: torch.as_tensor(x.swapaxes(0, 1).reshape(-1, x.shape[-1]), dtype=torch.long)
    with torch.no_grad():
        scores = model(input_ids=flat(rows["input_ids"]), attention_mask=flat(rows["pair_mask"])).logits[:, 0]
    chosen, rejected = np.split(scores.double().numpy(), 2)
    want = {
        "eval_min_reward": scores.min().item(),
        "eval_mean_reward": scores.mean().item(),
        "eval_max_reward": scores.max().item(),
        "eval_accuracy": float(np.mean(chosen > rejected)),
        "eval_margin": float(np.mean(chosen - rejected)),
    }
    assert abs(want["eval_margin"]) > 1e-4  # the head scores the pairs apart
    assert {k: results[k] for k in want} == pytest.approx(want, rel=1e-4, abs=1e-5)
