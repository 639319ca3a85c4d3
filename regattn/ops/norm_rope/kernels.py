"""Per-head RMSNorm and RoPE of ``[B, T, H, D]`` queries or keys in one pass, forward and backward.

``y = rope(x * rstd * w)``, ``rstd = 1 / sqrt(mean(x^2) + eps)`` over ``D``, computed in fp32 and rounded
once to x's dtype. The rotation turns the pair ``(n[j], n[j + D/2])`` by the angle of the row's token:
``y1 = n1 c - n2 s``, ``y2 = n2 c + n1 s`` with ``c, s: [T, D/2]`` (fp32) given per token. Either step can
be left out (``NORM``, ``ROTATE``). The backward recomputes ``x * rstd`` from x and the saved ``rstd``.
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
                          BLOCK_H: tl.constexpr, NORM: tl.constexpr, ROTATE: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_H)
    cmask = cols < HALF
    mask = (rows < n_rows)[:, None] & cmask[None, :]
    n1, n2 = _load_halves(X, rows, cols, HALF, mask)
    if NORM:
        eps = tl.cast(eps, tl.float32)  # fp64 when torch.compile launches the kernel: keep the arithmetic fp32
        rstd = 1.0 / tl.sqrt((tl.sum(n1 * n1, 1) + tl.sum(n2 * n2, 1)) / (2 * HALF) + eps)
        tl.store(RSTD + rows, rstd, mask=rows < n_rows)
        w1, w2 = _weights(W, cols, HALF, cmask)
        n1, n2 = n1 * rstd[:, None] * w1, n2 * rstd[:, None] * w2
    if ROTATE:
        c, s = _angles(COS, SIN, rows, cols, T, H, HALF, mask)
        n1, n2 = n1 * c - n2 * s, n2 * c + n1 * s
    _store_halves(Y, rows, cols, HALF, mask, n1, n2)


@triton.jit
def _norm_rope_bwd_kernel(X, W, COS, SIN, DY, RSTD, DX, DW, n_rows, T, H, HALF, BLOCK_R: tl.constexpr,
                          BLOCK_H: tl.constexpr, NORM: tl.constexpr, ROTATE: tl.constexpr):
    """Each program walks row blocks ``pid, pid + programs, ...`` and writes its part of ``dw`` to ``DW[pid]``."""
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
        if NORM:
            x1, x2 = _load_halves(X, rows, cols, HALF, mask)
            rstd = tl.load(RSTD + rows, mask=rows < n_rows, other=0.0)[:, None]
            x1, x2 = x1 * rstd, x2 * rstd
            dw1 += tl.sum(g1 * x1, 0)
            dw2 += tl.sum(g2 * x2, 0)
            g1, g2 = g1 * w1, g2 * w2
            mean = ((tl.sum(g1 * x1, 1) + tl.sum(g2 * x2, 1)) / (2 * HALF))[:, None]
            g1, g2 = rstd * (g1 - x1 * mean), rstd * (g2 - x2 * mean)
        _store_halves(DX, rows, cols, HALF, mask, g1, g2)
    if NORM:
        tl.store(DW + tl.program_id(0) * 2 * HALF + cols, dw1, mask=cmask)
        tl.store(DW + tl.program_id(0) * 2 * HALF + HALF + cols, dw2, mask=cmask)


def _tiles(half: int) -> tuple[int, int]:
    """``(BLOCK_R, BLOCK_H)``: about 2048 elements a tile (16 a thread on 4 warps)."""
    block_h = next_pow2(half)
    return (16 if interpreting() else max(2048 // (2 * block_h), 1)), block_h


def norm_rope_fwd(x, weight, cos, sin, eps: float):
    """``(y, rstd)``: ``y`` as x (contiguous ``[B, T, H, D]``), ``rstd: [B, T, H]`` fp32 (empty without
    ``weight``). ``weight`` None: no norm; ``cos`` None: no rotation."""
    B, T, H, D = x.shape
    n_rows = B * T * H
    y = torch.empty_like(x)
    rstd = torch.empty((B, T, H) if weight is not None else (0,), device=x.device, dtype=torch.float32)
    block_r, block_h = _tiles(D // 2)
    launch(
        _norm_rope_fwd_kernel, (ceil_div(n_rows, block_r),), x, weight if weight is not None else x,
        cos if cos is not None else x, sin if sin is not None else x, y, rstd, n_rows, T, H, D // 2, eps,
        BLOCK_R=block_r, BLOCK_H=block_h, NORM=weight is not None, ROTATE=cos is not None, num_warps=4)
    return y, rstd


def norm_rope_bwd(dy, x, weight, cos, sin, rstd):
    """``(dx, dw)``: ``dx`` as x, ``dw`` as weight (None without ``weight``)."""
    B, T, H, D = x.shape
    n_rows = B * T * H
    block_r, block_h = _tiles(D // 2)
    programs = max(min(ceil_div(n_rows, block_r), 1 if interpreting() else 4 * sm_count(x.device)), 1)
    dx = torch.empty_like(x)
    dw = torch.empty(programs, D, device=x.device, dtype=torch.float32) if weight is not None else dx
    launch(
        _norm_rope_bwd_kernel, (programs,), x, weight if weight is not None else x, cos if cos is not None else x,
        sin if sin is not None else x, dy, rstd, dx, dw, n_rows, T, H, D // 2, BLOCK_R=block_r, BLOCK_H=block_h,
        NORM=weight is not None, ROTATE=cos is not None, num_warps=4)
    return dx, (dw.sum(0).to(weight.dtype) if weight is not None else None)
