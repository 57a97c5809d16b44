"""``jaxseq dpo`` against TRL's DPOTrainer (installed with the test extra), on a tiny GPT-2 whose policy and
reference weights are perturbed apart: the pairs are tokenised as TRL tokenises them (strings and
conversations, both truncation modes); for each loss type the loss, TRL's logged figures and every gradient
equal TRL's ``compute_loss`` on the same batch; LoRA's implicit reference (the base, adapters off) equals a
frozen copy's, in the eval and the train step; and ``jaxseq dpo`` as a fresh process on one CPU device
follows TRL's DPOTrainer for 10 full-batch steps (loss and rewards at every step), logs TRL's names, and
exports a folder transformers loads whose log-probs are jaxseq's."""

import json
import os
import subprocess
import sys
import types

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
from jaxseq.data.preference import PreferenceDataConfig, encode_pair, encode_pairs, load_pair_rows, pair_rows  # noqa: E402
from jaxseq.errors import JaxseqError  # noqa: E402
from jaxseq.mesh import make_mesh  # noqa: E402
from jaxseq.models import load_pretrained  # noqa: E402
from jaxseq.train.lora import LoraConfig  # noqa: E402
from jaxseq.train.optim import OptimizerConfig  # noqa: E402
from jaxseq.train.preference import DPO, LOSS_TYPES, METRICS, REFERENCE_FREE, DPOConfig  # noqa: E402
from jaxseq.train.step import TrainProgram  # noqa: E402
from jaxseq.train.training import Training  # noqa: E402
from tests.reference import assert_gradients_match, perturb  # noqa: E402

TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
PAIRS = [
    {"prompt": "The sky on a clear day is", "chosen": " blue.", "rejected": " green and very loud."},
    {"prompt": "Two plus two is", "chosen": " four, as everyone knows.", "rejected": " five."},
    {"prompt": "Water at sea level boils at", "chosen": " 100 degrees.", "rejected": " room temperature, always."},
    {"prompt": "The opposite of hot is", "chosen": " cold.", "rejected": " a colour."},
]
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
IMPLICIT = [  # no prompt: the shared first turns are (TRL's extract_prompt)
    {"chosen": [*c["prompt"], *c["chosen"]], "rejected": [*c["prompt"], *c["rejected"]]} for c in CONVERSATIONS
]
CASES = {"sigmoid": (0.1, 0.0), "hinge": (0.5, 0.0), "ipo": (0.1, 0.0), "robust": (0.1, 0.2)}


@pytest.fixture(scope="module")
def tok():
    folder = shared_asset("data/tokenizers/gpt2")
    tokenizer = transformers.GPT2TokenizerFast(vocab=str(folder / "vocab.json"), merges=str(folder / "merges.txt"))
    tokenizer.chat_template = TEMPLATE
    return tokenizer


@pytest.fixture(scope="module")
def folders(tok, tmp_path_factory):
    """A tiny GPT-2 reference (perturbed) and a policy perturbed further from it, as Hugging Face folders."""
    root = tmp_path_factory.mktemp("dpo-models")
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, n_positions=64, vocab_size=len(tok), resid_pdrop=0, embd_pdrop=0, attn_pdrop=0
    )
    torch.manual_seed(0)
    model = perturb(transformers.GPT2LMHeadModel(config), std=0.05, seed=0)
    model.save_pretrained(root / "ref")
    tok.save_pretrained(root / "ref")
    perturb(model, std=0.02, seed=1).save_pretrained(root / "policy")
    tok.save_pretrained(root / "policy")
    return root / "policy", root / "ref"


def trl_trainer(tok, policy, ref, rows, tmp_path, **config):
    """TRL's DPOTrainer on ``rows`` in float32 on the CPU, the whole set one batch."""
    args = trl.DPOConfig(
        output_dir=str(tmp_path / "trl"),
        per_device_train_batch_size=len(rows),
        bf16=False,
        use_cpu=True,
        gradient_checkpointing=False,
        report_to=[],
        save_strategy="no",
        **config,
    )
    ref_model = None if ref is None else transformers.AutoModelForCausalLM.from_pretrained(ref)
    return trl.DPOTrainer(
        model=str(policy) if ref is None else transformers.AutoModelForCausalLM.from_pretrained(policy),
        ref_model=ref_model,
        args=args,
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=tok,
    )


