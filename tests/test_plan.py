"""Ahead-of-time plans: TPU topologies, memory per device, the HLO roofline, refusals, attention kernel detection.

Programs are compiled for an abstract v5e:2x4 slice through libtpu (no TPU needed). Without libtpu those tests
skip, except under CI=true where they fail.
"""

import importlib.util
import json
import math
import os
import re

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxseq.errors import JaxseqError
from jaxseq.mesh import make_mesh
from jaxseq.plan import buffers, hlo, report
from jaxseq.plan import chips as plan_chips
from jaxseq.plan import compile as plan_compile

GiB = 2**30
PLAN_FIELDS = {
    "topology", "accelerator", "devices", "mesh", "hbm_bytes_per_device", "bytes_per_device", "fits",
    "model_flops_per_step", "compiled_flops_per_device", "estimated_step_seconds", "estimated_mfu",
    "estimate_method", "attention_kernel", "compile_seconds", "jax_version", "libtpu_version", "peak_buffers",
}  # fmt: skip


def require_libtpu():
    if importlib.util.find_spec("libtpu") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("libtpu is missing under CI (pip install 'jaxseq[tpu]')")
        pytest.skip("libtpu is not installed: no ahead-of-time TPU compilation")


@pytest.fixture(scope="module")
def v5e():
    require_libtpu()
    return plan_chips.topology("v5e-8")


# ---------------------------------------------------------------------------------------------- topologies


@pytest.mark.parametrize(
    "name, libtpu_name, accelerator, chips, devices",
    [
        ("v5e-8", "v5e:2x4", "v5e-8", 8, 8),
        ("v5litepod-8", "v5e:2x4", "v5e-8", 8, 8),
        ("V5E-4", "v5e:2x2", "v5e-4", 4, 4),
        ("v5e-1", "v5e:1x1", "v5e-1", 1, 1),
        ("v5e-16", "v5e:4x4", "v5e-16", 16, 16),
        ("v5e-256", "v5e:16x16", "v5e-256", 256, 256),
        ("v6e-8", "v6e:2x4", "v6e-8", 8, 8),
        ("v4-8", "v4:2x2x1", "v4-8", 4, 4),  # TensorCores: 4 megacore chips, one device each
        ("v4-32", "v4:2x2x4", "v4-32", 16, 16),
        ("v5p-8", "v5p:2x2x1", "v5p-8", 4, 4),
        ("v5p-128", "v5p:4x4x4", "v5p-128", 64, 64),
        ("v3-8", "v3:2x2", "v3-8", 4, 8),  # v3 devices are TensorCores
        ("v3-32", "v3:4x4", "v3-32", 16, 32),
        ("v5e:2x4", "v5e:2x4", "v5e-8", 8, 8),
        ("v4:2x2x1", "v4:2x2x1", "v4-8", 4, 4),
        ("v5p:2x2x2", "v5p:2x2x2", "v5p-16", 8, 8),
    ],
)
def test_topology_names(name, libtpu_name, accelerator, chips, devices):
    require_libtpu()
    topo = plan_chips.topology(name)
    assert (topo.name, topo.accelerator, topo.chips, len(topo.devices)) == (libtpu_name, accelerator, chips, devices)
    assert topo.chip is plan_chips.CHIPS[accelerator.split("-")[0]]
    # libtpu's budget per device is within 1% of the published HBM (v5p: 95.74 of '95 GiB')
    assert 0.9 < topo.hbm_bytes_per_device / (topo.chip.hbm / topo.chip.devices_per_chip) < 1.01


