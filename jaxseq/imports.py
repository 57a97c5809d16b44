"""Importing libraries that would import PyTorch, without it: jaxseq uses none of their PyTorch parts."""

from __future__ import annotations

import contextlib
import sys


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
