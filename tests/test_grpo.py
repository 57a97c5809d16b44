"""``jaxseq grpo`` against TRL's GRPOTrainer (trl 1.16): on a tiny GPT-2 with perturbed weights, for every loss type
with and without the KL, the loss, TRL's logged figures and every gradient of one batch of given completions,
advantages and old/reference log-probs equal TRL's own ``_compute_loss`` (its log-probs from its fused LM head,
at a temperature); advantages equal TRL's formulas (its ``nanstd``); reward functions get TRL's arguments; the
sampler compiles once for every step; the flags mean what TRL's mean (--per_device_train_batch_size counts
completions, with TRL's divisibility rule; --reward_weights 1.0 0.5 is a list); and ``jaxseq grpo`` as a fresh
process raises a verifiable reward."""

import collections
import contextlib
import json
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.conftest import shared_asset
from tests.tiny import LETTERS, letters_gpt2

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
trl = pytest.importorskip("trl")

from trl.trainer.grpo_trainer import GRPOTrainer  # noqa: E402
from trl.trainer.utils import add_fused_lm_head, nanstd  # noqa: E402

from jaxseq import generation, sharding  # noqa: E402
from jaxseq.commands import grpo  # noqa: E402
from jaxseq.commands.grpo import load_reward_funcs, prompt_rows  # noqa: E402
from jaxseq.errors import JaxseqError  # noqa: E402
from jaxseq.mesh import make_mesh  # noqa: E402
from jaxseq.models import load_pretrained  # noqa: E402
from jaxseq.runner import parse_job  # noqa: E402
from jaxseq.train.lora import LoraConfig  # noqa: E402
from jaxseq.train.optim import OptimizerConfig  # noqa: E402
from jaxseq.train.rl import GRPO, LOSS_TYPES, GRPOConfig, Rollout, group_advantages, prompts_per_step  # noqa: E402
from jaxseq.train.step import TrainProgram  # noqa: E402
from jaxseq.train.task import Policy  # noqa: E402
from jaxseq.train.training import Training  # noqa: E402
from tests.reference import assert_gradients_match, perturb  # noqa: E402

TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@pytest.fixture(scope="module")
def tok():
    folder = shared_asset("data/tokenizers/gpt2")
    tokenizer = transformers.GPT2TokenizerFast(vocab=str(folder / "vocab.json"), merges=str(folder / "merges.txt"))
    tokenizer.chat_template = TEMPLATE
    return tokenizer


@pytest.fixture(scope="module")
def folder(tok, tmp_path_factory):
    """A tiny GPT-2 with every weight perturbed, as a Hugging Face folder."""
    root = tmp_path_factory.mktemp("grpo-model")
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, n_positions=64, vocab_size=len(tok), resid_pdrop=0, embd_pdrop=0, attn_pdrop=0
    )
    torch.manual_seed(0)
    perturb(transformers.GPT2LMHeadModel(config), std=0.05, seed=0).save_pretrained(root)
    tok.save_pretrained(root)
    return root


class OneProcess:
    """The accelerator's collectives on one process (identity), as TRL's ``_compute_loss`` calls them."""

    num_processes, is_main_process = 1, True
    autocast = staticmethod(contextlib.nullcontext)
    gather = gather_for_metrics = staticmethod(lambda x: x)
    reduce = staticmethod(lambda x, reduction="sum": x)


