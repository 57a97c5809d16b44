"""Small pieces every family uses: activations, initialisers, dense layers (and GPT-2's Conv1D), dropout,
and how transformer blocks run: remat policies, per-block weight gathering, and blocks stacked and scanned."""

from __future__ import annotations

import dataclasses
import functools
import itertools

import jax
import jax.extend.random
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxseq.errors import JaxseqError
from jaxseq.mesh import batch_spec, context_size, data_parallel_size
from jaxseq.models.execution import REMAT_POLICIES, Execution, Gathering
from jaxseq.sharding import STACKED, every, match_partition_rules, named_leaves, path_string, unstacked_path


@jax.custom_jvp
def gelu_exact(x: jax.Array) -> jax.Array:
    """The exact (erf) GELU as PyTorch computes it, ``x / 2 * (1 + erf(x / sqrt(2)))``; jax.nn.gelu's exact form
    goes through erfc, which XLA:CPU evaluates about twice as slowly. Its derivative is written out, so the
    backward pass keeps one array (the slope at ``x``) where differentiating the formula kept three: the QA
    job's MiniLM step (23 x 384 tokens) holds 5.8 GiB of temporaries on CPU instead of 6.4."""
    return x * _normal_cdf(x)


def _normal_cdf(x: jax.Array) -> jax.Array:
    return 0.5 * (1.0 + jax.lax.erf(x * np.sqrt(0.5).astype(x.dtype)))


@gelu_exact.defjvp
def _gelu_exact_jvp(primals, tangents):
    (x,), (dx,) = primals, tangents
    cdf = _normal_cdf(x)
    slope = cdf + x * jnp.exp(-0.5 * x * x) * np.sqrt(0.5 / np.pi).astype(x.dtype)
    return x * cdf, dx * slope


ACTIVATIONS = {
    "gelu": gelu_exact,
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_fast": lambda x: jax.nn.gelu(x, approximate=True),
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
    "tanh": jnp.tanh,
}


def activation(name: str):
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise JaxseqError(f"activation {name!r} is not supported; use one of {sorted(ACTIVATIONS)}") from None


