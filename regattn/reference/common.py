"""Pieces every reference mechanism shares: head grouping, the visibility mask, varlen splitting."""
from __future__ import annotations

import torch


def repeat_kv(x: torch.Tensor, num_query_heads: int) -> torch.Tensor:
    """``[B, S, H, D] -> [B, S, HQ, D]``: query head ``h`` reads key/value head ``h // (HQ // H)``."""
    groups = num_query_heads // x.shape[2]
    return x if groups == 1 else x.repeat_interleave(groups, dim=2)


def visible(T: int, S: int, *, causal: bool, window: int | None, device=None) -> torch.Tensor:
    """Boolean ``[T, S]``: which keys query ``i`` sees.

    Queries are aligned to the end of the keys (query ``i`` sits at position ``i + S - T``),
    as in flash-attn. ``window=w`` keeps keys ``pos - w < j <= pos``.
    """
    pos = torch.arange(T, device=device)[:, None] + (S - T)
    j = torch.arange(S, device=device)[None, :]
    mask = torch.ones(T, S, dtype=torch.bool, device=device)
    if causal:
        mask &= j <= pos
    if window is not None:
        mask &= j > pos - window
    return mask


def split_varlen(cu_seqlens: torch.Tensor | None, total: int):
    """Slices ``[start, end)`` of each packed sequence (one slice over everything when ``cu_seqlens`` is None)."""
    if cu_seqlens is None:
        return [slice(0, total)]
    c = cu_seqlens.tolist()
    return [slice(a, b) for a, b in zip(c[:-1], c[1:]) if b > a]


def per_sequence(fn, cu_seqlens, out_like: torch.Tensor, *seq_tensors, **kwargs) -> torch.Tensor:
    """Apply ``fn`` to each packed sequence of ``seq_tensors`` (time on dim 1) and concatenate on dim 1."""
    if cu_seqlens is None:
        return fn(*seq_tensors, **kwargs)
    parts = [fn(*(t[:, s] for t in seq_tensors), **kwargs) for s in split_varlen(cu_seqlens, out_like.shape[1])]
    if not parts:
        return out_like.new_zeros(out_like.shape)
    return torch.cat(parts, dim=1)
