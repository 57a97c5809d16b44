"""``--plan_search``: which run to launch on a TPU slice. It enumerates how the same run could be laid out (the mesh
split into dp/fsdp/mp, ep for a mixture of experts and cp for a model that splits its rows' tokens, the remat
policy, the micro-batch with gradient accumulation for the same global batch, the attention kernel, the causal LM's
loss chunks), prunes them with an analytic model of memory and step time, compiles the most promising with the
real TPU compiler (each a plan of the run in its own process, several at once where the host has cores), ranks them
by the compiled plan's estimated step time, and writes the fastest that fits as a YAML ``--config`` for the same
command (``OUTPUT_DIR/best_plan.yaml``) with its ``plan.json``.

The analytic model only orders and prunes; every figure in the ranked table of a compiled candidate is the
compiler's (memory) or the compiled program's roofline (time)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from flax import nnx

from jaxseq.config import save_config
from jaxseq.errors import JaxseqError
from jaxseq.mesh import format_mesh
from jaxseq.models.attention import splits_sequence
from jaxseq.models.layers import EXPERTS
from jaxseq.models.registry import model_flops
from jaxseq.plan.chips import GiB, Topology
from jaxseq.train.objectives import DEFAULT_CHUNK_TOKENS

MEMORY_SLACK = 1.25  # the memory model may be this far under the compiler's figure: prune only beyond it
REMATS = ("none", "dots", "full")
COMPILE_TIMEOUT = 1800.0
"""Seconds a candidate's plan may take (a large model's step compiles in minutes): past it the process is stopped,
the candidate ranked as timed out, and the search goes on with the others."""


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One layout of the run: its mesh, remat policy, micro-batch per device and accumulation steps (their
    product times the data shards is the run's global batch), attention kernel and loss chunk (None: the
    job has no such flag)."""

    mesh: tuple[int, int, int]  # dp, fsdp, mp
    remat: str
    micro_batch: int
    accumulation: int
    attention: str
    loss_chunk_tokens: int | None = None
    ep: int = 1  # a mixture of experts' experts split this many ways (the batch too, as dp)
    cp: int = 1  # each row's tokens split this many ways (a cp group shares its rows)

    @property
    def mesh_spec(self) -> str:
        sizes = dict(zip(("dp", "fsdp", "mp"), self.mesh), ep=self.ep, cp=self.cp)
        return format_mesh(sizes)

    def flags(self) -> list[str]:
        flags = ["--mesh", self.mesh_spec, "--remat", self.remat, "--attention", self.attention]
        flags += ["--per_device_train_batch_size", str(self.micro_batch)]
        flags += ["--gradient_accumulation_steps", str(self.accumulation)]
        if self.loss_chunk_tokens is not None:
            flags += ["--loss_chunk_tokens", str(self.loss_chunk_tokens)]
        return flags

    def describe(self) -> str:
        chunk = "" if self.loss_chunk_tokens is None else f" chunk {'auto' if self.loss_chunk_tokens < 0 else 'off'}"
        return (
            f"{self.mesh_spec:<16} {self.remat:<5} {self.micro_batch:>3} x {self.accumulation:<3} "
            f"{self.attention:<5}{chunk}"
        )


@dataclasses.dataclass(frozen=True)
class Shape:
    """What the analytic model needs of the run: parameters (trained and frozen), layers, width, heads,
    vocabulary, tokens per example, rows per global batch, and the model FLOPs of one step (the family's own
    count, ``models.registry.model_flops``, as a plan's MFU)."""

    trained: int
    frozen: int
    layers: int
    width: int
    heads: int
    vocab: int
    seq_len: int
    global_rows: int
    step_flops: float
    expert_params: int = 0  # of the parameters above, the experts' (split over ep)
    experts: int = 0
    splits_sequence: bool = False  # the model runs under a cp mesh (``attention.split_sequence``)


