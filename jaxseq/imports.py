"""Importing libraries without the heavy ones they would import for parts jaxseq never uses: PyTorch
(``torch_hidden``), scikit-learn (``import_module``'s ``seqeval.metrics``); and importing ahead of need on
another thread (``import_ahead``, ``imports_ahead_done``)."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys
import threading


@contextlib.contextmanager
def torch_hidden():
    """Within: ``import torch`` fails as where PyTorch is not installed (``sys.modules["torch"]`` is None), so a
    library that imports it only where it can (transformers' configurations, tensorboardX's writer) goes on
    without it, sparing its import (1-2 s on two cores). torch stays importable afterwards (jaxseq reads
    ``.bin`` checkpoints with it). Nothing is hidden where torch is already imported."""
    if "torch" in sys.modules:
        yield
        return
    sys.modules["torch"] = None
    try:
        yield
    finally:
        if "torch" in sys.modules and sys.modules["torch"] is None:
            del sys.modules["torch"]


_IMPORTING = threading.Lock()


def import_module(name: str):
    """``importlib.import_module(name)``, by a lighter way where ``LIGHTER`` has one. One at a time: a caller
    waits for the same import running on ``import_ahead``'s thread rather than take its half-made module
    from ``sys.modules``."""
    with _IMPORTING:
        if name in sys.modules:
            return sys.modules[name]
        lighter = LIGHTER.get(name)
        return lighter() if lighter is not None else importlib.import_module(name)


def _seqeval_metrics():
    """seqeval's metrics, which import one warning class from ``sklearn.exceptions``: that import runs
    scikit-learn's whole package, scipy and pandas with it (0.8-0.9 s). Its ``exceptions.py`` (no imports of
    its own) is loaded alone as that module while seqeval imports, and dropped after, so a later ``import
    sklearn`` loads the package as ever. Where scikit-learn is imported already, or not installed, the plain
    import (and its error)."""
    spec = importlib.util.find_spec("sklearn") if "sklearn" not in sys.modules else None
    locations = spec.submodule_search_locations if spec is not None else None
    if not locations:
        return importlib.import_module("seqeval.metrics")
    exceptions = importlib.util.spec_from_file_location("sklearn.exceptions", f"{next(iter(locations))}/exceptions.py")
    module = importlib.util.module_from_spec(exceptions)
    sys.modules["sklearn.exceptions"] = module
    try:
        exceptions.loader.exec_module(module)
        return importlib.import_module("seqeval.metrics")
    finally:
        if sys.modules.get("sklearn.exceptions") is module:
            del sys.modules["sklearn.exceptions"]


LIGHTER = {"seqeval.metrics": _seqeval_metrics}


_AHEAD: list[threading.Thread] = []


def import_ahead(modules: tuple[str, ...]) -> None:
    """Import ``modules`` on another thread, while this one waits for the compiler (which holds no Python
    lock), so that their first user finds them imported. An import that fails is left for that user to
    report. The thread is not a daemon: a run that ends sooner waits for it rather than end mid-import."""

    def run():
        for name in modules:
            try:
                import_module(name)
            except Exception:  # raised again, with its message, where the module is used
                continue

    if modules:
        thread = threading.Thread(target=run, name="jaxseq-import")
        thread.start()
        _AHEAD.append(thread)


def imports_ahead_done() -> None:
    """Wait for ``import_ahead``'s imports to end. For a library that looks modules up in ``sys.modules``
    without importing them, where it would find one half-made (trackio's ``log`` reads
    ``matplotlib.figure.Figure`` there, and drops every figure it is given when that fails)."""
    while _AHEAD:
        _AHEAD.pop().join()
