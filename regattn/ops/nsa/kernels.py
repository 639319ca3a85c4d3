"""NSA's selected attention (gatedfwa.md Appendix B, eq. 22) in Triton: each query attends the tokens at or
before it of the blocks it selected, with the selection given as block indices.

* forward: one program per (query, batch row, key/value head) holding the query heads of the group as the
  rows of its tiles (padded to 16, the smallest tile ``tl.dot`` takes), as in NSA's own kernel; it loops
  over the ``topk`` selected blocks, one key tile each, with the online softmax in base 2, and saves the
  log-sum-exp. Only visible tokens are loaded, so a non-finite key or value reaches only the rows that see it.
* backward: the same loop recomputes each tile's probabilities and gives ``dQ`` in registers; ``dK`` and
  ``dV`` of the tile's tokens are added into fp32 buffers atomically (queries select overlapping blocks),
  so their sums are taken in no fixed order.

Layout: ``q: [B, T, HQ, D]`` (queries at positions ``offset .. offset + T - 1``), ``k: [B, S, H, D]``,
``v: [B, S, H, Dv]``, ``blocks: [B, H, T, topk]`` int32 selection-block indices, ``-1`` where a query
selected no block.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from regattn.ops._common.attention_tiles import (
    LOG2E, dot_precision, head_block, interpreting, online_softmax_step, row_dot, softmax_finish,
)
from regattn.ops._common.ints import next_pow2


@triton.jit
def _group_rows(P, b, t, h, stride_b, stride_t, stride_h, GROUP: tl.constexpr, E,
                BLOCK_G: tl.constexpr, BLOCK_E: tl.constexpr):
    """Pointers ``[BLOCK_G, BLOCK_E]`` to the rows of query token ``t`` of the heads of group ``h``, and their mask."""
    g = tl.arange(0, BLOCK_G)
    e = tl.arange(0, BLOCK_E)
    ptrs = P + b * stride_b + t * stride_t + (h * GROUP + g)[:, None] * stride_h + e[None, :]
    return ptrs, (g < GROUP)[:, None] & (e < E)[None, :]


@triton.jit
def _load_group_rows(P, b, t, h, stride_b, stride_t, stride_h, GROUP: tl.constexpr, E,
                     BLOCK_G: tl.constexpr, BLOCK_E: tl.constexpr):
    """The rows of :func:`_group_rows` loaded (0 where masked), and their mask."""
    ptrs, mask = _group_rows(P, b, t, h, stride_b, stride_t, stride_h, GROUP, E, BLOCK_G, BLOCK_E)
    return tl.load(ptrs, mask=mask, other=0.0), mask


@triton.jit
def _program(H):
    """``(query, batch row, key/value head)`` of a program of the grid ``(T, B * H)``."""
    return tl.program_id(0), tl.program_id(1) // H, tl.program_id(1) % H


@triton.jit
def _block_tokens(BLK, i, pos, S, BLOCK_SLC, BLOCK_N: tl.constexpr):
    """The tokens of the ``i``-th selected block (``BLK`` at the query's list) and which of them are visible."""
    n = tl.arange(0, BLOCK_N)
    blk = tl.load(BLK + i + 0 * n)  # the index read as a vector: the interpreter takes no scalar in a mask
    tok = blk * BLOCK_SLC + n
    return tok, (blk >= 0) & (n < BLOCK_SLC) & (tok <= pos) & (tok < S)


@triton.jit
def _token_ptrs(P, b, tok, h, stride_b, stride_s, stride_h, E, visible, BLOCK_E: tl.constexpr):
    """Pointers ``[BLOCK_N, BLOCK_E]`` to tokens ``tok`` of head ``h``, and the mask of the visible ones."""
    e = tl.arange(0, BLOCK_E)
    return P + b * stride_b + tok[:, None] * stride_s + h * stride_h + e[None, :], visible[:, None] & (e < E)[None, :]


@triton.jit
def selected_fwd_kernel(Q, K, V, BLK, O, LSE,
                        stride_qb, stride_qt, stride_qh, stride_kb, stride_ks, stride_kh,
                        stride_vb, stride_vs, stride_vh, stride_bb, stride_bh, stride_bt,
                        stride_ob, stride_ot, stride_oh,
                        T, S, H, D, DV, offset, topk, block_slc, qk_scale2,
                        GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                        BLOCK_DV: tl.constexpr, PRECISION: tl.constexpr):
    t, b, h = _program(H)
    q, q_mask = _load_group_rows(Q, b, t, h, stride_qb, stride_qt, stride_qh, GROUP, D, BLOCK_G, BLOCK_D)
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], dtype=tl.float32)
    pos = offset + t
    blk_list = BLK + b * stride_bb + h * stride_bh + t * stride_bt
    for i in range(topk):
        tok, visible = _block_tokens(blk_list, i, pos, S, block_slc, BLOCK_N)
        k_ptrs, k_mask = _token_ptrs(K, b, tok, h, stride_kb, stride_ks, stride_kh, D, visible, BLOCK_D)
        k = tl.load(k_ptrs, mask=k_mask, other=0.0)
        s2 = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale2
        s2 = tl.where(visible[None, :], s2, float("-inf"))
        m_i, l_i, p, alpha = online_softmax_step(m_i, l_i, s2)
        v_ptrs, v_mask = _token_ptrs(V, b, tok, h, stride_vb, stride_vs, stride_vh, DV, visible, BLOCK_DV)
        v = tl.load(v_ptrs, mask=v_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    o, lse2 = softmax_finish(acc, m_i, l_i)
    o_ptrs, o_mask = _group_rows(O, b, t, h, stride_ob, stride_ot, stride_oh, GROUP, DV, BLOCK_G, BLOCK_DV)
    tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=o_mask)
    g = tl.arange(0, BLOCK_G)
    tl.store(LSE + (b * H * GROUP + h * GROUP + g) * T + t, lse2, mask=g < GROUP)


