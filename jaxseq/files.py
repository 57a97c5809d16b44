"""Writing files so that a crash never leaves a half-written one: write beside the target, then rename."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO


def atomic_write(path: str | os.PathLike, data: str | bytes | Callable[[IO[bytes]], None]) -> Path:
    """Write ``data`` (text, bytes, or a function writing to a binary file) to ``path`` in one step: readers
    see the old file or the whole new one, never a part."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data.encode("utf-8") if isinstance(data, str) else data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


@contextlib.contextmanager
def atomic_folder(out: str | os.PathLike) -> Iterator[Path]:
    """A temporary folder inside ``out`` to write files into; when the block ends without an error each file
    replaces its namesake in ``out``, so a failed export leaves ``out`` as it was."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out, prefix=".saving-") as tmp:
        yield Path(tmp)
        for name in os.listdir(tmp):
            os.replace(os.path.join(tmp, name), out / name)
