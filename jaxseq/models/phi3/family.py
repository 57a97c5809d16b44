"""Phi-3 as jaxseq knows it: Llama's family (checkpoint names, heads, vocabulary, position limit) under Phi-3's
classes, with the fused projections' partition rules and LoRA targets; Llama's FLOP count (the fused kernels hold
Llama's q, k, v, gate and up weights; its windows are ``layer_windows``'s)."""

from __future__ import annotations

import dataclasses

from jax.sharding import PartitionSpec as P

from jaxseq.models.llama.family import PARTITION_RULES, llama_family
from jaxseq.models.phi3.modeling import Phi3ForCausalLM, Phi3ForSequenceClassification, Phi3Model

# The fused kernels over fsdp only. qkv_proj's columns are q heads | k heads | v heads and gate_up_proj's are
# gate | up: an even split of those columns over mp cuts across the parts (Phi-3-mini's 3 x 3072 qkv columns
# on mp=4: device 1 holds the last queries and the first keys), and the layer would gather them back at once.
# Attention and the MLP's product then run whole on each mp device; o_proj and down_proj keep Llama's rows
# over mp, which slices their (replicated) inputs and sums the partial products: the same numbers either way.
PARTITION_RULES = (
    (r"(qkv_proj|gate_up_proj)/kernel$", P("fsdp", None)),
    *PARTITION_RULES,
)


FAMILY = dataclasses.replace(
    llama_family("phi3", "Phi-3", Phi3Model, Phi3ForCausalLM, Phi3ForSequenceClassification),
    partition_rules=PARTITION_RULES,
    lora_targets=r"/(qkv_proj|o_proj|gate_up_proj|down_proj)/kernel$",
    scans=None,  # every layer attends over the same window
)