def deinterleave(x: jax.Array) -> jax.Array:
    """Interleaved last-axis features ``(a0, b0, a1, b1, ...)`` as ``(a0, a1, ..., b0, b1, ...)``: a reshape and
    a transpose, never strided slices (``x[..., ::2]``), which made libtpu's compiles of large steps take tens
    of GB of host memory."""
    return jnp.swapaxes(x.reshape(*x.shape[:-1], x.shape[-1] // 2, 2), -1, -2).reshape(x.shape)


def normal(std: float):
    return nnx.initializers.normal(stddev=std)


VOCAB_MULTIPLE = 128
"""Vocabulary-sized weights (token embeddings, LM heads and their biases) have ``padded_vocab_size`` rows:
a multiple of 128 divides by any model-parallel size up to 128 and fills whole 128-wide TPU MXU tiles.
The padding rows are zero when loaded from a checkpoint and never looked up, the loss leaves their logits
out (``train.objectives.cross_entropy``), models return only the real vocabulary's logits, and exports drop
them (``Family.vocab_params`` says which weights and axes)."""


def padded_vocab_size(vocab_size: int) -> int:
    """``vocab_size`` rounded up to a multiple of ``VOCAB_MULTIPLE``."""
    return -(-vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, out_sharding=None):
    """``jax.lax.dot_general``, except that a product of bfloat16 (or float16) operands accumulated into float32
    (an LM head's logits) keeps its backward pass in the operands' dtype: the float32 cotangent is rounded to
    it first, as PyTorch autocast's half-precision logits are. JAX's own transpose multiplies the float32
    cotangent by the half-precision operand in float32: TF32 GEMMs on an H100 (GPT-2 small's tied head, 16 x
    1024 tokens: 7.8 of the 44.5 ms step, `bench/gpu.py`), multi-pass products on a TPU."""
    half = lhs.dtype == rhs.dtype and lhs.dtype in (jnp.bfloat16, jnp.float16)
    if half and preferred_element_type == jnp.float32 and out_sharding is None:
        return _widened_dot(lhs, rhs, dimension_numbers, precision)
    return jax.lax.dot_general(
        lhs, rhs, dimension_numbers, precision, preferred_element_type=preferred_element_type, out_sharding=out_sharding
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _widened_dot(lhs, rhs, dimension_numbers, precision):
    return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type=jnp.float32)


def _widened_dot_forward(lhs, rhs, dimension_numbers, precision):
    return _widened_dot(lhs, rhs, dimension_numbers, precision), (lhs, rhs)


def _widened_dot_backward(dimension_numbers, precision, operands, cotangent):
    lhs, rhs = operands
    _, transpose = jax.vjp(lambda a, b: jax.lax.dot_general(a, b, dimension_numbers, precision), lhs, rhs)
    return transpose(cotangent.astype(lhs.dtype))  # the unused forward product is dead code under jit


_widened_dot.defvjp(_widened_dot_forward, _widened_dot_backward)


class Linear(nnx.Linear):
    """``nnx.Linear`` applied to its input flattened to rows, ``[..., in] -> [rows, in] @ [in, out]``: the same
    numbers, but the backward pass's weight gradient becomes a plain ``x^T dy`` product of row-major arrays.
    Given ``[batch, seq, in]`` inputs, XLA's CPU backend instead transposes ``dy`` and runs a slower dot
    (GPT-2 small's training step: about 4% faster flattened, `bench/train_vs_pytorch.py`). Products go
    through ``dot_general`` above (half-precision heads accumulated in float32 keep a half-precision
    backward pass)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, dot_general=kwargs.pop("dot_general", dot_general), **kwargs)

    def __call__(self, inputs, out_sharding=None):
        if inputs.ndim <= 2:
            return super().__call__(inputs, out_sharding)
        y = super().__call__(inputs.reshape(-1, inputs.shape[-1]), out_sharding)
        return y.reshape(*inputs.shape[:-1], y.shape[-1])


class Conv1D(Linear):
    """GPT-2's Conv1D: a dense layer whose PyTorch weight is stored (in, out), so it is not transposed
    when converted (an ordinary ``nnx.Linear`` is, since PyTorch's Linear stores (out, in))."""


def tied_logits(h: jax.Array, embedding: jax.Array, dtype) -> jax.Array:
    """float32 logits ``h @ embedding.T`` of an LM head tied to the ``[vocab, hidden]`` token embeddings,
    multiplied in ``dtype`` (the compute dtype; None: as stored) and accumulated in float32."""
    dtype = dtype or embedding.dtype
    dims = (((h.ndim - 1,), (1,)), ((), ()))
    return dot_general(h.astype(dtype), embedding.astype(dtype), dims, preferred_element_type=jnp.float32)


def embedding_lookup(embed: nnx.Embed, ids: jax.Array, padding_idx: int | None) -> jax.Array:
    """``embed(ids)`` with row ``padding_idx`` looked up without gradient, as transformers' ``nn.Embedding(...,
    padding_idx)``: the token embeddings of Llama, Mistral, Qwen, Gemma, Phi-3, OPT, BERT and RoBERTa (the
    config's ``pad_token_id``) and RoBERTa's positions. The pad token's embedding never trains, also where the
    pad id is a real token (a pad token set to EOS)."""
    x = embed(ids)
    if padding_idx is None:
        return x
    return jnp.where((ids == padding_idx)[..., None], jax.lax.stop_gradient(x), x)


def one_hot_lookup(embed: nnx.Embed, ids: jax.Array) -> jax.Array:
    """``embed(ids)`` for a table of a few rows (BERT's token types, T5's position buckets) as a one-hot
    product, as T5X computes its position bias: the gradient is a matmul, where a gather's is a scatter-add
    whose many updates of one row serialise on a GPU (62 ms of a BERT-base step at 64 x 128 tokens on an
    H100, bench/gpu.py). Exact: each output sums one row times 1."""
    table = embed.embedding.get_value()
    table = table.astype(embed.dtype or table.dtype)
    one_hot = jax.nn.one_hot(ids, table.shape[0], dtype=table.dtype)
    return jnp.matmul(one_hot, table, precision=jax.lax.Precision.HIGHEST)


def _derivation_key(words: jax.Array) -> jax.Array:
    """The Threefry-2x32 key of a ``THREEFRY4X32_BITS`` key's 4 words (their two halves xored: 64 bits, as
    JAX's default keys have)."""
    return jax.random.wrap_key_data(words[:2] ^ words[2:], impl="threefry2x32")


THREEFRY4X32_BITS = jax.extend.random.define_prng_impl(
    key_shape=(4,),
    seed=lambda seed: jax.random.bits(jax.random.key(seed, impl="threefry2x32"), (4,), jnp.uint32),
    split=lambda words, shape: jax.random.bits(_derivation_key(words), (*shape, 4), jnp.uint32),
    fold_in=lambda words, data: jax.random.bits(jax.random.fold_in(_derivation_key(words), data), (4,), jnp.uint32),
    random_bits=lambda words, width, shape: jax.random.bits(
        jax.random.wrap_key_data(words, impl="threefry4x32"), shape, jnp.dtype(f"uint{width}")
    ),
    name="threefry4x32_bits",
    tag="fry4b",
)
"""Keys of 4 words whose bits are Threefry-4x32's (Random123's; unrolled by XLA:CPU, which runs it about ten
times faster than JAX's threefry2x32, a rolled loop) and whose ``split`` and ``fold_in`` are JAX's Threefry-2x32
(rolled: quick to compile for the few words a key is). Threefry-4x32's own ``split`` and ``fold_in`` stack the
hash's 4 output words, and XLA:CPU's fusion of that stack emits the 20-round hash once per word: the 3 such
fusions of NER's train step took 0.96 s of its LLVM compilation; its compilation takes 4.8-5.0 s with these keys
against 5.4-5.9 s. Bits are drawn per shard as Threefry-4x32's are (partitionable)."""


def dropout_prng(platform: str):
    """The PRNG of dropout keys (``jax.random.key(seed, impl=...)``) of programs that run on ``platform``. On
    CPU, ``THREEFRY4X32_BITS``: the bits of Threefry-4x32 of Random123, the cipher family of JAX's default
    threefry2x32, which XLA:CPU runs as a rolled loop about ten times more slowly (the attention-probability
    dropout of one BERT layer, [16, 12, 128, 128]: 25.7 ms against 2.8 ms). Elsewhere JAX's default: under remat
    on TPU, XLA keeps Threefry-4x32's bits for the backward pass instead of recomputing them (BERT-large, 8 x 512
    tokens on one v5e chip, --remat full: 5.58 GiB of temporaries against 1.02, and 86 ms a step against 68)."""
    return THREEFRY4X32_BITS if platform == "cpu" else "threefry2x32"


def dropout(x: jax.Array, rate: float, rngs: nnx.Rngs | DrawnMasks | None) -> jax.Array:
    """Inverted dropout, active only when the caller passes ``rngs`` (training); ``rngs=None`` is eval. Given
    ``DrawnMasks`` (a scanned stack's, ``Stacked``), it takes the next of the masks drawn before the scan."""
    if rngs is None or rate == 0.0:
        return x
    if isinstance(rngs, DrawnMasks):
        return kept(x, rngs.take(x.shape, rate), rate)
    return dropout_with_key(x, rate, rngs.dropout())


def dropout_with_key(x: jax.Array, rate: float, key: jax.Array) -> jax.Array:
    return kept(x, jax.random.bernoulli(key, 1.0 - rate, x.shape), rate)


def kept(x: jax.Array, keep: jax.Array, rate: float) -> jax.Array:
    """``x`` dropped out where ``keep`` is False, the rest divided by ``1 - rate`` (inverted dropout)."""
    return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)


@jax.tree_util.register_pytree_node_class
class DrawnMasks:
    """One block's dropout keep-masks, drawn before a scanned stack runs (``Stacked.draws_ahead``), which
    ``dropout`` takes in the order the block drops out. ``masks=None`` records that order instead (each
    site's shape and rate in ``sites``) and keeps everything. A pytree, so it passes through remat."""

    def __init__(self, masks: tuple | None = None, sites: list | None = None):
        self.masks, self.sites, self.used = masks, [] if sites is None else sites, 0

    def take(self, shape: tuple, rate: float) -> jax.Array:
        if self.masks is None:
            self.sites.append((tuple(shape), rate))
            return jnp.ones(shape, bool)
        if self.used >= len(self.masks) or self.masks[self.used].shape != tuple(shape):
            raise JaxseqError(f"a scanned block drops out differently than it did when its masks were drawn: {shape}")
        self.used += 1
        return self.masks[self.used - 1]

    def tree_flatten(self):
        return (self.masks,), self.sites

    @classmethod
    def tree_unflatten(cls, sites, children):
        return cls(children[0], sites)


def remat_policy(name: str):
    """The ``jax.checkpoint`` policy of a ``REMAT_POLICIES`` name (None for ``none``: no checkpoint)."""
    policies = jax.checkpoint_policies
    if name == "none":
        return None
    if name == "full":
        return policies.nothing_saveable
    if name == "dots":
        return policies.dots_with_no_batch_dims_saveable
    if name == "offload":
        return policies.offload_dot_with_no_batch_dims("device", "pinned_host")
    raise JaxseqError(f"unknown remat policy {name!r}; choose one of {', '.join(REMAT_POLICIES)}")


def call_block(block: nnx.Module, remat: str, *args, gather: WeightGather | None = None, shadow=None, **kwargs):
    """``block(*args, **kwargs)`` under the ``remat`` policy (``REMAT_POLICIES``: ``Execution.remat``). With a
    ``gather`` (the block's ``WeightGather``), its weights are cast and all-gathered inside the (rematerialised)
    call, so only this block's weights are whole at a time; ``shadow``: zeros that ``WeightGather`` adds to the
    cast weights there (a scanned stack's route for their gradients)."""
    if remat == "none" and gather is None:
        return block(*args, **kwargs)
    names = tuple(kwargs)

    def run(block, shadow, *values):
        if gather is not None:
            block, values = gather(block, shadow), (gather.split_batch(values[0]), *values[1:])
        return block(*values[: len(args)], **dict(zip(names, values[len(args) :])))

    values = (shadow, *args, *kwargs.values())
    if remat == "none":
        return run(block, *values)
    return nnx.remat(run, policy=remat_policy(remat))(block, *values)


def _round_to_bf16(x: jax.Array) -> jax.Array:
    """float32 ``x`` rounded to bfloat16 (to nearest, ties to even; NaN stays NaN) as ``x.astype(bfloat16)`` does,
    in integer arithmetic on its bits."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    bits = (bits + jnp.uint32(0x7FFF) + ((bits >> 16) & 1)) >> 16
    bits = jnp.where(jnp.isnan(x), jnp.uint32(0x7FC0), bits).astype(jnp.uint16)
    return jax.lax.bitcast_convert_type(bits, jnp.bfloat16)


@jax.custom_jvp
def to_bf16(x: jax.Array) -> jax.Array:
    """``x.astype(bfloat16)`` for a float32 ``x``, the same numbers and gradient, but not a convert that XLA:TPU's
    bfloat16 propagation can move: a convert of a scanned layer's slice of a float32 stack is moved out of the
    loop onto the whole stack, a bfloat16 copy of every layer's weights kept from the forward loop to the
    backward one (52 MiB a layer on v5e-8 at Llama-3-8B widths, fsdp=8)."""
    return _round_to_bf16(x)


@to_bf16.defjvp
def _to_bf16_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return to_bf16(x), t.astype(jnp.bfloat16)


@jax.custom_vjp
def _gradient_shadow(x: jax.Array) -> jax.Array:
    """bfloat16 zeros of ``x``'s shape whose gradient becomes ``x``'s, converted to ``x``'s dtype."""
    return jnp.zeros(x.shape, jnp.bfloat16)


def _gradient_shadow_fwd(x):
    return _gradient_shadow(x), None


def _gradient_shadow_bwd(_, gradient):
    return (gradient.astype(jnp.float32),)


_gradient_shadow.defvjp(_gradient_shadow_fwd, _gradient_shadow_bwd)


@dataclasses.dataclass(frozen=True)
class WeightGather:
    """What a block does on entry (``weight_gather``): for each parameter sharded over the fsdp axis (its
    path inside the block), the dtype its layer computes in and the sharding it is gathered to; and the mesh,
    whose batch axes split the block's hidden states. Hashable, so it can be a static attribute of a module."""

    weights: tuple[tuple[str, np.dtype | None, NamedSharding], ...]
    mesh: Mesh

    def __call__(self, block: nnx.Module, shadow: dict | None = None) -> nnx.Module:
        """A copy of ``block`` whose listed parameters are cast and constrained to their gathered shardings;
        ``shadow`` (path -> zeros of the compute dtype, from ``Stacked``) is added to the cast parameters it
        names, which ``Stacked`` passes in without their gradient (see ``Stacked.__call__``)."""
        table = {name: (dtype, sharding) for name, dtype, sharding in self.weights}
        shadow = shadow or {}

        def leaf(path, x):
            name = path_string(path)
            entry = table.get(name)
            if entry is None or x.size == 0:  # size 0: a QLoRA kernel's place (its layer dequantises its codes)
                return x
            dtype, sharding = entry
            if name in shadow:
                x = to_bf16(x) + shadow[name]
            elif dtype is not None and jnp.issubdtype(x.dtype, jnp.floating):
                x = x.astype(dtype)
            return jax.lax.with_sharding_constraint(x, sharding)

        graphdef, state = nnx.split(block)
        return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(leaf, state))

    def split_batch(self, x: jax.Array) -> jax.Array:
        """``x`` (``[batch, ...]``) constrained to be split over the batch axes (``jaxseq.mesh.batch_spec``),
        when its batch divides. Without it, GSPMD may follow the embedding table's split of the hidden
        dimension over fsdp and compute every block on the whole batch on every device."""
        if x.shape[0] % data_parallel_size(self.mesh):
            return x
        spec, parts = batch_spec(x.ndim), context_size(self.mesh)
        if parts > 1 and x.ndim > 2 and x.shape[1] % parts == 0:  # the sequence split over cp (split_sequence)
            spec = P(spec[0], "cp", *spec[2:])
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))


