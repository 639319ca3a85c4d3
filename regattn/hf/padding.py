"""Left-padded batches for the regattn ops, which take no per-key mask.

In a left-padded row the real tokens are contiguous at the end. Rolling the row left by its padding
length puts them first: causal (and windowed) attention of the real queries then never reaches a
padded key, and with a cache the real keys are a prefix whose length is the ops' ``cache_seqlens``.
RoPE is applied before the roll and depends only on relative positions, so nothing else changes.
"""
from __future__ import annotations

import torch

from regattn.reference.common import visible


def roll_rows(x: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """``out[b, t] = x[b, (t + shift[b]) % n]`` for ``x: [B, n, ...]`` and ``shift: [B]`` (a per-row roll left)."""
    n = x.shape[1]
    index = (torch.arange(n, device=x.device) + shift[:, None]) % n                  # [B, n]
    return x.gather(1, index.view(*index.shape, *[1] * (x.dim() - 2)).expand_as(x))


def left_padding(attention_mask, T: int, S: int, *, window: int | None) -> torch.Tensor | None:
    """``start: [B]`` (int64), the first key any query of each row sees, when ``attention_mask`` is a
    causal (windowed) mask of left-padded rows with some padding; None otherwise (no padding, or a
    mask of another kind: :func:`regattn.hf.attention.check_plain_mask` then accepts or refuses it).

    Accepted masks: ``[B, S]`` (1 for real tokens, zeros first) or ``[B, 1, T, S]`` (boolean True
    visible, or additive float 0 visible) equal to the causal pattern, within ``window``, restricted
    to keys and queries at or after ``start`` (padded queries see nothing, as transformers builds it).
    """
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() not in (2, 4):
        return None
    pattern = visible(T, S, causal=True, window=window, device=attention_mask.device)
    if attention_mask.dim() == 2:
        if attention_mask.shape[-1] != S:
            return None
        allowed = attention_mask.bool()[:, None, None, :] & pattern
    else:
        allowed = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
    if tuple(allowed.shape[-2:]) != (T, S) or allowed.shape[1] != 1:
        return None
    start = allowed.any(dim=-2).flatten(1).int().argmax(-1).long()                  # [B]
    keys = torch.arange(S, device=allowed.device)
    queries = keys[S - T:]
    expected = (pattern & (keys >= start[:, None])[:, None, :] & (queries >= start[:, None])[:, :, None])
    if not bool((allowed[:, 0] == expected).all()) or not bool(start.any()):
        return None
    return start
