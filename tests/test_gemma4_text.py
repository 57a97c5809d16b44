"""Gemma 4's text decoder against transformers PyTorch, every weight and layer scalar perturbed, in two configs
that between them turn each optional part on and off: logits on left- and right-padded rows longer than the
sliding window, greedy generation (the KV cache, a KV-shared layer reading its store layer's), one training
step's loss and every gradient, the same on 8-device meshes (experts over ep), export, LoRA's targets, and the
one-line refusals."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxseq import partition  # noqa: E402
from jaxseq.errors import JaxseqError  # noqa: E402
from jaxseq.generation import generate  # noqa: E402
from jaxseq.mesh import make_mesh  # noqa: E402
from jaxseq.models import load_pretrained, save_pretrained  # noqa: E402
from jaxseq.models.decide import decide_execution  # noqa: E402
from jaxseq.models.execution import Execution  # noqa: E402
from jaxseq.models.hub import load_config  # noqa: E402
from jaxseq.models.registry import family_for  # noqa: E402
from jaxseq.train.objectives import CausalLM  # noqa: E402
from tests.reference import assert_gradients_match, padded_batch, perturb, scaled_diff, torch_forward  # noqa: E402
from tests.test_llama import PAD, VOCAB, forward, prompts  # noqa: E402

NEW = 12
SLIDING, FULL = "sliding_attention", "full_attention"
CASES = {
    # everything on: per-layer inputs, the last 2 of 5 layers sharing keys/values (a sliding one layer 2's, a full
    # one layer 1's) with double-wide MLPs, keys as values on the full layers with their own head size and one
    # key/value head, experts beside every MLP, Gemma 4's default ropes (proportional on full layers), an untied
    # head with the final soft-cap
    "moe-shared": dict(
        layer_types=[SLIDING, FULL, SLIDING, SLIDING, FULL], global_head_dim=16, num_global_key_value_heads=1,
        attention_k_eq_v=True, hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB,
        num_kv_shared_layers=2, use_double_wide_mlp=True, enable_moe_block=True, num_experts=4, top_k_experts=2,
        moe_intermediate_size=16, tie_word_embeddings=False, final_logit_softcapping=10.0,
    ),
    # everything off: no per-layer inputs, no sharing, no experts, values of their own; biases; YaRN (its
    # attention factor too) on the sliding layers, a proportional rope with a factor on the full ones, which keep
    # head_dim (global_head_dim 8); an untied head without a soft-cap (a tiny tied Gemma's greedy tokens repeat the
    # prompt's last: the tied head is Gemma 3's, tests/test_gemma.py)
    "dense": dict(
        layer_types=[FULL, SLIDING, SLIDING, FULL], global_head_dim=8, hidden_size_per_layer_input=0,
        attention_bias=True, tie_word_embeddings=False, rope_parameters={
            SLIDING: {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 100.0},
            FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.5, "factor": 2.0, "rope_theta": 1e4},
        },
    ),
}  # fmt: skip


def tiny_config(case, **kw):
    fields = {**CASES, **UNSEEN}[case]
    base = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=len(fields["layer_types"]),
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=4, max_position_embeddings=64,
        pad_token_id=PAD, bos_token_id=1, eos_token_id=2, initializer_range=0.3, attn_implementation="eager",
    )  # fmt: skip
    return transformers.Gemma4TextConfig(**{**base, **fields, **kw})


@pytest.fixture(scope="module", params=list(CASES))
def saved(request, tmp_path_factory):
    """``(case, perturbed transformers LM, its folder)``; the layer scalars (buffers) perturbed too."""
    torch.manual_seed(0)
    ref = perturb(transformers.Gemma4ForCausalLM(tiny_config(request.param))).eval()
    with torch.no_grad():
        for name, buffer in ref.named_buffers():
            if name.endswith("layer_scalar"):
                buffer.add_(0.3 * torch.randn(buffer.shape))
    path = tmp_path_factory.mktemp(request.param)
    ref.save_pretrained(path)
    return request.param, ref, path


def batches():
    """Rows of 12, 9 and 5 tokens (past the window of 4) padded on the right and on the left."""
    return {"right": padded_batch(VOCAB), "left": prompts((12, 9, 5))}


def test_logits_match_pytorch_on_both_paddings(saved):
    _, ref, path = saved
    model = load_pretrained(path, "causal-lm")
    for side, (ids, mask) in batches().items():
        want = torch_forward(ref, input_ids=ids, attention_mask=mask).logits.numpy()
        got = forward(model, jnp.asarray(ids), jnp.asarray(mask)).logits
        assert got.shape == want.shape and scaled_diff(mask, got, want) <= 1e-4, side


def test_greedy_generation_matches_pytorch(saved):
    _, ref, path = saved
    ids, mask = prompts()
    with torch.no_grad():
        out = ref.generate(
            torch.as_tensor(ids).long(), attention_mask=torch.as_tensor(mask).long(), max_new_tokens=NEW,
            do_sample=False, pad_token_id=PAD, eos_token_id=None,
        )  # fmt: skip
    want = out[:, ids.shape[1] :].numpy()
    assert all(len(set(row)) > 4 for row in want)
    got = generate(load_pretrained(path, "causal-lm"), ids, mask, max_new_tokens=NEW, pad_token_id=PAD)
    np.testing.assert_array_equal(np.asarray(got.sequences), want)


def loss_and_gradients(model, ids, mask):
    batch = {"input_ids": jnp.asarray(ids), "attention_mask": jnp.asarray(mask)}
    return nnx.jit(nnx.value_and_grad(lambda m: CausalLM(None).loss(m, batch, None)))(model)


ONE_DEVICE = {}  # case -> the one-device loss and gradients, which the mesh test compares with


def test_training_loss_and_every_gradient_equal_transformers(saved):
    """One step on right-padded rows: the loss, and the gradient of every parameter (the experts' whole stacks,
    the router's scales, the per-layer inputs' table); the layer scalars, buffers in transformers, get none."""
    case, ref, path = saved
    ids, mask = padded_batch(VOCAB)
    ref.zero_grad()
    out = ref(
        input_ids=torch.as_tensor(ids).long(), attention_mask=torch.as_tensor(mask).long(),
        labels=torch.as_tensor(np.where(mask == 1, ids, -100)).long(),
    )  # fmt: skip
    out.loss.backward()
    want = {name: p.grad.numpy() for name, p in ref.named_parameters()}
    ref.zero_grad()
    model = load_pretrained(path, "causal-lm")
    loss, grads = ONE_DEVICE[case] = loss_and_gradients(model, ids, mask)
    assert abs(float(loss) - out.loss.item()) <= 1e-5 * abs(out.loss.item())
    assert_gradients_match(model, grads, want)
    assert not np.asarray(grads.model.layers[0].layer_scalar[...]).any()


@pytest.mark.parametrize("saved", ["moe-shared"], indirect=True)
def test_mesh_gives_the_same_loss_and_gradients(saved):
    """The config with every part split over fsdp and mp, the experts over ep (as a run decides): the loss and
    every gradient as on one device (test_training_loss_and_every_gradient_...'s, or computed here when run
    alone)."""
    case, _, path = saved
    if case not in ONE_DEVICE:
        ONE_DEVICE[case] = loss_and_gradients(load_pretrained(path, "causal-lm"), *padded_batch(VOCAB))
    devices = make_mesh("fsdp=2,ep=2,mp=2")
    execution = decide_execution(load_config(path), "causal-lm", mesh=devices)
    model = load_pretrained(path, "causal-lm", mesh=devices, execution=execution)
    specs = {name: x.sharding.spec for name, x in partition.named_leaves(nnx.state(model, nnx.Param))}
    assert specs["model/layers/0/experts/gate_up_proj"] == P("ep", "mp", "fsdp")
    assert model.model.layers[0].experts.expert_mesh == devices
    loss, grads = loss_and_gradients(model, *padded_batch(VOCAB))
    want_loss, want = ONE_DEVICE[case]
    assert abs(float(loss) - float(want_loss)) <= 1e-6 * abs(float(want_loss))
    got, want = (dict(partition.named_leaves(nnx.state(g, nnx.Param))) for g in (grads, want))
    assert got.keys() == want.keys()
    for name, g in got.items():
        scale = max(1e-6, float(np.abs(want[name]).max()))
        assert float(np.abs(np.asarray(g) - np.asarray(want[name])).max()) / scale <= 1e-4, name


def test_export_loads_in_transformers_with_the_same_logits(saved, tmp_path):
    _, ref, path = saved
    save_pretrained(load_pretrained(path, "causal-lm"), tmp_path)
    assert "allow_global_per_layer_attribute_access" not in (tmp_path / "config.json").read_text()
    back, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, output_loading_info=True, attn_implementation="eager"
    )
    assert type(back) is transformers.Gemma4ForCausalLM
    assert not info["missing_keys"] and not info["unexpected_keys"]
    ids, mask = padded_batch(VOCAB)
    want = torch_forward(ref, input_ids=ids, attention_mask=mask).logits.numpy()
    assert scaled_diff(mask, torch_forward(back, input_ids=ids, attention_mask=mask).logits, want) <= 1e-6


def test_lora_targets_and_one_line_refusals(saved):
    """LoRA adapts q/v (PEFT's default) and refuses the experts; scanned layers, bidirectional attention and a
    rope type jaxseq lacks (dynamic) are refused in one line."""
    from jaxseq.partition import get_partition_rules, match_partition_rules
    from jaxseq.train.lora import Lora, LoraConfig

    case, _, path = saved
    model = load_pretrained(path, "causal-lm")
    specs = match_partition_rules(get_partition_rules("gemma4_text"), nnx.state(model))
    targets = Lora(LoraConfig(lora_rank=2), model, specs).targets
    assert targets and {path[-1] for path in targets} == {"q_proj", "v_proj"}
    assert family_for("gemma4_text").scans(load_config(path)) is False
    dynamic = {SLIDING: {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}, FULL: {"rope_theta": 1e4}}
    refusals = [
        dict(execution=Execution(scan_layers=True)),
        dict(use_bidirectional_attention="all"),
        dict(rope_parameters=dynamic),
    ]
    if case == "moe-shared":
        with pytest.raises(JaxseqError, match="experts"):
            Lora(LoraConfig(lora_rank=2, lora_targets=r"gate_up_proj"), model, specs)
    for kw in refusals:
        with pytest.raises(JaxseqError) as error:
            load_pretrained(path, "causal-lm", **kw)
        assert "\n" not in str(error.value)


def test_config_overrides_rebuild_the_per_layer_fields():
    """``--model_type gemma4_text --config_overrides``: a new depth gets its layer kinds and their head sizes
    (the full layers' global_head_dim) anew; shared layers of a kind no earlier layer has stop in one line."""
    from jaxseq.models.gemma4_text.modeling import layer_shape
    from jaxseq.models.hub import apply_overrides, parse_overrides

    config = transformers.AutoConfig.for_model("gemma4_text")
    text = "num_hidden_layers=7,head_dim=16,num_kv_shared_layers=1"
    config = apply_overrides(config, **parse_overrides(text, config))
    assert config.layer_types == [SLIDING] * 5 + [FULL] * 2
    assert [layer_shape(config, i)[0] for i in range(7)] == [16] * 5 + [512] * 2
    with pytest.raises(JaxseqError, match="num_kv_shared_layers") as error:
        family_for("gemma4_text").model_flops(apply_overrides(config, num_kv_shared_layers=3), "causal-lm", 1, 8)
    assert "\n" not in str(error.value)


def test_the_text_model_of_a_multimodal_checkpoint(tmp_path):
    """A Gemma 4 checkpoint as published (``gemma4``: the text model's config its ``text_config``, its weights
    under ``model.language_model.``, a vision tower beside it): ``causal-lm`` loads the text model, whose logits
    of text are the multimodal model's."""
    torch.manual_seed(0)
    vision = transformers.Gemma4VisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
        head_dim=8, position_embedding_size=64,
    )  # fmt: skip
    config = transformers.Gemma4Config(text_config=tiny_config("moe-shared"), vision_config=vision, audio_config=None)
    ref = perturb(transformers.Gemma4ForConditionalGeneration(config)).eval()
    ref.save_pretrained(tmp_path)
    model = load_pretrained(tmp_path, "causal-lm")
    assert type(model).hf_architecture == "Gemma4ForCausalLM" and model.config.model_type == "gemma4_text"
    ids, mask = padded_batch(VOCAB)
    want = torch_forward(ref, input_ids=ids, attention_mask=mask).logits.numpy()
    assert scaled_diff(mask, forward(model, jnp.asarray(ids), jnp.asarray(mask)).logits, want) <= 1e-4


UNSEEN = {
    # YaRN with truncate false on the sliding layers (transformers truncates its ramp all the same: it reads the
    # flag from the top of the per-kind rope_parameters), linear rope on the full ones; SiLU; a tied head with a
    # soft-cap; num_global_key_value_heads without attention_k_eq_v (ignored)
    "yarn-untruncated": dict(
        layer_types=[SLIDING, SLIDING, FULL], global_head_dim=16, num_global_key_value_heads=1,
        hidden_size_per_layer_input=0, hidden_activation="silu", final_logit_softcapping=30.0, rope_parameters={
            SLIDING: {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 64,
                      "rope_theta": 1e4, "truncate": False},
            FULL: {"rope_type": "linear", "factor": 2.0, "rope_theta": 100.0},
        },
    ),
    # every expert of each token, KV sharing without double-wide MLPs, a per-layer table larger than the
    # vocabulary, exact GELU, llama3 rope on the full layers, "vision" bidirectionality (text stays causal)
    "all-experts": dict(
        layer_types=[FULL, SLIDING, SLIDING, FULL], global_head_dim=8, num_kv_shared_layers=1,
        hidden_size_per_layer_input=4, vocab_size_per_layer_input=VOCAB + 20, enable_moe_block=True, num_experts=3,
        top_k_experts=3, moe_intermediate_size=8, hidden_activation="gelu", use_bidirectional_attention="vision",
        tie_word_embeddings=False, rope_parameters={
            SLIDING: {"rope_type": "default", "rope_theta": 1e4},
            FULL: {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 32, "rope_theta": 1e4},
        },
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(UNSEEN))
def test_more_configs_match_pytorch_logits_and_greedy_tokens(case, tmp_path):
    """Configs beyond the two above, each loaded from transformers' save_pretrained: the logits on both paddings
    and the greedy tokens of left-padded prompts (past the window of 4)."""
    torch.manual_seed(0)
    ref = perturb(transformers.Gemma4ForCausalLM(tiny_config(case))).eval()
    ref.save_pretrained(tmp_path)
    model = load_pretrained(tmp_path, "causal-lm")
    for side, (ids, mask) in batches().items():
        want = torch_forward(ref, input_ids=ids, attention_mask=mask).logits.numpy()
        assert scaled_diff(mask, forward(model, jnp.asarray(ids), jnp.asarray(mask)).logits, want) <= 1e-4, side
    ids, mask = prompts()
    with torch.no_grad():
        out = ref.generate(
            torch.as_tensor(ids).long(), attention_mask=torch.as_tensor(mask).long(), max_new_tokens=NEW,
            do_sample=False, pad_token_id=PAD, eos_token_id=None,
        )  # fmt: skip
    got = generate(model, ids, mask, max_new_tokens=NEW, do_sample=False, pad_token_id=PAD)
    np.testing.assert_array_equal(np.asarray(got.sequences), out[:, ids.shape[1] :].numpy())
