"""Per-head RMSNorm (or L2 norm) and RoPE of ``[B, T, H, D]`` queries or keys in one pass, forward and backward.

``y = rope(x * rstd * w)``, ``rstd = 1 / sqrt(mean(x^2) + eps)`` over ``D``, or ``y = rope(x * rstd)`` with
``rstd = 1 / max(|x|, eps)`` (``L2``, as ``F.normalize``), computed in fp32 and rounded once to x's dtype (or
another asked for; the backward takes ``dy`` in either). The rotation turns the pair ``(n[j], n[j + D/2])`` by
the angle of the row's token: ``y1 = n1 c - n2 s``, ``y2 = n2 c + n1 s`` with ``c, s: [T, D/2]`` (fp32) given
per token. Either step can be left out (``NORM`` or ``L2``, ``ROTATE``). The backward recomputes ``x * rstd``
from x and the saved ``rstd``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from regattn.ops._common.attention_tiles import interpreting
from regattn.ops._common.checks import sm_count
from regattn.ops._common.ints import ceil_div, next_pow2
from regattn.ops._common.launch import launch


@triton.jit
def _load_halves(PTR, rows, cols, HALF, mask):
    """The two halves ``[BLOCK_R, BLOCK_H]`` of the rows (row length ``2 * HALF``) in fp32."""
    base = rows.to(tl.int64)[:, None] * (2 * HALF) + cols[None, :]
    return (tl.load(PTR + base, mask=mask, other=0.0).to(tl.float32),
            tl.load(PTR + base + HALF, mask=mask, other=0.0).to(tl.float32))


@triton.jit
def _store_halves(PTR, rows, cols, HALF, mask, a, b):
    base = rows.to(tl.int64)[:, None] * (2 * HALF) + cols[None, :]
    tl.store(PTR + base, a.to(PTR.dtype.element_ty), mask=mask)
    tl.store(PTR + base + HALF, b.to(PTR.dtype.element_ty), mask=mask)


@triton.jit
def _angles(COS, SIN, rows, cols, T, H, HALF, mask):
    """``(c, s)`` of each row's token (rows run over ``[B, T, H]``)."""
    at = ((rows // H) % T)[:, None] * HALF + cols[None, :]
    return tl.load(COS + at, mask=mask, other=0.0), tl.load(SIN + at, mask=mask, other=0.0)


@triton.jit
def _weights(W, cols, HALF, cmask):
    return (tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)[None, :],
            tl.load(W + HALF + cols, mask=cmask, other=0.0).to(tl.float32)[None, :])


@triton.jit
def _norm_rope_fwd_kernel(X, W, COS, SIN, Y, RSTD, n_rows, T, H, HALF, eps, BLOCK_R: tl.constexpr,
                          BLOCK_H: tl.constexpr, NORM: tl.constexpr, L2: tl.constexpr, ROTATE: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_H)
    cmask = cols < HALF
    mask = (rows < n_rows)[:, None] & cmask[None, :]
    n1, n2 = _load_halves(X, rows, cols, HALF, mask)
    if NORM or L2:
        eps = tl.cast(eps, tl.float32)  # fp64 when torch.compile launches the kernel: keep the arithmetic fp32
        squares = tl.sum(n1 * n1, 1) + tl.sum(n2 * n2, 1)
        if L2:
            rstd = 1.0 / tl.maximum(tl.sqrt(squares), eps)
        else:
            rstd = 1.0 / tl.sqrt(squares / (2 * HALF) + eps)
        tl.store(RSTD + rows, rstd, mask=rows < n_rows)
        n1, n2 = n1 * rstd[:, None], n2 * rstd[:, None]
        if NORM:
            w1, w2 = _weights(W, cols, HALF, cmask)
            n1, n2 = n1 * w1, n2 * w2
    if ROTATE:
        c, s = _angles(COS, SIN, rows, cols, T, H, HALF, mask)
        n1, n2 = n1 * c - n2 * s, n2 * c + n1 * s
    _store_halves(Y, rows, cols, HALF, mask, n1, n2)


@triton.jit
def _norm_rope_bwd_kernel(X, W, COS, SIN, DY, RSTD, DX, DW, n_rows, T, H, HALF, eps, BLOCK_R: tl.constexpr,
                          BLOCK_H: tl.constexpr, NORM: tl.constexpr, L2: tl.constexpr, ROTATE: tl.constexpr):
    """Each program walks row blocks ``pid, pid + programs, ...`` and writes its part of ``dw`` to ``DW[:, pid]``.
    ``L2``: the rows whose norm the forward clamped to ``eps`` scale the gradient alone (as ``F.normalize``)."""
    cols = tl.arange(0, BLOCK_H)
    cmask = cols < HALF
    if NORM:
        w1, w2 = _weights(W, cols, HALF, cmask)
    dw1 = tl.zeros((BLOCK_H,), tl.float32)
    dw2 = tl.zeros((BLOCK_H,), tl.float32)
    for start in range(tl.program_id(0) * BLOCK_R, n_rows, tl.num_programs(0) * BLOCK_R):
        rows = start + tl.arange(0, BLOCK_R)
        mask = (rows < n_rows)[:, None] & cmask[None, :]
        g1, g2 = _load_halves(DY, rows, cols, HALF, mask)
        if ROTATE:  # the rotation's transpose
            c, s = _angles(COS, SIN, rows, cols, T, H, HALF, mask)
            g1, g2 = g1 * c + g2 * s, g2 * c - g1 * s
        if NORM or L2:
            x1, x2 = _load_halves(X, rows, cols, HALF, mask)
            rstd = tl.load(RSTD + rows, mask=rows < n_rows, other=0.0)[:, None]
            if L2:
                projected = tl.sqrt(tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) >= tl.cast(eps, tl.float32)
            x1, x2 = x1 * rstd, x2 * rstd
            if NORM:
                dw1 += tl.sum(g1 * x1, 0)
                dw2 += tl.sum(g2 * x2, 0)
                g1, g2 = g1 * w1, g2 * w2
            along = tl.sum(g1 * x1, 1) + tl.sum(g2 * x2, 1)
            if L2:
                along = tl.where(projected, along, 0.0)
            else:
                along = along / (2 * HALF)
            g1, g2 = rstd * (g1 - x1 * along[:, None]), rstd * (g2 - x2 * along[:, None])
        _store_halves(DX, rows, cols, HALF, mask, g1, g2)
    if NORM:
        # [D, programs]: the sum over the programs then runs along rows (torch's sum down a column of 528 rows of
        # 128 took 9 us on an H200)
        tl.store(DW + cols * tl.num_programs(0) + tl.program_id(0), dw1, mask=cmask)
        tl.store(DW + (HALF + cols) * tl.num_programs(0) + tl.program_id(0), dw2, mask=cmask)


def _tiles(half: int) -> tuple[int, int]:
    """``(BLOCK_R, BLOCK_H)``: about 2048 elements a tile (16 a thread on 4 warps)."""
    block_h = next_pow2(half)
    return (16 if interpreting() else max(2048 // (2 * block_h), 1)), block_h


def norm_rope_fwd(x, weight, cos, sin, eps: float, dtype: torch.dtype | None = None, l2: bool = False):
    """``(y, rstd)``: ``y`` as x (contiguous ``[B, T, H, D]``) in ``dtype`` (None: x's), ``rstd: [B, T, H]`` fp32
    (empty without a norm). ``weight`` None and not ``l2``: no norm; ``l2``: the L2 norm (no weight); ``cos``
    None: no rotation."""
    B, T, H, D = x.shape
    n_rows = B * T * H
    y = torch.empty_like(x, dtype=dtype)
    normed = weight is not None or l2
    rstd = torch.empty((B, T, H) if normed else (0,), device=x.device, dtype=torch.float32)
    block_r, block_h = _tiles(D // 2)
    launch(
        _norm_rope_fwd_kernel, (ceil_div(n_rows, block_r),), x, weight if weight is not None else x,
        cos if cos is not None else x, sin if sin is not None else x, y, rstd, n_rows, T, H, D // 2, eps,
        BLOCK_R=block_r, BLOCK_H=block_h, NORM=weight is not None, L2=l2, ROTATE=cos is not None, num_warps=4)
    return y, rstd


def norm_rope_bwd(dy, x, weight, cos, sin, rstd, eps: float = 0.0, l2: bool = False):
    """``(dx, dw)``: ``dx`` as x, ``dw`` as weight (None without ``weight``); ``eps`` and ``l2`` as the forward's."""
    B, T, H, D = x.shape
    n_rows = B * T * H
    block_r, block_h = _tiles(D // 2)
    programs = max(min(ceil_div(n_rows, block_r), 1 if interpreting() else 4 * sm_count(x.device)), 1)
    dx = torch.empty_like(x)
    dw = torch.empty(D, programs, device=x.device, dtype=torch.float32) if weight is not None else dx
    launch(
        _norm_rope_bwd_kernel, (programs,), x, weight if weight is not None else x, cos if cos is not None else x,
        sin if sin is not None else x, dy, rstd, dx, dw, n_rows, T, H, D // 2, eps, BLOCK_R=block_r, BLOCK_H=block_h,
        NORM=weight is not None, L2=l2, ROTATE=cos is not None, num_warps=4)
    return dx, (dw.sum(1).to(weight.dtype) if weight is not None else None)
