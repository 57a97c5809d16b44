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


def assert_gradients_match(model, grads, want: dict) -> None:
    """jaxseq's gradients of ``model`` (an ``nnx.State``) equal torch's ``want`` (numpy arrays by PyTorch name,
    a tied head listed once), within 1e-4 of each tensor's scale and 1e-6 of the largest gradient (a gradient
    that is 0 in exact arithmetic, e.g. a reward model's final norm bias, is noise there)."""
    from flax import nnx

    from jaxseq.models.hub import torch_layout

    flat = {"/".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(grads)}
    largest = max(np.abs(w).max() for w in want.values())
    compared = 0
    for name, (path, transposed) in torch_layout(model).items():
        if name not in want:  # a tied head
            continue
        array = flat["/".join(map(str, path))]
        array = (array.T if transposed else array)[tuple(slice(0, n) for n in want[name].shape)]
        error = np.abs(array - want[name]).max()
        assert error <= 1e-4 * np.abs(want[name]).max() + 1e-6 * largest, (name, error, np.abs(want[name]).max())
        compared += 1
    assert compared == len(want)
