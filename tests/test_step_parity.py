"""Training-step parity with PyTorch: from identical (perturbed) weights and the same batch, jaxseq's jitted
train step (``TrainProgram.step``, what the Trainer runs, with the optimizer ``make_optimizer`` builds)
equals transformers' loss, ``loss.backward()``, ``clip_grad_norm_`` and ``torch.optim.AdamW``; gradient
accumulation over two micro-batches equals one step on the doubled batch; a LoRA step equals PEFT's."""

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxseq.data.glue import get_task  # noqa: E402
from jaxseq.mesh import make_mesh  # noqa: E402
from jaxseq.models import load_pretrained  # noqa: E402
from jaxseq.models.registry import family_for  # noqa: E402
from jaxseq.models.weights import torch_layout  # noqa: E402
from jaxseq.sharding import path_string  # noqa: E402
from jaxseq.train.lora import LoraConfig  # noqa: E402
from jaxseq.train.objectives import CausalLM, Seq2SeqLM, SequenceClassification  # noqa: E402
from jaxseq.train.optim import OptimizerConfig  # noqa: E402
from jaxseq.train.step import TrainProgram  # noqa: E402
from tests.reference import padded_batch, perturb  # noqa: E402
from tests.tiny import tiny_config  # noqa: E402

VOCAB, SEQ, STEPS = 101, 16, 2
LENGTHS = (16, 11, 7, 3)  # batch 4, right-padded: the loss must skip the padding targets

# Adam's first update is lr * g / (|g| + eps): with the default eps of 1e-8 it is lr * sign(g) for nearly
# every weight, which tests the gradients' signs only and turns float32 noise in a gradient near zero into a
# difference of up to lr * noise / eps. An eps near the gradients' own size (they run from 1e-5 to 1e-1 here)
# makes the update follow the gradient's magnitude and keeps that amplification below 1e-5 of the update.
OPTIMIZER = dict(learning_rate=1e-2, weight_decay=0.1, adam_beta1=0.8, adam_beta2=0.9, adam_epsilon=1e-3)


WIDE = dict(hidden_size=64, intermediate_size=96, vocab_size=VOCAB, max_position_embeddings=64, pad_token_id=0)
NO_DROPOUT = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def gpt2_config():
    return tiny_config("gpt2", n_embd=64, vocab_size=VOCAB, n_positions=64, **NO_DROPOUT, pad_token_id=0)


def gptj_config():
    return tiny_config("gptj", n_embd=64, rotary_dim=8, vocab_size=VOCAB, n_positions=64, **NO_DROPOUT, pad_token_id=0)


def t5_config(gated: bool):
    return tiny_config(
        "t5", num_decoder_layers=2, d_model=64, d_kv=16, d_ff=128, vocab_size=VOCAB, relative_attention_num_buckets=8,
        relative_attention_max_distance=20, dropout_rate=0.0, decoder_start_token_id=0,
        feed_forward_proj="gated-gelu" if gated else "relu", tie_word_embeddings=not gated,
    )  # fmt: skip


def bert_config():
    return tiny_config(
        "bert", hidden_size=64, intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=64, num_labels=3,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=0,
    )  # fmt: skip


def roberta_config():
    return tiny_config(
        "roberta", hidden_size=64, intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=66, num_labels=3,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=1,
    )  # fmt: skip


def llama_config():
    return tiny_config("llama", **WIDE, attention_bias=True)


def opt_config():
    """350m-style: post-norm, project_in/project_out."""
    return tiny_config(
        "opt", hidden_size=64, ffn_dim=96, word_embed_proj_dim=32, do_layer_norm_before=False, vocab_size=VOCAB,
        max_position_embeddings=64, pad_token_id=0, dropout=0.0,
    )  # fmt: skip


def qwen3_config():
    return tiny_config("qwen3", **WIDE, head_dim=16, tie_word_embeddings=False)


