"""NSA's selected attention (gatedfwa.md Appendix B, eq. 22) in Triton: each query attends the tokens at or
before it of the blocks it selected, with the selection given as block indices.

* forward: one program per (query, batch row, key/value head) holding the query heads of the group as the
  rows of its tiles (padded to 16, the smallest tile ``tl.dot`` takes), as in NSA's own kernel; it loops
  over the ``topk`` selected blocks, one key tile each, with the online softmax in base 2, and saves the
  log-sum-exp. Only visible tokens are loaded, so a non-finite key or value reaches only the rows that see it.
* backward: the same loop, query by query, recomputes each tile's probabilities and gives ``dQ``. ``dK`` and
  ``dV`` go block by block: :func:`inverse_index` lists, on the device, the queries that selected each block
  (a sort of the selections by block), cut into segments of at most :data:`SEGMENT` queries; one program per
  segment loads its block's keys and values once and takes the segment's queries, with their groups' query
  heads, as the rows of its tiles. A block's segments add their sums into fp32 buffers atomically, so the
  sums are taken in no fixed order.

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
from regattn.ops._common.ints import ceil_div, next_pow2

# Launch settings, from a sweep on the H100 (bf16, B1 HQ16 H4 D128, NSA's blocks): the backward took 12.6 ms at
# T = 32768 with segments of 256, 64 rows and 4 warps, against 15.7 ms with 128, 32 and 8 (segments of 64 to 512,
# 16 to 64 rows, 4 or 8 warps); the forward 8.5 ms on 2 warps against 9.2 on 4 and 12.4 on 8, dQ 9.0 against 9.3
# and 11.8. The dK/dV kernel on 64 rows and 4 warps holds 255 registers without spilling under triton 3.6 (it
# spills 304 bytes under 3.9).
SEGMENT = 256    # queries of one selection block a dK/dV program takes; a block chosen by more has several
DKV_ROWS = 64    # rows of a dK/dV tile: SEGMENT's queries taken DKV_ROWS // group at a time
DKV_WARPS = 4
QUERY_WARPS = 2  # the forward's and dQ's (a tile of 16 rows)


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
    """``(first grid index, batch row, key/value head)`` of a program of a grid ``(n, B * H)``: the query for the
    forward and dQ, the segment slot for dK/dV."""
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
def _load_tokens(P, b, tok, h, stride_b, stride_s, stride_h, E, visible, BLOCK_E: tl.constexpr):
    """The rows of :func:`_token_ptrs` loaded (0 where not visible), and their mask."""
    ptrs, mask = _token_ptrs(P, b, tok, h, stride_b, stride_s, stride_h, E, visible, BLOCK_E)
    return tl.load(ptrs, mask=mask, other=0.0), mask


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
        k, _ = _load_tokens(K, b, tok, h, stride_kb, stride_ks, stride_kh, D, visible, BLOCK_D)
        s2 = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale2
        s2 = tl.where(visible[None, :], s2, float("-inf"))
        m_i, l_i, p, alpha = online_softmax_step(m_i, l_i, s2, 1.0)
        v, _ = _load_tokens(V, b, tok, h, stride_vb, stride_vs, stride_vh, DV, visible, BLOCK_DV)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    o, lse2 = softmax_finish(acc, m_i, l_i)
    o_ptrs, o_mask = _group_rows(O, b, t, h, stride_ob, stride_ot, stride_oh, GROUP, DV, BLOCK_G, BLOCK_DV)
    tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=o_mask)
    g = tl.arange(0, BLOCK_G)
    tl.store(LSE + (b * H * GROUP + h * GROUP + g) * T + t, lse2, mask=g < GROUP)


@triton.jit
def selected_dq_kernel(Q, K, V, BLK, DO, LSE, DELTA, DQ,
                       stride_qb, stride_qt, stride_qh, stride_kb, stride_ks, stride_kh,
                       stride_vb, stride_vs, stride_vh, stride_bb, stride_bh, stride_bt,
                       stride_ob, stride_ot, stride_oh,
                       T, S, H, D, DV, offset, topk, block_slc, qk_scale2, scale,
                       GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                       BLOCK_DV: tl.constexpr, PRECISION: tl.constexpr):
    """``dQ`` of the program's query rows (``DO`` has o's strides, ``DQ`` q's). ``LSE, DELTA: [B, HQ, T]`` fp32."""
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
        k, _ = _load_tokens(K, b, tok, h, stride_kb, stride_ks, stride_kh, D, visible, BLOCK_D)
        v, _ = _load_tokens(V, b, tok, h, stride_vb, stride_vs, stride_vh, DV, visible, BLOCK_DV)
        seen = real[:, None] & visible[None, :]
        s2 = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale2
        p = tl.where(seen, tl.exp2(s2 - lse2[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = tl.where(seen, p * (dp - delta[:, None]), 0.0)
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    dq_ptrs, _ = _group_rows(DQ, b, t, h, stride_qb, stride_qt, stride_qh, GROUP, D, BLOCK_G, BLOCK_D)
    tl.store(dq_ptrs, (dq * scale).to(DQ.dtype.element_ty), mask=q_mask)


@triton.jit
def selected_dkv_kernel(Q, K, V, DO, LSE, DELTA, QUERIES, SEG_BLOCK, SEG_START, SEG_END, DK, DV_OUT,
                        stride_qb, stride_qt, stride_qh, stride_kb, stride_ks, stride_kh,
                        stride_vb, stride_vs, stride_vh, stride_ob, stride_ot, stride_oh,
                        T, S, H, D, DV, offset, entries, slots, block_slc, qk_scale2, scale,
                        GROUP: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                        BLOCK_DV: tl.constexpr, PRECISION: tl.constexpr):
    """``dK, dV`` (fp32, k's and v's strides) of one selection block from one segment of the queries that
    selected it (:func:`inverse_index`): the segment's queries are taken ``BLOCK_R // GROUP`` at a time, each
    with its group's query heads, as the rows of one tile; the block's sums are added atomically (a block
    selected by more queries than a segment holds has several segments)."""
    slot, b, h = _program(H)
    seg = tl.program_id(1) * slots + slot
    lo = tl.load(SEG_START + seg)
    hi = tl.load(SEG_END + seg)
    n = tl.arange(0, BLOCK_N)
    blk = tl.load(SEG_BLOCK + seg + 0 * n)  # the index read as a vector: the interpreter takes no scalar in a mask
    tok = blk * block_slc + n
    in_block = (blk >= 0) & (n < block_slc) & (tok < S)
    k, k_mask = _load_tokens(K, b, tok, h, stride_kb, stride_ks, stride_kh, D, in_block, BLOCK_D)
    v, v_mask = _load_tokens(V, b, tok, h, stride_vb, stride_vs, stride_vh, DV, in_block, BLOCK_DV)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    r = tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    e = tl.arange(0, BLOCK_DV)
    per_step = BLOCK_R // GROUP
    head = h * GROUP + r % GROUP
    for first in range(lo, hi, per_step):
        entry = first + r // GROUP
        real = (r < per_step * GROUP) & (entry < hi)
        t = tl.load(QUERIES + tl.program_id(1) * entries + entry, mask=real, other=0)
        q = tl.load(Q + b * stride_qb + t[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                    mask=real[:, None] & (d < D)[None, :], other=0.0)
        do = tl.load(DO + b * stride_ob + t[:, None] * stride_ot + head[:, None] * stride_oh + e[None, :],
                     mask=real[:, None] & (e < DV)[None, :], other=0.0)
        rows = (b * H * GROUP + head) * T + t
        lse2 = tl.load(LSE + rows, mask=real, other=0.0)
        delta = tl.load(DELTA + rows, mask=real, other=0.0)
        seen = real[:, None] & in_block[None, :] & (tok[None, :] <= (offset + t)[:, None])
        s2 = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale2
        p = tl.where(seen, tl.exp2(s2 - lse2[:, None]), 0.0)
        dv += tl.dot(tl.trans(p).to(do.dtype), do, input_precision=PRECISION)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = tl.where(seen, p * (dp - delta[:, None]), 0.0)
        dk += tl.dot(tl.trans(ds).to(q.dtype), q, input_precision=PRECISION)
    dk_ptrs, _ = _token_ptrs(DK, b, tok, h, stride_kb, stride_ks, stride_kh, D, in_block, BLOCK_D)
    dv_ptrs, _ = _token_ptrs(DV_OUT, b, tok, h, stride_vb, stride_vs, stride_vh, DV, in_block, BLOCK_DV)
    tl.atomic_add(dk_ptrs, dk * scale, mask=k_mask)
    tl.atomic_add(dv_ptrs, dv, mask=v_mask)


def inverse_index(blocks: torch.Tensor, n_slc: int, segment: int):
    """For each ``(b, h)``, the queries that selected each block, in segments of at most ``segment`` queries.

    ``blocks [B, H, T, topk]`` (``-1``: none). Returns ``queries [B, H, T * topk]`` int32 (the query of each
    selection, grouped by block in ascending order, unused entries last) and, for each of ``slots = ceil(T *
    topk / segment) + n_slc`` segment slots (at least the number of segments), ``block, start, end [B, H,
    slots]`` int32: the slot's block (``-1`` for an unused slot) and its range of ``queries``. On the device,
    with no host read.
    """
    B, H, T, K = blocks.shape
    key = blocks.reshape(B, H, T * K).long()
    key = torch.where(key >= 0, key, n_slc)                                        # unused entries sort last
    queries = (torch.sort(key, dim=-1, stable=True).indices // K).to(torch.int32)
    counts = torch.zeros(B, H, n_slc + 1, dtype=torch.long, device=blocks.device)
    counts = counts.scatter_add_(-1, key, torch.ones_like(key))[..., :n_slc]
    first = counts.cumsum(-1) - counts
    segments = (counts + segment - 1) // segment
    last_slot = segments.cumsum(-1)                                                # one past each block's slots
    slots = -(-T * K // segment) + n_slc
    slot = torch.arange(slots, device=blocks.device).expand(B, H, slots).contiguous()
    block = torch.searchsorted(last_slot, slot, right=True)                        # n_slc: an unused slot
    used = block < n_slc
    block = block.clamp_max(n_slc - 1)
    start = first.gather(-1, block) + (slot - last_slot.gather(-1, block) + segments.gather(-1, block)) * segment
    end = torch.minimum(start + segment, (first + counts).gather(-1, block))
    block = torch.where(used, block, -1)
    start, end = torch.where(used, start, 0), torch.where(used, end, 0)
    return queries, block.to(torch.int32), start.to(torch.int32), end.to(torch.int32)


def _launch(q, k, v, blocks, block_slc, num_warps):
    """Grid, strides and tile sizes of the query-centric kernels (forward and dQ)."""
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
    grid, strides, dims, sizes = _launch(q, k, v, blocks, block_slc, num_warps=QUERY_WARPS)
    selected_fwd_kernel[grid](q, k, v, blocks, o, lse, *strides, *o.stride()[:3], *dims, offset, blocks.shape[3],
                              block_slc, scale * LOG2E, **sizes)
    return o, lse


def selected_backward(do, q, k, v, blocks, o, lse, *, block_slc: int, offset: int, scale: float):
    """``(dq, dk, dv)`` in the inputs' dtypes for contiguous inputs: ``dq`` query by query, ``dk, dv`` block by
    block over the queries that selected it (:func:`inverse_index`), summed in fp32."""
    do = do.contiguous()
    dq = torch.empty_like(q)
    dk = torch.zeros(k.shape, device=k.device, dtype=torch.float32)
    dv = torch.zeros(v.shape, device=v.device, dtype=torch.float32)
    B, T, HQ, _ = q.shape
    if T:
        delta = row_dot(o, do, heads_first=True)  # [B, HQ, T]
        topk = blocks.shape[3]
        grid, strides, dims, sizes = _launch(q, k, v, blocks, block_slc, num_warps=QUERY_WARPS)
        selected_dq_kernel[grid](q, k, v, blocks, do, lse, delta, dq, *strides, *o.stride()[:3], *dims, offset, topk,
                                 block_slc, scale * LOG2E, scale, **sizes)
        queries, seg_block, seg_start, seg_end = inverse_index(blocks, ceil_div(k.shape[1], block_slc), SEGMENT)
        group = sizes.pop("GROUP")
        sizes.pop("BLOCK_G")
        if not interpreting():
            sizes.update(num_warps=DKV_WARPS)
        selected_dkv_kernel[(seg_block.shape[2], grid[1])](
            q, k, v, do, lse, delta, queries, seg_block, seg_start, seg_end, dk, dv, *strides[:9], *do.stride()[:3],
            *dims, offset, T * topk, seg_block.shape[2], block_slc, scale * LOG2E, scale, GROUP=group,
            BLOCK_R=max(DKV_ROWS, next_pow2(group)), **sizes)
    return dq, dk.to(k.dtype), dv.to(v.dtype)
