"""Mixtral (Jiang et al. 2024): Llama's decoder (``jaxseq.models.llama``) with each MLP a sparse mixture of
experts, parameters named as Mixtral's checkpoints name them (``block_sparse_moe.gate`` the router,
``block_sparse_moe.experts.N.w1/w2/w3`` expert N's gate, down and up projections; transformers 5 saves these
names and fuses them only in memory).

Each token goes to its ``num_experts_per_tok`` best experts by the router's softmax, their weights renormalised to
sum to one. Dropless: the token-expert pairs are sorted by expert and each expert multiplies only its own rows in
one grouped matmul (``jax.lax.ragged_dot`` with the experts' row counts), then the rows are weighted and
summed back onto their tokens. With ``output_router_logits`` the model returns transformers'
``load_balancing_loss_func`` times ``router_aux_loss_coef`` as ``aux_loss``, which the causal-LM objective adds.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxseq.mesh import BATCH_AXES
from jaxseq.models.execution import Execution
from jaxseq.models.layers import Linear, activation, normal
from jaxseq.models.llama.modeling import LlamaDecoderLayer, LlamaForCausalLM, LlamaForSequenceClassification, LlamaModel
from jaxseq.models.outputs import BaseOutput


def route(logits: jax.Array, top_k: int, normalise: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
    """float32 router probabilities ``[tokens, experts]``, each token's ``top_k`` weights and expert ids
    (weights renormalised to sum to one if ``normalise``, as Mixtral's and Qwen3-MoE's ``norm_topk_prob``)."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if normalise:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return probs, weights, experts


MIXTRAL_EXPERT = ("w1", "w3", "w2")


def moe_layers(config) -> tuple[bool, ...]:
    """Which layers are sparse MoE (the rest dense MLPs): Mixtral's all; Qwen3-MoE's every
    ``decoder_sparse_step``-th not in ``mlp_only_layers``, as transformers builds them."""
    dense, step = set(getattr(config, "mlp_only_layers", None) or ()), getattr(config, "decoder_sparse_step", 1)
    return tuple(i not in dense and (i + 1) % step == 0 for i in range(config.num_hidden_layers))


"""An expert's gate, up and down projections as Mixtral's checkpoints name them (Qwen3-MoE's: gate_proj, ...)."""


class Experts(nnx.Module):
    """``count`` SwiGLU experts, ``down(act(gate(x)) * up(x))``, each of the projections ``names`` (gate, up,
    down) one parameter ``[experts, in, out]`` (``layers.EXPERTS``: checkpoints keep ``experts.N.<name>.weight``
    per expert), which the grouped matmul reads whole and ``ep`` splits by expert. ``grouped``: LoRA refuses
    them."""

    grouped = True

    def __init__(self, config, count: int, inner: int, names=MIXTRAL_EXPERT, *, dtype, param_dtype, rngs: nnx.Rngs):
        d, init = config.hidden_size, normal(config.initializer_range)
        for name, shape in zip(names, ((d, inner), (d, inner), (inner, d))):
            setattr(self, name, nnx.Param(init(rngs.params(), (count, *shape), param_dtype)))
        self.names, self.dtype = names, dtype

    def kernels(self, dtype) -> tuple[jax.Array, jax.Array, jax.Array]:
        return tuple(getattr(self, n)[...].astype(dtype) for n in self.names)


def swiglu_experts(kernels, act, h, grouped, experts):
    """Mixtral's experts of sorted rows ``h``: ``down(act(gate(h)) * up(h))``, ``kernels`` the (gate, up, down)
    stacks ``[experts, in, out]``, ``grouped(h, kernel)`` the grouped matmul of the rows with their experts'
    kernels (``experts``: each row's, for what else an expert holds per expert, such as biases)."""
    gate, up, down = kernels
    return grouped(act(grouped(h, gate)) * grouped(h, up), down)