def phi3_config():
    """Fused qkv_proj and gate_up_proj, rotation over half of each head, every layer sliding over 8 positions,
    LongRoPE past an original length of 8 (the 16-token batch takes its long factors and attention factor)."""
    return tiny_config(
        "phi3", **WIDE, sliding_window=8, partial_rotary_factor=0.5, original_max_position_embeddings=8,
        rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 8,
            "short_factor": [1.0, 1.5, 2.0, 2.5], "long_factor": [2.0, 4.0, 6.0, 8.0],
        },
    )  # fmt: skip


def gemma2_config():
    """Tied head, both soft-caps, layers sliding over 4 positions and full in turn."""
    return tiny_config(
        "gemma2", **WIDE, head_dim=16, sliding_window=4, query_pre_attn_scalar=24, attn_logit_softcapping=3.0,
        final_logit_softcapping=8.0, attn_implementation="eager",
    )  # fmt: skip


def causal_batch(seed=0, lengths=LENGTHS):
    ids, mask = padded_batch(VOCAB, lengths, seed=seed)
    labels = np.where(mask == 1, ids, -100)  # transformers' loss skips -100; jaxseq's skips mask-0 targets
    return {"input_ids": ids, "attention_mask": mask}, {"input_ids": ids, "attention_mask": mask, "labels": labels}


def gemma3_config():
    """q/k norms, linear rope scaling on the full layer and a local base on the sliding one (window 4), final
    soft-cap, untied head."""
    return tiny_config(
        "gemma3_text", **WIDE, head_dim=16, sliding_window=4, query_pre_attn_scalar=24, final_logit_softcapping=8.0,
        tie_word_embeddings=False, layer_types=["sliding_attention", "full_attention"], attn_implementation="eager",
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 50.0},
        },
    )  # fmt: skip


def full_rows(seed=0):
    """``causal_batch`` without padding: transformers' eager Gemma 2 in float64 (the exact reference) gives NaN
    logits on every position of padded rows (transformers 5.23; not in float32);
    test_gemma checks padded rows against its float32 model."""
    return causal_batch(seed, lengths=(SEQ,) * len(LENGTHS))


def seq2seq_batch(seed=0):
    ids, mask = padded_batch(VOCAB, LENGTHS, seed=seed)
    targets, target_mask = padded_batch(VOCAB, (9, 16, 4, 12), seed=seed + 1)
    ours = {"input_ids": ids, "attention_mask": mask, "labels": targets, "decoder_attention_mask": target_mask}
    labels = np.where(target_mask == 1, targets, -100)  # T5 shifts these right, -100 becoming the pad id
    return ours, {"input_ids": ids, "attention_mask": mask, "labels": labels}