@triton.jit
def selected_bwd_kernel(Q, K, V, BLK, DO, LSE, DELTA, DQ, DK, DV_OUT,
                        stride_qb, stride_qt, stride_qh, stride_kb, stride_ks, stride_kh,
                        stride_vb, stride_vs, stride_vh, stride_bb, stride_bh, stride_bt,
                        stride_ob, stride_ot, stride_oh,
                        T, S, H, D, DV, offset, topk, block_slc, qk_scale2, scale,
                        GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                        BLOCK_DV: tl.constexpr, PRECISION: tl.constexpr):
    """``dQ`` of the program's query rows (``DO``, ``DQ`` share q's and o's strides); ``dK, dV`` (fp32, k's and
    v's strides) atomically. ``LSE, DELTA: [B, HQ, T]`` fp32."""
    t, b, h = _program(H)
    q, q_mask = _load_group_rows(Q, b, t, h, stride_qb, stride_qt, stride_qh, GROUP, D, BLOCK_G, BLOCK_D)
    do, do_mask = _load_group_rows(DO, b, t, h, stride_ob, stride_ot, stride_oh, GROUP, DV, BLOCK_G, BLOCK_DV)
    g = tl.arange(0, BLOCK_G)
    rows = (b * H * GROUP + h * GROUP + g) * T + t
    real = g < GROUP
    lse2 = tl.load(LSE + rows, mask=real, other=0.0)
    delta = tl.load(DELTA + rows, mask=real, other=0.0)
    dq = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    pos = offset + t
    blk_list = BLK + b * stride_bb + h * stride_bh + t * stride_bt
    for i in range(topk):
        tok, visible = _block_tokens(blk_list, i, pos, S, block_slc, BLOCK_N)
        k_ptrs, k_mask = _token_ptrs(K, b, tok, h, stride_kb, stride_ks, stride_kh, D, visible, BLOCK_D)
        v_ptrs, v_mask = _token_ptrs(V, b, tok, h, stride_vb, stride_vs, stride_vh, DV, visible, BLOCK_DV)
        k = tl.load(k_ptrs, mask=k_mask, other=0.0)
        v = tl.load(v_ptrs, mask=v_mask, other=0.0)
        seen = real[:, None] & visible[None, :]
        s2 = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale2
        p = tl.where(seen, tl.exp2(s2 - lse2[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = tl.where(seen, p * (dp - delta[:, None]), 0.0)
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
        dk = tl.dot(tl.trans(ds).to(q.dtype), q, input_precision=PRECISION) * scale
        dv = tl.dot(tl.trans(p).to(do.dtype), do, input_precision=PRECISION)
        dk_ptrs, _ = _token_ptrs(DK, b, tok, h, stride_kb, stride_ks, stride_kh, D, visible, BLOCK_D)
        dv_ptrs, _ = _token_ptrs(DV_OUT, b, tok, h, stride_vb, stride_vs, stride_vh, DV, visible, BLOCK_DV)
        tl.atomic_add(dk_ptrs, dk, mask=k_mask)
        tl.atomic_add(dv_ptrs, dv, mask=v_mask)
    dq_ptrs, _ = _group_rows(DQ, b, t, h, stride_qb, stride_qt, stride_qh, GROUP, D, BLOCK_G, BLOCK_D)
    tl.store(dq_ptrs, (dq * scale).to(DQ.dtype.element_ty), mask=q_mask)


def _launch(q, k, v, blocks, block_slc, num_warps):
    """Grid, strides and tile sizes shared by both kernels."""
    B, T, HQ, D = q.shape
    S, H, DV = k.shape[1], k.shape[2], v.shape[3]
    sizes = dict(GROUP=HQ // H, BLOCK_G=max(16, next_pow2(HQ // H)), BLOCK_N=max(16, next_pow2(block_slc)),
                 BLOCK_D=head_block(D), BLOCK_DV=head_block(DV), PRECISION=dot_precision(q.dtype))
    if not interpreting():
        sizes.update(num_warps=num_warps, num_stages=2)
    strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *blocks.stride()[:3])
    return (T, B * H), strides, (T, S, H, D, DV), sizes


def selected_forward(q, k, v, blocks, *, block_slc: int, offset: int, scale: float):
    """``(o [B, T, HQ, Dv] in q's dtype, lse2 [B, HQ, T] fp32)``: attention over the selected blocks' tokens
    for contiguous ``q, k, v, blocks``."""
    B, T, HQ, _ = q.shape
    o = torch.empty(B, T, HQ, v.shape[3], device=q.device, dtype=q.dtype)
    lse = torch.empty(B, HQ, T, device=q.device, dtype=torch.float32)
    if T == 0:
        return o, lse
    grid, strides, dims, sizes = _launch(q, k, v, blocks, block_slc, num_warps=4)
    selected_fwd_kernel[grid](q, k, v, blocks, o, lse, *strides, *o.stride()[:3], *dims, offset, blocks.shape[3],
                              block_slc, scale * LOG2E, **sizes)
    return o, lse


def selected_backward(do, q, k, v, blocks, o, lse, *, block_slc: int, offset: int, scale: float):
    """``(dq, dk, dv)`` in the inputs' dtypes for contiguous inputs; ``dk, dv`` summed in fp32."""
    do = do.contiguous()
    dq = torch.empty_like(q)
    dk = torch.zeros(k.shape, device=k.device, dtype=torch.float32)
    dv = torch.zeros(v.shape, device=v.device, dtype=torch.float32)
    if q.shape[1]:
        delta = row_dot(o, do).transpose(1, 2).contiguous()   # [B, HQ, T]
        grid, strides, dims, sizes = _launch(q, k, v, blocks, block_slc, num_warps=8)  # 4 spill at D = 128
        selected_bwd_kernel[grid](q, k, v, blocks, do, lse, delta, dq, dk, dv, *strides, *o.stride()[:3], *dims,
                                  offset, blocks.shape[3], block_slc, scale * LOG2E, scale, **sizes)
    return dq, dk.to(k.dtype), dv.to(v.dtype)
