"""One FLOP count per family (``Family.model_flops``), checked against the count written out by hand from each
config's dimensions: 6 FLOPs per matrix weight and token in training (2 forward), plus attention's two
products (QK^T and AV: 2 x 2 x width per query-key pair forward, 12 x width in training), causal attention
over the lower triangle only (half the square), a sliding window over its window."""

import pytest
import transformers

from jaxseq.models.registry import FAMILIES, model_flops

ROWS, SEQ = 3, 16
TOKENS = ROWS * SEQ
V = 100  # vocabulary of every config below


def causal_pairs(seq, window=None):
    """Query-key pairs of one row of causal attention: half the square, or under a window the square minus
    the triangle the window leaves out."""
    w = min(window or seq, seq)
    return seq * w - w * w / 2


def test_gpt2():
    d, layers, labels = 64, 2, 3
    config = transformers.GPT2Config(n_embd=d, n_layer=layers, n_head=4, vocab_size=V, num_labels=labels)
    per_layer = 3 * d * d + d * d + d * 4 * d + 4 * d * d  # c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj
    attention = 12 * layers * d * (SEQ * SEQ / 2) * ROWS  # QK^T and AV over the lower triangle
    body = 6 * layers * per_layer * TOKENS + attention
    assert model_flops(config, "causal-lm", ROWS, SEQ) == body + 6 * d * V * TOKENS  # + the LM head
    assert model_flops(config, "sequence-classification", ROWS, SEQ) == body + 6 * d * labels * ROWS
    assert model_flops(config, "base", ROWS, SEQ) == body
    forward = 2 * layers * per_layer * TOKENS + 4 * layers * d * (SEQ * SEQ / 2) * ROWS + 2 * d * V * TOKENS
    assert model_flops(config, "causal-lm", ROWS, SEQ, training=False) == forward
    # the count can fail: full (not causally halved) attention, as throughput.flops_per_token once counted, differs
    full = 6 * (layers * per_layer + d * V) * TOKENS + 12 * layers * d * SEQ * SEQ * ROWS
    assert model_flops(config, "causal-lm", ROWS, SEQ) != full


def test_gpt2_n_inner():
    d, inner = 64, 96
    config = transformers.GPT2Config(n_embd=d, n_layer=1, n_head=4, n_inner=inner, vocab_size=V)
    per_layer = 4 * d * d + 2 * d * inner
    assert model_flops(config, "base", 1, SEQ) == 6 * per_layer * SEQ + 12 * d * SEQ * SEQ / 2


def test_gptj():
    d, layers = 64, 2
    config = transformers.GPTJConfig(n_embd=d, n_layer=layers, n_head=4, rotary_dim=8, vocab_size=V)
    per_layer = 4 * d * d + 2 * d * 4 * d  # q, k, v, out_proj; fc_in, fc_out
    expected = 6 * (layers * per_layer + d * V) * TOKENS + 12 * layers * d * (SEQ * SEQ / 2) * ROWS
    assert model_flops(config, "causal-lm", ROWS, SEQ) == expected


def llama_like(cls, **kw):
    return cls(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
        vocab_size=V, **kw,
    )  # fmt: skip


def llama_layer(d=64, heads=4, kv_heads=2, dim=16, inner=96):
    # q and o over every head; k and v over the key/value heads only; gate, up and down
    return d * heads * dim + 2 * d * kv_heads * dim + heads * dim * d + 3 * d * inner


def test_llama():
    config = llama_like(transformers.LlamaConfig)
    expected = 6 * (2 * llama_layer() + 64 * V) * TOKENS + 12 * 2 * (4 * 16) * causal_pairs(SEQ) * ROWS
    assert model_flops(config, "causal-lm", ROWS, SEQ) == expected
    assert (
        model_flops(config, "sequence-classification", ROWS, SEQ) == expected - 6 * 64 * V * TOKENS + 6 * 64 * 2 * ROWS
    )


def test_llama_head_dim_apart_from_hidden_size():
    config = llama_like(transformers.LlamaConfig, head_dim=32)  # heads x head_dim = 128, not hidden_size 64
    expected = 6 * (2 * llama_layer(dim=32) + 64 * V) * TOKENS + 12 * 2 * (4 * 32) * causal_pairs(SEQ) * ROWS
    assert model_flops(config, "causal-lm", ROWS, SEQ) == expected


