"""Real vocabularies shard on mp: token embeddings and LM heads have ``padded_vocab_size`` rows (a multiple of
128), the padding is masked out of softmax, loss, argmax and sampling, and exports drop it. Checked against
transformers' PyTorch models with perturbed weights, on a dp=4,mp=2 mesh, for every family's vocabulary weights.
(Two processes on dp=4,mp=2 with GPT-2's 50257 tokens: tests/test_multihost.py.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxseq.generation import generate  # noqa: E402
from jaxseq.mesh import make_mesh  # noqa: E402
from jaxseq.models import load_pretrained, save_pretrained  # noqa: E402
from jaxseq.models.layers import padded_vocab_size  # noqa: E402
from jaxseq.train.objectives import CausalLM  # noqa: E402
from tests.reference import max_diff_on, padded_batch, perturb, torch_forward  # noqa: E402
from tests.tiny import DEFAULT, tiny_config  # noqa: E402

MESH = "dp=4,mp=2"


def saved(model, path):
    model.save_pretrained(path)
    return path


def exported_equals_original(ours, ref, out):
    """Export ``ours``; transformers loads the folder, every tensor bitwise equal to ``ref``'s."""
    save_pretrained(ours, out)
    back = type(ref).from_pretrained(out).state_dict()
    for name, tensor in ref.state_dict().items():
        np.testing.assert_array_equal(back[name].numpy(), tensor.numpy(), err_msg=name)


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    """GPT-2 with its real 50257-token vocabulary (tiny otherwise), weights perturbed."""
    torch.manual_seed(0)
    config = tiny_config("gpt2", n_embd=64, n_positions=64, vocab_size=50257)
    ref = perturb(transformers.GPT2LMHeadModel(config)).eval()
    return ref, saved(ref, tmp_path_factory.mktemp("gpt2"))


def test_gpt2_vocabulary_is_padded_sharded_on_mp_and_matches_pytorch(gpt2, tmp_path):
    ref, path = gpt2
    model = load_pretrained(path, "causal-lm", mesh=make_mesh(MESH))
    wte = model.transformer.wte.embedding[...]
    assert wte.shape == (50304, 64) and padded_vocab_size(50257) == 50304
    assert wte.sharding.spec == P("mp", "fsdp")
    assert {s.data.shape for s in wte.addressable_shards} == {(50304 // 2, 64)}
    np.testing.assert_array_equal(np.asarray(wte)[50257:], 0.0)

    ids, mask = padded_batch(50257, lengths=(12, 9, 5, 12, 7, 3, 10, 12))  # 8 rows: dp=4 splits them
    want = torch_forward(ref, input_ids=ids, attention_mask=mask).logits.numpy()
    got = model(jnp.asarray(ids), jnp.asarray(mask)).logits
    assert got.shape == want.shape  # transformers' shape: the padding is not returned
    scale = float(np.abs(want).max())
    assert max_diff_on(mask, got, want) <= 1e-5 * scale

    # the head makes logits for the padding too (zero rows: logit 0, likelier than many real tokens) and the
    # loss leaves them out: it is transformers' loss over the real vocabulary
    padded = model.logits(model.hidden_states(jnp.asarray(ids), jnp.asarray(mask)).last_hidden_state)
    assert padded.shape[-1] == 50304 and bool(jnp.all(padded[..., 50257:] == 0))
    labels = np.where(mask == 1, ids, -100)
    torch_loss = torch_forward(ref, input_ids=ids, attention_mask=mask, labels=labels).loss.item()
    for chunk in (4, None):
        loss = CausalLM(chunk_tokens=chunk).loss(model, {"input_ids": ids, "attention_mask": mask}, None)
        np.testing.assert_allclose(float(loss), torch_loss, rtol=1e-5)

    # the padding rows get no gradient: training never moves them
    graphdef, state = nnx.split(model)
    batch = {"input_ids": jnp.asarray(ids), "attention_mask": jnp.asarray(mask)}
    grads = jax.grad(lambda s: CausalLM(chunk_tokens=4).loss(nnx.merge(graphdef, s), batch, None))(state)
    wte_grad = np.asarray(grads["transformer"]["wte"]["embedding"][...])
    assert np.abs(wte_grad[:50257]).max() > 0 and np.all(wte_grad[50257:] == 0)

    exported_equals_original(model, ref, tmp_path / "export")


def test_gpt2_greedy_and_sampled_generation_never_leave_the_real_vocabulary(gpt2):
    ref, path = gpt2
    model = load_pretrained(path, "causal-lm", mesh=make_mesh(MESH))
    ids, mask = padded_batch(50257, lengths=(6, 6, 6, 6))
    with torch.no_grad():
        want = ref.generate(
            torch.as_tensor(ids).long(), attention_mask=torch.as_tensor(mask).long(), max_new_tokens=6, do_sample=False
        )[:, ids.shape[1] :].numpy()
    got = generate(model, ids, mask, max_new_tokens=6).sequences
    np.testing.assert_array_equal(np.asarray(got), want)
    # a flat distribution (temperature 1000) samples all over the vocabulary, but never a padding entry
    hot = generate(model, ids, mask, max_new_tokens=32, do_sample=True, temperature=1000.0, seed=1).sequences
    assert np.asarray(hot).max() < 50257 and len(np.unique(np.asarray(hot))) > 64


@pytest.mark.parametrize(
    "name",
    ["gptj-untied", "gptj-tied", "bert-mlm", "bert-mlm-untied", "t5-v1_1", "t5"],
)
def test_every_familys_vocabulary_weights_pad_on_load_and_trim_on_export(tmp_path, name):
    """One vocabulary that 128 does not divide per family; logits equal transformers' on a dp=4,mp=2 mesh,
    and the exported folder equals the original bitwise."""
    torch.manual_seed(0)
    if name.startswith("gptj"):
        config = tiny_config(
            "gptj", n_embd=64, rotary_dim=8, n_positions=64, vocab_size=1000, tie_word_embeddings=name == "gptj-tied"
        )
        ref, task = transformers.GPTJForCausalLM(config), "causal-lm"
    elif name.startswith("bert"):
        config = tiny_config(
            "bert", vocab_size=30522, hidden_size=64, intermediate_size=128, max_position_embeddings=64,
            tie_word_embeddings=name == "bert-mlm",
        )  # fmt: skip
        ref, task = transformers.BertForMaskedLM(config), "masked-lm"
    else:
        config = tiny_config(
            "t5", vocab_size=32100, d_model=64, d_kv=16, d_ff=128, relative_attention_num_buckets=8, dropout_rate=0.0,
            decoder_start_token_id=0, feed_forward_proj="gated-gelu" if name == "t5-v1_1" else "relu",
            tie_word_embeddings=name == "t5",
        )  # fmt: skip
        ref, task = transformers.T5ForConditionalGeneration(config), "seq2seq-lm"
    ref = perturb(ref).eval()
    model = load_pretrained(saved(ref, tmp_path / "ref"), task, mesh=make_mesh(MESH))
    vocab = config.vocab_size
    shapes = {v.shape for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param)) if padded_vocab_size(vocab) in v.shape}
    assert shapes and not any(vocab in s for s in shapes)  # every vocabulary weight is padded

    ids, mask = padded_batch(vocab, lengths=(10, 7, 4, 10, 9, 2, 10, 5), low=3)
    if task == "seq2seq-lm":
        decoder = padded_batch(vocab, lengths=(6, 3, 5, 6, 6, 2, 4, 6), seed=1, low=3)[0]
        inputs = dict(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder)
        got = model(jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(decoder)).logits
        real = np.ones_like(decoder)
    else:
        inputs = dict(input_ids=ids, attention_mask=mask)
        got = getattr(model(jnp.asarray(ids), jnp.asarray(mask)), "logits", None)
        got = got if got is not None else model(jnp.asarray(ids), jnp.asarray(mask))
        real = mask
    want = torch_forward(ref, **inputs).logits.numpy()
    assert got.shape == want.shape
    assert max_diff_on(real, got, want) <= 1e-5 * float(np.abs(want).max())
    exported_equals_original(model, ref, tmp_path / "export")


