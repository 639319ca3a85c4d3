"""Left-padded batches (each row's real tokens at its end, after ``start[b]`` padding slots) for ops
that take no per-key mask.

Rolling a row left by ``start`` puts its real tokens first: causal (and windowed) attention of the
real queries then never reaches a padded key, and in a cache the real keys become a prefix of
``n - start`` keys, the ``cache_seqlens`` of the decode ops. RoPE depends only on relative positions,
so keys and queries rotated at their slot positions need no change.
"""
from __future__ import annotations

import torch

from regattn.ops.parallax.api import parallax_decode


def roll_rows(x: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """``out[b, t] = x[b, (t + shift[b]) % n]`` for ``x: [B, n, ...]`` and ``shift: [B]`` (a per-row roll left)."""
    n = x.shape[1]
    index = (torch.arange(n, device=x.device) + shift[:, None]) % n                  # [B, n]
    return x.gather(1, index.view(*index.shape, *[1] * (x.dim() - 2)).expand_as(x))


def attend_left_padded(op, start: torch.Tensor | None, *tensors: torch.Tensor, **options) -> torch.Tensor:
    """``op(*tensors, **options)`` (tensors ``[B, T, ...]``, self-attention) on the rows rolled left by
    ``start: [B]``, rolled back; ``op`` itself when ``start`` is None."""
    if start is None:
        return op(*tensors, **options)
    return roll_rows(op(*(roll_rows(x, start) for x in tensors), **options), -start)


def ragged_cache(keys: torch.Tensor, values: torch.Tensor, start: torch.Tensor):
    """``(keys, values, cache_seqlens)``: a left-padded cache ``[B, n, H, D]`` rolled so that each row's
    real keys are a prefix of ``n - start[b]`` keys (what :func:`regattn.parallax_decode` takes)."""
    return roll_rows(keys, start), roll_rows(values, start), keys.shape[1] - start


def trimmed_start(start: torch.Tensor | None, n: int, kept: int) -> torch.Tensor | None:
    """The padding left in a row of ``n`` slots after dropping all but the last ``kept``."""
    return None if start is None else (start - (n - kept)).clamp_min(0)


def softmax_decode_left_padded(q, k, v, start: torch.Tensor, **options) -> torch.Tensor:
    """Softmax attention of new tokens ``q: [B, Tn, HQ, D]`` on a left-padded cache ``k, v: [B, S, H, D]``:
    the Parallax decode op with a zero probe (eq. 14 with rho = 0 is softmax attention) on each row's
    real keys. ``options``: ``window``, ``scale``, ``backend``."""
    k, v, lengths = ragged_cache(k, v, start)
    return parallax_decode(q, torch.zeros_like(q), k, v, cache_seqlens=lengths, **options)
