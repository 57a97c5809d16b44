"""Gemma 4's text decoder (Gemma Team 2026): Gemma 3's with per-layer inputs, KV sharing, head sizes per layer
kind and an optional mixture of experts; ``FAMILY`` is what the registry lists."""

from jaxseq.models.gemma4_text.family import FAMILY
from jaxseq.models.gemma4_text.modeling import Gemma4ForCausalLM, Gemma4TextModel

__all__ = ["FAMILY", "Gemma4ForCausalLM", "Gemma4TextModel"]
