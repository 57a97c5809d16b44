"""A plan as people read it: the printed table, ``plan.json``, and the one line a refused plan ends with."""

from __future__ import annotations

import json
import os

from jaxseq.files import atomic_write
from jaxseq.plan.buffers import PEAK_SHOWN
from jaxseq.plan.chips import GiB


def format_table(plan: dict) -> str:
    """A few lines for the terminal: memory per device in GiB, step time, MFU, attention kernel, layers."""
    memory, hbm = plan["bytes_per_device"], plan["hbm_bytes_per_device"]
    mesh = " ".join(f"{k}={v}" for k, v in plan["mesh"].items())
    rows = [f"plan for {plan['accelerator']} ({plan['topology']}, {plan['devices']} devices, mesh {mesh})"]
    for key in ("parameters", "optimizer_state", "batch", "temporaries"):
        rows.append(f"  {key.replace('_', ' '):<17}{memory[key] / GiB:9.2f} GiB")
    verdict = "fits" if plan["fits"] else "DOES NOT FIT"
    rows.append(f"  {'total':<17}{memory['total'] / GiB:9.2f} GiB of {hbm / GiB:.2f} GiB per device: {verdict}")
    step, mfu = plan["estimated_step_seconds"], plan["estimated_mfu"]
    rows.append(f"  {'step time':<17}{step * 1e3:9.2f} ms" if step is not None else f"  {'step time':<17}{'-':>9}")
    rows.append(f"  {'MFU':<17}{mfu * 100:8.1f} %" if mfu is not None else f"  {'MFU':<17}{'-':>9}")
    rows.append(f"  {'attention':<17}{plan['attention_kernel'] or '-':>9}")
    if "layers" in plan:  # scanned or unrolled (a run's plan: runner.plan)
        rows.append(f"  {'layers':<17}{plan['layers']:>9}")
    rows.append(f"  ({plan['estimate_method']})")
    peak = plan.get("peak_buffers")
    if peak:
        kinds = ", ".join(f"{kind} {size / GiB:.2f}" for kind, size in list(peak["by_kind"].items())[:6])
        rows.append(f"  {'at the peak':<17}{peak['live_bytes'] / GiB:9.2f} GiB live: {kinds} GiB")
        for i, buffer in enumerate(peak["largest"][:PEAK_SHOWN]):
            holds = buffer["holds"] if len(buffer["holds"]) <= 60 else "..." + buffer["holds"][-57:]
            label = "largest" if i == 0 else ""
            rows.append(f"  {label:<17}{buffer['bytes'] / GiB:9.2f} GiB {buffer['shape']} {buffer['kind']}: {holds}")
    return "\n".join(rows)


def write_plan(path, plan: dict) -> None:
    """``plan`` as JSON at ``path``, written whole or not at all."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    atomic_write(path, json.dumps(plan, indent=2) + "\n")


def refusal(plan: dict, suggestions: list[str] | None = None, *, remat: str | None = None, lora: bool = False) -> str:
    """One line: ``needs 21.30 GiB per chip of 15.75 GiB on v5e-8; try: ...`` (up to 3 suggestions; ``remat``:
    the run's policy, so that a run already at ``full`` is not told to use it; ``lora``: the run trains LoRA
    already, so it is not told to)."""
    memory, hbm = plan["bytes_per_device"], plan["hbm_bytes_per_device"]
    unit = "core" if plan["accelerator"].startswith("v3") else "chip"
    tips = list(suggestions) if suggestions is not None else _suggestions(plan, remat, lora)
    line = f"needs {memory['total'] / GiB:.2f} GiB per {unit} of {hbm / GiB:.2f} GiB on {plan['accelerator']}"
    peak = plan.get("peak_buffers")
    if peak:  # what the memory is, so the user knows what to change
        line += " (at the peak: " + ", ".join(f"{k} {v / GiB:.2f} GiB" for k, v in list(peak["by_kind"].items())[:3])
        line += ")"
    return line + (f"; try: {', '.join(tips[:3])}" if tips else "")


def _suggestions(plan: dict, remat: str | None = None, lora: bool = False) -> list[str]:
    """What to change, led by what takes the memory: the training state (weights + optimizer) or activations."""
    memory, mesh = plan["bytes_per_device"], plan["mesh"]
    state = memory["parameters"] + memory["optimizer_state"]
    data_devices = plan["devices"] // max(mesh.get("mp", 1), 1)
    shard = [f"more fsdp (fsdp={data_devices})"] if mesh and mesh.get("fsdp", 1) < data_devices else []
    if state > memory["temporaries"]:
        adafactor = ["Adafactor"] if memory["optimizer_state"] > memory["parameters"] else []
        tips = shard + ([] if lora else ["LoRA"]) + adafactor
    else:
        tips = (["--remat full"] if remat != "full" else []) + ["a smaller batch", *shard]
    generation, _, count = plan["accelerator"].partition("-")
    bigger = int(count) * 2 if int(count) > 1 else 4  # Cloud TPU has no two-chip slice (no v5e-2)
    return [*tips, f"a bigger topology ({generation}-{bigger})"][:3]