def test_mistral_sliding_window():
    config = llama_like(transformers.MistralConfig, sliding_window=8)  # every layer sees its 8 latest keys
    pairs = SEQ * 8 - 8 * 8 / 2  # 96 of the causal 128
    expected = 6 * (2 * llama_layer() + 64 * V) * TOKENS + 12 * 2 * 64 * pairs * ROWS
    assert model_flops(config, "causal-lm", ROWS, SEQ) == expected
    unwindowed = llama_like(transformers.MistralConfig, sliding_window=None)
    assert model_flops(config, "causal-lm", ROWS, SEQ) < model_flops(unwindowed, "causal-lm", ROWS, SEQ)


def test_qwen2():
    from jaxseq.models.llama import layer_windows

    config = llama_like(transformers.Qwen2Config, use_sliding_window=True, sliding_window=8, max_window_layers=1)
    assert layer_windows(config) == (None, 8)  # the first layer full causal, the second under its window
    attention = 12 * 64 * (SEQ * SEQ / 2) * ROWS + 12 * 64 * (SEQ * 8 - 8 * 8 / 2) * ROWS
    expected = 6 * (2 * llama_layer() + 64 * V) * TOKENS + attention
    assert model_flops(config, "causal-lm", ROWS, SEQ) == expected
    plain = llama_like(transformers.Qwen2Config)
    assert model_flops(plain, "causal-lm", ROWS, SEQ) == model_flops(
        llama_like(transformers.LlamaConfig), "causal-lm", ROWS, SEQ
    )


def test_qwen3_head_dim_and_norms():
    """head_dim 32 (Qwen3Config's default is 128): the q/k norms and biases are no matrix products."""
    config = llama_like(transformers.Qwen3Config, head_dim=32, attention_bias=True)
    expected = 6 * (2 * llama_layer(dim=32) + 64 * V) * TOKENS + 12 * 2 * (4 * 32) * causal_pairs(SEQ) * ROWS
    assert model_flops(config, "causal-lm", ROWS, SEQ) == expected
    classifier = expected - 6 * 64 * V * TOKENS + 6 * 64 * 2 * ROWS
    assert model_flops(config, "sequence-classification", ROWS, SEQ) == classifier


def test_phi3_fused_projections_and_window():
    """qkv_proj (hidden x (heads + 2 kv_heads) x head_dim), o_proj, gate_up_proj (hidden x 2 I) and down_proj:
    Llama's weights fused; every layer under its window of 8; the partial rotation counts nothing."""
    d, heads, kv_heads, dim, inner = 64, 4, 2, 16, 96
    config = llama_like(transformers.Phi3Config, sliding_window=8, partial_rotary_factor=0.5, num_labels=2)
    per_layer = d * (heads + 2 * kv_heads) * dim + heads * dim * d + d * 2 * inner + inner * d
    body = 6 * 2 * per_layer * TOKENS + 12 * 2 * (heads * dim) * causal_pairs(SEQ, 8) * ROWS
    assert model_flops(config, "causal-lm", ROWS, SEQ) == body + 6 * d * V * TOKENS
    assert model_flops(config, "sequence-classification", ROWS, SEQ) == body + 6 * d * 2 * ROWS
    full = llama_like(transformers.Phi3Config)
    assert model_flops(full, "causal-lm", ROWS, SEQ) == model_flops(
        llama_like(transformers.LlamaConfig), "causal-lm", ROWS, SEQ
    )


def test_gemma2_windows_and_head_dim():
    """head_dim 32 apart from hidden / heads; layers sliding over 8 positions and full in turn (layer_types); the
    extra norms, embedding scale and soft-caps count nothing."""
    config = llama_like(transformers.Gemma2Config, head_dim=32, sliding_window=8)
    assert config.layer_types == ["sliding_attention", "full_attention"]
    attention = 12 * (4 * 32) * (causal_pairs(SEQ, 8) + causal_pairs(SEQ)) * ROWS
    expected = 6 * (2 * llama_layer(dim=32) + 64 * V) * TOKENS + attention
    assert model_flops(config, "causal-lm", ROWS, SEQ) == expected


def test_gemma3_q_k_norms_and_windows():
    """Gemma 3's default layer pattern (five sliding layers, then a full one) over a window of 8; the q/k norms
    count nothing; the classifier's head is hidden x labels on each row."""
    config = transformers.Gemma3TextConfig(
        hidden_size=64, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
        vocab_size=V, head_dim=16, sliding_window=8, num_labels=2,
    )  # fmt: skip
    assert config.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
    windows = 5 * causal_pairs(SEQ, 8) + causal_pairs(SEQ)
    body = 6 * 6 * llama_layer() * TOKENS + 12 * (4 * 16) * windows * ROWS
    assert model_flops(config, "causal-lm", ROWS, SEQ) == body + 6 * 64 * V * TOKENS
    assert model_flops(config, "sequence-classification", ROWS, SEQ) == body + 6 * 64 * 2 * ROWS