def test_making_a_topology_leaves_the_environment_as_it_was(monkeypatch):
    """libtpu's settings are in the environment only while it makes the topology (a value already there kept):
    the process and the children it starts later see the environment they had, after a failure too."""
    require_libtpu()
    from jax.experimental import topologies

    for name in plan_chips.LIBTPU_ENVIRONMENT:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "127.0.0.1")  # the user's own
    seen, make = [], topologies.get_topology_desc
    watch = lambda *a, **k: seen.append({n: os.environ.get(n) for n in plan_chips.LIBTPU_ENVIRONMENT}) or make(*a, **k)
    monkeypatch.setattr(topologies, "get_topology_desc", watch)
    before = dict(os.environ)
    assert len(plan_chips.topology("v5e-4").devices) == 4
    assert dict(os.environ) == before
    assert seen == [
        {"ALLOW_MULTIPLE_LIBTPU_LOAD": "1", "TPU_ACCELERATOR_TYPE": "v5litepod-8", "TPU_WORKER_HOSTNAMES": "127.0.0.1"}
    ]
    with pytest.raises(JaxseqError, match="libtpu cannot make topology v5e:3x5"):
        plan_chips._abstract_devices("v5e:3x5", [3, 5], {})
    assert dict(os.environ) == before and len(seen) == 2


@pytest.mark.parametrize("name", ["v9-8", "tpu", "v5e", "v5e-3", "v4-6", "v5e:2x2x2", "v4:2x2", "v5e-512", "h100-8"])
def test_unknown_topology_is_one_line(name):
    with pytest.raises(JaxseqError) as error:
        plan_chips.topology(name)
    message = str(error.value)
    assert "\n" not in message and ("v5e-8" in message or f"{name[:2]}" in message)


def test_slice_shapes():
    assert [plan_chips._slice_shape(n, 2) for n in (1, 4, 8, 16, 32, 64, 128, 256)] == [
        [1, 1], [2, 2], [2, 4], [4, 4], [4, 8], [8, 8], [8, 16], [16, 16],
    ]  # fmt: skip
    assert [plan_chips._slice_shape(n, 3) for n in (4, 8, 16, 32, 64, 128, 256, 512)] == [
        [2, 2, 1], [2, 2, 2], [2, 2, 4], [2, 4, 4], [4, 4, 4], [4, 4, 8], [4, 8, 8], [8, 8, 8],
    ]  # fmt: skip
    assert plan_chips._slice_shape(12, 2) is None and plan_chips._slice_shape(2, 3) is None


def test_chip_table():
    assert {g: c.peak_flops for g, c in plan_chips.CHIPS.items()} == {
        "v3": 123e12, "v4": 275e12, "v5e": 197e12, "v5p": 459e12, "v6e": 918e12,
    }  # fmt: skip
    assert {g: c.hbm // GiB for g, c in plan_chips.CHIPS.items()} == {
        "v3": 32,
        "v4": 32,
        "v5e": 16,
        "v5p": 95,
        "v6e": 32,
    }
    assert plan_chips.CHIPS["v5e"].usable_hbm == int(15.75 * GiB)


# ---------------------------------------------------------------------------------------------- compiled plans

L, D, H, B = 4, 1024, 2048, 64  # layers, width, hidden, global batch


def mlp_step(mesh, layers=L, width=D, hidden=H, fsdp=True):
    """An fsdp-sharded MLP train step (scan over layers, bf16 compute, AdamW), lowered for the mesh."""
    spec1, spec2 = (P(None, "fsdp", None), P(None, None, "fsdp")) if fsdp else (P(), P())
    shard = {"w1": NamedSharding(mesh, spec1), "w2": NamedSharding(mesh, spec2)}
    shapes = {"w1": jax.ShapeDtypeStruct((layers, width, hidden), jnp.float32)}
    shapes["w2"] = jax.ShapeDtypeStruct((layers, hidden, width), jnp.float32)
    params = plan_compile.with_shardings(shapes, shard)
    optimizer = optax.adamw(1e-3)
    opt_shapes = jax.eval_shape(optimizer.init, shapes)
    replicated = NamedSharding(mesh, P())
    opt_shard = jax.tree_util.tree_map_with_path(
        lambda path, _: shard[path[-1].key] if hasattr(path[-1], "key") else replicated, opt_shapes
    )
    opt_state = plan_compile.with_shardings(opt_shapes, opt_shard)
    batch = jax.ShapeDtypeStruct((B, width), jnp.float32, sharding=NamedSharding(mesh, P(("dp", "fsdp"))))

    def loss(p, x):
        def layer(h, w):
            return jnp.tanh(h @ w[0].astype(jnp.bfloat16)) @ w[1].astype(jnp.bfloat16), None

        h, _ = jax.lax.scan(layer, x.astype(jnp.bfloat16), (p["w1"], p["w2"]))
        return jnp.mean(h.astype(jnp.float32) ** 2)

    def step(p, o, x):
        value, grads = jax.value_and_grad(loss)(p, x)
        updates, o = optimizer.update(grads, o, p)
        return optax.apply_updates(p, updates), o, value

    jitted = jax.jit(step, out_shardings=(shard, opt_shard, replicated), donate_argnums=(0, 1))
    return jitted.lower(params, opt_state, batch), params, opt_state, batch


