"""fp32 operands as two fp16 parts each, for the scan's ``precision="fp16x3"``.

A value ``x`` scaled by a power of two ``2^c`` into fp16's range becomes ``hi + lo``: ``hi`` its nearest fp16
value (11 significant bits) and ``lo`` the nearest fp16 value of the rest, so ``hi + lo`` holds about 22 bits
of ``x``, as TF32's two parts do. A product is then three fp16 products, ``hi hi' + hi lo' + lo hi'`` (the
dropped ``lo lo'`` is ``2^-22`` of it), at the tensor cores' fp16 rate: twice TF32's.

The scales are chosen so no part leaves fp16's range and none but the negligible falls to its subnormals:
each group of values that meet in one sum is scaled so that its largest finite magnitude lies in
``[2^14, 2^15)``, and non-finite values are left out of that maximum (they stay non-finite in ``hi``):

* ``q`` and ``k`` per row (``[.., D]``): a score is ``(q~ . k~) * q_scale_i * k_scale_j``;
* ``v`` per column over the keys of each sequence (the weights ``p <= 1`` are scaled by ``2^14`` in the
  kernel): ``o = (p~ @ v~) * v_scale_d``. Below ``2^-38`` of a column's largest value (in its sequence) a
  value keeps only fp16's absolute steps, so values that span more than 2^14 in one column lose bits there,
  which fp32's range would keep (``"tf32x3"`` keeps them).

The scaling is exact (powers of two), so the parts differ from ``x`` by their rounding alone.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from regattn.ops._common.ints import ceil_div, next_pow2
from regattn.ops._common.launch import launch

TOP = 15  # each scaled group's largest magnitude lies in [2^(TOP - 1), 2^TOP)
P_SHIFT = 14  # the kernel's weights p <= 1 are multiplied by 2^P_SHIFT before their split
_TOP: tl.constexpr = tl.constexpr(TOP)
_P_SHIFT: tl.constexpr = tl.constexpr(P_SHIFT)


@triton.jit
def _pow2(e):
    """``2^e`` in fp32 for integers ``e`` in ``[-126, 127]``, exactly (from its bits)."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def times_pow2(x, e):
    """``x * 2^e`` for integers ``|e| <= 252``, as two exact factors (rounded only where fp32 underflows)."""
    half = e // 2
    return x * _pow2(half) * _pow2(e - half)


@triton.jit
def exponent_above(a):
    """``e`` with ``a < 2^e`` for finite ``a >= 0`` (``e = 0`` for ``a = 0``), from the bits of ``a``."""
    e = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 126
    return tl.where(a == 0.0, 0, e)


@triton.jit
def _store_parts(HI, LO, offs, x, shift, mask):
    """``x * 2^shift`` as fp16 ``hi + lo`` at ``offs``."""
    xs = times_pow2(x, shift)
    hi = xs.to(tl.float16)
    tl.store(HI + offs, hi, mask=mask)
    tl.store(LO + offs, (xs - hi.to(tl.float32)).to(tl.float16), mask=mask)


