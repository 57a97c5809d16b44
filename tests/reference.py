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


def perturb(model, std: float = 0.05, seed: int = 0):
    """The PyTorch ``model`` with N(0, ``std``) noise added to every parameter (in place; returned). A fresh
    model's biases are zero and its norm scales one, which hides a bias or norm that is dropped, loaded
    into the wrong place or applied twice; noise makes every parameter count."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(std * torch.randn(p.shape, generator=generator, dtype=p.dtype))
    return model


def scaled_diff(mask, got, want) -> float:
    """Largest absolute difference of ``got`` and ``want`` over the positions where ``mask`` is 1 (all, for
    None) relative to the reference's scale there, max |``want``|: logits of perturbed models run from ~1 to
    tens, so one absolute bound would be loose on the small ones and strict on the large ones."""
    want = np.asarray(want, np.float32)
    mask = np.ones(want.shape[:1], np.int32) if mask is None else np.asarray(mask)
    scale = max_diff_on(mask, want, np.zeros_like(want))
    return max_diff_on(mask, got, want) / max(scale, 1e-30)