def test_lora_on_an_untied_lm_head_exports_adapters_peft_loads(tmp_path):
    """LoRA may adapt the (padded) LM head itself: the exported lora_B has the real vocabulary's rows and
    PEFT's model gives our logits."""
    peft = pytest.importorskip("peft")
    from jaxseq.partition import get_partition_rules, match_partition_rules
    from jaxseq.train.lora import Lora, LoraConfig

    torch.manual_seed(0)
    config = tiny_config("gpt2", n_layer=1, vocab_size=1000, tie_word_embeddings=False)
    ref = perturb(transformers.GPT2LMHeadModel(config)).eval()
    base = saved(ref, tmp_path / "base")
    model = load_pretrained(base, "causal-lm")
    graphdef, state = nnx.split(model)
    specs = match_partition_rules(get_partition_rules("gpt2"), state)
    lora = Lora(LoraConfig(lora_rank=4, lora_alpha=8.0, lora_targets=r"(c_attn|lm_head)/kernel$"), model, specs)
    trainable = lora.init(state, 0)
    leaves, treedef = jax.tree.flatten(trainable)
    keys = jax.random.split(jax.random.key(3), len(leaves))
    trainable = jax.tree.unflatten(treedef, [x + 0.2 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])
    lora.save_adapter(trainable, tmp_path / "adapter", base_model=str(base))

    from safetensors.numpy import load_file

    tensors = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert tensors["base_model.model.lm_head.lora_B.weight"].shape == (1000, 4)
    ids, mask = padded_batch(1000, lengths=(8, 5, 8))
    ours = np.asarray(lora.training_model(graphdef, trainable, state)(jnp.asarray(ids), jnp.asarray(mask)).logits)
    loaded = peft.PeftModel.from_pretrained(transformers.GPT2LMHeadModel.from_pretrained(base), tmp_path / "adapter")
    theirs = torch_forward(loaded, input_ids=ids, attention_mask=mask).logits.numpy()
    assert max_diff_on(mask, ours, theirs) <= 1e-4


def test_indivisible_vocabularies_no_longer_stop_a_sharded_run():
    """What used to fail ("not divisible"): BERT's 30522 and GPT-2's 50257 rows on mp=2, 4 and 8."""
    from jaxseq.models.hub import abstract_model
    from jaxseq.partition import check_divisible, get_partition_rules, match_partition_rules

    for config, task in [
        (tiny_config("gpt2", n_layer=1, n_embd=64, n_head=8, vocab_size=50257, n_positions=DEFAULT), "causal-lm"),
        (tiny_config("bert", hidden_size=64, num_hidden_layers=1, num_attention_heads=8, intermediate_size=128,
                     vocab_size=DEFAULT, max_position_embeddings=DEFAULT), "masked-lm"),
    ]:  # fmt: skip
        state = nnx.state(abstract_model(config, task), nnx.Param)
        specs = match_partition_rules(get_partition_rules(config.model_type), state)
        for mp in (2, 4, 8):
            check_divisible(state, specs, make_mesh(f"dp={8 // mp},mp={mp}"))


def test_padded_vocabulary_rounds_up_to_128():
    assert [padded_vocab_size(n) for n in (1, 128, 129, 30522, 32128, 50257, 50400)] == [
        128, 128, 256, 30592, 32128, 50304, 50432,
    ]  # fmt: skip
