"""Writing files so that a crash never leaves a half-written one: write beside the target, then rename."""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

from jaxseq.errors import JaxseqError


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


class RunLock:
    """One run at a time in a folder: process 0 of a run holds ``.jaxseq-run.lock`` (host and pid) while it
    writes there, so two runs that do not know of each other (a launcher starting N copies) never write
    one folder. A lock left by a run that died on this host is taken over."""

    NAME = ".jaxseq-run.lock"

    def __init__(self, folder: str | os.PathLike, flag: str = "--output_dir"):
        self.path, self.flag, self.held = Path(folder) / self.NAME, flag, False

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        me = f"{socket.gethostname()} {os.getpid()}"
        while True:
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                host, _, pid = self.path.read_text(encoding="utf-8").partition(" ")
                if host == socket.gethostname() and pid.strip().isdigit() and not _alive(int(pid)):
                    self.path.unlink(missing_ok=True)  # its run died without releasing it
                    continue
                raise JaxseqError(
                    f"another run ({host} pid {pid.strip()}) is writing to {self.path.parent}; wait for it or pick "
                    f"another {self.flag} (if no such run is left, delete {self.path})"
                ) from None
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(me)
            self.held = True
            return

    def release(self) -> None:
        if self.held:
            self.path.unlink(missing_ok=True)
            self.held = False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True