def without_axis(spec: P, axis: str) -> P:
    """``spec`` with mesh ``axis`` taken out of every dimension (that dimension whole along ``axis``)."""
    out = []
    for entry in spec:
        if isinstance(entry, tuple):
            entry = tuple(a for a in entry if a != axis) or None
        elif entry == axis:
            entry = None
        out.append(entry)
    return P(*out)


def weight_gather(block: nnx.Module, gathering: Gathering | None) -> WeightGather | None:
    """What ``block`` gathers on entry under ``gathering`` (``Execution.gather``; None: nothing): every parameter
    its family's rules shard over ``gathering.axis``, cast to the dtype its layer computes in and constrained to
    its partition spec with that axis taken out, and the block's input hidden states kept split over the batch
    axes (dp, fsdp). XLA then all-gathers one block's compute-dtype weights at a time (again in the backward pass
    under remat) instead of every weight at once, and each device computes on its own examples; the numbers are
    unchanged. The rules are matched on the parameters' paths inside the block: each rule ends in ``$``, so it
    matches a block's own paths as it matches the model's. A scanned stack's block (``Stacked.stacked``) is
    matched as one layer: the scan hands it one layer at a time."""
    if gathering is None:
        return None
    params = nnx.state(block, nnx.Param)
    specs = jax.tree.leaves(match_partition_rules(gathering.rules, params), is_leaf=lambda x: isinstance(x, P))
    modules = {"/".join(map(str, p)): m for p, m in nnx.iter_modules(block)}
    weights = []
    for (name, _), spec in zip(named_leaves(params), specs):
        gathered = without_axis(spec, gathering.axis)
        if gathered == spec:
            continue
        dtype = getattr(modules.get(name.rpartition("/")[0]), "dtype", None)
        weights.append((name, None if dtype is None else jnp.dtype(dtype), NamedSharding(gathering.mesh, gathered)))
    return WeightGather(tuple(weights), gathering.mesh)