def grouped_experts(kernels, act, x, weights, ids, first: int = 0, expert=swiglu_experts):
    """``x`` ``[tokens, hidden]`` through each token's experts ``ids`` ``[tokens, k]``, summed with ``weights``:
    the token-expert pairs sorted by expert, each expert's rows multiplied by its kernels alone in one grouped
    matmul (``jax.lax.ragged_dot`` over ``kernels``, stacks ``[experts, ...]`` that ``expert`` reads: by default
    ``swiglu_experts``'s (gate, up, down)), then weighted and summed back onto their tokens, in float32.
    ``kernels`` may hold only experts ``first`` to ``first + len``: the pairs of other experts are sorted last,
    outside every group, their rows zeros going in and each grouped matmul's rows for them selected away (a
    grouped matmul may leave rows outside its groups undefined, NaN included), so they add exactly nothing,
    forward and backward."""
    tokens, k = ids.shape
    count = kernels[0].shape[0]
    local = ids.reshape(-1) - first
    local = jnp.where((local >= 0) & (local < count), local, count)  # count: another device's expert
    order = jnp.argsort(local, stable=True)
    rows = order // k
    sizes = jnp.bincount(local, length=count + 1)[:count].astype(jnp.int32)
    mine = (local[order] < count)[:, None]  # selects, not products with 0: 0 x NaN is NaN, in gradients too

    def grouped(h, kernel):
        return jnp.where(mine, jax.lax.ragged_dot(h, kernel, sizes), 0)

    h = jnp.where(mine, x[rows], 0).astype(kernels[0].dtype)
    y = jnp.where(mine, expert(kernels, act, h, grouped, jnp.minimum(local[order], count - 1)), 0)
    y = y.astype(jnp.float32) * weights.reshape(-1)[order][:, None]
    return jnp.zeros((tokens, x.shape[-1]), jnp.float32).at[rows].add(y)


def expert_parallel(mesh, kernels, act, x, weights, ids, expert=swiglu_experts):
    """``grouped_experts`` with the experts split over the mesh's ``ep`` axis: each device holds
    ``experts / ep`` of them whole (gathered over fsdp and mp) and its own tokens (the batch axes). The
    token exchange: each device gathers its ``ep`` group's tokens and their routes, computes its own
    experts' pairs among them, and the partial outputs are summed and scattered back to the tokens'
    devices (one all-gather and one reduce-scatter over ``ep``; dropless, whatever the routing). Tokens that
    do not split evenly over the batch axes (and cp: each device's own positions of a split sequence) are padded."""
    token_axes = (*BATCH_AXES, "cp")
    rows, split = P(token_axes, None), P("ep")

    def local(kernels, x, weights, ids):
        gathered = [jax.lax.all_gather(a, "ep", tiled=True) for a in (x, weights, ids)]
        first = jax.lax.axis_index("ep") * kernels[0].shape[0]
        y = grouped_experts(kernels, act, *gathered, first=first, expert=expert)
        return jax.lax.psum_scatter(y, "ep", scatter_dimension=0, tiled=True)

    tokens, pad = x.shape[0], -x.shape[0] % math.prod(mesh.shape[a] for a in token_axes)
    x, weights, ids = (jnp.pad(a, ((0, pad), (0, 0))) for a in (x, weights, ids))  # padding: weight 0
    in_specs = ((split,) * len(kernels), rows, rows, rows)
    run = jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=rows)
    return run(kernels, x, weights, ids)[:tokens]


class SparseMoeBlock(nnx.Module):
    """The router (``gate``, no bias) and the ``experts``; returns the output and the layer's router statistics
    for the load balancing loss: ``[2, experts]``, each expert's count of top-k picks and its summed
    probability over the real tokens (``key_mask`` not 0; all tokens without one). ``expert_mesh``: a mesh whose
    ``ep`` axis splits the experts (``Execution.experts``), None: every device computes every expert."""

    def __init__(
        self,
        config,
        inner: int | None = None,
        names=MIXTRAL_EXPERT,
        *,
        expert_mesh: Mesh | None = None,
        dtype,
        param_dtype,
        rngs: nnx.Rngs,
    ):
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        count, inner = config.num_local_experts, inner or config.intermediate_size
        init = normal(config.initializer_range)
        self.gate = Linear(config.hidden_size, count, use_bias=False, kernel_init=init, **kw)
        self.experts = Experts(config, count, inner, names, **kw)
        self.top_k, self.normalise = config.num_experts_per_tok, getattr(config, "norm_topk_prob", True)
        self.act, self.dtype = activation(config.hidden_act), dtype
        self.expert_mesh = expert_mesh

    def __call__(self, x, key_mask=None):
        flat = x.reshape(-1, x.shape[-1])
        probs, weights, experts = route(self.gate(flat), self.top_k, self.normalise)
        real = jnp.ones(flat.shape[:1], jnp.float32) if key_mask is None else (key_mask.reshape(-1) != 0)
        real = real.astype(jnp.float32)
        picks = jax.nn.one_hot(experts, probs.shape[-1], dtype=jnp.float32).sum(axis=1)
        stats = jnp.stack([real @ picks, real @ probs])
        kernels = self.experts.kernels(self.dtype or x.dtype)
        if self.expert_mesh is None:
            y = grouped_experts(kernels, self.act, flat, weights, experts)
        else:
            y = expert_parallel(self.expert_mesh, kernels, self.act, flat, weights, experts)
        return y.astype(x.dtype).reshape(x.shape), stats


