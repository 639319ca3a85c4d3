"""causal_dot_product: the row recurrence of Appendix B.1 (Algorithm 1) with decay, as a Triton kernel.

One program owns a block of ``BD`` value columns of one (batch, head) and keeps the state
``U [R, BD]`` in float32 registers:

    U <- gamma U + c_t^T v_t,    o_t = b_t U         for t = 0 .. T-1 (or T-1 .. 0 with ``REVERSE``)

fp16, bf16 and fp32 inputs; the state is always float32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from regattn.ops._common.attention_tiles import head_block, interpreting
from regattn.ops._common.ints import ceil_div


@triton.jit
def _cdp_kernel(
    Bm, Cm, Vm, O, LOG2G,
    sb_b, sb_t, sb_h, sc_b, sc_t, sc_h, sv_b, sv_t, sv_h, so_b, so_t, so_h,
    T, H, R, D,
    BR: tl.constexpr, BD: tl.constexpr, REVERSE: tl.constexpr,
):
    pid_d = tl.program_id(0)
    pid_bh = tl.program_id(1)
    bi = (pid_bh // H).to(tl.int64)
    hi = pid_bh % H
    g = tl.exp2(tl.load(LOG2G + hi))
    offs_r = tl.arange(0, BR)
    offs_d = pid_d * BD + tl.arange(0, BD)
    mask_r = offs_r < R
    mask_d = offs_d < D
    U = tl.zeros((BR, BD), dtype=tl.float32)
    # 64-bit pointers walk the rows one step at a time (forward, or backward from the last row)
    first = bi * 0        # int64 zero
    step = 1
    if REVERSE:
        first += T - 1
        step = -1
    b_ptr = Bm + bi * sb_b + hi * sb_h + first * sb_t + offs_r
    c_ptr = Cm + bi * sc_b + hi * sc_h + first * sc_t + offs_r
    v_ptr = Vm + bi * sv_b + hi * sv_h + first * sv_t + offs_d
    o_ptr = O + bi * so_b + hi * so_h + first * so_t + offs_d
    for _ in range(T):
        b = tl.load(b_ptr, mask=mask_r, other=0.0).to(tl.float32)
        c = tl.load(c_ptr, mask=mask_r, other=0.0).to(tl.float32)
        v = tl.load(v_ptr, mask=mask_d, other=0.0).to(tl.float32)
        U = g * U + c[:, None] * v[None, :]
        o = tl.sum(b[:, None] * U, axis=0)
        tl.store(o_ptr, o.to(O.dtype.element_ty), mask=mask_d)
        b_ptr += step * sb_t
        c_ptr += step * sc_t
        v_ptr += step * sv_t
        o_ptr += step * so_t


def cdp_blocks(R: int, D: int) -> dict:
    """Value columns per program: a ``BR x BD`` float32 state in registers."""
    BR = head_block(R)
    if interpreting():
        return dict(BR=BR, BD=min(head_block(D), 16), num_warps=1)
    return dict(BR=BR, BD=min(head_block(D), max(16, 4096 // BR)), num_warps=4)


def cdp_forward(b, c, v, log2g, *, reverse: bool = False) -> torch.Tensor:
    """Row-by-row ``o_t = b_t U_t``: ``b, c: [B, T, H, R]``, ``v: [B, T, H, D]``, ``log2g: [H]`` fp32."""
    B, T, H, R = b.shape
    D = v.shape[-1]
    cfg = cdp_blocks(R, D)
    o = torch.empty_like(v)
    grid = (ceil_div(D, cfg["BD"]), B * H)
    _cdp_kernel[grid](
        b, c, v, o, log2g,
        b.stride(0), b.stride(1), b.stride(2), c.stride(0), c.stride(1), c.stride(2),
        v.stride(0), v.stride(1), v.stride(2), o.stride(0), o.stride(1), o.stride(2),
        T, H, R, D, BR=cfg["BR"], BD=cfg["BD"], REVERSE=reverse, num_warps=cfg["num_warps"],
    )
    return o