@triton.jit
def _row_block(X, n_rows, D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rows ``program_id(0) * BLOCK_R + arange`` of ``X [n_rows, D]``: ``(rows, cols, offsets, mask, x)``."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows < n_rows)[:, None] & (cols < D)[None, :]
    offs = rows.to(tl.int64)[:, None] * D + cols[None, :]
    return rows, cols, offs, mask, tl.load(X + offs, mask=mask, other=0.0)


@triton.jit
def _row_parts_kernel(X, HI, LO, SCALE, n_rows, T, H, D: tl.constexpr, BLOCK_R: tl.constexpr,
                      BLOCK_D: tl.constexpr):
    """Rows ``r = (b * T + t) * H + h`` of ``x [B, T, H, D]``: parts, and ``scale [B, H, T]``."""
    rows, cols, offs, mask, x = _row_block(X, n_rows, D, BLOCK_R, BLOCK_D)
    e = exponent_above(tl.max(tl.where(tl.abs(x) < float("inf"), tl.abs(x), 0.0), 1))
    _store_parts(HI, LO, offs, x, -(e - _TOP)[:, None], mask)
    bt = rows // H
    at = ((bt // T) * H + rows % H).to(tl.int64) * T + bt % T
    tl.store(SCALE + at, times_pow2(tl.full([BLOCK_R], 1.0, tl.float32), e - _TOP), mask=rows < n_rows)


@triton.jit
def _key_sequence(SEQ, keys, n_keys, S, VARLEN: tl.constexpr):
    """The sequence of the keys ``b * S + s``: ``SEQ[s]`` with ``VARLEN`` (``B == 1``), else ``b``."""
    if VARLEN:
        return tl.load(SEQ + keys, mask=keys < n_keys, other=0)
    return keys // S


@triton.jit
def _column_max_kernel(X, MOST, SEQ, n_keys, S, H, D: tl.constexpr, VARLEN: tl.constexpr, BLOCK_R: tl.constexpr,
                       BLOCK_D: tl.constexpr):
    """``MOST [N, H, D]`` (int32 bits of fp32, zeros to start): the largest finite ``|v|`` of each column of head
    ``program_id(1)`` over each sequence's keys, by atomic maxima (the bits of non-negative floats order as
    integers; relaxed: only the launch's end orders them): one per column for the block's keys in its first
    key's sequence, one per entry for the rest."""
    h = tl.program_id(1)
    keys = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # b * S + s
    cols = tl.arange(0, BLOCK_D)
    mask = (keys < n_keys)[:, None] & (cols < D)[None, :]
    x = tl.abs(tl.load(X + (keys.to(tl.int64) * H + h)[:, None] * D + cols[None, :], mask=mask, other=0.0))
    top = tl.where(x < float("inf"), x, 0.0).to(tl.int32, bitcast=True)
    seq = _key_sequence(SEQ, keys, n_keys, S, VARLEN)
    first = tl.min(tl.where(keys < n_keys, seq, 2 ** 30))
    same = seq == first
    tl.atomic_max(MOST + (first * H + h).to(tl.int64) * D + cols, tl.max(tl.where(same[:, None], top, 0), 0),
                  mask=cols < D, sem="relaxed")
    tl.atomic_max(MOST + (seq * H + h).to(tl.int64)[:, None] * D + cols[None, :], top, mask=mask & ~same[:, None],
                  sem="relaxed")


@triton.jit
def _column_parts_kernel(X, HI, LO, MOST, SCALE, SEQ, n_rows, S, H, D: tl.constexpr, VARLEN: tl.constexpr,
                         BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rows ``r = (b * S + s) * H + h`` of ``v [B, S, H, D]``: parts scaled by the column maxima ``MOST [N, H, D]``
    of the row's sequence (``SEQ [S]`` with ``VARLEN``, else its batch entry), and their scales into ``SCALE``
    (written alike by every row of a sequence)."""
    rows, cols, offs, mask, x = _row_block(X, n_rows, D, BLOCK_R, BLOCK_D)
    seq = _key_sequence(SEQ, rows // H, n_rows // H, S, VARLEN)
    at = (seq * H + rows % H).to(tl.int64)[:, None] * D + cols[None, :]
    e = exponent_above(tl.load(MOST + at, mask=mask, other=0).to(tl.float32, bitcast=True))
    _store_parts(HI, LO, offs, x, -(e - _TOP), mask)
    tl.store(SCALE + at, times_pow2(tl.full([BLOCK_R, BLOCK_D], 1.0, tl.float32), e - _TOP - _P_SHIFT), mask=mask)


def _blocks(n_rows: int, D: int):
    block_d = next_pow2(D)
    block_r = max(1, min(64, 4096 // block_d))
    return (ceil_div(n_rows, block_r),), dict(D=D, BLOCK_R=block_r, BLOCK_D=block_d)


def _empty_parts(x: torch.Tensor):
    return (torch.empty(x.shape, dtype=torch.float16, device=x.device),
            torch.empty(x.shape, dtype=torch.float16, device=x.device))


def row_parts(x: torch.Tensor):
    """``(hi, lo, scale)`` of ``x [B, T, H, D]`` fp32: ``x = (hi + lo) * scale`` row by row (fp16 parts,
    contiguous), ``scale [B, H, T]`` fp32 (a power of two)."""
    x = x.contiguous()
    B, T, H, D = x.shape
    hi, lo = _empty_parts(x)
    scale = torch.empty(B, H, T, dtype=torch.float32, device=x.device)
    grid, meta = _blocks(B * T * H, D)
    launch(_row_parts_kernel, grid, x, hi, lo, scale, B * T * H, T, H, **meta)
    return hi, lo, scale


def _sequence_of_keys(cu_seqlens: torch.Tensor, S: int) -> torch.Tensor:
    """The packed sequence of each key position ``[S]`` (positions past the last offset: the last one)."""
    pos = torch.arange(S, device=cu_seqlens.device)
    seq = torch.searchsorted(cu_seqlens[1:].to(torch.int64), pos, right=True)
    return seq.clamp(max=cu_seqlens.numel() - 2).to(torch.int32)


def column_parts(v: torch.Tensor, cu_seqlens: torch.Tensor | None):
    """``(hi, lo, scale)`` of ``v [B, S, H, DV]`` fp32: ``v = (hi + lo) * scale * 2^P_SHIFT`` column by column
    over each sequence's keys (each batch entry, or each packed sequence of ``cu_seqlens``); ``scale [N, H, DV]``
    fp32 with ``N`` sequences."""
    v = v.contiguous()
    B, S, H, D = v.shape
    varlen = cu_seqlens is not None
    seq = _sequence_of_keys(cu_seqlens, S) if varlen else v
    most = torch.zeros(cu_seqlens.numel() - 1 if varlen else B, H, D, dtype=torch.int32, device=v.device)
    grid, meta = _blocks(B * S, D)
    launch(_column_max_kernel, grid + (H,), v, most, seq, B * S, S, H, VARLEN=varlen, **meta)
    hi, lo = _empty_parts(v)
    scale = torch.full(most.shape, 2.0 ** -(TOP + P_SHIFT), device=v.device)  # that of a sequence with no keys
    grid, meta = _blocks(B * S * H, D)
    launch(_column_parts_kernel, grid, v, hi, lo, most, scale, seq, B * S * H, S, H, VARLEN=varlen, **meta)
    return hi, lo, scale