def classification_batch(seed=0):
    ids, mask = padded_batch(VOCAB, LENGTHS, seed=seed)
    types = ((np.arange(SEQ)[None, :] >= mask.sum(1, keepdims=True) // 2) & (mask == 1)).astype(np.int32)
    labels = np.array([0, 2, 1, 2], np.int32)
    ours = {"input_ids": ids, "attention_mask": mask, "token_type_ids": types, "labels": labels}
    return ours, dict(ours)


def roberta_batch(seed=0):
    """Right-padded with RoBERTa's <pad> (1), no token types: positions count the real tokens."""
    ids, mask = padded_batch(VOCAB, LENGTHS, pad_id=1, seed=seed, low=2)
    ours = {"input_ids": ids, "attention_mask": mask, "labels": np.array([0, 2, 1, 2], np.int32)}
    return ours, dict(ours)


def v11(config):
    """A T5 v1.1 reference with its own ``lm_head`` (transformers 5 ties it to ``shared`` unless the
    checkpoint holds a distinct one, as real v1.1 checkpoints do)."""
    model = transformers.T5ForConditionalGeneration(config)
    model.lm_head.weight = torch.nn.Parameter(torch.randn(VOCAB, config.d_model))
    return model


CASES = {  # reference constructor, jaxseq task, objective, batch
    "gpt2": (lambda: transformers.GPT2LMHeadModel(gpt2_config()), "causal-lm", CausalLM, causal_batch),
    "gptj": (lambda: transformers.GPTJForCausalLM(gptj_config()), "causal-lm", CausalLM, causal_batch),
    "llama": (lambda: transformers.LlamaForCausalLM(llama_config()), "causal-lm", CausalLM, causal_batch),
    "qwen3": (lambda: transformers.Qwen3ForCausalLM(qwen3_config()), "causal-lm", CausalLM, causal_batch),
    "phi3": (lambda: transformers.Phi3ForCausalLM(phi3_config()), "causal-lm", CausalLM, causal_batch),
    "opt": (lambda: transformers.OPTForCausalLM(opt_config()), "causal-lm", CausalLM, causal_batch),
    "gemma2": (lambda: transformers.Gemma2ForCausalLM(gemma2_config()), "causal-lm", CausalLM, full_rows),
    "gemma3": (lambda: transformers.Gemma3ForCausalLM(gemma3_config()), "causal-lm", CausalLM, full_rows),
    "t5-v1.0": (
        lambda: transformers.T5ForConditionalGeneration(t5_config(gated=False)),
        "seq2seq-lm",
        Seq2SeqLM,
        seq2seq_batch,
    ),
    "t5-v1.1": (lambda: v11(t5_config(gated=True)), "seq2seq-lm", Seq2SeqLM, seq2seq_batch),
    "bert-classification": (
        lambda: transformers.BertForSequenceClassification(bert_config()),
        "sequence-classification",
        lambda: SequenceClassification(get_task("mnli")),
        classification_batch,
    ),
    "roberta-classification": (
        lambda: transformers.RobertaForSequenceClassification(roberta_config()),
        "sequence-classification",
        lambda: SequenceClassification(get_task("mnli")),
        roberta_batch,
    ),
}


@pytest.fixture(scope="module")
def mesh():
    return make_mesh("dp=1", devices=jax.devices()[:1])


def reference(case, tmp_path):
    """The perturbed transformers model of ``case``, saved to ``tmp_path`` for jaxseq to load."""
    torch.manual_seed(0)
    model = perturb(CASES[case][0](), std=0.05, seed=0)
    model.save_pretrained(tmp_path)
    return model


def torch_steps(model, batches, *, max_grad_norm, total_steps=STEPS, params=None):
    """transformers' loss, backward, ``clip_grad_norm_`` and ``torch.optim.AdamW`` with jaxseq's decay mask
    (matrices decay; biases and norm scales, the 1-D parameters, do not) and its default schedule (linear
    decay to 0 over ``total_steps``, no warmup) on ``params`` (default: every parameter). Returns the
    trained parameters by name after each step, the losses and the gradient norms before clipping."""
    model.train()  # every dropout rate is 0
    params = [p for p in model.parameters() if p.requires_grad] if params is None else params
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": OPTIMIZER["weight_decay"]},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(
        groups,
        lr=OPTIMIZER["learning_rate"],
        betas=(OPTIMIZER["adam_beta1"], OPTIMIZER["adam_beta2"]),
        eps=OPTIMIZER["adam_epsilon"],
    )
    schedule = transformers.get_linear_schedule_with_warmup(opt, 0, total_steps)
    after, losses, norms = [], [], []
    for batch in batches:
        loss = model(**{k: torch.as_tensor(v).long() for k, v in batch.items()}).loss
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, max_grad_norm or float("inf"))))
        opt.step()
        schedule.step()
        opt.zero_grad()
        losses.append(loss.item())
        after.append({n: p.detach().numpy().astype(np.float64) for n, p in model.named_parameters() if p.requires_grad})
    return after, losses, norms