def trl_batch(trainer):
    return trainer.data_collator([trainer.train_dataset[i] for i in range(len(trainer.train_dataset))])


def as_trl(rows: dict) -> dict[str, np.ndarray]:
    """Our ``[pairs, 2, length]`` arrays as TRL's ``[2 x pairs, length]`` batch (every chosen, then every rejected)."""
    flat = lambda x: x.swapaxes(0, 1).reshape(-1, x.shape[-1])
    return {"input_ids": flat(rows["input_ids"]), "attention_mask": flat(rows["pair_mask"]),
            "completion_mask": flat(rows["completion_mask"])}  # fmt: skip


@pytest.mark.parametrize("rows", ["strings", "conversations", "implicit prompts"])
def test_pairs_are_tokenised_as_trl_tokenises_them(tok, folders, tmp_path, rows):
    records = {"strings": PAIRS, "conversations": CONVERSATIONS, "implicit prompts": IMPLICIT}[rows]
    trainer = trl_trainer(tok, *folders, records, tmp_path)
    for i, record in enumerate(records):
        prompt, chosen, rejected = encode_pair(tok, record)
        want = trainer.train_dataset[i]
        assert (prompt, chosen, rejected) == (want["prompt_ids"], want["chosen_ids"], want["rejected_ids"])
        assert tok.eos_token_id in chosen and tok.eos_token_id in rejected  # appended, or the template's
    encoded = encode_pairs(tok, records, progress=False)
    cut = max(len(prompt) for prompt, _, _ in encoded)  # the longest prompt's pair is dropped, the others cut
    for mode in ("keep_start", "keep_end"):  # the collator's cut, and keep_start's dropped pairs
        trainer = trl_trainer(tok, *folders, records, tmp_path, max_length=cut, truncation_mode=mode)
        want = trl_batch(trainer)
        got = as_trl(pair_rows(encoded, PreferenceDataConfig(max_length=cut, truncation_mode=mode), 0))
        assert got["input_ids"].shape[0] == want["input_ids"].shape[0] == 2 * (len(records) - (mode == "keep_start"))
        width = want["input_ids"].shape[1]
        assert not got["attention_mask"][:, width:].any()
        for key in ("attention_mask", "completion_mask"):
            np.testing.assert_array_equal(got[key][:, :width], want[key].numpy())
        real = want["attention_mask"].numpy() == 1
        np.testing.assert_array_equal(got["input_ids"][:, :width][real], want["input_ids"].numpy()[real])


def jaxseq_batch(tok, records):
    rows = pair_rows(encode_pairs(tok, records, progress=False), PreferenceDataConfig(), tok.eos_token_id)
    return {k: jnp.asarray(v) for k, v in rows.items()}


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_loss_metrics_and_gradients_equal_trl(tok, folders, tmp_path, loss_type):
    beta, smoothing = CASES[loss_type]
    trainer = trl_trainer(tok, *folders, PAIRS, tmp_path, loss_type=[loss_type], beta=beta, label_smoothing=smoothing)
    model = trainer.model
    model.train()
    loss = trainer.compute_loss(model, trl_batch(trainer))
    loss.backward()
    want_grads = {n: p.grad.numpy() for n, p in model.named_parameters()}
    want_metrics = {k: trainer._metrics["train"][k][-1] for k in METRICS}

    objective = DPO(loss_type, beta, smoothing)
    policy, ref = (load_pretrained(folder, "causal-lm") for folder in folders)
    batch = jaxseq_batch(tok, PAIRS)
    batch["ref_logps"] = objective.logps(ref, batch)
    graphdef, state = nnx.split(policy)
    (got, metrics), grads = jax.value_and_grad(
        lambda s: objective.loss_and_metrics(nnx.merge(graphdef, s), batch), has_aux=True
    )(state)
    assert abs(float(got) - loss.item()) <= 1e-5 * max(1.0, abs(loss.item())), (float(got), loss.item())
    assert abs(want_metrics["rewards/margins"]) > 1e-3  # the policy is not its reference
    for key in METRICS:
        assert abs(float(metrics[key]) - want_metrics[key]) <= 1e-4 * max(1.0, abs(want_metrics[key])), key
    assert_gradients_match(policy, grads, want_grads)