@pytest.mark.parametrize("gated", [False, True])
def test_t5(gated):
    d, inner, d_ff, enc, dec = 32, 4 * 8, 64, 2, 3
    config = transformers.T5Config(
        vocab_size=V, d_model=d, d_kv=8, num_heads=4, d_ff=d_ff, num_layers=enc, num_decoder_layers=dec,
        feed_forward_proj="gated-gelu" if gated else "relu",
    )  # fmt: skip
    source, target = SEQ, 4
    ff = (3 if gated else 2) * d * d_ff  # wi (wi_0 and wi_1 when gated) and wo
    expected = 6 * enc * (4 * d * inner + ff) * ROWS * source  # encoder: q, k, v, o and the feed-forward
    expected += 12 * enc * inner * source * source * ROWS  # encoder self-attention, bidirectional
    # decoder: self-attention's q, k, v, o, cross-attention's q and o, the feed-forward and the LM head per target
    expected += 6 * (dec * (4 * d * inner + 2 * d * inner + ff) + d * V) * ROWS * target
    expected += 6 * dec * 2 * d * inner * ROWS * source  # cross-attention's k and v, from the source tokens
    expected += 12 * dec * inner * (target * target / 2) * ROWS  # decoder self-attention, causal
    expected += 12 * dec * inner * target * source * ROWS  # cross-attention: every target token over the source
    assert model_flops(config, "seq2seq-lm", ROWS, source, target) == expected
    # the count can fail: cross-attention's keys and values counted on the target tokens (as before) differ
    assert model_flops(config, "seq2seq-lm", ROWS, source, target) != (
        expected - 6 * dec * 2 * d * inner * ROWS * source + 6 * dec * 2 * d * inner * ROWS * target
    )


def test_bert():
    d, layers, inner, labels = 64, 2, 128, 3
    config = transformers.BertConfig(
        hidden_size=d, num_hidden_layers=layers, num_attention_heads=4, intermediate_size=inner, vocab_size=V,
        num_labels=labels,
    )  # fmt: skip
    layer = 4 * d * d + 2 * d * inner  # query, key, value, attention output; intermediate, output
    full = 12 * d * SEQ * SEQ * ROWS  # one layer's bidirectional attention
    masked_lm = 6 * (layers * layer + d * d + d * V) * TOKENS + layers * full  # + the head's transform and decoder
    assert model_flops(config, "masked-lm", ROWS, SEQ) == masked_lm
    assert model_flops(config, "base", ROWS, SEQ) == 6 * layers * layer * TOKENS + layers * full + 6 * d * d * ROWS
    # the classifier: the last layer's keys and values at every token, the rest of it at each row's [CLS] only,
    # whose one query reads SEQ keys; then the pooler and the classifier there
    classification = 6 * (layers - 1) * layer * TOKENS + (layers - 1) * full
    classification += 6 * 2 * d * d * TOKENS + 6 * (2 * d * d + 2 * d * inner) * ROWS + 12 * d * 1 * SEQ * ROWS
    classification += 6 * (d * d + d * labels) * ROWS
    assert model_flops(config, "sequence-classification", ROWS, SEQ) == classification


def test_roberta():
    """BERT's count: the classification head (dense, out_proj) at each row's <s> costs what BERT's pooler and
    classifier do; the masked LM's head (dense, decoder) what BERT's transform and decoder do."""
    d, layers, inner, labels = 64, 2, 128, 3
    config = transformers.RobertaConfig(
        hidden_size=d, num_hidden_layers=layers, num_attention_heads=4, intermediate_size=inner, vocab_size=V,
        num_labels=labels,
    )  # fmt: skip
    layer, full = 4 * d * d + 2 * d * inner, 12 * d * SEQ * SEQ * ROWS
    assert model_flops(config, "masked-lm", ROWS, SEQ) == 6 * (layers * layer + d * d + d * V) * TOKENS + layers * full
    classification = 6 * (layers - 1) * layer * TOKENS + (layers - 1) * full  # the last layer at <s> alone:
    classification += 6 * 2 * d * d * TOKENS + 6 * (2 * d * d + 2 * d * inner) * ROWS + 12 * d * 1 * SEQ * ROWS
    classification += 6 * (d * d + d * labels) * ROWS  # dense and out_proj
    assert model_flops(config, "sequence-classification", ROWS, SEQ) == classification


