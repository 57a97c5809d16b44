"""Where a training script's model comes from: a pretrained checkpoint (``--model_name_or_path``), or a
config to start from scratch (``--config_name`` or ``--model_type``, plus ``--config_overrides``), and
the tokenizer that goes with it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from transformers import AutoConfig, AutoTokenizer

from jaxseq.config import arg
from jaxseq.errors import JaxseqError, first_line
from jaxseq.models.hub import (
    apply_overrides,
    load_config,
    parse_overrides,
    position_limit,
    resolve,
)
from jaxseq.models.registry import families_with


@dataclasses.dataclass
class PretrainedModel:
    """A trained checkpoint to load (what generation needs)."""

    model_name_or_path: str | None = arg(None, "Hub id or local folder of a checkpoint")
    config_overrides: str | None = arg(
        None, "config fields to change, comma-separated, e.g. 'n_layer=2,n_embd=128,n_head=4,resid_pdrop=0'"
    )
    tokenizer_name: str | None = arg(None, "tokenizer Hub id or folder (default: the one beside the model or config)")


@dataclasses.dataclass
class ModelSource(PretrainedModel):
    """A checkpoint to start training from, or a config to train from scratch."""

    model_name_or_path: str | None = arg(
        None,
        "Hub id or local folder of a checkpoint to start from (omit to "
        "train from scratch with --config_name or --model_type)",
    )
    config_name: str | None = arg(None, "train from scratch: a local folder holding config.json, or a Hub id")
    model_type: str | None = arg(
        None,
        "train from scratch from transformers' default config of this type "
        "(e.g. gpt2, gptj, t5) instead of --config_name",
    )


def check(source: ModelSource, default_model: str | None = None) -> None:
    """Exactly one of a checkpoint, --config_name or --model_type (``default_model`` fills a missing one)."""
    scratch = source.config_name or source.model_type
    if not source.model_name_or_path and not scratch:
        if default_model is None:
            raise JaxseqError(
                "pass --model_name_or_path (start from a checkpoint) or --config_name/--model_type (train from scratch)"
            )
        source.model_name_or_path = default_model
    if source.model_name_or_path and scratch:
        raise JaxseqError("pass either --model_name_or_path or --config_name/--model_type, not both")
    if source.config_name and source.model_type:
        raise JaxseqError("pass either --config_name or --model_type, not both")


def model_config(source: ModelSource, task: str, *, weights: bool = True):
    """(HF config with the overrides applied, the folder it came from or None, the overrides), after
    checking that jaxseq has a ``task`` model for its type. ``weights=False`` fetches only the config and
    tokenizer files of a Hub checkpoint (for a plan)."""
    folder = None
    if source.model_type:
        try:
            config = AutoConfig.for_model(source.model_type)
        except ValueError:
            config = None
    else:
        folder = resolve(
            source.model_name_or_path or source.config_name, weights=weights and bool(source.model_name_or_path)
        )
        config = load_config(folder)
    supported = families_with(task)
    model_type = source.model_type if config is None else config.model_type
    if model_type not in supported:
        raise JaxseqError(
            f"model_type {model_type!r} is not supported for this job ({model_type!r} has no {task} model in "
            f"jaxseq); use one of {', '.join(supported)}"
        )
    overrides = parse_overrides(source.config_overrides, config)
    return apply_overrides(config, **overrides), folder, overrides


def load_tokenizer(name: str | Path | None, *, fast: bool = True):
    """A tokenizer (a fast one, if ``fast``) from a folder or Hub id, or a one-line error. Remote code is
    never run (transformers' ``trust_remote_code`` stays off)."""
    if name is None:
        raise JaxseqError("--model_type gives no tokenizer: pass --tokenizer_name")
    try:
        tokenizer = AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
        first = first_line(e, 150)
        raise JaxseqError(
            f"cannot load a tokenizer from {name} ({first}); pass --tokenizer_name with a tokenizer folder or Hub id"
        ) from None
    if fast and not tokenizer.is_fast:
        raise JaxseqError(f"the tokenizer of {name} is not a fast (Rust) tokenizer; pass one with a tokenizer.json")
    return tokenizer


def pad_with_eos(tokenizer):
    """``tokenizer`` with EOS as its pad token when it has none (GPT-2's): padding is masked out, so which token
    pads does not change any number."""
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def stop_token_ids(tokenizer, config) -> list[int]:
    """The ids a generation stops at: the tokenizer's EOS, then the model config's other ones (a list in
    Llama 3's and Qwen's configs)."""
    listed = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
    ids = [tokenizer.eos_token_id, *(e for e in listed if e != tokenizer.eos_token_id)]
    return [int(e) for e in ids if e is not None]


def check_vocabulary(tokenizer, config) -> None:
    """Stop in one line when ``tokenizer`` has more tokens than the model's vocabulary."""
    if len(tokenizer) > config.vocab_size:
        raise JaxseqError(
            f"the tokenizer has {len(tokenizer)} tokens but the model only {config.vocab_size}; "
            "pass the model's own tokenizer or override vocab_size"
        )


def sequence_length(requested: int | None, config, flag: str, default: int) -> int:
    """``requested`` (the value of ``--flag``), or the model's positions up to ``default``; more positions than
    the model has stop in one line."""
    limit = position_limit(config)
    if requested is None:
        return min(default, limit or default)
    if limit is not None and requested > limit:
        raise JaxseqError(f"--{flag} {requested} exceeds the model's {limit} positions; lower it")
    return requested
