"""What every script shares, in the order a run goes: ``parse`` its flag sections (YAML, then flags), ``start``
the JAX runtime (multi-host, compilation cache, mesh), and ``finish`` a training run (results, plot, export,
Hub push); ``script`` turns errors into one line and a non-zero exit."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import sys
from pathlib import Path

import jax

from jaxseq.config import arg, build_parser, parse_args
from jaxseq.distributed import DistributedConfig, initialize
from jaxseq.errors import JaxseqError, first_line
from jaxseq.hub_push import HubConfig, push_run
from jaxseq.mesh import make_mesh
from jaxseq.train.results import export_model, write_results

DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass
class RuntimeConfig:
    """How a script runs, whatever it trains."""

    mesh: str = arg(
        "", "device mesh, e.g. 'dp=2,mp=4' or 'fsdp=2,cp=4' (axes dp, fsdp, ep, cp, mp; default: all devices on dp)"
    )
    dtype: str = arg(
        "float32",
        "compute dtype; parameters stay float32 (float16 adds dynamic loss scaling)",
        choices=DTYPES,
        switches={"bf16": "bfloat16", "fp16": "float16"},
    )
    compilation_cache_dir: str | None = arg(None, "persistent XLA cache (default ~/.cache/jaxseq/xla; '' disables)")


@dataclasses.dataclass
class PlanConfig:
    """Plan a run before renting the chips."""

    compile_topology: str | None = arg(
        None,
        "plan instead of training: compile this run's exact train step for a Cloud TPU slice (v5e-8, v5e-4, "
        "v6e-8, v4-8, v5p-8, v3-8, ... or a libtpu topology like v5e:2x4) on this machine, print memory per "
        "chip, estimated step time and MFU, write OUTPUT_DIR/plan.json; no weights are read, nothing trains; "
        "exits 1 with one line if the run does not fit",
    )
    plan_search: bool = arg(
        False,
        "with --compile_topology: search how to lay this run out on the slice (mesh split, remat, micro-batch "
        "with accumulation for the same global batch, attention kernel, loss chunks), compile the most "
        "promising, print them ranked and write the fastest that fits as OUTPUT_DIR/best_plan.yaml (a --config "
        "for the same command) with its plan.json",
    )
    plan_search_compiles: int = arg(
        6, "with --plan_search: how many layouts to compile (the fastest by the analytic model that it lets through)"
    )
    plan_search_timeout: float = arg(
        1800.0,
        "with --plan_search: seconds each layout's compile may take; a hung one is stopped and ranked as timed out",
    )


def parse(description: str, sections: tuple[type, ...], argv) -> tuple:
    """One instance of each section (a config dataclass), from ``--config FILE.yaml`` and then the flags."""
    return parse_args(build_parser(description, *sections), sections, argv)[1]


def start(runtime: RuntimeConfig, distributed: DistributedConfig | None = None):
    """Join a multi-host run if asked (before anything touches devices), turn on the compilation cache,
    and return the device mesh."""
    skip_absent_tpu()
    if distributed is not None:
        initialize(distributed)
    setup_compilation_cache(runtime.compilation_cache_dir)
    return make_mesh(runtime.mesh or None)


def finish(
    trainer,
    results: dict,
    *,
    tokenizer,
    base_model: str | None,
    hub: HubConfig,
    train_samples: int,
    eval_samples: int,
    extra_eval: dict | None = None,
) -> dict:
    """What every training script does once ``trainer.train()`` returned ``results``: ``eval_results.json``
    and ``all_results.json``, the training-curve plot, the model (or adapter) with its tokenizer as a Hugging
    Face folder in the output dir, and the push to the Hub if asked. Every process calls this."""
    output_dir = trainer.output_dir
    evaluated = write_results(
        output_dir, results, train_samples=train_samples, eval_samples=eval_samples, extra_eval=extra_eval
    )
    trainer.logger.plot()
    export_model(trainer, output_dir, tokenizer, base_model=base_model)  # every process gathers, process 0 writes
    push_run(hub, output_dir)
    return evaluated


def skip_absent_tpu() -> None:
    """With libtpu installed (``jaxseq[tpu]``, for plans) on a machine without a TPU, JAX would still start
    libtpu, which prints a screen of warnings about the TPU it cannot find: leave the TPU out of JAX's
    platforms there (unless JAX_PLATFORMS says otherwise). A Cloud TPU's chips are PCI devices of Google
    (vendor 0x1ae0), as JAX's own check reads them; NVIDIA's (0x10de) keep CUDA in when its plugin is there."""
    if os.environ.get("JAX_PLATFORMS") or importlib.util.find_spec("libtpu") is None:
        return
    if _has_tpu():
        return
    jax.config.update("jax_platforms", "cuda,cpu" if _has_cuda_gpu() else "cpu")


@functools.cache
def _pci_vendors() -> set[str]:
    return {p.read_text().strip() for p in Path("/sys/bus/pci/devices").glob("*/vendor")}


def _has_tpu() -> bool:
    return importlib.util.find_spec("libtpu") is not None and "0x1ae0" in _pci_vendors()


def _has_cuda_gpu() -> bool:
    return "0x10de" in _pci_vendors() and any(importlib.util.find_spec(f"jax_cuda{v}_plugin") for v in (12, 13))


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "jaxseq" / "xla"


def setup_compilation_cache(directory: str | None) -> None:
    """Persist compiled programs so a second run of the same config skips compiling ('' disables): those that
    took at least half a second to compile, unless JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS says otherwise."""
    if directory == "":
        return
    path = Path(directory) if directory else default_cache_dir()
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def script(main):
    """Run ``main(argv)``; a JaxseqError, a failing file operation (unwritable folder, full disk) or a
    Ctrl-C ends in one line on stderr and a non-zero exit code: 1, or 128 + the signal's number when a
    signal stopped training (``--debug`` shows the traceback instead)."""

    @functools.wraps(main)
    def wrapper(argv=None):
        argv = sys.argv[1:] if argv is None else argv
        skip_absent_tpu()  # every job, before anything starts JAX (jobs that never call ``start`` too)
        try:
            return main(argv) or 0
        except (JaxseqError, OSError, KeyboardInterrupt) as e:
            if "--debug" in argv:
                raise
            if isinstance(e, JaxseqError):
                line, code = f"{e.label}: {e}", e.exit_code
            elif isinstance(e, OSError):
                line, code = f"error: {os_error_line(e)}", 1
            else:
                line, code = "interrupted: stopped by Ctrl-C; a rerun resumes from the last checkpoint, if any", 130
            print(line, file=sys.stderr, flush=True)
            return code

    return wrapper


def os_error_line(e: OSError) -> str:
    """One line for a file operation that failed: what, on which path, and what to check."""
    paths = " -> ".join(str(p) for p in (e.filename, e.filename2) if p is not None)
    what = e.strerror or first_line(e)
    return (
        f"{what}{f': {paths}' if paths else ''}; check that the path exists and is writable and that "
        "the disk has room (--debug shows where it happened)"
    )