KINDS = {"p": "parameters", "o": "optimizer state", "x": "batch"}  # mlp_step's step(p, o, x)


@pytest.fixture(scope="module")
def mlp_plan(v5e):
    mesh = make_mesh("fsdp=8", devices=v5e.devices)
    lowered, params, opt_state, batch = mlp_step(mesh)
    flops = 6.0 * 2 * L * D * H * B  # forward and backward of the two matmuls per layer
    plan = plan_compile.compile_plan(
        lowered, v5e, parameters=params, optimizer_state=opt_state, batch=batch, model_flops=flops, argument_kinds=KINDS
    )
    return plan, lowered


def test_plan_fields(mlp_plan):
    plan, _ = mlp_plan
    assert set(plan) == PLAN_FIELDS
    assert (plan["topology"], plan["accelerator"], plan["devices"]) == ("v5e:2x4", "v5e-8", 8)
    assert plan["mesh"] == {"dp": 1, "fsdp": 8, "mp": 1}
    assert plan["hbm_bytes_per_device"] == int(15.75 * GiB)
    assert plan["fits"] is True
    assert plan["attention_kernel"] == "xla"
    assert plan["estimate_method"].startswith("roofline from compiled HLO") and "\n" not in plan["estimate_method"]
    assert plan["compile_seconds"] > 0
    assert plan["jax_version"] == jax.__version__ and plan["libtpu_version"]
    json.dumps(plan)


def test_plan_memory(mlp_plan):
    memory = mlp_plan[0]["bytes_per_device"]
    n_params = 2 * L * D * H
    assert memory["parameters"] == n_params * 4 // 8  # f32 over fsdp=8, exactly
    assert 2 * memory["parameters"] <= memory["optimizer_state"] <= 2 * memory["parameters"] + 64  # mu, nu, count
    assert memory["batch"] == B * D * 4 // 8
    arguments = memory["parameters"] + memory["optimizer_state"] + memory["batch"]
    assert memory["temporaries"] > 0 and memory["total"] == arguments + memory["temporaries"]


