"""What every script shares: one-line errors with a non-zero exit, and the JAX runtime set-up."""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
from pathlib import Path

from jaxseq.config import arg
from jaxseq.errors import JaxseqError

DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass
class RuntimeConfig:
    """How a script runs, whatever it trains."""

    mesh: str = arg("", "device mesh, e.g. 'dp=2,mp=4' (axes dp, fsdp, mp; default: all devices on dp)")
    dtype: str = arg(
        "float32", "compute dtype; parameters stay float32 (float16 adds dynamic loss scaling)", choices=DTYPES
    )
    remat: bool = arg(False, "recompute each block's activations in the backward pass (less memory, more compute)")
    compilation_cache_dir: str | None = arg(None, "persistent XLA cache (default ~/.cache/jaxseq/xla; '' disables)")


def start(runtime: RuntimeConfig, distributed=None):
    """Join a multi-host run if asked (before anything touches devices), turn on the compilation cache,
    and return the device mesh."""
    from jaxseq.distributed import initialize
    from jaxseq.mesh import make_mesh

    if distributed is not None:
        initialize(distributed)
    setup_compilation_cache(runtime.compilation_cache_dir)
    return make_mesh(runtime.mesh or None)


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "jaxseq" / "xla"


def setup_compilation_cache(directory: str | None) -> None:
    """Persist compiled programs so a second run of the same config skips compiling ('' disables)."""
    import jax

    if directory == "":
        return
    path = Path(directory) if directory else default_cache_dir()
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def script(main):
    """Run ``main(argv)``; a JaxseqError, a failing file operation (unwritable folder, full disk) or a
    Ctrl-C ends in one line on stderr and a non-zero exit code: 1, or 128 + the signal's number when a
    signal stopped training (``--debug`` shows the traceback instead)."""

    @functools.wraps(main)
    def wrapper(argv=None):
        argv = sys.argv[1:] if argv is None else argv
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
    what = e.strerror or str(e).splitlines()[0][:200] or type(e).__name__
    return (
        f"{what}{f': {paths}' if paths else ''}; check that the path exists and is writable and that "
        "the disk has room (--debug shows where it happened)"
    )
