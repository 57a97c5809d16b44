"""Helpers for parity tests against transformers' PyTorch models."""

from __future__ import annotations

import numpy as np


def padded_batch(vocab_size: int, lengths=(12, 9, 5), pad_id: int = 0, seed: int = 0, low: int = 1):
    """Right-padded ``(input_ids, attention_mask)`` int32 numpy arrays with the given row lengths."""
    rng = np.random.RandomState(seed)
    width = max(lengths)
    ids = rng.randint(low, vocab_size, (len(lengths), width)).astype(np.int32)
    mask = (np.arange(width)[None, :] < np.asarray(lengths)[:, None]).astype(np.int32)
    ids[mask == 0] = pad_id
    return ids, mask


def torch_forward(model, **inputs):
    """Run a transformers PyTorch model in eval mode on numpy inputs; returns its output object."""
    import torch

    model.eval()
    with torch.no_grad():
        return model(
            **{k: torch.as_tensor(v).long() if v.dtype.kind in "iu" else torch.as_tensor(v) for k, v in inputs.items()}
        )


def max_diff_on(mask: np.ndarray, a, b) -> float:
    """Largest absolute difference of ``a`` and ``b`` over the positions where ``mask`` is 1."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    m = np.asarray(mask, bool).reshape(mask.shape + (1,) * (a.ndim - mask.ndim))
    return float(np.max(np.abs(np.where(m, a - b, 0.0))))
