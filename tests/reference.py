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


def assert_causal_lm_matches(ref, model, vocab_size: int, pad_id: int, new_tokens: int = 10) -> None:
    """A jaxseq causal LM and its transformers original ``ref`` agree: logits within 1e-4 of the reference's
    scale on a right- and a left-padded batch (rows of 70, 33 and 9 tokens: one past a 64-position chunk), and
    greedy tokens on left-padded prompts identical to transformers' ``generate``, or where that raises (a stack
    of linear-attention layers alone has no attention cache to measure), to a full forward per token."""
    import jax.numpy as jnp
    import torch
    from flax import nnx

    from jaxseq.generation import generate

    forward = nnx.jit(lambda m, ids, mask: m(ids, mask).logits)
    ref.eval()
    for ids, mask in (padded_batch(vocab_size, (70, 33, 9), pad_id, low=3), left_padded(vocab_size, (70, 33, 9))):
        with torch.no_grad():
            inputs = dict(input_ids=torch.as_tensor(ids).long(), attention_mask=torch.as_tensor(mask).long())
            want = ref(**inputs, use_cache=False).logits.numpy()
        got = np.asarray(forward(model, jnp.asarray(ids), jnp.asarray(mask)))[..., :vocab_size]
        assert scaled_diff(mask, got, want) <= 1e-4

    ids, mask = left_padded(vocab_size, (11, 6, 2), pad_id)
    tokens, attention = torch.as_tensor(ids).long(), torch.as_tensor(mask).long()
    with torch.no_grad():
        try:
            want = ref.generate(
                tokens, attention_mask=attention, max_new_tokens=new_tokens, do_sample=False, pad_token_id=pad_id,
                eos_token_id=None,
            )[:, ids.shape[1] :].numpy()  # fmt: skip
        except ValueError:
            for _ in range(new_tokens):
                last = ref(input_ids=tokens, attention_mask=attention, use_cache=False).logits[:, -1].argmax(-1)
                tokens = torch.cat([tokens, last[:, None]], 1)
                attention = torch.cat([attention, torch.ones_like(attention[:, :1])], 1)
            want = tokens[:, ids.shape[1] :].numpy()
    assert all(len(set(row)) > 3 for row in want)  # not one repeated token
    got = generate(model, ids, mask, max_new_tokens=new_tokens, pad_token_id=pad_id)
    np.testing.assert_array_equal(np.asarray(got.sequences), want)


def left_padded(vocab_size: int, lengths, pad_id: int = 0, seed: int = 1):
    """Left-padded ``(input_ids, attention_mask)`` int32 numpy arrays of random tokens (3 and up)."""
    rng = np.random.RandomState(seed)
    width = max(lengths)
    ids, mask = np.full((len(lengths), width), pad_id, np.int32), np.zeros((len(lengths), width), np.int32)
    for row, n in enumerate(lengths):
        ids[row, width - n :], mask[row, width - n :] = rng.randint(3, vocab_size, n), 1
    return ids, mask