def trl_loss(folder, tmp_path, batch, *, loss_type, beta, temperature, epsilon, epsilon_high, max_completion_length):
    """TRL's own ``GRPOTrainer._compute_loss`` (and its ``_get_per_token_logps_and_entropies`` through the fused
    LM head it installs) on a trainer holding only what that code reads, and the torch model's gradients."""
    args = trl.GRPOConfig(
        output_dir=str(tmp_path / "trl"), use_cpu=True, report_to=[], bf16=False, loss_type=loss_type, beta=beta,
        temperature=temperature, epsilon=epsilon, epsilon_high=epsilon_high, num_generations=2,
        per_device_train_batch_size=len(batch["advantages"]), max_completion_length=max_completion_length,
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel.from_pretrained(folder)
    model.train()
    add_fused_lm_head(model, temperature=temperature, outputs=("log_probs", "entropy"))
    trainer = object.__new__(GRPOTrainer)
    trainer.__dict__.update(
        args=args, model=model, accelerator=OneProcess(), beta=beta, loss_type=loss_type, temperature=temperature,
        epsilon_low=epsilon, epsilon_high=epsilon_high, max_completion_length=max_completion_length,
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level="token", use_vllm=False,
        aux_loss_enabled=False, _entropy_bonus_enabled=False, current_gradient_accumulation_steps=1,
        _metrics={"train": collections.defaultdict(list), "eval": collections.defaultdict(list)},
    )  # fmt: skip
    width = batch["completion_mask"].shape[1]
    t = {k: torch.as_tensor(np.asarray(v)) for k, v in batch.items()}
    inputs = {
        "prompt_ids": t["input_ids"][:, :-width].long(),
        "prompt_mask": t["attention_mask"][:, :-width].long(),
        "completion_ids": t["input_ids"][:, -width:].long(),
        "completion_mask": t["completion_mask"].long(),
        "advantages": t["advantages"],
        "old_per_token_logps": t["old_logps"],
        "num_items_in_batch": t["completion_mask"].sum().float(),
    }
    if beta:
        inputs["ref_per_token_logps"] = t["ref_logps"]
    loss = trainer._compute_loss(model, inputs)
    loss.backward()
    grads = {n: p.grad.numpy() for n, p in model.named_parameters()}
    figures = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return loss.item(), figures, grads


def given_batch(tok, policy, temperature, seed=0):
    """Four completions of two prompts of equal length (TRL's training forward numbers positions 0, 1, ... also
    over left padding), right-padded, with advantages, and old and reference log-probs perturbed off the
    policy's own so that both clipping bounds act."""
    rng = np.random.default_rng(seed)
    prompts = tok(["The sky is", "Two plus two"])["input_ids"]
    prompt = np.repeat(np.asarray(prompts, np.int32), 2, axis=0)
    width = 6
    completion = rng.integers(10, 1000, (4, width)).astype(np.int32)
    lengths = np.array([6, 3, 5, 1])
    completion_mask = (np.arange(width)[None] < lengths[:, None]).astype(np.int32)
    completion[completion_mask == 0] = tok.eos_token_id
    batch = {
        "input_ids": np.concatenate([prompt, completion], axis=1),
        "attention_mask": np.concatenate([np.ones_like(prompt), completion_mask], axis=1),
        "completion_mask": completion_mask,
        "advantages": np.array([1.2, -0.7, 0.4, -1.1], np.float32),
    }
    own = np.asarray(GRPO(GRPOConfig(temperature=temperature)).per_token(policy, batch)[0])
    batch["old_logps"] = (own + rng.normal(0, 0.3, own.shape)).astype(np.float32)
    batch["ref_logps"] = (own + rng.normal(0, 0.5, own.shape)).astype(np.float32)
    return batch


@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_loss_figures_and_gradients_equal_trl(tok, folder, tmp_path, loss_type, beta):
    settings = {"temperature": 0.7, "epsilon": 0.2, "epsilon_high": 0.28, "max_completion_length": 8}
    policy = load_pretrained(folder, "causal-lm")
    batch = given_batch(tok, policy, settings["temperature"])
    want, want_figures, want_grads = trl_loss(folder, tmp_path, batch, loss_type=loss_type, beta=beta, **settings)

    config = GRPOConfig(loss_type=loss_type, beta=beta, **settings)
    objective = GRPO(config)
    assert objective.needs_reference == bool(beta)
    ours = {k: jnp.asarray(v) for k, v in batch.items() if beta or k != "ref_logps"}
    graphdef, state = nnx.split(policy)
    (got, figures), grads = jax.value_and_grad(
        lambda s: objective.loss_and_metrics(nnx.merge(graphdef, s), ours), has_aux=True
    )(state)
    assert abs(float(got) - want) <= 1e-5 * max(1.0, abs(want)), (float(got), want)
    assert want_figures["clip_ratio/low_mean"] > 0 and want_figures["clip_ratio/high_mean"] > 0  # both bounds act
    assert set(figures) == set(want_figures), (set(figures), set(want_figures))
    for key, value in want_figures.items():
        assert abs(float(figures[key]) - value) <= 1e-4 * max(1.0, abs(value)), (key, float(figures[key]), value)
    assert_gradients_match(policy, grads, want_grads)


def test_lora_reference_is_the_base_with_adapters_off_as_a_frozen_copy(tok, folder):
    """With --lora_rank the KL's reference is the base weights (adapters off, no copy): the train step's loss
    and kl equal those of the full model (adapters folded in) against a frozen copy of the base, and the loss
    computed directly with the base's log-probs as ``ref_logps``."""
    mesh = make_mesh("dp=1", devices=jax.devices()[:1])
    objective = GRPO(GRPOConfig(beta=0.1, temperature=0.7))
    base = load_pretrained(folder, "causal-lm", mesh=mesh)
    batch = {k: v for k, v in given_batch(tok, base, 0.7).items() if k != "ref_logps"}
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
    start = load_pretrained(folder, "causal-lm", mesh=mesh)
    full = TrainProgram(start, objective, mesh, OptimizerConfig(), total_steps=1, seed=0)
    assert type(full.training) is Training and full.training.frozen_shardings is not None  # a reference copy
    copy = full.training.freeze(nnx.state(start))
    merged = sharding.shard(program.training.lora.merged(adapters, frozen), full.state_shardings.params)
    direct = {**batch, "ref_logps": objective.per_token(start, batch)[0]}
    want, figures = objective.loss_and_metrics(nnx.merge(full.graphdef, merged), direct)
    _, lora_step = program.step(program.init_state(adapters), frozen, batch)
    _, copy_step = full.step(full.init_state(merged), copy, batch)
    assert float(figures["kl"]) > 1e-3  # the adapters moved the policy off its reference
    for key, value in (("loss", want), ("kl", figures["kl"])):
        np.testing.assert_allclose(float(lora_step[key]), float(value), rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(float(copy_step[key]), float(value), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_advantages_equal_trls(scale_rewards):
    """TRL's ``_generate_and_score_completions`` (sum_then_normalize), its lines reimplemented here with its own
    ``nanstd`` (the method needs a whole generation run)."""
    rng = np.random.default_rng(1)
    rewards = rng.normal(size=12).astype(np.float32)
    rewards[3:6] = 0.5  # a group whose rewards are all equal
    rewards[7] = np.nan  # an unscorable completion
    g = 3
    r = torch.tensor(rewards)
    mean = torch.nanmean(r.view(-1, g), dim=1).repeat_interleave(g, dim=0)
    if scale_rewards in ("group", "none"):
        std = nanstd(r.view(-1, g), dim=1).repeat_interleave(g, dim=0)
    else:
        std = nanstd(r).expand_as(r)
    want = r - mean
    if scale_rewards != "none":
        want = want / (std + 1e-4)
    want = torch.nan_to_num(want, nan=0.0).numpy()
    got, zero = group_advantages(rewards, g, scale_rewards)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(zero, torch.isclose(std, torch.zeros_like(std)).numpy())
    if scale_rewards != "batch":
        assert zero[3:6].all() and not zero[:3].any()


def recording(calls):
    def reward_len(prompts, completions, completion_ids, **kwargs):
        calls.append({"prompts": prompts, "completions": completions, "completion_ids": completion_ids, **kwargs})
        return [float(len(ids)) for ids in completion_ids]

    return reward_len


@pytest.mark.parametrize("conversational", [False, True])
def test_reward_funcs_get_trls_arguments_and_the_sampler_compiles_once(tok, folder, conversational, monkeypatch):
    records = [
        {"prompt": "The sky is", "answer": "blue"},
        {"prompt": "Two plus two is", "answer": "four"},
    ]
    if conversational:
        records = [{**r, "prompt": [{"role": "user", "content": r["prompt"]}]} for r in records]
    calls = []
    config = GRPOConfig(num_generations=3, max_completion_length=5, temperature=0.9)
    rollout = Rollout(config, tok, records, [("reward_len", recording(calls))], eos_token_ids=[tok.eos_token_id])
    rows = prompt_rows(tok, records, None, tok.eos_token_id)
    policy = load_pretrained(folder, "causal-lm")
    built, original = [], generation.program
    monkeypatch.setattr(generation, "program", lambda *a: built.append(original(*a)) or built[-1])
    generation.cached_program.cache_clear()
    graphdef, state = nnx.split(policy)
    for step in range(3):  # new weights each step, as after an update: the same compiled sampler
        state = jax.tree.map(lambda x: x * 1.01, state)
        out, figures = rollout.sample(nnx.merge(graphdef, state), rows, seed=step)
    info = generation.cached_program.cache_info()
    assert info.misses == 1 and info.hits == 2 and len(built) == 1, info
    assert built[0]._cache_size() == 1  # one trace, one compilation for every step
    call = calls[-1]
    assert set(call) == {"prompts", "completions", "completion_ids", "answer"}
    assert call["prompts"] == [r["prompt"] for r in records for _ in range(3)]
    assert call["answer"] == ["blue"] * 3 + ["four"] * 3
    lengths = out["completion_mask"].sum(1)
    assert [len(ids) for ids in call["completion_ids"]] == lengths.tolist()
    texts = tok.batch_decode(call["completion_ids"], skip_special_tokens=True)
    if conversational:
        assert call["completions"] == [[{"role": "assistant", "content": t}] for t in texts]
    else:
        assert call["completions"] == texts
    np.testing.assert_allclose(figures["reward"], lengths.mean(), rtol=1e-6)
    np.testing.assert_allclose(figures["rewards/reward_len/mean"], lengths.mean(), rtol=1e-6)
    np.testing.assert_allclose(out["advantages"], group_advantages(lengths.astype(np.float32), 3)[0], rtol=1e-5)


def test_qlora_rollout_samples_the_quantised_kernels_with_their_adapters(tok, monkeypatch):
    """GRPO with --quantize samples from the quantised kernels with the adapters beside them, each layer
    dequantised inside the sampler's program: no full-precision model is built (``Lora.merged`` is never called,
    the sampled model holds codes, no float kernel), its completions and old log-probs are those of the
    dequantised model with the adapters folded in, and new weights reuse the compiled sampler."""
    from jaxseq.models import Execution, from_config
    from jaxseq.train import rl
    from jaxseq.train.lora import Lora

    mesh = make_mesh("fsdp=2,mp=2,dp=2")
    llama = transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    model = from_config(llama, "causal-lm", mesh=mesh, seed=0, execution=Execution(scan_layers=True))
    records = [{"prompt": p} for p in ("The sky is", "Two plus two is", "Hello there", "Once upon a")]
    config = GRPOConfig(num_generations=4, max_completion_length=5, temperature=0.9, num_iterations=2)
    prompts = prompt_rows(tok, records, None, tok.eos_token_id)
    rollout = Rollout(config, tok, records, [("reward_len", recording([]))], eos_token_ids=[tok.eos_token_id],
                      prompts=prompts)  # fmt: skip
    lora = LoraConfig(lora_rank=4, lora_targets="q_proj,v_proj,down_proj", quantize="nf4")
    program = TrainProgram(model, GRPO(config, rollout), mesh, OptimizerConfig(), total_steps=2, seed=0, lora=lora)
    frozen = program.training.freeze(nnx.state(model))
    noise = lambda x: x + 0.05 * jax.random.normal(jax.random.key(x.size), x.shape, x.dtype)  # B starts at 0
    params = jax.tree.map(noise, program.training.init(nnx.state(model)))
    weights = [params]
    eval_model = program.training.eval_model
    policy = Policy(lambda: eval_model(weights[-1], frozen), per_device_batch=2, replicas=4, accumulate=1,
                    place=lambda rows, stacked: rows)  # fmt: skip
    sampled, original = [], rl.generate
    monkeypatch.setattr(rl, "generate", lambda model, *a, **k: sampled.append(model) or original(model, *a, **k))
    monkeypatch.setattr(Lora, "merged", lambda *a, **k: pytest.fail("a full-precision model was built"))
    generation.cached_program.cache_clear()
    rows, _ = rollout(policy, None, 0)
    flat = {path: v.get_value() for path, v in nnx.to_flat_state(nnx.state(sampled[0]))}
    quantized = program.training.lora.quantized
    assert len(quantized) == 7 and all(flat[(*path, "kernel")].size == 0 for path in quantized)
    assert all(flat[(*path, "dot_general", "quantized", "codes")].dtype == jnp.uint8 for path in quantized)
    weights.append(jax.tree.map(noise, params))  # new weights: the same compiled sampler
    rollout(policy, None, 2)
    info = generation.cached_program.cache_info()
    assert info.misses == 1 and info.hits == 1, info
    monkeypatch.undo()
    merged = program.training.merged_model(params, frozen)  # the dequantised kernels, the adapters folded in
    want, _ = rollout.sample(merged, rollout.step_prompts(0, 2), seed=0)
    np.testing.assert_array_equal(rows["input_ids"], want["input_ids"])
    np.testing.assert_array_equal(rows["completion_mask"], want["completion_mask"])
    old = jax.jit(lambda m, b: rl.completion_logps(m, b, config.temperature)[0])(merged, want)
    np.testing.assert_allclose(rows["old_logps"], np.asarray(old), rtol=1e-5, atol=1e-5)


def test_bad_grpo_settings_stop_in_one_line(tmp_path):
    with pytest.raises(JaxseqError, match="--num_generations"):
        GRPOConfig(num_generations=1)
    with pytest.raises(JaxseqError, match="--reward_weights"):
        GRPOConfig(reward_funcs=["a.py:f"], reward_weights=[1.0, 2.0])
    with pytest.raises(JaxseqError, match="--reward_funcs"):
        load_reward_funcs(None)
    with pytest.raises(JaxseqError, match="does not exist"):
        load_reward_funcs([str(tmp_path / "missing.py:f")])
    (tmp_path / "r.py").write_text("def f(**kw):\n    return []\n")
    with pytest.raises(JaxseqError, match="defines no function g"):
        load_reward_funcs([f"{tmp_path / 'r.py'}:g"])
    with pytest.raises(JaxseqError, match=r"= 6 completions a step.*--num_generations 4.*batch_size 4$"):
        prompts_per_step(3, 2, 1, 4)  # 3 per device x 2 devices: not whole groups of 4; 4 per device are


@pytest.mark.parametrize(
    "per_device, accumulate, num_generations", [(8, 1, 8), (4, 2, 8), (6, 1, 3), (3, 1, 4), (2, 3, 4), (16, 1, 2)]
)
def test_batch_size_rule_and_prompts_per_step_are_trls(tmp_path, per_device, accumulate, num_generations):
    """TRL's GRPOConfig on one process: its generation batch (per_device x processes x gradient accumulation
    completions) must be divisible by num_generations, and holds generation_batch_size / num_generations
    prompts; jaxseq's rule is the same (and names the batch size that would be)."""
    try:
        want = trl.GRPOConfig(
            output_dir=str(tmp_path), use_cpu=True, report_to=[], per_device_train_batch_size=per_device,
            gradient_accumulation_steps=accumulate, num_generations=num_generations,
        )  # fmt: skip
    except ValueError as e:
        assert "must be divisible by num_generations" in str(e)
        with pytest.raises(JaxseqError, match="must be divisible by --num_generations"):
            prompts_per_step(per_device, 1, accumulate, num_generations)
    else:
        assert want.generation_batch_size == per_device * accumulate
        assert prompts_per_step(per_device, 1, accumulate, num_generations) == want.generation_batch_size // (
            num_generations
        )


def test_reward_lists_are_trls_nargs_or_repeated_flags(tmp_path):
    """--reward_weights 1.0 0.5 and --reward_funcs a.py:f b.py:g (TRL's lists, HfArgumentParser's nargs="+"),
    the repeated flags, a mix, ``=`` and negative weights, and a YAML list, all parse to the same lists."""
    funcs, weights = ["a.py:f", "b.py:g"], [1.0, -0.5]
    given = {
        "TRL's lists": ["--reward_funcs", *funcs, "--reward_weights", "1.0", "-0.5"],
        "repeated": ["--reward_funcs", funcs[0], "--reward_funcs", funcs[1], "--reward_weights", "1.0",
                     "--reward_weights", "-0.5"],
        "mixed, with =": ["--reward_weights=1.0", "--reward_weights", "-0.5", "--reward_funcs", funcs[0],
                          "--reward_funcs=b.py:g"],
    }  # fmt: skip
    (tmp_path / "c.yaml").write_text("reward_funcs: [a.py:f, b.py:g]\nreward_weights: [1.0, -0.5]\n")
    given["YAML lists"] = ["--config", str(tmp_path / "c.yaml")]
    for name, flags in given.items():
        argv = ["--model_name_or_path", "m", *flags, "--num_generations", "4", "--output_dir", "o"]
        args = parse_job(grpo.JOB, argv)
        assert (args.grpo.reward_funcs, args.grpo.reward_weights) == (funcs, weights), name
        assert (args.grpo.num_generations, args.trainer.output_dir) == (4, "o"), name
    hf = transformers.HfArgumentParser(trl.GRPOConfig)
    (trl_args,) = hf.parse_args_into_dataclasses(["--output_dir", "o", "--use_cpu", "--reward_weights", "1.0", "-0.5"])
    assert trl_args.reward_weights == weights  # TRL's own parser reads the same flags


REWARD = '''
def fraction_of_a(prompts, completions, completion_ids, **kwargs):
    """The share of the completion's tokens that are "a"."""
    return [sum(t == {a} for t in ids) / max(len(ids), 1) for ids in completion_ids]
'''


def test_jaxseq_grpo_raises_a_verifiable_reward(tmp_path):
    """A fresh process on one CPU device: reward = the share of "a" in 8-token completions; uniform at the start
    (about 1/19), it climbs well above within 40 steps, logged every step under TRL's names."""
    vocab = letters_gpt2(tmp_path / "model")
    (tmp_path / "rewards.py").write_text(REWARD.format(a=vocab["a"]))
    rng = np.random.default_rng(0)
    prompts = [{"prompt": " ".join(rng.choice(LETTERS, 4))} for _ in range(32)]
    (tmp_path / "prompts.jsonl").write_text("\n".join(map(json.dumps, prompts)) + "\n")
    steps = 40
    args = [
        "--model_name_or_path", tmp_path / "model", "--train_file", tmp_path / "prompts.jsonl",
        "--reward_funcs", f"{tmp_path / 'rewards.py'}:fraction_of_a", "--num_generations", 8,
        "--max_completion_length", 8, "--per_device_train_batch_size", 32, "--max_steps", steps,
        "--learning_rate", 3e-3, "--lr_scheduler_type", "constant", "--logging_steps", 1,
        "--output_dir", tmp_path / "out", "--report_to", "none", "--save_strategy", "no", "--seed", 0,
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["HF_HUB_OFFLINE"] = "1"
    started = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "jaxseq", "grpo", *map(str, args)], capture_output=True,
                            text=True, env=env, timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    logged = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in logged if "train/reward" in r]
    assert [r["step"] for r in train] == list(range(1, steps + 1))
    names = ("reward", "reward_std", "rewards/fraction_of_a/mean", "completions/mean_length", "clip_ratio/region_mean")
    assert {f"train/{k}" for k in names} <= set(train[0])
    rewards = np.array([r["train/reward"] for r in train])
    first, last = rewards[:5].mean(), rewards[-5:].mean()
    assert first < 0.15 and last > 0.4 and last > 3 * first, (rewards.round(3).tolist(), time.perf_counter() - started)
    assert (tmp_path / "out" / "config.json").exists()  # the trained model, a Hugging Face folder


RECORD_PROMPTS = """
import json

def length(prompts, completions, completion_ids, **kwargs):
    with open({log!r}, "a") as f:
        f.write(json.dumps(prompts) + "\\n")
    return [float(len(ids)) for ids in completion_ids]
"""


def test_per_device_batch_counts_completions_as_trls(tmp_path, capsys):
    """--per_device_train_batch_size counts completions (TRL's): 1 per device on the 8 devices x 2 accumulated
    micro-batches is 16 completions a step, sampled as 16 / --num_generations 4 = 4 prompts with their 4
    completions each (one reward call a step), other prompts each step of an epoch; the log and results say so."""
    vocab = letters_gpt2(tmp_path / "model")
    assert jax.device_count() == 8 and vocab
    log = tmp_path / "calls.jsonl"
    (tmp_path / "rewards.py").write_text(RECORD_PROMPTS.format(log=str(log)))
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"a b {x}"}) + "\n" for x in LETTERS))
    args = [
        "--model_name_or_path", tmp_path / "model", "--train_file", tmp_path / "prompts.jsonl",
        "--reward_funcs", f"{tmp_path / 'rewards.py'}:length", "--num_generations", 4, "--max_completion_length", 4,
        "--per_device_train_batch_size", 1, "--gradient_accumulation_steps", 2, "--max_steps", 2,
        "--logging_steps", 1, "--output_dir", tmp_path / "out", "--report_to", "none", "--save_strategy", "no",
        "--compilation_cache_dir", "",
    ]  # fmt: skip
    assert grpo.main([str(a) for a in args]) == 0
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(calls) == 2, calls  # one sampled batch a step
    for prompts in calls:
        assert len(prompts) == 16 and prompts == [p for p in prompts[::4] for _ in range(4)], prompts
        assert len(set(prompts)) == 4, prompts  # 4 groups of 4 completions: whole groups, 4 prompts
    assert not set(calls[0]) & set(calls[1])  # an epoch is 16 prompts x 4 completions = 4 steps: no repeats
    printed = capsys.readouterr().out
    assert "2 steps of global batch 16 on 8 devices" in printed, printed
    assert "a step samples 4 prompts x 4 = 16 completions (1 per device)" in printed, printed
    results = json.loads((tmp_path / "out" / "all_results.json").read_text())
    assert results["train_samples"] == 16 * 4 and results["epoch"] == 0.5, results  # completions, as TRL's