REFERENCE_FREE_CASES = {
    "simpo": {"beta": 2.0, "label_smoothing": 0.1, "simpo_gamma": 0.7, "cpo_alpha": 0.5},
    "orpo": {"beta": 0.3, "label_smoothing": 0.0, "simpo_gamma": 0.5, "cpo_alpha": 1.0},
}


@pytest.mark.parametrize("loss_type", REFERENCE_FREE)
def test_reference_free_losses_equal_trl(tok, folders, loss_type):
    """SimPO and ORPO: TRL's own loss code (``CPOTrainer.cpo_loss``, ``ORPOTrainer.odds_ratio_loss`` and
    ``get_batch_logps``, on the transformers model's logits of our batch; their trainers' glue, the mean of
    the pairs' losses and the chosen completions' NLL, as their ``get_batch_loss_metrics`` writes it)."""
    from trl.experimental.cpo import CPOTrainer
    from trl.experimental.orpo import ORPOTrainer

    case = REFERENCE_FREE_CASES[loss_type]
    model = transformers.AutoModelForCausalLM.from_pretrained(folders[0]).train()
    rows = as_trl(pair_rows(encode_pairs(tok, PAIRS, progress=False), PreferenceDataConfig(), tok.eos_token_id))
    ids = torch.as_tensor(rows["input_ids"], dtype=torch.long)
    labels = torch.where(torch.as_tensor(rows["completion_mask"]) == 1, ids, -100)
    logits = model(input_ids=ids, attention_mask=torch.as_tensor(rows["attention_mask"])).logits
    per_token = ORPOTrainer.get_batch_logps(logits, labels, average_log_prob=True)
    n = len(PAIRS)
    chosen, rejected = per_token[:n], per_token[n:]
    nll = torch.nn.CrossEntropyLoss()(logits[:n, :-1].reshape(-1, logits.shape[-1]), labels[:n, 1:].reshape(-1))
    trl_self = types.SimpleNamespace(
        **case, loss_type=loss_type, alpha=0.0, accelerator=types.SimpleNamespace(device="cpu")
    )
    if loss_type == "simpo":
        losses, chosen_rewards, rejected_rewards = CPOTrainer.cpo_loss(trl_self, chosen, rejected)
        loss = losses.mean() + case["cpo_alpha"] * nll
        extra = {}
    else:
        losses, chosen_rewards, rejected_rewards, ratio, log_odds = ORPOTrainer.odds_ratio_loss(
            trl_self, chosen, rejected
        )
        loss = nll - losses.mean()
        extra = {"log_odds_ratio": ratio.item(), "log_odds_chosen": log_odds.item()}
    loss.backward()
    want_grads = {name: p.grad.numpy() for name, p in model.named_parameters()}
    want = {
        "rewards/chosen": chosen_rewards.mean().item(),
        "rewards/rejected": rejected_rewards.mean().item(),
        "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean().item(),
        "rewards/margins": (chosen_rewards - rejected_rewards).mean().item(),
        "logps/chosen": chosen.mean().item(),
        "logps/rejected": rejected.mean().item(),
        "nll_loss": nll.item(),
        **extra,
    }

    objective = DPOConfig(loss_type=loss_type, **case).objective()
    assert not objective.needs_reference and not objective.precomputes_reference
    policy = load_pretrained(folders[0], "causal-lm")
    batch = jaxseq_batch(tok, PAIRS)
    graphdef, state = nnx.split(policy)
    (got, metrics), grads = jax.value_and_grad(
        lambda s: objective.loss_and_metrics(nnx.merge(graphdef, s), batch), has_aux=True
    )(state)
    assert abs(float(got) - loss.item()) <= 1e-5 * max(1.0, abs(loss.item())), (float(got), loss.item())
    assert set(metrics) == set(want)
    for key, value in want.items():
        assert abs(float(metrics[key]) - value) <= 1e-4 * max(1.0, abs(value)), (key, float(metrics[key]), value)
    assert_gradients_match(policy, grads, want_grads)


