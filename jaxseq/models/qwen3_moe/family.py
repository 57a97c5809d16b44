"""Qwen3-MoE as jaxseq knows it: Mixtral's family (partition rules, FLOPs) under Qwen3-MoE's classes."""

from __future__ import annotations

import dataclasses

from jaxseq.models.mixtral.family import FAMILY as MIXTRAL
from jaxseq.models.mixtral.modeling import moe_layers
from jaxseq.models.qwen3_moe.modeling import Qwen3MoeForCausalLM, Qwen3MoeForSequenceClassification, Qwen3MoeModel

FAMILY = dataclasses.replace(
    MIXTRAL,
    model_type="qwen3_moe",
    name="Qwen3-MoE",
    tasks={
        "base": Qwen3MoeModel,
        "causal-lm": Qwen3MoeForCausalLM,
        "sequence-classification": Qwen3MoeForSequenceClassification,
    },
    scans=lambda config: all(moe_layers(config)),  # dense layers among MoE ones do not stack with them
)