@pytest.mark.parametrize("loss_type", ["dapo", "bnpo"])
def test_accumulated_micro_batches_reduce_as_trl(tok, folder, loss_type):
    """With --gradient_accumulation_steps, dapo is one mean over every completion token of the step (TRL's
    num_items_in_batch spans the accumulation window: the whole batch's loss); bnpo, grpo and dr_grpo average
    the micro-batches' own losses (TRL divides each by the accumulation steps)."""
    mesh = make_mesh("dp=1", devices=jax.devices()[:1])
    objective = GRPO(GRPOConfig(loss_type=loss_type, temperature=0.7))
    model = load_pretrained(folder, "causal-lm", mesh=mesh)
    batch = {k: v for k, v in given_batch(tok, model, 0.7).items() if k != "ref_logps"}
    batch["completion_mask"][2:, 1:] = 0  # the second micro-batch holds far fewer tokens than the first
    halves = [{k: v[i : i + 2] for k, v in batch.items()} for i in (0, 2)]
    whole = float(objective.loss(model, batch))
    parts = [float(objective.loss(model, half)) for half in halves]
    want = whole if loss_type == "dapo" else np.mean(parts)
    assert abs(whole - np.mean(parts)) > 1e-3  # the two reductions differ on this batch
    program = TrainProgram(model, objective, mesh, OptimizerConfig(), total_steps=1, seed=0, accumulate=2)
    stacked = {k: np.stack([h[k] for h in halves]) for k in batch}
    _, metrics = program.step(program.init_state(nnx.state(model)), None, stacked)
    np.testing.assert_allclose(float(metrics["loss"]), want, rtol=1e-5)