def test_lora_reference_is_the_base_with_adapters_off_as_a_frozen_copy(tok, folders):
    mesh = make_mesh("dp=1", devices=jax.devices()[:1])
    objective = DPO("sigmoid", 0.1)
    batch = jaxseq_batch(tok, PAIRS)
    ref_folder = folders[1]
    base = load_pretrained(ref_folder, "causal-lm", mesh=mesh)
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

    # full weights: the adapters folded in, the reference a frozen copy of the starting (base) weights
    start = load_pretrained(ref_folder, "causal-lm", mesh=mesh)
    full = TrainProgram(start, objective, mesh, OptimizerConfig(), total_steps=1, seed=0)
    assert type(full.training) is Training and full.training.frozen_shardings is not None  # a reference copy
    copy = full.training.freeze(nnx.state(start))
    merged = sharding.shard(program.training.lora.merged(adapters, frozen), full.state_shardings.params)
    with_copy = full.eval_step(merged, copy, batch)
    assert np.abs(np.asarray(with_lora["rewards/margins"])).max() > 1e-3  # the adapters moved the policy
    for key in ("preference_loss", *METRICS):
        np.testing.assert_allclose(np.asarray(with_lora[key]), np.asarray(with_copy[key]), rtol=1e-4, atol=1e-5)
    # the train steps see the same reference: the same loss and figures
    _, lora_step = program.step(program.init_state(adapters), frozen, batch)
    _, copy_step = full.step(full.init_state(merged), copy, batch)
    for key in ("loss", *METRICS):
        np.testing.assert_allclose(float(lora_step[key]), float(copy_step[key]), rtol=1e-4, atol=1e-5)
        evaluated = np.asarray(with_lora["preference_loss" if key == "loss" else key]).mean()
        np.testing.assert_allclose(float(lora_step[key]), evaluated, rtol=1e-4, atol=1e-5)


def test_bad_pairs_stop_in_one_line(tmp_path):
    folder = shared_asset("data/tokenizers/gpt2")
    plain = transformers.GPT2TokenizerFast(vocab=str(folder / "vocab.json"), merges=str(folder / "merges.txt"))
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps(CONVERSATIONS[0]) + "\n")
    with pytest.raises(JaxseqError, match="--chat_template"):
        load_pair_rows(PreferenceDataConfig(train_file=str(path)), plain, progress=False)
    path.write_text(json.dumps({"prompt": "a", "chosen": "b"}) + "\n")
    with pytest.raises(JaxseqError, match=r"lacks column.*rejected"):
        load_pair_rows(PreferenceDataConfig(train_file=str(path)), plain, progress=False)
    with pytest.raises(JaxseqError, match="--label_smoothing"):
        DPOConfig(loss_type="robust", label_smoothing=0.5)
    with pytest.raises(JaxseqError, match="--beta"):
        DPOConfig(beta=0.0)


STEPS = 10