# --------------------------------------------------------------------------- stacks of blocks


class Unrolled(nnx.List):
    """A stack's blocks run one after another in a Python loop (``attention.run_blocks``), block ``i`` with its
    own ``WeightGather`` (``weight_gathers[i]``; None without gathering), built with the blocks."""

    def __init__(self, blocks, gathering: Gathering | None = None):
        super().__init__(blocks)
        self.weight_gathers = tuple(weight_gather(block, gathering) for block in self)

    def call(self, layer: int, remat: str, *args, **kwargs):
        """Block ``layer`` of ``args``/``kwargs`` under ``call_block``, with its weight gather."""
        return call_block(self[layer], remat, *args, gather=self.weight_gathers[layer], **kwargs)

    def arrange(self, per_layer) -> tuple:
        """Values given per layer in order (a KV cache's) as the blocks take them: a tuple."""
        return tuple(per_layer)


class Stacked(nnx.Module):
    """``count`` blocks of one structure held as one (``stacked``), every parameter with a leading layer axis,
    and run by ``jax.lax.scan``: one block's program, whatever the depth (MaxText's ``scan_layers``, Levanter's
    ``Stacked``). ``make(rngs)`` builds one block; the layers are made one after another from ``rngs``, so a
    model initialises alike scanned and unrolled (and so do the modules made after its stack: a task's head).
    A block class whose numbers depend on its layer (GPT-2's ``scale_attn_by_inverse_layer_idx``) sets
    ``uses_layer_index`` and is called with ``layer=`` its (traced) index. Parameter paths hold ``STACKED``
    where the unrolled model's hold the layer index (``unstacked_path``). Parameters that only the unrolled
    stack's first block holds (T5's relative position bias) live beside the stack, in ``first_only``
    (``first_only(rngs)``, made after the blocks), at their paths inside that block (``nested``): the unrolled
    paths hold 0 where theirs hold ``FIRST_ONLY``. ``execution`` gives the blocks' ``weight_gather`` (one for
    every layer: the scan hands the block one layer at a time) and ``draws_ahead``.

    ``draws_ahead`` (``Execution.draws_ahead``, a run's on CPU): the blocks' dropout masks are drawn before the
    scan, each site's for every layer at once, instead of in the loop body, where XLA:CPU computes each site's
    random bits in about twice as many fusions as unrolled and the step ran 10-36% slower. Drawn ahead, the
    scanned step is within 5% of the unrolled one (BENCHMARKS.md). Elsewhere the bits stay in the loop, where
    remat recomputes them instead of holding every layer's masks."""

    def __init__(self, make, count: int, rngs: nnx.Rngs, execution: Execution = Execution(), first_only=None):
        made = [nnx.split(make(rngs)) for _ in range(count)]
        if any(graphdef != made[0][0] for graphdef, _ in made):
            raise JaxseqError("the blocks of a stack to scan differ in structure; leave scan_layers off")
        stacked = jax.tree.map(lambda *layers: jnp.stack(layers), *(state for _, state in made))
        self.stacked = nnx.merge(made[0][0], stacked)
        self.count = count
        self.draws_ahead = execution.draws_ahead  # draw every layer's dropout masks before the scan
        self.weight_gather = weight_gather(self.stacked, execution.gather)
        if first_only is not None:
            self.first_only = first_only(rngs)

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, layer: int) -> nnx.Module:
        """Block ``layer`` on its own, its parameters a slice of the stack's."""
        graphdef, state = nnx.split(self.stacked)
        return nnx.merge(graphdef, jax.tree.map(lambda a: a[layer], state))

    def call(self, layer: int, remat: str, *args, **kwargs):
        """Block ``layer`` alone (apart from the scan) of ``args``/``kwargs`` under ``call_block``, with the
        blocks' weight gather."""
        return call_block(self[layer], remat, *args, gather=self.weight_gather, **kwargs)

    def each(self, fn):
        """``fn(block)`` of every block, stacked (a ``vmap`` over the layers)."""
        graphdef, state = nnx.split(self.stacked)
        return jax.vmap(lambda state: fn(nnx.merge(graphdef, state)))(state)

    def arrange(self, per_layer):
        """Values given per layer in order (a KV cache's) as the blocks take them: stacked."""
        return jax.tree.map(lambda *layers: jnp.stack(layers), *per_layer)

    def __call__(self, remat: str, x, *args, per_layer=None, layers=slice(None), rngs: nnx.Rngs | None = None, **kw):
        """``x`` through the blocks in order (``layers``: a slice of them) under ``call_block``, each given its own
        layer of ``per_layer`` (keyword arguments stacked over the layers: a decoder's KV caches) and its own
        dropout key (``rngs``' next one folded with the layer index); returns the output and what the blocks
        return beside it (their caches), stacked, or None from blocks that return their output alone.

        With fsdp (``weight_gather``), each float32 weight the blocks compute with in bfloat16 enters the scan
        twice: its stack without gradient, which the block casts (``to_bf16``) inside its rematerialised call,
        and a "shadow" stack of bfloat16 zeros added there, whose gradient is the weight's. The backward loop
        then stacks each layer's reduce-scattered gradient in bfloat16, as the unrolled program keeps them,
        not float32 (which held 104 MiB more a layer at Llama-3-8B widths on v5e-8)."""
        key = None if rngs is None else rngs.dropout()
        xs, run = self.scan_parts(remat, args, kw, per_layer)
        xs = jax.tree.map(lambda a: a[layers], xs)
        if key is not None and self.draws_ahead:
            first = jax.tree.map(lambda a: a[0], xs)
            masks = self._draw_masks(key, len(xs[2]), lambda block_rngs: run(x, first, block_rngs, "none"))
            return jax.lax.scan(lambda x, both: run(x, both[0], DrawnMasks(both[1])), x, (xs, masks))

        def body(x, xs):
            return run(x, xs, None if key is None else nnx.Rngs(dropout=jax.random.fold_in(key, xs[2])))

        return jax.lax.scan(body, x, xs)

    def scan_parts(self, remat: str, args: tuple, kw: dict, per_layer=None, first: int = 0, step: int = 1):
        """What a scan over the blocks hands each one, ``(parameters, shadow, layer, per_layer)`` stacked (the
        layers numbered ``first``, ``first + step``, ...), and ``run(x, xs, block_rngs, remat)``, the block of
        one step's ``xs`` under ``call_block`` returning ``(output, what it returns beside it or None)``."""
        graphdef, state = nnx.split(self.stacked)
        layered = getattr(type(self.stacked), "uses_layer_index", False)
        gather = self.weight_gather
        lowered = set() if gather is None else {n for n, dtype, _ in gather.weights if dtype == jnp.bfloat16}
        flat = {path_string(p): v for p, v in jax.tree_util.tree_leaves_with_path(state)}
        lowered = {n for n in lowered if n in flat and flat[n].dtype == jnp.float32}
        shadow = {n: _gradient_shadow(flat[n]) for n in sorted(lowered)}
        if lowered:
            state = jax.tree_util.tree_map_with_path(
                lambda p, v: jax.lax.stop_gradient(v) if path_string(p) in lowered else v, state
            )

        def run(x, xs, block_rngs, remat=remat):
            state, shadow, layer, own = xs
            extra = {"layer": layer} if layered else {}
            block = nnx.merge(graphdef, state)
            out = call_block(
                block, remat, x, *args, gather=gather, shadow=shadow, rngs=block_rngs, **kw, **own, **extra
            )
            return out if isinstance(out, tuple) else (out, None)

        numbers = first + step * jnp.arange(self.count, dtype=jnp.int32)
        return (state, shadow, numbers, per_layer or {}), run

    @staticmethod
    def _draw_masks(key: jax.Array, count: int, one_block) -> tuple:
        """The dropout masks of ``count`` layers: one draw per dropout site of ``one_block(rngs)`` (a block's
        call, traced once to record its sites), each for all of the layers together."""
        recorder = DrawnMasks()
        jax.eval_shape(lambda: one_block(recorder))
        if not recorder.sites:
            return ()
        keys = jax.random.split(key, len(recorder.sites))
        return tuple(
            jax.random.bernoulli(k, 1.0 - rate, (count, *shape)) for k, (shape, rate) in zip(keys, recorder.sites)
        )