class MixtralDecoderLayer(LlamaDecoderLayer):
    """Llama's pre-norm layer with the sparse MoE block for its MLP; beside its output it returns its cache, or
    without one its router statistics (``SparseMoeBlock``)."""

    mlp_class = SparseMoeBlock
    moe_name = "block_sparse_moe"  # Mixtral's checkpoint name of the MoE block (Qwen3-MoE's: mlp)

    def __init__(self, config, window: int | None = None, **kw):
        super().__init__(config, window, **kw)
        self.num_experts = config.num_local_experts
        if self.moe_name != "mlp":
            setattr(self, self.moe_name, self.mlp)
            del self.mlp

    def feed_forward(self, config, execution: Execution, **kw):
        """The sparse MoE block, its experts split over ``execution.experts`` (ep > 1)."""
        return self.mlp_class(config, expert_mesh=execution.experts, **kw)

    def __call__(self, x, masks, ropes, *, cache=None, index=0, rngs=None):
        a, cache = self.self_attn(self.input_layernorm(x), masks, ropes, cache=cache, index=index, rngs=rngs)
        x = x + a
        moe, h = getattr(self, self.moe_name), self.post_attention_layernorm(x)
        if isinstance(moe, SparseMoeBlock):
            y, stats = moe(h, masks[0].segments)
        else:  # a dense layer: no routing
            y, stats = moe(h), jnp.zeros((2, self.num_experts), jnp.float32)
        return x + y, stats if cache is None else cache


def layer_stats(stats) -> jax.Array:
    """Every layer's router statistics ``[layers, 2, experts]`` from what a stack returns: one array per layer,
    one stacked array, or a grouped stack's (``layers.Grouped``) stacks and layers (the order does not count)."""
    return jnp.concatenate([s.reshape(-1, *s.shape[-2:]) for s in jax.tree.leaves(stats)])


def load_balancing_loss(stats: jax.Array) -> jax.Array:
    """transformers' ``load_balancing_loss_func`` from every layer's router statistics ``[layers, 2, experts]``:
    ``experts x sum(picks / rows x probs / rows)`` over all layers' real tokens (``rows``)."""
    total = stats.sum(axis=0)
    rows = total[1].sum()  # each real token's probabilities sum to one in every layer
    return stats.shape[-1] * jnp.sum(total[0] / rows * total[1] / rows)


class MixtralModel(LlamaModel):
    """Llama's decoder stack with Mixtral's layers; without a cache and with ``output_router_logits``, its output
    carries the router's load balancing loss times ``router_aux_loss_coef`` (``aux_loss``)."""

    hf_architecture = "MixtralModel"
    layer_class = MixtralDecoderLayer

    def __call__(self, input_ids, attention_mask=None, position_ids=None, *, cache=None, rngs=None):
        out = super().__call__(input_ids, attention_mask, position_ids, cache=cache, rngs=rngs)
        if cache is not None:
            return out
        aux = None
        if getattr(self.config, "output_router_logits", False):
            aux = self.config.router_aux_loss_coef * load_balancing_loss(layer_stats(out.cache))
        return BaseOutput(out.last_hidden_state, aux_loss=aux)


class MixtralForCausalLM(LlamaForCausalLM):
    hf_architecture = "MixtralForCausalLM"
    base = MixtralModel


class MixtralForSequenceClassification(LlamaForSequenceClassification):
    hf_architecture = "MixtralForSequenceClassification"
    base = MixtralModel