@pytest.mark.parametrize("projected", [False, True])
def test_opt(projected):
    """125m-style (the head over hidden_size) and 350m-style (project_in and project_out, word_embed_proj_dim x d
    each; the head over word_embed_proj_dim)."""
    d, layers, ffn, width, labels = 64, 2, 96, 32 if projected else 64, 3
    config = transformers.OPTConfig(
        hidden_size=d, num_hidden_layers=layers, num_attention_heads=4, ffn_dim=ffn, vocab_size=V,
        word_embed_proj_dim=width, num_labels=labels,
    )  # fmt: skip
    body = 6 * (layers * (4 * d * d + 2 * d * ffn) + (2 * width * d if projected else 0)) * TOKENS
    body += 12 * layers * d * causal_pairs(SEQ) * ROWS
    assert model_flops(config, "causal-lm", ROWS, SEQ) == body + 6 * width * V * TOKENS
    assert model_flops(config, "sequence-classification", ROWS, SEQ) == body + 6 * width * labels * ROWS


def test_gpt_oss_routed_experts_and_windows():
    """Per layer q and o (64 x 64), k and v (64 x 32), the router (64 x 8) and 2 of the 8 experts (gate/up 64 x 96,
    down 48 x 64); layers sliding over 8 positions and full in turn; biases, sinks and the clamp count nothing."""
    config = transformers.GptOssConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=48, num_local_experts=8, num_experts_per_tok=2, sliding_window=8, vocab_size=V,
    )  # fmt: skip
    layer = 2 * 64 * 64 + 2 * 64 * 32 + 64 * 8 + 2 * 3 * 64 * 48
    attention = 12 * (4 * 16) * (causal_pairs(SEQ, 8) + causal_pairs(SEQ)) * ROWS
    assert model_flops(config, "causal-lm", ROWS, SEQ) == 6 * (2 * layer + 64 * V) * TOKENS + attention


def test_gemma4_kinds_sharing_per_layer_inputs_and_experts():
    """Gemma 4 over layers sliding (window 8), full, sliding, full: head_dim 16 on sliding layers, 32 with one
    key/value head on full ones, whose values are their keys (no v_proj); the last two share the first two's
    keys/values (no k_proj, v_proj) and have double-wide MLPs; per-layer inputs of width 8 (each layer's gate
    and projection, once per token the projection onto all 4 x 8); a router over 4 experts of width 24, 2 per
    token."""
    d, inner, width, expert = 64, 96, 8, 24
    config = transformers.Gemma4TextConfig(
        hidden_size=d, intermediate_size=inner, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True, vocab_size=V,
        sliding_window=8, layer_types=["sliding_attention", "full_attention"] * 2, num_kv_shared_layers=2,
        use_double_wide_mlp=True, hidden_size_per_layer_input=width, vocab_size_per_layer_input=V,
        enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=expert,
    )  # fmt: skip
    q_o = 2 * (2 * d * 4 * 16 + 2 * d * 4 * 32)  # a sliding and a full layer's, twice
    k_v = 2 * d * 2 * 16 + d * 1 * 32  # layer 0's k and v, layer 1's k; layers 2 and 3 share them
    mlps = 2 * 3 * d * inner + 2 * 3 * d * 2 * inner
    extras = 4 * (2 * d * width + d * 4 + 2 * 3 * d * expert) + d * 4 * width
    windows = 2 * 4 * 16 * causal_pairs(SEQ, 8) + 2 * 4 * 32 * causal_pairs(SEQ)
    body = 6 * (q_o + k_v + mlps + extras) * TOKENS + 12 * windows * ROWS
    assert model_flops(config, "causal-lm", ROWS, SEQ) == body + 6 * d * V * TOKENS
    assert model_flops(config, "base", ROWS, SEQ) == body


def test_every_family_has_a_count_and_no_other_task():
    families = {"gpt2", "gptj", "opt", "t5", "bert", "roberta", "llama", "mistral", "qwen2", "qwen3", "gemma2"}
    families |= {"gemma3_text", "mixtral", "qwen3_moe"}  # the MoE hand counts: tests/test_mixtral.py, test_qwen3_moe.py
    families |= {"phi3", "gemma4_text"}
    families |= {"gpt_oss"}
    families |= {"deepseek_v3"}  # its hand count: tests/test_deepseek_v3.py
    families |= {"qwen3_5_text", "qwen3_5_moe_text"}  # hand counts: tests/test_qwen3_5_text.py, _moe_text.py
    assert set(FAMILIES) == families
    assert all(family.flops is not None for family in FAMILIES.values())
    with pytest.raises(Exception, match="not available"):
        model_flops(transformers.BertConfig(), "causal-lm", 1, 8)