@pytest.fixture(scope="module")
def runs(tok, folders, tmp_path_factory):
    """``jaxseq dpo`` (a fresh process, one CPU device, no compile cache) and TRL's DPOTrainer: the same
    policy, the same 4 pairs as one batch, AdamW at a constant 1e-3, 10 steps."""
    root = tmp_path_factory.mktemp("dpo-run")
    (root / "pairs.jsonl").write_text("\n".join(map(json.dumps, PAIRS)) + "\n")
    out = root / "out"
    args = [
        "--model_name_or_path", folders[0], "--train_file", root / "pairs.jsonl",
        "--validation_file", root / "pairs.jsonl", "--output_dir", out, "--per_device_train_batch_size", 4,
        "--max_steps", STEPS, "--logging_steps", 1, "--learning_rate", 1e-3, "--lr_scheduler_type", "constant",
        "--report_to", "none", "--save_strategy", "no",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["HF_HUB_OFFLINE"] = "1"
    result = subprocess.run([sys.executable, "-m", "jaxseq", "dpo", *map(str, args)], capture_output=True,
                            text=True, env=env, timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    trainer = trl_trainer(
        tok, folders[0], None, PAIRS, root, max_steps=STEPS, learning_rate=1e-3, lr_scheduler_type="constant",
        logging_steps=1,
    )  # fmt: skip
    trainer.train()
    return out, [h for h in trainer.state.log_history if "loss" in h and "rewards/margins" in h]


def test_ten_steps_follow_trl_dpotrainer_and_log_its_names(runs):
    out, trl_log = runs
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in logged if "train/loss" in r]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1)) and len(trl_log) == STEPS
    assert {f"train/{k}" for k in ("loss", *METRICS)} <= set(train[0])
    for ours, theirs in zip(train, trl_log, strict=True):
        for key in ("loss", *METRICS):
            want = theirs[key]
            assert abs(ours[f"train/{key}"] - want) <= 1e-4 * max(1.0, abs(want)), (
                ours["step"],
                key,
                want,
                ours[f"train/{key}"],
            )
    assert trl_log[-1]["loss"] < trl_log[0]["loss"] - 0.1  # the curves moved
    results = json.loads((out / "eval_results.json").read_text())
    assert {f"eval_{k}" for k in ("loss", *METRICS)} <= set(results)


def test_the_exported_folder_loads_in_transformers_with_jaxseq_log_probs(tok, runs):
    out, _ = runs
    results = json.loads((out / "eval_results.json").read_text())
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    rows = as_trl(pair_rows(encode_pairs(tok, PAIRS, progress=False), PreferenceDataConfig(), tok.eos_token_id))
    ids = torch.as_tensor(rows["input_ids"], dtype=torch.long)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=torch.as_tensor(rows["attention_mask"])).logits
    logps = torch.log_softmax(logits[:, :-1].double(), -1).gather(-1, ids[:, 1:, None])[..., 0]
    logps = (logps * torch.as_tensor(rows["completion_mask"][:, 1:])).sum(-1).numpy()
    chosen, rejected = np.split(logps, 2)
    assert abs(chosen.mean() - results["eval_logps/chosen"]) <= 1e-4 * abs(chosen.mean())
    assert abs(rejected.mean() - results["eval_logps/rejected"]) <= 1e-4 * abs(rejected.mean())


@pytest.mark.parametrize("reference", ["frozen copy", "precomputed"])
def test_a_dpo_plan_compiles_the_runs_own_step(folders, tmp_path, reference):
    """The run's train step (its frozen reference copy, or precomputed log-probs, on a dp=4, mp=2 mesh) and
    the plan's, from abstract weights and rows of --max_length tokens (the pairs here all reach it), lower
    to the same program."""
    from jaxseq.commands import dpo
    from tests.test_run_spec import lowered_texts

    (tmp_path / "pairs.jsonl").write_text("\n".join(map(json.dumps, PAIRS * 2)) + "\n")
    argv = [
        "--model_name_or_path", folders[0], "--train_file", tmp_path / "pairs.jsonl", "--max_length", 8,
        "--output_dir", tmp_path / "out", "--max_steps", 2, "--per_device_train_batch_size", 2,
        "--report_to", "none", *(["--precompute_ref_log_probs"] if reference == "precomputed" else []),
    ]  # fmt: skip
    run, plan, names = lowered_texts(dpo.JOB, list(map(str, argv)), make_mesh("dp=4,mp=2"))
    assert ("ref_logps" in names) == (reference == "precomputed")
    assert run == plan
