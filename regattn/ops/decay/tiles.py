"""Powers of gamma the row-block decay kernels share (``lightning2``, ``fleet``).

A block holds ``BT`` rows ``p = 0 .. BT-1``. Powers come from ``log2g = log2 gamma`` and only
non-negative exponents are formed, so gamma near 0 underflows to exact zeros and gamma = 1 never
overflows.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def decay_matrix(offs_t, log2g):
    """``M [BT, BT]``: ``gamma^(p-q)`` for ``p >= q``, else 0 (the decayed causal mask of one block)."""
    dist = offs_t[:, None] - offs_t[None, :]
    return tl.where(dist >= 0, tl.exp2(tl.maximum(dist, 0).to(tl.float32) * log2g), 0.0)


@triton.jit
def decay_into(offs_t, log2g):
    """``gamma^(p+1)``: the weight of the state carried into the block, per row ``[BT]``."""
    return tl.exp2((offs_t + 1).to(tl.float32) * log2g)


@triton.jit
def decay_out_of(n, offs_t, valid, log2g):
    """``gamma^(n-1-p)`` for the ``valid`` rows of a block of ``n`` (0 elsewhere): each row's weight in the
    state carried out of the block."""
    return tl.where(valid, tl.exp2(tl.maximum(n - 1 - offs_t, 0).to(tl.float32) * log2g), 0.0)