def candidates(shape: Shape, devices: int, *, chunked: bool) -> list[Candidate]:
    """Every layout of ``devices`` chips for ``shape``'s global batch: mp a power of two dividing the heads
    (at most 8), the data shards split all-fsdp, all-dp or half and half (with experts, also ep: a power of
    two dividing them and the shards, the rest split so; for a model that splits its sequence, also cp: a power
    of two whose 2 x cp chunks divide the row, sharing each data shard's rows), micro-batches the powers of two
    dividing each shard's rows."""
    out = []
    cps = [c for c in (1, 2, 4, 8) if c == 1 or (shape.splits_sequence and shape.seq_len % (2 * c) == 0)]
    for mp, cp in _product([m for m in (1, 2, 4, 8) if shape.heads % m == 0], cps):
        if devices % (mp * cp):
            continue
        shards = devices // (mp * cp)
        if shape.global_rows % shards:
            continue
        rows = shape.global_rows // shards
        eps = [e for e in (1, 2, 4, 8) if shards % e == 0 and (e == 1 or (shape.experts and shape.experts % e == 0))]
        splits = set()
        for ep in eps:
            rest = shards // ep
            splits |= {(1, rest, ep), (rest, 1, ep)} | ({(2, rest // 2, ep)} if rest >= 4 else set())
        micros = [m for m in (1, 2, 4, 8, 16, 32, 64, 128) if m <= rows and rows % m == 0]
        for (dp, fsdp, ep), remat, micro, attention in _product(sorted(splits), REMATS, micros, ("auto", "xla")):
            for chunk in (-1, 0) if chunked else (None,):
                out.append(Candidate((dp, fsdp, mp), remat, micro, rows // micro, attention, chunk, ep, cp))
    return out


def _product(*lists):
    if not lists:
        yield ()
        return
    for item in lists[0]:
        for rest in _product(*lists[1:]):
            yield (item, *rest)


def estimate(c: Candidate, shape: Shape, topo: Topology) -> tuple[float, float]:
    """(bytes per device, seconds per step) by a coarse analytic model: float32 weights and AdamW moments
    (12 bytes a trained parameter, 4 a frozen one, split over fsdp x mp) with float32 gradients; bf16
    activations per Korthikanti et al. 2022 (34 s h + 5 a s^2 bytes a token-layer without remat; the dots
    policy keeps about a third; full remat, the block inputs and one block's working set); float32 logits
    (or the loss's chunks of ``DEFAULT_CHUNK_TOKENS``). Time: the step's model FLOPs at the chip's peak (a
    third more with full remat, a sixth with dots, for the forward pass computed again), plus fsdp's gathers
    per micro-step, mp's all-reduces per layer, cp's key/value gathers per layer (and their gradients' reduction;
    each device holding 1/cp of every row's tokens) and dp's gradient all-reduce over ICI."""
    dp, fsdp, mp = c.mesh
    ep, cp, chip = c.ep, c.cp, topo.chip
    weights = shape.trained * 12 + shape.frozen * 4 + shape.trained * 4
    experts = weights * shape.expert_params / (shape.trained + shape.frozen)  # their share, split over ep too
    state = (weights - experts) / (fsdp * mp) + experts / (fsdp * mp * ep)
    row_tokens = c.micro_batch * shape.seq_len
    tokens = row_tokens // cp  # a device's share
    width, layers = shape.width, shape.layers
    attention_scores = 0 if c.attention == "auto" else 5 * shape.heads * shape.seq_len / mp
    per_layer = tokens * (34 * width / mp + attention_scores)
    kept = {"none": per_layer * layers, "dots": per_layer * layers / 3, "full": tokens * width * 2 * layers}[c.remat]
    working = per_layer if c.remat == "full" else 0
    logits = (tokens if not c.loss_chunk_tokens else min(tokens, DEFAULT_CHUNK_TOKENS)) * shape.vocab * 4 / mp
    memory = state + kept + working + logits
    params = shape.trained + shape.frozen
    forward_backward = 8 if c.remat == "full" else (7 if c.remat == "dots" else 6)
    devices = dp * fsdp * ep * cp * mp
    compute = shape.step_flops * forward_backward / 6 / (devices * chip.peak_flops)
    ici = chip.ici_bandwidth / 2
    gathers = 3 * params * 2 * (fsdp - 1) / fsdp / mp / ep * c.accumulation if fsdp > 1 else 0
    reductions = 4 * layers * tokens * width * 2 * (mp - 1) / mp * c.accumulation if mp > 1 else 0
    exchange = 4 * layers * tokens * ep * width * 2 * (ep - 1) / ep * c.accumulation  # experts' tokens
    context = 3 * 2 * layers * row_tokens * width * 2 * (cp - 1) / cp / mp * c.accumulation  # keys and values
    gradients = 2 * shape.trained * 4 / (fsdp * mp) if dp * ep * cp > 1 else 0
    return memory, compute + (gathers + reductions + exchange + context + gradients) / ici


def shape_of(spec, prepared, global_rows: int) -> Shape:
    """The analytic model's view of a run (its abstract model's parameter count, config sizes)."""
    model = spec.abstract_model()
    flat = list(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    count = sum(math.prod(v.get_value().shape) for _, v in flat)
    experts = sum(math.prod(v.get_value().shape) for path, v in flat if EXPERTS in path)
    config = spec.config
    lora = spec.lora is not None and spec.lora.enabled
    layers = config.num_hidden_layers + getattr(config, "num_decoder_layers", 0) * (config.model_type == "t5")
    return Shape(
        trained=0 if lora else count,
        frozen=count if lora else 0,
        layers=layers,
        width=config.hidden_size,
        heads=config.num_attention_heads,
        vocab=config.vocab_size,
        seq_len=prepared.seq_len + prepared.target_len,
        global_rows=global_rows,
        step_flops=model_flops(config, spec.task, global_rows, prepared.seq_len, prepared.target_len),
        expert_params=experts,
        experts=getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None) or 0,
        splits_sequence=splits_sequence(model),
    )


def search(
    module: str,
    argv: list[str],
    sections: dict,
    shape: Shape,
    topo: Topology,
    output_dir: Path,
    *,
    chunked: bool,
    compiles: int = 6,
    timeout: float = COMPILE_TIMEOUT,
    say: Callable[[str], None] = print,
) -> dict:
    """Search the layouts of the run of ``module``'s ``main(argv)`` (its saved config ``sections`` by name) on
    ``topo``, compiling the ``compiles`` most promising layouts, each within ``timeout`` seconds; write
    ``output_dir/best_plan.yaml`` and ``output_dir/plan.json`` of the fastest that fits and return its plan; one
    line (a JaxseqError) when none fits."""
    hbm = topo.hbm_bytes_per_device
    scored = [(c, *estimate(c, shape, topo)) for c in candidates(shape, len(topo.devices), chunked=chunked)]
    if not scored:
        raise JaxseqError(
            f"no layout of {len(topo.devices)} devices divides the global batch of {shape.global_rows} rows; "
            "pick a --per_device_train_batch_size and --gradient_accumulation_steps whose product times the "
            "data shards is divisible by the devices"
        )
    promising = sorted((s for s in scored if s[1] <= hbm * MEMORY_SLACK), key=lambda s: s[2])
    chosen = promising[: max(compiles, 1)] or sorted(scored, key=lambda s: s[1])[:1]
    say(
        f"plan search on {topo.accelerator}: {len(scored)} layouts of global batch {shape.global_rows} x "
        f"{shape.seq_len} tokens, {len(scored) - len(promising)} refused by the memory model, compiling the "
        f"{len(chosen)} fastest by it"
    )
    base = _strip(argv)
    workers = max(1, min(len(chosen), (os.cpu_count() or 2) // 2))
    with tempfile.TemporaryDirectory(prefix="jaxseq-plan-search-") as scratch, ThreadPoolExecutor(workers) as pool:

        def compile_all(layouts, start=0):
            jobs = [(c, Path(scratch) / f"candidate-{start + i}") for i, c in enumerate(layouts)]
            results = pool.map(lambda job: _compile(module, base, *job, timeout), jobs)
            return [(c, plan, failure, folder) for (c, folder), (plan, failure) in zip(jobs, results)]

        rows = compile_all([c for c, _, _ in chosen])
        if not any(r[1] is not None and r[1]["fits"] for r in rows):  # the time model's picks were too big:
            tried = {c for c, _, _ in chosen}  # the smallest by the memory model next
            smallest = [c for c, _, _ in sorted(scored, key=lambda s: s[1]) if c not in tried][: max(compiles, 1)]
            say(f"none of them fits: compiling the {len(smallest)} smallest by the memory model")
            rows += compile_all(smallest, len(rows))
            chosen = chosen + [(c, 0, 0) for c in smallest]
        folders = {r[0]: r[3] for r in rows}
        rows = [r[:3] for r in rows]
        fitting = [r for r in rows if r[1] is not None and r[1]["fits"]]
        fitting.sort(key=lambda r: r[1]["estimated_step_seconds"] or math.inf)
        say(_table(rows, fitting, scored, chosen, hbm))
        if not any(plan is not None for _, plan, _ in rows):
            raise JaxseqError(
                f"none of the {len(rows)} layouts compiled for {topo.accelerator} (the first: {rows[0][2]}); plan "
                "one with --compile_topology alone to see why"
            )
        if not fitting:
            best_refused = min((r for r in rows if r[1] is not None), default=None, key=_total)
            need = f"; the closest needs {_total(best_refused) / GiB:.2f} GiB" if best_refused else ""
            raise JaxseqError(
                f"no layout of this run fits {topo.accelerator} ({hbm / GiB:.2f} GiB per chip){need}; try LoRA, a "
                "smaller global batch or a bigger topology"
            )
        best, plan, _ = fitting[0]
        output_dir.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(folders[best] / "plan.json", output_dir / "plan.json")
    save_config(output_dir / "best_plan.yaml", *_with(sections, best).values())
    say(
        f"fastest that fits: {best.describe().strip()} ({plan['bytes_per_device']['total'] / GiB:.2f} GiB, "
        f"{plan['estimated_step_seconds'] * 1e3:.1f} ms); wrote {output_dir / 'best_plan.yaml'} (run it with "
        f"--config {output_dir / 'best_plan.yaml'}) and {output_dir / 'plan.json'}"
    )
    return plan


def _strip(argv: list[str]) -> list[str]:
    """``argv`` without the search's flags (--plan_search, with a value it was given) and --output_dir (each
    candidate has its own)."""
    out, skip = [], False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in ("--plan_search", "--plan_search_compiles", "--plan_search_timeout", "--output_dir"):
            has_value = "=" not in arg and i + 1 < len(argv) and not argv[i + 1].startswith("--")
            skip = has_value and (name != "--plan_search" or argv[i + 1].lower() in ("true", "false"))
            continue
        out.append(arg)
    return out


def _compile(
    module: str, argv: list[str], candidate: Candidate, folder: Path, timeout: float = COMPILE_TIMEOUT
) -> tuple[dict | None, str | None]:
    """Plan one candidate in its own process, stopped after ``timeout`` seconds: (its plan.json, None) or (None,
    why it has none). The process loads libtpu beside the search's own (``ALLOW_MULTIPLE_LIBTPU_LOAD``)."""
    code = f"import sys; from {module} import main; sys.exit(main(sys.argv[1:]))"
    cmd = [sys.executable, "-c", code, *argv, *candidate.flags(), "--output_dir", str(folder)]
    env = {**os.environ, "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:  # the process is killed; a plan it wrote before it hung still counts
        result = None
    path = folder / "plan.json"
    if path.is_file():
        return json.loads(path.read_text()), None
    if result is None:
        return None, f"compile timed out after {timeout:g} s"
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    return None, "compile failed: " + (lines[-1] if lines else f"exit code {result.returncode}")[:160]


def _total(row) -> float:
    return row[1]["bytes_per_device"]["total"] if row is not None and row[1] is not None else math.inf


def _table(rows, fitting, scored, chosen, hbm) -> str:
    """The ranked table: compiled candidates, fastest fitting first, then those refused and why."""
    order = fitting + [r for r in rows if r not in fitting]
    lines = [f"  {'rank':<5} {'mesh':<16} {'remat':<5} {'micro x accum':<13} {'attention':<12} {'memory':>12} "
             f"{'step':>10} {'MFU':>6}  verdict"]  # fmt: skip
    for i, (c, plan, failure) in enumerate(order):
        rank = str(i + 1) if (c, plan, failure) in fitting else "-"
        if plan is None:
            lines.append(f"  {rank:<5} {c.describe():<50} {failure}")
            continue
        total = plan["bytes_per_device"]["total"] / GiB
        step = plan["estimated_step_seconds"]
        mfu = plan["estimated_mfu"]
        verdict = "fits" if plan["fits"] else f"needs {total:.2f} of {hbm / GiB:.2f} GiB"
        lines.append(
            f"  {rank:<5} {c.describe():<50} {total:>8.2f} GiB "
            f"{'-' if step is None else f'{step * 1e3:.1f} ms':>10} {'-' if mfu is None else f'{mfu:.0%}':>6}  "
            f"{verdict}"
        )
    refused = len(scored) - len([s for s in scored if s[1] <= hbm * MEMORY_SLACK])
    skipped = len(scored) - refused - len(chosen)
    lines.append(
        f"  ({refused} layouts refused by the memory model (over {MEMORY_SLACK:.0%} of HBM), {skipped} slower by "
        f"its time model, not compiled)"
    )
    return "\n".join(lines)


def _with(sections: dict, c: Candidate) -> dict:
    """The run's saved config sections (by name) with ``c``'s layout, for best_plan.yaml."""
    out = {}
    for name, section in sections.items():
        changes = {}
        fields = {f.name for f in dataclasses.fields(section)}
        values = {
            "mesh": c.mesh_spec,
            "remat": c.remat,
            "attention": c.attention,
            "per_device_train_batch_size": c.micro_batch,
            "gradient_accumulation_steps": c.accumulation,
            "loss_chunk_tokens": c.loss_chunk_tokens,
        }
        for key, value in values.items():
            if key in fields and value is not None:
                changes[key] = value
        out[name] = dataclasses.replace(section, **changes) if changes else section
    return out