def test_plan_roofline(mlp_plan):
    plan, lowered = mlp_plan
    flops = plan["compiled_flops_per_device"]
    assert flops == 3 * 2 * 2 * (B // 8) * D * H * L  # forward + backward matmuls of the local batch, L layers
    assert plan["model_flops_per_step"] == 6 * 2 * L * D * H * B
    assert plan["estimated_step_seconds"] > 0
    assert 0 < plan["estimated_mfu"] <= 1
    cost = hlo.hlo_cost(lowered.compile().as_text(), 8)
    # fsdp: every layer's weights are all-gathered (forward and backward) and the gradients reduce-scattered
    gathered = 2 * L * D * H * 2 * 7 / 8  # bf16 bytes of all layers' weights, (n-1)/n of them received
    assert 2 * gathered < cost.collective_bytes < 5 * gathered
    assert cost.hbm_bytes > 0 and cost.unknown_loops == 0


def test_replicated_step_has_no_weight_collectives(v5e):
    mesh = make_mesh("fsdp=8", devices=v5e.devices)
    lowered, *_ = mlp_step(mesh, layers=2, width=256, hidden=512, fsdp=False)
    cost = hlo.hlo_cost(lowered.compile().as_text(), 8)
    sharded, *_ = mlp_step(mesh, layers=2, width=256, hidden=512)
    assert cost.collective_bytes < hlo.hlo_cost(sharded.compile().as_text(), 8).collective_bytes


def test_flops_match_cost_analysis_without_loops(v5e):
    mesh = make_mesh("fsdp=8", devices=v5e.devices)
    x = jax.ShapeDtypeStruct((256, 512), jnp.bfloat16, sharding=NamedSharding(mesh, P("fsdp")))
    w = jax.ShapeDtypeStruct((512, 512), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
    compiled = jax.jit(lambda x, a, b: jnp.tanh(x @ a) @ b).lower(x, w, w).compile()
    flops = hlo.hlo_cost(compiled.as_text(), 8).flops
    assert flops == 2 * 2 * 32 * 512 * 512
    assert flops == pytest.approx(compiled.cost_analysis()["flops"], rel=0.01)


@pytest.mark.parametrize("steps", [2, 6])
def test_scan_counts_every_step(v5e, steps):
    mesh = make_mesh("fsdp=8", devices=v5e.devices)
    x = jax.ShapeDtypeStruct((256, 512), jnp.bfloat16, sharding=NamedSharding(mesh, P("fsdp")))
    ws = jax.ShapeDtypeStruct((steps, 512, 512), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
    scan = lambda x, ws: jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)[0]
    compiled = jax.jit(scan).lower(x, ws).compile()
    cost = hlo.hlo_cost(compiled.as_text(), 8)
    assert cost.flops == steps * 2 * 32 * 512 * 512 and cost.unknown_loops == 0
    assert compiled.cost_analysis()["flops"] < cost.flops  # XLA's own analysis counts a loop body once


SYNTHETIC_HLO = """HloModule synthetic, is_scheduled=true

%body.1 (p: (s32[], bf16[4,128,256], bf16[64,256])) -> (s32[], bf16[4,128,256], bf16[64,256]) {
  %p = (s32[], bf16[4,128,256]{2,1,0}, bf16[64,256]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  %stack = bf16[4,128,256]{2,1,0} get-tuple-element(%p), index=1
  %h = bf16[64,256]{1,0} get-tuple-element(%p), index=2
  %w = bf16[128,256]{1,0} fusion(%stack, %i), kind=kLoop, calls=%slice_layer
  %full = bf16[1024,256]{1,0} all-gather(%w), channel_id=7, replica_groups=mesh['x'=8] {'x'}, dimensions={0}
  %y = bf16[64,256]{1,0} fusion(%h, %full, %stack), kind=kOutput, calls=%matmul
  ROOT %t = (s32[], bf16[4,128,256]{2,1,0}, bf16[64,256]{1,0}) tuple(%next, %stack, %y)
}

%slice_layer (a: bf16[4,128,256], b: s32[]) -> bf16[128,256] {
  %a = bf16[4,128,256]{2,1,0} parameter(0)
  %b = s32[] parameter(1)
  %z = s32[] constant(0)
  %ds = bf16[1,128,256]{2,1,0} dynamic-slice(%a, %b, %z, %z), dynamic_slice_sizes={1,128,256}
  ROOT %r = bf16[128,256]{1,0} bitcast(%ds)
}

%matmul (x: bf16[64,256], w: bf16[1024,256], s: bf16[4,128,256]) -> bf16[64,256] {
  %x = bf16[64,256]{1,0} parameter(0)
  %w = bf16[1024,256]{1,0} parameter(1)
  %s = bf16[4,128,256]{2,1,0} parameter(2)
  %d = bf16[64,1024]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={1}
  ROOT %e = bf16[64,256]{1,0} dot(%d, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%cond.1 (q: (s32[], bf16[4,128,256], bf16[64,256])) -> pred[] {
  %q = (s32[], bf16[4,128,256]{2,1,0}, bf16[64,256]{1,0}) parameter(0)
  %k = s32[] get-tuple-element(%q), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%k, %n), direction=LT
}

%add (u: f32[], v: f32[]) -> f32[] {
  %u = f32[] parameter(0)
  %v = f32[] parameter(1)
  ROOT %s = f32[] add(%u, %v)
}

%reduce_scatter (g: f32[1024]) -> f32[128] {
  %g = f32[1024]{0} parameter(0)
  %ar = f32[1024]{0} all-reduce(%g), channel_id=9, replica_groups=[1,8]<=[8], to_apply=%add
  %pid = u32[] partition-id()
  ROOT %piece = f32[128]{0} dynamic-slice(%ar, %pid), dynamic_slice_sizes={128}
}

ENTRY %main (stack: bf16[4,128,256], h: bf16[64,256], g: f32[1024]) -> (bf16[64,256], f32[128]) {
  %stack = bf16[4,128,256]{2,1,0} parameter(0)
  %h = bf16[64,256]{1,0} parameter(1)
  %g = f32[1024]{0} parameter(2)
  %zero = s32[] constant(0)
  %init = (s32[], bf16[4,128,256]{2,1,0}, bf16[64,256]{1,0}) tuple(%zero, %stack, %h)
  %loop = (s32[], bf16[4,128,256]{2,1,0}, bf16[64,256]{1,0}) while(%init), condition=%cond.1, body=%body.1
  %out = bf16[64,256]{1,0} get-tuple-element(%loop), index=2
  %rs = f32[128]{0} fusion(%g), kind=kCustom, calls=%reduce_scatter
  ROOT %r = (bf16[64,256]{1,0}, f32[128]{0}) tuple(%out, %rs)
}
"""


def test_hlo_reader_on_a_written_module():
    """A scan of 4 layers with no known_trip_count (read off i < 4), per-layer weights sliced from a stack and
    all-gathered over a mesh axis, and XLA:TPU's reduce-scatter (all-reduce + dynamic-slice in one fusion)."""
    cost = hlo.hlo_cost(SYNTHETIC_HLO, 8)
    assert cost.flops == 4 * (2 * 64 * 256 * 1024 + 2 * 64 * 1024 * 256) and cost.unknown_loops == 0
    assert cost.collective_bytes == 4 * 1024 * 256 * 2 * 7 / 8 + 1024 * 4 * 7 / 8
    layer = 128 * 256 * 2  # the slice fusion reads one layer of the stack, not all four
    per_step = 2 * layer + (layer + 8 * layer) + (64 * 256 * 2 + 8 * layer + 64 * 256 * 2)
    assert cost.hbm_bytes == pytest.approx(4 * per_step + 128 * 4, abs=100)


def test_trip_count_on_cpu_hlo():
    """XLA:CPU writes known_trip_count on the while; the reader takes it from there."""
    x, ws = jax.ShapeDtypeStruct((8, 64), jnp.float32), jax.ShapeDtypeStruct((5, 64, 64), jnp.float32)
    scan = lambda x, ws: jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)[0]
    text = jax.jit(scan).lower(x, ws).compile().as_text()
    assert hlo.hlo_cost(text, 1).flops == 5 * 2 * 8 * 64 * 64


def test_peak_buffers_name_what_the_memory_holds(mlp_plan):
    """At the compiler's memory peak, every weight and optimizer moment is live: summed by kind, they are
    exactly the bytes their shard shapes give, and the largest buffers are named by their pytree paths."""
    plan, _ = mlp_plan
    peak, memory = plan["peak_buffers"], plan["bytes_per_device"]
    assert peak["by_kind"]["parameters"] == memory["parameters"]
    assert peak["by_kind"]["optimizer state"] == memory["optimizer_state"]
    assert memory["parameters"] + memory["optimizer_state"] < peak["live_bytes"] <= memory["total"]
    largest = peak["largest"]
    assert len(largest) == buffers.PEAK_BUFFERS and [b["bytes"] for b in largest] == sorted(
        (b["bytes"] for b in largest), reverse=True
    )
    named = {b["holds"]: (b["kind"], b["shape"], b["bytes"]) for b in largest}
    assert named["p w1"] == ("parameters", "f32[4,128,2048]", L * D * H * 4 // 8)  # w1's fsdp shard
    assert named["o 0/nu/w2"] == ("optimizer state", "f32[4,2048,128]", L * D * H * 4 // 8)
    assert {b["kind"] for b in largest} >= {"backward", "forward activations"}  # the step's own buffers
    table = report.format_table(plan)
    assert re.search(r"^  at the peak +[\d.]+ GiB live: .*optimizer state 0\.02", table, re.M)


def test_over_budget_is_refused(v5e):
    mesh = make_mesh("fsdp=8", devices=v5e.devices)
    lowered, params, opt_state, batch = mlp_step(mesh, layers=2, width=16384, hidden=32768, fsdp=False)
    plan = plan_compile.compile_plan(
        lowered, v5e, parameters=params, optimizer_state=opt_state, batch=batch, argument_kinds=KINDS
    )
    assert set(plan) == PLAN_FIELDS and plan["fits"] is False
    memory = plan["bytes_per_device"]
    assert memory["parameters"] == 2 * 2 * 16384 * 32768 * 4  # replicated: whole on every device
    assert memory["total"] > plan["hbm_bytes_per_device"]
    assert memory["total"] == sum(memory[k] for k in ("parameters", "optimizer_state", "batch", "temporaries"))
    assert plan["estimated_step_seconds"] is None and plan["attention_kernel"] == "xla"
    line = report.refusal(plan)
    assert "\n" not in line and line.startswith(f"needs {memory['total'] / GiB:.2f} GiB per chip of 15.75 GiB on v5e-8")
    assert "LoRA" in line and line.split("; try: ")[1].count(",") <= 2  # the training state is what is too big
    # what it is, from the buffers live at the (refused) program's peak
    assert plan["peak_buffers"]["by_kind"]["parameters"] == memory["parameters"]
    assert "(at the peak: optimizer state 16.00 GiB, " in line
    assert report.refusal(plan, ["--remat full"]).endswith("; try: --remat full")
    assert "LoRA" not in report.refusal(plan, lora=True)  # a LoRA run is not told to use LoRA


def test_total_is_the_compilers_peak(v5e):
    """Arguments + outputs - aliased + temp counts a donated state twice: by that sum this step needs 15.77 GiB of
    15.75 and yet it compiles. The plan's total is the compiler's peak, the figure libtpu holds to the budget."""
    mesh = make_mesh("fsdp=8", devices=v5e.devices)
    lowered, params, opt_state, batch = mlp_step(mesh, layers=42, width=4096, hidden=16384)
    plan = plan_compile.compile_plan(lowered, v5e, parameters=params, optimizer_state=opt_state, batch=batch)
    stats = lowered.compile().memory_analysis()
    naive = stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes
    assert naive + stats.temp_size_in_bytes > plan["hbm_bytes_per_device"]
    assert plan["fits"] and plan["bytes_per_device"]["total"] == stats.peak_memory_in_bytes


def test_other_compile_errors_propagate():
    class Broken:
        def compile(self, compiler_options=None):
            raise ValueError("INVALID_ARGUMENT: something else")

    with pytest.raises(ValueError, match="something else"):
        plan_compile.compile_plan(Broken(), None, parameters={})


def test_out_of_memory_messages():
    parse = plan_compile._out_of_memory
    needed = parse("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries "
                   "(18.00G) exceeds available HBM (15.75G).")  # fmt: skip
    assert needed == 18 * GiB
    assert parse("RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm. Used 20.50G of 15.75G hbm.") == int(
        20.5 * GiB
    )
    assert parse("INVALID_ARGUMENT: bad") is None


# ---------------------------------------------------------------------------------------------- attention kernels


def test_splash_kernel_is_found(v5e):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    heads, length, head_dim = 2, 256, 128
    mask = masks.MultiHeadMask([masks.CausalMask((length, length)) for _ in range(heads)])
    kernel = splash.make_splash_mha(mask, head_shards=1, q_seq_shards=1)
    mesh = make_mesh("dp=1", devices=v5e.devices[:1])
    q = jax.ShapeDtypeStruct((heads, length, head_dim), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
    lowered = jax.jit(kernel).lower(q, q, q)
    plan = plan_compile.compile_plan(lowered, v5e, parameters=q)
    assert plan["attention_kernel"] == "splash"
    assert "custom kernels" in plan["estimate_method"]
    assert hlo.attention_kernel(lowered.as_text()) == "splash"  # kernel_name in StableHLO, for refused plans


def test_plain_attention_is_xla(v5e):
    mesh = make_mesh("dp=1", devices=v5e.devices[:1])
    q = jax.ShapeDtypeStruct((2, 256, 128), jnp.bfloat16, sharding=NamedSharding(mesh, P()))

    def attention(q, k, v):
        weights = jax.nn.softmax(jnp.einsum("hqd,hkd->hqk", q, k) / math.sqrt(q.shape[-1]), axis=-1)
        return jnp.einsum("hqk,hkd->hqd", weights, v)

    compiled = jax.jit(attention).lower(q, q, q).compile()
    # XLA:TPU folds softmax(.)V into its own "online-softmax" Mosaic kernel: still XLA's attention, not splash
    assert hlo.attention_kernel(compiled.as_text()) == "xla"
    cost = hlo.hlo_cost(compiled.as_text(), 1)
    # QK^T is a convolution with the heads as a dilated spatial dim; count only the taps that hit real input
    assert cost.flops == 2 * 2 * 256 * 256 * 128 and cost.custom_kernels == 1


def test_cudnn_attention_is_named():
    text = 'custom-call(%q, %k, %v), custom_call_target="__cudnn$fmhaSoftmax"'
    assert hlo.attention_kernel(text) == "cudnn"


# ---------------------------------------------------------------------------------------------- output


def fake_plan(**overrides):
    plan = {
        "topology": "v5e:2x4", "accelerator": "v5e-8", "devices": 8, "mesh": {"dp": 1, "fsdp": 8, "mp": 1},
        "hbm_bytes_per_device": int(15.75 * GiB),
        "bytes_per_device": {"parameters": 2 * GiB, "optimizer_state": 4 * GiB, "batch": GiB // 2,
                             "temporaries": 3 * GiB, "total": 9.5 * GiB},
        "fits": True, "model_flops_per_step": 1e15, "compiled_flops_per_device": 1.3e14,
        "estimated_step_seconds": 1.0, "estimated_mfu": 0.63, "estimate_method": "roofline from compiled HLO: x",
        "attention_kernel": "splash", "compile_seconds": 12.0, "jax_version": "0.10.2", "libtpu_version": "0.0.42",
    }  # fmt: skip
    plan.update(overrides)
    return plan


def test_format_table():
    table = report.format_table(fake_plan())
    assert "v5e-8" in table and "9.50 GiB of 15.75 GiB" in table and "fits" in table
    assert "1000.00 ms" in table and "63.0 %" in table and "splash" in table
    refused = report.format_table(fake_plan(fits=False, estimated_step_seconds=None, estimated_mfu=None))
    assert "DOES NOT FIT" in refused


def test_write_plan_is_atomic_json(tmp_path):
    path = tmp_path / "out" / "plan.json"
    report.write_plan(path, fake_plan())
    assert json.loads(path.read_text())["accelerator"] == "v5e-8"
    assert [p.name for p in path.parent.iterdir()] == ["plan.json"]


def test_derived_suggestions():
    memory = {"parameters": 8 * GiB, "optimizer_state": 16 * GiB, "batch": GiB, "temporaries": 4 * GiB}
    state_bound = fake_plan(mesh={"dp": 8, "fsdp": 1, "mp": 1}, bytes_per_device={**memory, "total": 29 * GiB})
    expected = "needs 29.00 GiB per chip of 15.75 GiB on v5e-8; try: more fsdp (fsdp=8), LoRA, Adafactor"
    assert report.refusal(state_bound) == expected
    memory = {"parameters": GiB, "optimizer_state": 2 * GiB, "batch": GiB, "temporaries": 20 * GiB, "total": 24 * GiB}
    activation_bound = fake_plan(bytes_per_device=memory)
    assert report.refusal(activation_bound).endswith("try: --remat full, a smaller batch, a bigger topology (v5e-16)")
    assert report.refusal(activation_bound, remat="full").endswith("try: a smaller batch, a bigger topology (v5e-16)")
    no_optimizer = {**memory, "parameters": 22 * GiB, "optimizer_state": 0, "temporaries": GiB}
    assert report._suggestions(fake_plan(bytes_per_device=no_optimizer)) == ["LoRA", "a bigger topology (v5e-16)"]
    one_chip = fake_plan(
        accelerator="v5e-1", devices=1, mesh={"dp": 1, "fsdp": 1, "mp": 1}, bytes_per_device=no_optimizer
    )
    assert report._suggestions(one_chip) == ["LoRA", "a bigger topology (v5e-4)"]  # there is no v5e-2


def test_cpu_compiler_options_stay_off_tpu_programs(v5e):
    from jaxseq.train.step import CPU_COMPILER_OPTIONS, compiler_options

    def shardings(devices):
        return {"w": NamedSharding(make_mesh("fsdp=8", devices=devices), P("fsdp"))}

    assert compiler_options(shardings(jax.devices())) == CPU_COMPILER_OPTIONS  # the suite's 8 CPU devices
    assert compiler_options(shardings(v5e.devices)) is None


def test_dropout_keys_follow_the_platform(v5e):
    """Dropout bits from Threefry-4x32 on CPU, where JAX's threefry2x32 is a slow rolled loop (its keys derived
    by threefry2x32, ``THREEFRY4X32_BITS``); from JAX's threefry2x32 alone in TPU programs, where XLA keeps
    Threefry-4x32's bits through remat (``dropout_prng``)."""
    from flax import nnx
    from transformers import BertConfig

    from jaxseq.data.glue import TASKS
    from jaxseq.models.bert import BertForSequenceClassification
    from jaxseq.train.feeding import abstract_batch
    from jaxseq.train.objectives import SequenceClassification
    from jaxseq.train.optim import OptimizerConfig
    from jaxseq.train.step import TrainProgram

    config = BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, num_labels=2
    )
    row = dict.fromkeys(("input_ids", "attention_mask", "token_type_ids"), ((16,), jnp.int32))
    cpu, tpu = (jax.devices(), ["threefry4x32", "threefry2x32"], []), (v5e.devices, ["threefry2x32"], ["threefry4x32"])
    platforms = [cpu, tpu]
    for devices, used, unused in platforms:
        mesh = make_mesh("dp=8", devices=devices)
        model = nnx.eval_shape(lambda: BertForSequenceClassification(config, rngs=nnx.Rngs(0)))
        task = SequenceClassification(TASKS["sst2"])
        program = TrainProgram(model, task, mesh, OptimizerConfig(), total_steps=10, seed=0)
        batch = abstract_batch(mesh, 8, {**row, "labels": ((), jnp.int32)})
        text = program.step.lower(program.abstract_state, None, batch).as_text()
        assert all(name in text for name in used) and not any(name in text for name in unused)