FIRST_ONLY = "first_only"
"""The path segment of parameters that only a scanned stack's unrolled first block holds (``Stacked``)."""


def nested(path: str, module: nnx.Module) -> nnx.Module:
    """``module`` inside containers that put it at ``path`` (``layer/0/SelfAttention``; a number is a list's
    first item) of the result, as ``Stacked.first_only`` keeps what the unrolled first block holds."""
    for part in reversed(path.split("/")):
        module = nnx.List([module]) if part == "0" else nnx.Dict({part: module})
    return module


class Grouped(nnx.Module):
    """A stack whose layers repeat a pattern of ``period`` kinds (gpt-oss's sliding and full layers: 2; Gemma 3's
    five sliding and one full: 6; Qwen3.5's three linear and one full: 4), run by one ``jax.lax.scan`` over its
    whole groups of ``period`` layers: each step runs the group's ``period`` blocks in turn. The blocks at place
    ``p`` of every group are one ``Stacked`` (every parameter with a leading group axis) under the path segment
    ``every(p, period)`` (``model/layers/1::4/stacked/...``: layers 1, 5, 9, ..., ``sharding.unstacked_path``),
    so loading, export, PEFT names, partition rules and the parameter table stay per layer as for ``Stacked``.
    The layers past the last whole group run unrolled after the scan, each under its own index
    (``model/layers/62/...``) with its own weight gather. ``built``: every layer's block, made in the unrolled
    order (a model initialises alike scanned and unrolled). Each block is called with its own dropout key
    (``rngs``' next one folded with its layer index; masks drawn ahead on CPU, ``Stacked.draws_ahead``) and,
    if its class sets ``uses_layer_index``, its layer; ``per_layer`` values (KV caches) are laid out as
    ``arrange`` lays them."""

    def __init__(self, built: list, period: int, execution: Execution = Execution()):
        self.count, self.period, self.groups = len(built), period, len(built) // period
        self.draws_ahead = execution.draws_ahead
        whole = self.groups * period
        for place in range(period):
            same = iter(built[place:whole:period])
            setattr(
                self, every(place, period), Stacked(lambda rngs, same=same: next(same), self.groups, None, execution)
            )
        for layer in range(whole, self.count):
            setattr(self, str(layer), built[layer])
        self.weight_gathers = tuple(weight_gather(block, execution.gather) for block in built[whole:])

    def __len__(self) -> int:
        return self.count

    def places(self) -> list[Stacked]:
        """The stacks of each place in a group, in order."""
        return [getattr(self, every(place, self.period)) for place in range(self.period)]

    def rest(self) -> list[nnx.Module]:
        """The blocks past the last whole group, in order."""
        return [getattr(self, str(layer)) for layer in range(self.groups * self.period, self.count)]

    def arrange(self, per_layer) -> tuple:
        """Values given per layer in order (a KV cache's) as the blocks take them: for each place in a group,
        its layers' values stacked (a sliding layer's rolling cache beside a full layer's whole one), then the
        values of the layers past the last whole group."""
        per_layer, whole = list(per_layer), self.groups * self.period
        places = [per_layer[place : whole : self.period] for place in range(self.period)]
        return (*(jax.tree.map(lambda *layers: jnp.stack(layers), *values) for values in places), *per_layer[whole:])

    def __call__(self, remat: str, x, *args, per_layer=None, rngs: nnx.Rngs | None = None, **kw):
        """``x`` through every layer in order; returns the output and what the blocks return beside it, laid out
        as ``arrange`` (or None from blocks that return their output alone)."""
        per_layer, key = per_layer or {}, None if rngs is None else rngs.dropout()
        own = lambda i: {name: value[i] for name, value in per_layer.items()}
        parts = [
            stack.scan_parts(remat, args, kw, own(place), place, self.period)
            for place, stack in enumerate(self.places())
        ]
        xs = tuple(part[0] for part in parts)
        layer_rngs = lambda layer: None if key is None else nnx.Rngs(dropout=jax.random.fold_in(key, layer))

        def group(x, xs, masks=None):
            outs = []
            for place, (_, run) in enumerate(parts):
                block_rngs = layer_rngs(xs[place][2]) if masks is None else DrawnMasks(masks[place])
                x, out = run(x, xs[place], block_rngs)
                outs.append(out)
            return x, tuple(outs)

        if key is not None and self.draws_ahead:
            first = jax.tree.map(lambda a: a[0], xs)
            masks = tuple(
                Stacked._draw_masks(
                    jax.random.fold_in(key, place),
                    self.groups,
                    lambda r, run=run, place=place: run(x, first[place], r, "none"),
                )
                for place, (_, run) in enumerate(parts)
            )
            x, outs = jax.lax.scan(lambda x, both: group(x, *both), x, (xs, masks))
        else:
            x, outs = jax.lax.scan(group, x, xs)
        rest = []
        for i, block in enumerate(self.rest()):
            layer = self.groups * self.period + i
            extra = {"layer": layer} if getattr(type(block), "uses_layer_index", False) else {}
            gather = self.weight_gathers[i]
            out = call_block(
                block, remat, x, *args, gather=gather, rngs=layer_rngs(layer), **kw, **own(self.period + i), **extra
            )
            x, out = out if isinstance(out, tuple) else (out, None)
            rest.append(out)
        return x, (*outs, *rest)