def flat_params(params) -> dict[str, np.ndarray]:
    return {path_string(path): np.asarray(leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(params)}


def jaxseq_program(model, objective, mesh, *, max_grad_norm, accumulate=1, lora=None, total_steps=STEPS):
    config = OptimizerConfig(**OPTIMIZER, max_grad_norm=max_grad_norm, lr_scheduler_type="linear")
    return TrainProgram(
        model, objective, mesh, config, total_steps=total_steps, seed=0, accumulate=accumulate, lora=lora
    )


def torch_named(model, flat: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """jaxseq's parameters by PyTorch name, in PyTorch's layout, the vocabulary trimmed to ``config.vocab_size``
    after checking that the rows jaxseq pads it with (to a multiple of 128) are still exactly zero."""
    family = family_for(model.config.model_type)
    out = {}
    for name, (path, transposed) in torch_layout(model).items():
        key = "/".join(map(str, path))
        array, axis = flat[key], family.vocab_axis(key)
        if axis is not None:
            assert not np.take(array, np.arange(VOCAB, array.shape[axis]), axis=axis).any(), f"{name}: padding moved"
            array = np.take(array, np.arange(VOCAB), axis=axis)
        out[name] = array.T if transposed else array
    return out


def assert_updates_match(got, got_before, exact, exact_before, f32, f32_before):
    """Each parameter's update (after - before) in jaxseq equals the update of transformers run in float64
    (``exact``), within max(1e-5 of the tensor's largest update, 4 x the error of transformers' own float32
    run, ``f32``) plus two float32 roundings of the stored weight.

    Why not 1e-5 of the update alone: float32 itself is not that exact here. The gradients carry rounding
    noise of ~1e-7 of the terms they sum, which cancels in small gradients; Adam divides by |g| + eps, so
    transformers' float32 updates differ from its float64 ones by up to ~8e-5 of the largest update (T5
    v1.1), jaxseq's by up to ~3e-5, never more than 3x transformers' own error for the same tensor. And the
    stored weights are rounded to float32 (half an ulp, ~6e-8 on a weight near 1, against updates of ~5e-3).
    A wrong activation, scale, mask, decay group, clip or learning rate moves updates by far more."""
    assert set(got) == set(exact), set(got) ^ set(exact)
    for name in exact:
        update = exact[name] - exact_before[name]
        err = np.abs((got[name].astype(np.float64) - got_before[name]) - update)
        noise = np.abs((f32[name] - f32_before[name]) - update).max()
        eps = np.finfo(np.float32).eps
        tol = max(1e-5 * np.abs(update).max(), 4 * noise) + 2 * eps * np.abs(exact[name])
        assert np.all(err <= tol), (name, float(err.max()), float(noise), float(np.abs(update).max()))


def run_jaxseq(program, state, frozen, batches, to_torch):
    """``program.step`` over ``batches``; parameters by PyTorch name (through ``to_torch``) after each step,
    losses and gradient norms."""
    after, losses, norms = [], [], []
    for batch in batches:
        state, metrics = program.step(state, frozen, {k: jnp.asarray(v) for k, v in batch.items()})
        after.append(to_torch(flat_params(state.params)))
        losses.append(float(metrics["loss"]))
        norms.append(float(metrics["grad_norm"]))
    return after, losses, norms


def assert_steps_match(ours, exact, f32, before):
    """Loss and gradient norm of each step within 1e-5 relative of the float64 reference (float32 gives
    ~3e-7), and the updates as ``assert_updates_match`` says."""
    for i in range(len(exact[0])):
        assert ours[1][i] == pytest.approx(exact[1][i], rel=1e-5), i
        assert ours[2][i] == pytest.approx(exact[2][i], rel=1e-5), i
        previous = [before if i == 0 else run[0][i - 1] for run in (ours, exact, f32)]
        assert_updates_match(ours[0][i], previous[0], exact[0][i], previous[1], f32[0][i], previous[2])


@pytest.mark.parametrize(
    "case, max_grad_norm",
    [
        ("gpt2", 0.1),
        ("gptj", 0.0),
        ("llama", 0.5),
        ("qwen3", 0.5),
        ("phi3", 0.5),
        ("opt", 0.5),
        ("gemma2", 0.5),
        ("gemma3", 0.5),
        ("t5-v1.0", 1.0),
        ("t5-v1.1", 0.5),
        ("bert-classification", 100.0),
        ("roberta-classification", 0.5),
    ],
)
def test_optimizer_step_parity(case, max_grad_norm, mesh, tmp_path):
    """Two steps: the first checks the gradients, clipping, update and weight decay (Adam's moments are the
    gradient itself), the second the moment averages (betas 0.8, 0.9) and the schedule's second learning
    rate (half the first). Clipping binds (``max_grad_norm`` under the gradient norm) for GPT-2 and T5, is
    off for GPT-J and stays far above the norm for BERT; the test checks which. Both clips scale by
    max_norm / (norm + 1e-6) (``jaxseq.train.optim.clip_by_global_norm``)."""
    ref = reference(case, tmp_path)
    before = {n: p.detach().numpy().astype(np.float64) for n, p in ref.named_parameters()}
    _, task, objective, make_batch = CASES[case]
    ours, theirs = zip(*(make_batch(seed) for seed in range(STEPS)))
    exact = torch_steps(copy.deepcopy(ref).double(), theirs, max_grad_norm=max_grad_norm)
    f32 = torch_steps(ref, theirs, max_grad_norm=max_grad_norm)

    model = load_pretrained(tmp_path, task, mesh=mesh)
    program = jaxseq_program(model, objective(), mesh, max_grad_norm=max_grad_norm)
    state = program.init_state(nnx.state(model))
    got = run_jaxseq(program, state, None, ours, lambda flat: torch_named(model, flat))
    assert_steps_match(got, exact, f32, before)
    if max_grad_norm:
        assert all((n > max_grad_norm) == (case != "bert-classification") for n in exact[2]), exact[2]


def accumulation_runs(model, mesh, lengths):
    """One step on 8 rows, and one step accumulating the same rows as two micro-batches of 4 (jaxseq's
    ``[accumulate, micro-batch, ...]`` layout): (losses, parameters after) of each."""
    ids, mask = padded_batch(VOCAB, lengths, seed=5)
    results = []
    for accumulate in (1, 2):
        program = jaxseq_program(model, CausalLM(), mesh, max_grad_norm=1.0, accumulate=accumulate)
        batch = {k: jnp.asarray(v.reshape(accumulate, -1, SEQ) if accumulate > 1 else v) for k, v in
                 (("input_ids", ids), ("attention_mask", mask))}  # fmt: skip
        state, metrics = program.step(program.init_state(nnx.state(model)), None, batch)
        results.append((float(metrics["loss"]), flat_params(state.params)))
    return results


@pytest.mark.parametrize(
    "lengths",
    [(16, 11, 7, 3, 3, 7, 11, 16), (16, 16, 14, 12, 6, 4, 3, 2)],
    ids=["equal-targets", "unequal-padding"],  # 54 and 11 targets in the second case's micro-batches
)
def test_gradient_accumulation_equals_the_doubled_batch(lengths, mesh, tmp_path):
    """Accumulating 2 micro-batches of 4 rows is one step on the 8 rows: the same loss (1e-6 relative) and the
    same parameters (1e-4 of each tensor's largest update, plus float32 rounding of the weights). The two
    programs sum the same terms in another order, and Adam amplifies that rounding in small gradients as in
    ``assert_updates_match``: measured up to 1.3e-5 of the update. With the micro-batches' target counts
    equal, and with them unequal:
    each micro-batch's per-token mean then counts by its targets (``loss_weight``), not half each (which
    gave a loss 9e-4 relative off and updates up to twice their size off)."""
    reference("gpt2", tmp_path)
    model = load_pretrained(tmp_path, "causal-lm", mesh=mesh)
    before = flat_params(nnx.state(model))
    (loss, whole), (accumulated_loss, accumulated) = accumulation_runs(model, mesh, lengths)
    assert accumulated_loss == pytest.approx(loss, rel=1e-6)
    for key, want in whole.items():
        update = want - before[key]
        tol = 1e-4 * np.abs(update).max() + 2 * np.finfo(np.float32).eps * np.abs(want)
        assert np.all(np.abs(accumulated[key] - want) <= tol), key


LORA = {  # jaxseq task, PEFT task type, target modules, fan_in_fan_out (GPT-2's Conv1D stores [in, out])
    "gpt2": ("causal-lm", "CAUSAL_LM", ["c_attn"], True),
    "bert-classification": ("sequence-classification", "SEQ_CLS", ["query", "value"], False),
    "llama": (
        "causal-lm",
        "CAUSAL_LM",
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        False,
    ),
    "qwen3": ("causal-lm", "CAUSAL_LM", ["q_proj", "k_proj", "v_proj", "o_proj"], False),
    "phi3": ("causal-lm", "CAUSAL_LM", ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"], False),
    "opt": ("causal-lm", "CAUSAL_LM", ["q_proj", "v_proj", "fc1", "project_in"], False),
}


@pytest.mark.parametrize("case", list(LORA))
def test_lora_step_parity(case, mesh, tmp_path):
    """Two LoRA steps (rank 4, alpha 8, no dropout) equal PEFT's with torch AdamW on the same adapters, named
    by module as PEFT's ``target_modules`` (Llama: all seven projections): B starts random, not at zero, so A
    gets gradients too; BERT's classifier trains in full on both sides (jaxseq's task head, PEFT's
    ``modules_to_save``). Same tolerances as the full-model steps."""
    peft = pytest.importorskip("peft")
    task, peft_task, targets, fan_in_fan_out = LORA[case]
    ref = reference(case, tmp_path)
    model = load_pretrained(tmp_path, task, mesh=mesh)
    lora = LoraConfig(lora_rank=4, lora_alpha=8.0, lora_dropout=0.0, lora_targets=",".join(targets))
    program = jaxseq_program(model, CASES[case][2](), mesh, max_grad_norm=1.0, lora=lora)
    frozen = program.training.freeze(nnx.state(model))
    adapters = program.training.init(nnx.state(model))
    leaves, treedef = jax.tree_util.tree_flatten_with_path(adapters)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    adapters = jax.tree.unflatten(
        treedef,
        [x + 0.1 * jax.random.normal(k, x.shape) if path_string(p).endswith("lora_B") else x
         for (p, x), k in zip(leaves, keys)],
    )  # fmt: skip

    # jaxseq's trained tree by PEFT's parameter names, in PyTorch's layout
    layout = {"/".join(map(str, path)): (name, t) for name, (path, t) in torch_layout(model).items()}

    def peft_names(flat):
        out = {}
        for key, array in flat.items():
            *module, leaf = key.split("/")
            if leaf in ("lora_A", "lora_B"):
                name = layout["/".join((*module, "kernel"))][0].removesuffix(".weight")
                out[f"base_model.model.{name}.{leaf}.default.weight"] = array.T
            else:  # the task head, trained in full
                name, transposed = layout[key]
                head, _, param = name.rpartition(".")
                out[f"base_model.model.{head}.modules_to_save.default.{param}"] = array.T if transposed else array
        return out

    before = peft_names(flat_params(adapters))
    config = peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets, task_type=peft_task, fan_in_fan_out=fan_in_fan_out
    )
    runs = []
    for dtype in (torch.float64, torch.float32):
        wrapped = peft.get_peft_model(copy.deepcopy(ref).to(dtype), config)
        trained = {n: p for n, p in wrapped.named_parameters() if p.requires_grad}
        assert set(trained) == set(before), set(trained) ^ set(before)
        with torch.no_grad():
            for name, p in trained.items():
                p.copy_(torch.as_tensor(np.array(before[name])))
        _, theirs = zip(*(CASES[case][3](seed) for seed in range(STEPS)))
        runs.append(torch_steps(wrapped, theirs, max_grad_norm=1.0, params=list(trained.values())))
    exact, f32 = runs
    for run in runs:  # named_parameters of the PeftModel: keep the adapters' names
        for step in run[0]:
            assert set(step) == set(before)

    ours = [batch for batch, _ in (CASES[case][3](seed) for seed in range(STEPS))]
    state = program.init_state(adapters)
    got = run_jaxseq(program, state, frozen, ours, peft_names)
    assert_steps_match(got, exact, f32, {k: v.astype(np.float64) for k, v in before.items()})
