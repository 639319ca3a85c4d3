"""NSA's compression and selection branches (gatedfwa.md Appendix B, eq. 16-19, 22) in plain PyTorch.

Query ``t`` (0-based position) attends

* compression: to the compressed blocks ``i`` (keys ``kc_i``, values ``vc_i``, block ``i`` made of tokens
  ``i s .. i s + b - 1`` for the stride ``s = stride_cmp`` and length ``b = block_cmp``) that end at or
  before ``t``;
* selection: to the tokens ``<= t`` of the ``topk`` selection blocks (tokens ``j b_s .. (j + 1) b_s - 1``,
  ``b_s = block_slc``) of highest importance, among the blocks that start at or before ``t``; the block
  holding ``t`` is always chosen. The importance of block ``j`` is the compression attention probability
  summed over the compressed blocks that overlap it and over the query heads of a key/value group; equal
  importances are ranked by block index, lower first.

This is the spec: it builds the ``[T, S]`` masks. :mod:`regattn.ops.nsa` computes the same in linear memory.
"""
from __future__ import annotations

import torch

from regattn.reference.common import accumulation_dtype, contained_matmul, repeat_kv


def compressed_ends(n: int, *, block_cmp: int, stride_cmp: int, device=None) -> torch.Tensor:
    """``[n]``: the last token of each compressed block."""
    return torch.arange(n, device=device) * stride_cmp + block_cmp - 1


def masked_softmax(logits: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim of the entries ``seen`` (broadcastable); a row that sees nothing is zero,
    and so is its gradient (never NaN)."""
    if logits.shape[-1] == 0:
        return logits.clone()
    logits = logits.masked_fill(~seen, float("-inf"))
    top = logits.amax(-1, keepdim=True)
    e = torch.exp(logits - torch.where(torch.isfinite(top), top, torch.zeros_like(top)))
    return e / e.sum(-1, keepdim=True).clamp_min(torch.finfo(e.dtype).tiny)


def select_blocks(importance: torch.Tensor, t: torch.Tensor, *, block_slc: int, topk: int):
    """``(blocks, chosen)``, each ``[..., C, k]`` with ``k = min(topk, n_slc)``: the selected blocks of the
    queries at positions ``t: [C]`` from ``importance: [..., C, n_slc]``; ``chosen`` is False where fewer
    than ``k`` blocks have started."""
    j = torch.arange(importance.shape[-1], device=t.device)
    started = j * block_slc <= t[:, None]
    own = j == (t // block_slc)[:, None]
    score = importance.masked_fill(~started, float("-inf")).masked_fill(own, float("inf"))
    order = score.sort(dim=-1, descending=True, stable=True).indices[..., :min(topk, score.shape[-1])]
    return order, started.expand_as(score).gather(-1, order)


def nsa_attention(q, k, v, kc, vc, *, block_cmp, stride_cmp, block_slc, topk, scale=None):
    """``(o_cmp, o_slc)``, each ``[B, T, HQ, Dv]`` in q's dtype (computed in fp32, float64 for float64).

    ``q: [B, T, HQ, D]`` at positions ``0 .. T-1``; ``k: [B, T, H, D]``, ``v: [B, T, H, Dv]``;
    ``kc: [B, n, H, D]``, ``vc: [B, n, H, Dv]`` the compressed blocks. The selection is not differentiated
    (it is a top-k): gradients reach ``q, k, v`` through the selected tokens and ``q, kc, vc`` through the
    compression attention.
    """
    dtype, acc = q.dtype, accumulation_dtype(q.dtype)
    q, k, v, kc, vc = (x.to(acc) for x in (q, k, v, kc, vc))
    B, T, HQ, D = q.shape
    H, n = k.shape[2], kc.shape[1]
    G = HQ // H
    scale = D ** -0.5 if scale is None else scale
    t = torch.arange(T, device=q.device)
    qh = q.transpose(1, 2)                                                            # [B, HQ, T, D]

    ends = compressed_ends(n, block_cmp=block_cmp, stride_cmp=stride_cmp, device=q.device)
    logits = torch.einsum("bhtd,bnhd->bhtn", qh, kc.repeat_interleave(G, 2)) * scale
    seen_cmp = ends[None, :] <= t[:, None]
    p_cmp = masked_softmax(logits, seen_cmp)
    o_cmp = contained_matmul(p_cmp, repeat_kv(vc, HQ).transpose(1, 2), seen_cmp).transpose(1, 2)

    n_slc = -(-T // block_slc)
    cmp_lo = torch.arange(n, device=q.device) * stride_cmp
    slc_lo = torch.arange(n_slc, device=q.device) * block_slc
    overlap = (cmp_lo[:, None] < slc_lo[None, :] + block_slc) & (cmp_lo[:, None] + block_cmp > slc_lo[None, :])
    importance = (p_cmp.detach() @ overlap.to(acc)).view(B, H, G, T, n_slc).sum(2)   # [B, H, T, n_slc]
    blocks, chosen = select_blocks(importance, t, block_slc=block_slc, topk=topk)
    picked = torch.zeros_like(importance, dtype=torch.bool).scatter_(-1, blocks, chosen)
    seen = picked[..., t // block_slc] & (t[None, :] <= t[:, None])                  # [B, H, T, T]
    logits = torch.einsum("bhtd,bshd->bhts", qh, k.repeat_interleave(G, 2)) * scale
    seen = seen.repeat_interleave(G, 1)
    p_slc = masked_softmax(logits, seen)
    o_slc = contained_matmul(p_slc, repeat_kv(v, HQ).transpose(1, 2), seen).transpose(1, 2)
    return o_cmp.to(dtype), o_slc.to(dtype)