def repeating_period(kinds) -> int | None:
    """The shortest period ``p`` with which a stack's layer kinds repeat (layer ``i`` of the kind of layer
    ``i - p``) at least twice (1: every layer alike); None: they do not repeat."""
    kinds = list(kinds)
    if len(set(kinds)) <= 1:
        return 1
    return next(
        (p for p in range(2, len(kinds) // 2 + 1) if all(kinds[i] == kinds[i - p] for i in range(p, len(kinds)))),
        None,
    )


def blocks(
    make, count: int, rngs: nnx.Rngs, execution: Execution = Execution(), first_only=None, kinds=None
) -> Unrolled | Stacked | Grouped:
    """A stack's ``count`` blocks, ``make(i, rngs)`` for block ``i``, as ``execution`` runs them: a list run in a
    Python loop (``Unrolled``), or (``execution.scan_layers``) one ``Stacked`` block built with index 0 (a block
    that depends on its layer reads ``layer`` when called; ``first_only``: see ``Stacked``); each block's weight
    gather (``execution.gather``) and a scanned stack's ``draws_ahead`` are built with them. ``kinds``: each
    layer's kind (its window, its layer type: what makes its block differ), when they differ; scanned, layers
    whose kinds repeat a pattern run as a ``Grouped`` stack of its period (``repeating_period``), and layers
    whose kinds do not repeat are refused in one line."""
    if not execution.scan_layers:
        return Unrolled([make(i, rngs) for i in range(count)], execution.gather)
    period = 1 if kinds is None else repeating_period(kinds)
    if period is None:
        raise JaxseqError(
            f"scan_layers scans layers that repeat one pattern of kinds at least twice, and these {count} layers' "
            f"kinds do not ({', '.join(map(kind_name, kinds))}); leave scan_layers off"
        )
    if period == 1:
        return Stacked(lambda rngs: make(0, rngs), count, rngs, execution, first_only)
    return Grouped([make(i, rngs) for i in range(count)], period, execution)


def kind_name(kind) -> str:
    """A layer kind as an error names it: a window's size, ``full`` for no window, else the kind itself."""
    if kind is None:
        return "full"
    return f"window {kind}" if isinstance(kind, int) else str(kind)


EXPERTS = "experts"
"""The module name under which a mixture of experts keeps its experts' projections stacked, each one
``[experts, in, out]`` parameter (``experts/w1``), where checkpoints name them per expert
(``experts.3.w1.weight``, the unrolled path ``experts/3/w1/kernel``)."""


class WholeExperts(nnx.Param):
    """An experts' parameter that checkpoints keep whole, ``[experts, ...]`` under its own name (gpt-oss's
    ``experts.gate_up_proj``), not as one tensor per expert: no ``is_expert_stack``."""


class NamedAsIs(nnx.Param):
    """A parameter whose PyTorch name is its path as it stands, leaf included: no module's ``kernel``,
    ``embedding`` or norm ``scale`` (PyTorch's ``weight``) but a tensor of its own name (Gemma 4's router
    ``scale``)."""


def is_expert_stack(path: tuple, param: nnx.Variable) -> bool:
    """Whether parameter ``param`` at ``path`` is an experts' stacked projection that checkpoints name per expert
    (a parameter directly under ``EXPERTS``, not ``WholeExperts``)."""
    return len(path) >= 2 and path[-2] == EXPERTS and not isinstance(param, WholeExperts)


def layer_paths(state) -> dict[tuple, tuple[tuple, int | tuple | None]]:
    """The one map from the unrolled model's parameter paths (``transformer/h/3/attn/c_attn/kernel``) to where a
    model of either kind keeps them: ``(path, index)``, ``index`` None for a parameter that is not stacked
    (``Stacked.first_only``'s included), else its place on the stacked axes: the layer, the expert
    (``is_expert_stack``), or ``(layer, expert)`` for the experts of scanned blocks. ``state``: the model's
    parameters (arrays or shapes)."""
    out = {}
    for path, value in nnx.to_flat_state(state):
        shape, experts = value.get_value().shape, is_expert_stack(path, value)
        axes = [range(shape[0])] * (STACKED in path) + [range(shape[STACKED in path])] * experts
        if not axes:
            out[tuple(0 if part == FIRST_ONLY else part for part in path)] = (path, None)
            continue
        for index in itertools.product(*axes):
            unrolled = unstacked_path(path, index[0]) if STACKED in path else path
            if experts:
                unrolled = (*unrolled[:-1], index[-1], unrolled[-1], "kernel")
            out[unrolled] = (path, index[0] if len(index) == 1 else index)
    return out
