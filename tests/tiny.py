"""Tiny transformers configs of every family in ``jaxseq.models.registry.FAMILIES`` (2 layers, hidden 32, 4
heads, 64 tokens, 32 positions), one place for the shape the tests build their models from.

``tiny_config("gpt2", n_embd=64)`` is the family's tiny config with those fields changed; a field set to
``DEFAULT`` is left to transformers' default, so a test keeps exactly the config it had."""

from __future__ import annotations

DEFAULT = object()
"""An override that drops the tiny value: transformers' own default applies."""

_DECODER = dict(
    num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=64, max_position_embeddings=32,
)  # fmt: skip
_ENCODER = dict(
    num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4, vocab_size=64,
    max_position_embeddings=32,
)  # fmt: skip

_QWEN3_5 = dict(
    head_dim=8, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
    layer_types=["linear_attention", "full_attention"],
)  # fmt: skip
_QWEN3_5_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)

_DEEPSEEK_V3 = dict(
    _DECODER, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8,
    v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1, moe_intermediate_size=16,
    first_k_dense_replace=1,
)  # fmt: skip

_GEMMA4 = dict(head_dim=8, global_head_dim=16, hidden_size_per_layer_input=8, vocab_size_per_layer_input=64)

TINY: dict[str, tuple[str, dict]] = {
    "gpt2": ("GPT2Config", dict(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=32)),
    "gptj": ("GPTJConfig", dict(n_layer=2, n_embd=32, n_head=4, rotary_dim=4, vocab_size=64, n_positions=32)),
    "opt": (
        "OPTConfig",
        dict(
            num_hidden_layers=2,
            hidden_size=32,
            ffn_dim=64,
            num_attention_heads=4,
            word_embed_proj_dim=32,
            vocab_size=64,
            max_position_embeddings=32,
        ),
    ),
    "t5": ("T5Config", dict(num_layers=2, d_model=32, d_kv=8, num_heads=4, d_ff=64, vocab_size=64)),
    "bert": ("BertConfig", _ENCODER),
    "roberta": ("RobertaConfig", {**_ENCODER, "max_position_embeddings": 34, "type_vocab_size": 1}),
    "llama": ("LlamaConfig", _DECODER),
    "mistral": ("MistralConfig", _DECODER),
    "mixtral": ("MixtralConfig", {**_DECODER, "num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen2": ("Qwen2Config", _DECODER),
    "qwen3": ("Qwen3Config", {**_DECODER, "head_dim": 8}),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        {**_DECODER, "head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
    ),
    "deepseek_v3": ("DeepseekV3Config", _DEEPSEEK_V3),
    "qwen3_5_text": ("Qwen3_5TextConfig", {**_DECODER, **_QWEN3_5}),
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", {**_DECODER, **_QWEN3_5, **_QWEN3_5_MOE}),
    "gpt_oss": (
        "GptOssConfig",
        {**_DECODER, "head_dim": 8, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 4},
    ),
    "gemma2": ("Gemma2Config", {**_DECODER, "head_dim": 8}),
    "gemma3_text": ("Gemma3TextConfig", {**_DECODER, "head_dim": 8}),
    "gemma4_text": ("Gemma4TextConfig", {**_DECODER, **_GEMMA4}),
    "phi3": ("Phi3Config", {**_DECODER, "pad_token_id": 0}),  # its default pad id, 32000, is past the vocabulary
}
"""model_type -> (transformers config class, its tiny fields)."""


def tiny_config(model_type: str, **overrides):
    """The tiny ``transformers`` config of ``model_type`` with ``overrides`` (``DEFAULT``: transformers' value)."""
    import transformers

    name, fields = TINY[model_type]
    kwargs = {k: v for k, v in {**fields, **overrides}.items() if v is not DEFAULT}
    return getattr(transformers, name)(**kwargs)


LETTERS = list("abcdefghijklmnop")


def letters_gpt2(root):
    """A GPT-2 of 19 tokens (16 letters, eos, pad, unk; spaces between them) with a word-level tokenizer, saved
    as a folder; its vocabulary."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["<eos>", "<pad>", "<unk>", *LETTERS])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, n_positions=64, vocab_size=len(vocab), bos_token_id=0, eos_token_id=0,
        resid_pdrop=0, embd_pdrop=0, attn_pdrop=0,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(config).save_pretrained(root)
    tokenizer.save_pretrained(root)
    return vocab
