"""Pieces every reference mechanism shares: head grouping, the visibility mask, contained products,
varlen splitting.

Containment: a non-finite key or value reaches only the rows that see it, forward and backward.
A plain ``w @ v`` breaks that even when ``w`` is zero where hidden, since ``0 * NaN = NaN`` inside the
product (and again in the backward's ``dw = g @ v^T``). :func:`contained_scores` and
:func:`contained_matmul` multiply finite stand-ins and put NaN back where a non-finite entry is seen.
"""
from __future__ import annotations

import torch


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a reference accumulates in: float64 for float64 inputs, fp32 for fp32, fp16 and bf16."""
    return torch.float64 if dtype == torch.float64 else torch.float32


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


def _finite_rows(x: torch.Tensor) -> torch.Tensor:
    """``[..., N]`` True where every entry of the row ``x[..., n, :]`` is finite."""
    return torch.isfinite(x).all(-1)


def contained_scores(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b^T``, ``[..., T, D] x [..., S, D] -> [..., T, S]``, NaN in row ``i`` / column ``j`` where
    ``a_i`` / ``b_j`` is not finite; the gradient of every other entry reaches only finite inputs.

    Mask the result with a select (``torch.where``, ``masked_fill``) to keep hidden pairs out.
    """
    a_ok, b_ok = _finite_rows(a), _finite_rows(b)
    zero = a.new_zeros(())
    s = torch.where(a_ok[..., None], a, zero) @ torch.where(b_ok[..., None], b, zero).transpose(-1, -2)
    return torch.where(a_ok[..., :, None] & b_ok[..., None, :], s, float("nan"))


def _masked_product(w, x, seen):
    """``where(seen, w, 0) @ x`` with non-finite entries of ``x`` swapped for 0; a row that sees a key
    ``x_j`` holding one is NaN (the whole row, as in the kernels)."""
    finite = torch.isfinite(x)
    zero = w.new_zeros(())
    out = torch.where(seen, w, zero) @ torch.where(finite, x, zero)
    hits = seen.to(x.dtype) @ (~finite).any(-1, keepdim=True).to(x.dtype)  # [..., T, 1]
    return torch.where(hits > 0, float("nan"), out)


class _ContainedMatmul(torch.autograd.Function):
    """The product and its gradient, each over the seen pairs only: ``dw = g x^T`` and ``dx = w^T g``
    are contained like the forward, so a non-finite gradient row ``g_i`` reaches only the keys row ``i`` sees."""

    generate_vmap_rule = True

    @staticmethod
    def forward(w, x, seen):
        return _masked_product(w, x, seen)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, g):
        w, x, seen = ctx.saved_tensors
        # under autocast the forward multiplied in low precision; the backward runs outside it
        dtype = torch.promote_types(torch.promote_types(w.dtype, x.dtype), g.dtype)
        wc, xc, g = w.to(dtype), x.to(dtype), g.to(dtype)
        dw = torch.where(seen, contained_scores(g, xc), g.new_zeros(()))
        dx = _masked_product(wc.transpose(-1, -2), g, seen.transpose(-1, -2))
        return dw.sum_to_size(w.shape).to(w.dtype), dx.sum_to_size(x.shape).to(x.dtype), None


def contained_matmul(w: torch.Tensor, x: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
    """``sum_j w_ij x_j`` over the pairs ``seen_ij``: ``[..., T, S] x [..., S, D] -> [..., T, D]``.

    ``w`` is taken as exactly zero where ``seen`` (boolean, broadcastable to ``w``) is False. A
    non-finite entry of ``x_j`` makes NaN the rows that see ``j`` and nothing else; in the
    backward a non-finite gradient of row ``i`` reaches only ``w_i`` and the ``x_j`` that row ``i`` sees.
    """
    return _ContainedMatmul.apply(w, x, seen)


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
