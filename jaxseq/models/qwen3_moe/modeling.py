"""Qwen3-MoE (Yang et al. 2025): Qwen3's decoder (Llama's modules with q/k norms) with Mixtral's sparse MoE
block (``jaxseq.models.mixtral``) under Qwen3-MoE's names (``mlp.gate``, ``mlp.experts.N.gate_proj/up_proj/
down_proj``, ``moe_intermediate_size`` wide), its top-k weights renormalised only with ``norm_topk_prob``, and
dense MLPs on the layers ``mlp_only_layers`` and ``decoder_sparse_step`` leave out (``mixtral.moe_layers``)."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jaxseq.errors import JaxseqError
from jaxseq.models.execution import Execution
from jaxseq.models.llama.modeling import LlamaMLP
from jaxseq.models.mixtral.modeling import (
    MixtralDecoderLayer,
    MixtralForCausalLM,
    MixtralForSequenceClassification,
    MixtralModel,
    SparseMoeBlock,
    moe_layers,
)

QWEN_EXPERT = ("gate_proj", "up_proj", "down_proj")


class Qwen3MoeSparseMoeBlock(SparseMoeBlock):
    def __init__(self, config, **kw):
        super().__init__(config, config.moe_intermediate_size, QWEN_EXPERT, **kw)


class Qwen3MoeDecoderLayer(MixtralDecoderLayer):
    mlp_class = Qwen3MoeSparseMoeBlock
    moe_name = "mlp"


class Qwen3MoeDenseLayer(Qwen3MoeDecoderLayer):
    """A layer that ``moe_layers`` leaves dense: a Llama MLP (``intermediate_size``) under the name ``mlp``."""

    def feed_forward(self, config, execution: Execution, **kw):
        return LlamaMLP(config, **kw)


class Qwen3MoeModel(MixtralModel):
    """The stack with a dense MLP (``intermediate_size``) on each layer ``moe_layers`` leaves out."""

    hf_architecture = "Qwen3MoeModel"
    layer_class = Qwen3MoeDecoderLayer

    def __init__(
        self, config, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs, execution: Execution = Execution()
    ):
        if getattr(config, "sliding_window", None) is not None:
            raise JaxseqError("Qwen3-MoE's use_sliding_window is not supported by jaxseq; leave it off")
        self.sparse = moe_layers(config)
        if execution.scan_layers and not all(self.sparse):
            raise JaxseqError(
                "scan_layers needs every layer alike, and this config mixes dense and MoE layers (mlp_only_layers, "
                "decoder_sparse_step); leave scan_layers off"
            )
        super().__init__(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs, execution=execution)

    def layer_class_of(self, layer: int) -> type:
        return self.layer_class if self.sparse[layer] else Qwen3MoeDenseLayer


class Qwen3MoeForCausalLM(MixtralForCausalLM):
    hf_architecture = "Qwen3MoeForCausalLM"
    base = Qwen3MoeModel


class Qwen3MoeForSequenceClassification(MixtralForSequenceClassification):
    hf_architecture = "Qwen3MoeForSequenceClassification"
    base = Qwen3MoeModel
