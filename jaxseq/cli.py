"""What every script shares: one-line errors with a non-zero exit, and the JAX runtime set-up."""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

from jaxseq.errors import JaxseqError


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
    """Run ``main(argv)``; a JaxseqError or a bad file ends in one line on stderr and exit code 1
    (``--debug`` shows the traceback instead)."""

    @functools.wraps(main)
    def wrapper(argv=None):
        argv = sys.argv[1:] if argv is None else argv
        try:
            return main(argv) or 0
        except JaxseqError as e:
            if "--debug" in argv:
                raise
            print(f"error: {e}", file=sys.stderr)
            return 1

    return wrapper
