"""fleet: FleetAttention (leetdecoding.txt Section 3.1, Algorithm 5, Appendix C.1) as a Triton kernel.

``O = sum_r diag(b_r) lambda-cumsum(diag(c_r) V)``. One program owns a block of ``BD`` value
columns of one (batch, head) and walks the rows in blocks of ``BT`` (Algorithm 5's ``B_r``).
Inside a row block, for a chunk of ``RB`` ranks at a time:

    X_r  = diag(c_r) V_blk                          [BT, RB, BD]
    Y_r  = M X_r + gamma^(p+1) l_r                  the lambda-cumsum: M_pq = gamma^(p-q), p >= q
    O   += sum_r diag(b_r) Y_r
    l_r <- gamma^n l_r + sum_p gamma^(n-1-p) X_r[p]  the carried prefix sums (Algorithm 5 line 13)

The prefix sums ``l`` (``R x BD`` per program) live in a float32 scratch buffer that only their
own program reads and writes, so the sum over ranks needs no atomics (the race of Appendix D
cannot happen). ``REVERSE`` walks the rows from the end (for the backward).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from regattn.ops._common.attention_tiles import dot_precision, head_block, interpreting
from regattn.ops._common.ints import ceil_div
from regattn.ops.decay.tiles import decay_into, decay_matrix, decay_out_of


@triton.jit
def _fleet_kernel(
    Bm, Cm, Vm, O, L, LOG2G,
    sb_b, sb_t, sb_h, sc_b, sc_t, sc_h, sv_b, sv_t, sv_h, so_b, so_t, so_h,
    T, H, R, D,
    BT: tl.constexpr, RB: tl.constexpr, BD: tl.constexpr, REVERSE: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_d = tl.program_id(0)
    pid_bh = tl.program_id(1)
    bi = (pid_bh // H).to(tl.int64)
    hi = pid_bh % H
    log2g = tl.load(LOG2G + hi)

    offs_t = tl.arange(0, BT)
    offs_k = tl.arange(0, RB)
    offs_d = pid_d * BD + tl.arange(0, BD)
    mask_d = offs_d < D
    cumsum_mask = decay_matrix(offs_t, log2g)
    into = decay_into(offs_t, log2g)
    l_base = L + pid_bh.to(tl.int64) * R * D

    for start in range(0, T, BT):
        t = start + offs_t
        valid = t < T
        if REVERSE:
            pos = (T - 1 - t).to(tl.int64)
        else:
            pos = t.to(tl.int64)
        v = tl.load(Vm + bi * sv_b + pos[:, None] * sv_t + hi * sv_h + offs_d[None, :],
                    mask=valid[:, None] & mask_d[None, :], other=0.0).to(tl.float32)
        n = tl.minimum(T - start, BT)
        out_of = decay_out_of(n, offs_t, valid, log2g)
        g_n = tl.exp2(n.to(tl.float32) * log2g)
        o = tl.zeros((BT, BD), dtype=tl.float32)
        for r0 in range(0, R, RB):
            rr = r0 + offs_k
            mask_r = rr < R
            rows = valid[:, None] & mask_r[None, :]
            b = tl.load(Bm + bi * sb_b + pos[:, None] * sb_t + hi * sb_h + rr[None, :], mask=rows, other=0.0)
            c = tl.load(Cm + bi * sc_b + pos[:, None] * sc_t + hi * sc_h + rr[None, :], mask=rows, other=0.0)
            x = c.to(tl.float32)[:, :, None] * v[:, None, :]                                # [BT, RB, BD]
            y = tl.dot(cumsum_mask, tl.reshape(x, (BT, RB * BD)), input_precision=PRECISION)
            l_ptr = l_base + rr[:, None] * D + offs_d[None, :]
            l_mask = mask_r[:, None] & mask_d[None, :]
            carried = tl.load(l_ptr, mask=l_mask, other=0.0)                                # [RB, BD]
            y3 = tl.reshape(y, (BT, RB, BD)) + into[:, None, None] * carried[None, :, :]
            o += tl.sum(b.to(tl.float32)[:, :, None] * y3, axis=1)
            carried = g_n * carried + tl.sum(out_of[:, None, None] * x, axis=0)
            tl.store(l_ptr, carried, mask=l_mask)
            tl.debug_barrier()
        tl.store(O + bi * so_b + pos[:, None] * so_t + hi * so_h + offs_d[None, :], o.to(O.dtype.element_ty),
                 mask=valid[:, None] & mask_d[None, :])


def fleet_blocks(R: int, D: int) -> dict:
    """Row block ``BT``, rank chunk ``RB``, value columns ``BD``: the ``BT x RB x BD`` float32 tile
    must fit in registers."""
    if interpreting():
        return dict(BT=16, RB=min(8, head_block(R)), BD=min(head_block(D), 16), num_warps=1)
    return dict(BT=16, RB=8, BD=min(head_block(D), 64), num_warps=4)


def fleet_forward(b, c, v, log2g, *, reverse: bool = False) -> torch.Tensor:
    """``o = sum_r diag(b_r) lambda-cumsum(diag(c_r) v)``: ``b, c: [B, T, H, R]``, ``v: [B, T, H, D]``,
    ``log2g: [H]`` fp32. Returns ``o`` in v's dtype."""
    B, T, H, R = b.shape
    D = v.shape[-1]
    cfg = fleet_blocks(R, D)
    o = torch.empty_like(v)
    prefix = torch.zeros(B * H, R, D, device=v.device, dtype=torch.float32)
    grid = (ceil_div(D, cfg["BD"]), B * H)
    _fleet_kernel[grid](
        b, c, v, o, prefix, log2g,
        b.stride(0), b.stride(1), b.stride(2), c.stride(0), c.stride(1), c.stride(2),
        v.stride(0), v.stride(1), v.stride(2), o.stride(0), o.stride(1), o.stride(2),
        T, H, R, D,
        BT=cfg["BT"], RB=cfg["RB"], BD=cfg["BD"], REVERSE=reverse,
        PRECISION="ieee" if v.dtype == torch.float32 else "tf32", num_warps=cfg["num_warps"],
    )
    return o
