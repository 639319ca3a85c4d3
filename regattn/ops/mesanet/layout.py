"""MesaNet's rows in and out of its chunk kernels (:mod:`regattn.ops.mesanet.kernels`), one pass each way.

The chunk algebra reads ``[B, HQ, P, E]`` fp32 rows: ``P`` positions (whole chunks), each kv head's rows repeated
for its group of query heads, zeros before a sequence's first position (queries are aligned to the last of the keys)
and after its last. :class:`ToChunks` makes them from ``[B, L, H, E]`` in any float dtype, and flags each position
and head holding a non-finite entry; with ``zero_nonfinite`` (keys and values) such an entry becomes zero, so that
it reaches only the rows that see it, which :class:`FromChunks` sets to NaN. Its backward sums each group's
gradient rows back into ``[B, L, H, E]`` in x's dtype (zero where x is not finite, with ``zero_nonfinite``).
:class:`FromChunks` takes the output rows back to ``[B, T, HQ, Dv]`` in the output dtype; its backward puts the
gradient's rows in place, zero at the padding and at the NaN rows. In torch each way is about a dozen elementwise
kernels: the non-finite masks, casts, a copy into a padded layout, and their autograd (clones, slices, zero fills).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from regattn.ops._common.attention_tiles import head_block
from regattn.ops._common.checks import last_dim_contiguous
from regattn.ops._common.ints import ceil_div
from regattn.ops._common.launch import launch
from regattn.ops._common.vmap import fold_rule

BLOCK = 32  # positions a program
WARPS = 4


@triton.jit
def _heads(bq, HQ, H):
    """``(b, hq, h)`` of program ``bq = b HQ + hq``: its sequence, query head and kv head."""
    b, hq = bq // HQ, bq % HQ
    return b, hq, hq // (HQ // H)


@triton.jit
def _to_chunks_kernel(X, OUT, BAD, L, H, HQ, P, E, FRONT, sxb, sxl, sxh,
                      BLOCK: tl.constexpr, BE: tl.constexpr, ZERO: tl.constexpr):
    """Rows ``p`` of ``OUT[b, hq]`` from ``X[b, p - FRONT, hq // (HQ // H)]``; ``BAD[b, l, h]``: a non-finite entry."""
    p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    bq = tl.program_id(1)
    b, hq, h = _heads(bq, HQ, H)
    s = p - FRONT
    e = tl.arange(0, BE)[None, :]
    inside = (s >= 0) & (s < L)
    mask = inside[:, None] & (e < E)
    x = tl.load(X + b.to(tl.int64) * sxb + s[:, None].to(tl.int64) * sxl + h * sxh + e, mask=mask, other=0.0)
    x = x.to(tl.float32)
    finite = tl.abs(x) < float("inf")                       # false for NaN too
    if ZERO:
        x = tl.where(finite, x, 0.0)
    tl.store(OUT + (bq.to(tl.int64) * P + p[:, None]) * E + e, x, mask=(p[:, None] < P) & (e < E))
    bad = tl.max(tl.where(mask & ~finite, 1, 0), 1)
    lead = tl.zeros([BLOCK], tl.int32) + hq % (HQ // H) == 0    # one query head of each group writes the flags
    tl.store(BAD + (b.to(tl.int64) * L + s) * H + h, bad.to(tl.int8), mask=inside & lead)


@triton.jit
def _to_chunks_backward_kernel(G, X, DX, L, H, HQ, P, E, FRONT, sxb, sxl, sxh,
                               BLOCK: tl.constexpr, BE: tl.constexpr, ZERO: tl.constexpr):
    """``DX[b, l, h]``: the sum of ``G[b, hq, l + FRONT]`` over the query heads ``hq`` of kv head ``h``."""
    s = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)[:, None]
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    e = tl.arange(0, BE)[None, :]
    mask = (s < L) & (e < E)
    group = HQ // H
    acc = tl.zeros([BLOCK, BE], tl.float32)
    for g in range(group):
        rows = (b.to(tl.int64) * HQ + h * group + g) * P + FRONT + s
        acc += tl.load(G + rows * E + e, mask=mask, other=0.0)
    if ZERO:
        x = tl.load(X + b.to(tl.int64) * sxb + s.to(tl.int64) * sxl + h * sxh + e, mask=mask, other=0.0)
        acc = tl.where(tl.abs(x.to(tl.float32)) < float("inf"), acc, 0.0)
    tl.store(DX + ((b.to(tl.int64) * L + s) * H + h) * E + e, acc.to(DX.dtype.element_ty), mask=mask)


@triton.jit
def _from_chunks_kernel(O, SEEN, OUT, T, S, H, HQ, P, E, FRONT, BLOCK: tl.constexpr, BE: tl.constexpr):
    """``OUT[b, t, hq]`` from row ``FRONT + t`` of ``O[b, hq]``; NaN where ``SEEN[b, FRONT + t, hq // (HQ // H)]``."""
    t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    bq = tl.program_id(1)
    b, hq, h = _heads(bq, HQ, H)
    e = tl.arange(0, BE)[None, :]
    rows = t < T
    mask = rows[:, None] & (e < E)
    o = tl.load(O + (bq.to(tl.int64) * P + FRONT + t[:, None]) * E + e, mask=mask, other=0.0)
    seen = tl.load(SEEN + (b.to(tl.int64) * S + FRONT + t) * H + h, mask=rows, other=0) != 0
    o = tl.where(seen[:, None], float("nan"), o)
    tl.store(OUT + ((b.to(tl.int64) * T + t[:, None]) * HQ + hq) * E + e, o.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _from_chunks_backward_kernel(G, SEEN, DO, T, S, H, HQ, P, E, FRONT, BLOCK: tl.constexpr, BE: tl.constexpr):
    """Row ``p`` of ``DO[b, hq]``: ``G[b, p - FRONT, hq]``, zero at the padding and where the row is NaN."""
    p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    bq = tl.program_id(1)
    b, hq, h = _heads(bq, HQ, H)
    e = tl.arange(0, BE)[None, :]
    t = p - FRONT
    inside = (t >= 0) & (t < T)
    seen = tl.load(SEEN + (b.to(tl.int64) * S + p) * H + h, mask=inside, other=0) != 0
    g = tl.load(G + ((b.to(tl.int64) * T + t[:, None]) * HQ + hq) * E + e,
                mask=(inside & ~seen)[:, None] & (e < E), other=0.0)
    tl.store(DO + (bq.to(tl.int64) * P + p[:, None]) * E + e, g.to(tl.float32), mask=(p[:, None] < P) & (e < E))


def to_chunks(x: torch.Tensor, heads: int, positions: int, front: int, zero_nonfinite: bool) -> tuple:
    """``(rows [B, heads, positions, E] fp32, bad [B, L, H] int8)`` from ``x [B, L, H, E]``: row ``p`` of each head
    holds position ``p - front``."""
    x = last_dim_contiguous(x)
    B, L, H, E = x.shape
    rows = torch.empty(B, heads, positions, E, device=x.device, dtype=torch.float32)
    bad = torch.empty(B, L, H, device=x.device, dtype=torch.int8)
    if rows.numel():
        launch(_to_chunks_kernel, (ceil_div(positions, BLOCK), B * heads), x, rows, bad, L, H, heads, positions,
               E, front, *x.stride()[:3], BLOCK=BLOCK, BE=head_block(E), ZERO=zero_nonfinite, num_warps=WARPS)
    return rows, bad


def to_chunks_backward(g, x, front: int, zero_nonfinite: bool) -> torch.Tensor:
    """``dx [B, L, H, E]`` in x's dtype from the rows' gradient ``g [B, HQ, P, E]`` (contiguous fp32)."""
    x = last_dim_contiguous(x)
    B, L, H, E = x.shape
    dx = torch.empty(B, L, H, E, device=x.device, dtype=x.dtype)
    if dx.numel():
        launch(_to_chunks_backward_kernel, (ceil_div(L, BLOCK), B * H), g, x, dx, L, H, g.shape[1], g.shape[2],
               E, front, *x.stride()[:3], BLOCK=BLOCK, BE=head_block(E), ZERO=zero_nonfinite, num_warps=WARPS)
    return dx


def from_chunks(o, seen, T: int, dtype: torch.dtype) -> torch.Tensor:
    """``[B, T, HQ, E]`` in ``dtype`` from the rows ``o [B, HQ, P, E]`` (contiguous fp32), NaN where ``seen``
    ``[B, S, H]`` (bool: the position sees a non-finite key or value) at the query's key position."""
    B, HQ, P, E = o.shape
    S, H = seen.shape[1:]
    out = torch.empty(B, T, HQ, E, device=o.device, dtype=dtype)
    if out.numel():
        launch(_from_chunks_kernel, (ceil_div(T, BLOCK), B * HQ), o, seen, out, T, S, H, HQ, P, E, S - T,
               BLOCK=BLOCK, BE=head_block(E), num_warps=WARPS)
    return out


def from_chunks_backward(g, seen, P: int) -> torch.Tensor:
    """The rows' gradient ``[B, HQ, P, E]`` fp32 from ``g [B, T, HQ, E]`` (contiguous)."""
    B, T, HQ, E = g.shape
    S, H = seen.shape[1:]
    do = torch.empty(B, HQ, P, E, device=g.device, dtype=torch.float32)
    if do.numel():
        launch(_from_chunks_backward_kernel, (ceil_div(P, BLOCK), B * HQ), g, seen, do, T, S, H, HQ, P, E, S - T,
               BLOCK=BLOCK, BE=head_block(E), num_warps=WARPS)
    return do


class ToChunks(torch.autograd.Function):
    """:func:`to_chunks` with its gradient (x's); ``bad`` carries none."""

    @staticmethod
    def forward(x, heads, positions, front, zero_nonfinite):
        return to_chunks(x, heads, positions, front, zero_nonfinite)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])
        ctx.front, ctx.zero = inputs[3], inputs[4]
        ctx.mark_non_differentiable(output[1])

    @staticmethod
    def backward(ctx, g, _bad):
        return to_chunks_backward(g.contiguous(), *ctx.saved_tensors, ctx.front, ctx.zero), None, None, None, None

    vmap = staticmethod(fold_rule(lambda *a: ToChunks.apply(*a), batched=(0,), outputs=(0, 0)))


class FromChunks(torch.autograd.Function):
    """:func:`from_chunks` with its gradient (the rows')."""

    @staticmethod
    def forward(o, seen, T, dtype):
        return from_chunks(o, seen, T, dtype)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[1])
        ctx.positions = inputs[0].shape[2]

    @staticmethod
    def backward(ctx, g):
        return from_chunks_backward(g.contiguous(), *ctx.saved_tensors, ctx.positions), None, None, None

    vmap = staticmethod(fold_rule(lambda *a: FromChunks.apply(*a), batched=(0, 1), outputs=(0,)))
