"""Triton kernels of the ELSA scan: softmax attention as a reduction over the ``(m, S, W)`` monoid.

Forward, for one tile of queries and one slice of keys:

* intra-block: a tile of ``BLOCK_N`` keys becomes one state by tree reductions across the tile
  (``tl.max`` for ``m``, ``tl.sum`` for ``S`` and the tensor-core / FMA dot for ``W``);
* the tile's state merges into the running state by un-sum-renorm (the online-softmax step); strict
  fp32 folds in two levels (chunks of ``CHUNK_TILES`` tiles, then the chunks), so no accumulator
  takes more than ``max(CHUNK_TILES * BLOCK_N, n / (CHUNK_TILES * BLOCK_N))`` sequential additions (a
  tile's ``p @ v`` adds into its chunk's ``W`` inside the FMA dot);
* inter-block (split-KV): the keys are cut into ``NSPLIT`` slices run by separate programs, and a
  merge kernel combines their states by a balanced pairwise tree of depth ``log2(NSPLIT)``.

Logits are kept in base 2 (``qk_scale = scale * log2(e)``); ``lse`` is stored in base 2 as well,
``+inf`` for a query that sees no key (its output is 0 and its gradient 0).

The backward streams queries past each key tile for ``dk, dv``. For fp16/bf16 the same pass adds each
query tile's share of ``dq`` into an fp32 buffer (atomics, or Hopper's tensor-memory reduction), so ``p``
and ``ds`` are formed once per pair of tiles; fp32 inputs take the two-kernel form, ``dq`` per query tile
looping over keys in a pass of its own (both passes recomputing ``p = exp2(s - lse)``).

Precisions (fp32 inputs): ``"ieee"`` strict fp32 (FMA, no TF32; every tile transposed, the keys on its rows:
:func:`_fold_tile_t`), ``"tf32x3"`` (three TF32 products,
fp32-accurate), ``"fp16x3"`` (three products of fp16 parts, as accurate at twice the rate:
:mod:`regattn.ops.scan.split`; its backward is tf32x3's), ``"tf32"`` (operands rounded to the nearest TF32
value, not truncated). fp16/bf16 inputs use their own tensor cores with fp32 accumulation.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from regattn.ops._common.attention_tiles import (
    LOG2E, contained_dot, contained_dot_t, contained_split_dot, full_key_span, head_block, interpreting, key_span,
    online_softmax_step, query_span, query_tile, row_dot, sees_non_finite_t, size_class, softmax_finish, split_dot,
    tf32_parts, tf32_round, tile_configs, tile_loop_bounds, tma_descriptors, tma_pays, visible_mask, visible_mask_t,
)
from regattn.ops._common.checks import longest_sequence, sm_count
from regattn.ops._common.ints import ceil_div
from regattn.ops._common.launch import launch_tuned
from regattn.ops.scan.split import P_SHIFT, column_parts, row_parts

P_SCALE: tl.constexpr = tl.constexpr(2.0 ** P_SHIFT)


# ----------------------------------------------------------------------------- shared tile pieces

@triton.jit
def _sequence(CU, b, T, S, VARLEN: tl.constexpr):
    """(batch index into the tensors, first row, query count, key count) of sequence ``b``."""
    bat = b
    row0 = b * 0
    Tb = T + b * 0
    Sb = S + b * 0
    if VARLEN:
        bat = b * 0
        row0 = tl.minimum(tl.maximum(tl.load(CU + b).to(tl.int32), 0), T)  # unchecked offsets clamped to [0, T]
        Tb = tl.minimum(tl.maximum(tl.load(CU + b + 1).to(tl.int32), row0), T) - row0
        Sb = Tb
    return bat, row0, Tb, Sb


@triton.jit
def _sequence_head(CU, pid_bh, T, S, HQ, VARLEN: tl.constexpr):
    """``(batch index, query head, first row, query count, key count)`` of the grid index ``pid_bh``
    over ``sequences * HQ``."""
    b = pid_bh // HQ
    h = pid_bh % HQ
    bat, row0, Tb, Sb = _sequence(CU, b, T, S, VARLEN)
    return bat, h, row0, Tb, Sb


@triton.jit
def _head_rows(ptr, bat, head, row0, stride_b, stride_h, stride_t):
    """``ptr`` moved to the first row of ``head`` in the sequence at ``(bat, row0)`` (64-bit offsets)."""
    return ptr + bat.to(tl.int64) * stride_b + head.to(tl.int64) * stride_h + row0.to(tl.int64) * stride_t


@triton.jit
def _stats_rows(bat, h, HQ, T, row0):
    """Index of the sequence's first row in the per-row statistics ``[B * HQ * T]`` (lse, delta, splits)."""
    return (bat * HQ + h).to(tl.int64) * T + row0


@triton.jit
def _positions(offs_m, Tb, Sb, CAUSAL: tl.constexpr):
    """Key positions of the queries ``offs_m`` (query ``i`` sits at ``i + Sb - Tb``).

    Without a causal mask a query placed before the first key (``T > S``) still sees the keys.
    """
    pos = offs_m + (Sb - Tb)
    if not CAUSAL:
        pos = tl.maximum(pos, 0)
    return pos


@triton.jit
def _visible(offs_m, offs_n, Tb, Sb, CAUSAL: tl.constexpr, WINDOW: tl.constexpr):
    """``[BLOCK_M, BLOCK_N]``: key ``j`` is seen by query ``i``."""
    return visible_mask(_positions(offs_m, Tb, Sb, CAUSAL), offs_n, Sb, CAUSAL, WINDOW)


@triton.jit
def _key_tiles(m0, Tb, Sb, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
               WINDOW: tl.constexpr):
    """Keys ``[lo, hi)`` some query of the tile ``[m0, m0 + BLOCK_M)`` sees; ``lo`` on a tile edge."""
    shift = Sb - Tb
    lo, hi = key_span(m0 + shift, tl.minimum(m0 + BLOCK_M, Tb) - 1 + shift, Sb, CAUSAL, WINDOW)
    lo = lo // BLOCK_N * BLOCK_N
    return lo, tl.maximum(hi, lo)


@triton.jit
def _full_keys(m0, Tb, Sb, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr):
    """Keys ``[lo, hi)`` every query of the tile ``[m0, m0 + BLOCK_M)`` sees (may be empty)."""
    shift = Sb - Tb
    return full_key_span(m0 + shift, tl.minimum(m0 + BLOCK_M, Tb) - 1 + shift, Sb, CAUSAL, WINDOW)


@triton.jit
def _query_tiles(n0, Tb, Sb, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                 WINDOW: tl.constexpr):
    """Queries ``[lo, hi)`` that see some key of the tile ``[n0, n0 + BLOCK_N)``; ``lo`` on a tile edge."""
    lo, hi, _, _ = query_span(n0, tl.minimum(n0 + BLOCK_N, Sb) - 1, Tb, Sb - Tb, CAUSAL, WINDOW)
    lo = lo // BLOCK_M * BLOCK_M
    return lo, tl.maximum(hi, lo)


@triton.jit
def _load_rows(ptr, rows, stride_row, cols, n_rows, N_COLS: tl.constexpr, EVEN: tl.constexpr):
    """Tile ``[len(rows), len(cols)]``; rows ``>= n_rows`` and cols ``>= N_COLS`` read as 0."""
    ptrs = ptr + rows[:, None].to(tl.int64) * stride_row + cols[None, :]
    if EVEN:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=(rows[:, None] < n_rows) & (cols[None, :] < N_COLS), other=0.0)


@triton.jit
def _rows_at(desc, ptr, bat, head, row0, n0, rows, stride_row, cols, n_rows, N_COLS: tl.constexpr,
             EVEN: tl.constexpr, TMA: tl.constexpr):
    """Tile ``[len(rows), len(cols)]`` of a ``[B, S, H, N_COLS]`` tensor (keys, values; the fused backward's queries
    and output gradients), ``rows = n0 + arange`` of the sequence from row ``row0``: through its tensor descriptor
    ``desc`` (a Hopper TMA copy) at ``(bat, row0 + n0, head)``, where rows past the sequence read the next packed
    sequence's and rows past ``S`` read 0; or as :func:`_load_rows` from ``ptr`` (the head's first row of the
    sequence), rows from ``n_rows`` on reading 0."""
    if TMA:
        return desc.load([bat, row0 + n0, head, 0]).reshape(rows.shape[0], cols.shape[0])
    return _load_rows(ptr, rows, stride_row, cols, n_rows, N_COLS, EVEN)


@triton.jit
def _store_rows(ptr, x, rows, stride_row, cols, n_rows, N_COLS: tl.constexpr):
    ptrs = ptr + rows[:, None].to(tl.int64) * stride_row + cols[None, :]
    tl.store(ptrs, x.to(ptr.dtype.element_ty), mask=(rows[:, None] < n_rows) & (cols[None, :] < N_COLS))


# ----------------------------------------------------------------------------- forward

@triton.jit
def _tf32(x, ROUND: tl.constexpr):
    """``x`` rounded to the nearest TF32 value when ``ROUND`` (:func:`tf32_round`), else as it is."""
    if ROUND:
        x = tf32_round(x)
    return x


@triton.jit
def _identity(BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr):
    """The monoid identity ``(-inf, 0, 0)`` for ``BLOCK_M`` queries."""
    return (tl.full([BLOCK_M], float("-inf"), tl.float32), tl.zeros([BLOCK_M], tl.float32),
            tl.zeros([BLOCK_M, BLOCK_DV], tl.float32))


@triton.jit
def _combine(m_a, l_a, w_a, m_b, l_b, w_b, ROWS_AXIS: tl.constexpr = 0):
    """Un-sum-renorm merge of two states of ``BLOCK_M`` queries, anchored at 0 where both are empty; ``W`` is
    ``[BLOCK_M, BLOCK_DV]`` (``ROWS_AXIS`` 0) or its transpose (1)."""
    m = tl.maximum(m_a, m_b)
    anchor = tl.where(m == float("-inf"), 0.0, m)
    e_a = tl.exp2(m_a - anchor)
    e_b = tl.exp2(m_b - anchor)
    w = w_a * tl.expand_dims(e_a, 1 - ROWS_AXIS) + w_b * tl.expand_dims(e_b, 1 - ROWS_AXIS)
    return m, l_a * e_a + l_b * e_b, w


@triton.jit
def _fold_span(q, q_base, sqt, k_base, v_base, skt, svt, K_DESC, V_DESC, bat, hk, row0, lo, hi, full_lo, full_hi,
               offs_m, offs_n0, offs_d, offs_dv, Tb, Sb, qk_scale, D: tl.constexpr, DV: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
               CAUSAL: tl.constexpr, WINDOW: tl.constexpr, HIDDEN: tl.constexpr, EVEN_N: tl.constexpr,
               PREC: tl.constexpr, ROUND_TF32: tl.constexpr, POS_SCALE: tl.constexpr,
               TMA: tl.constexpr, q_lo, kl_base, vl_base, ks_base, q_rs, SPLIT: tl.constexpr):
    """Left fold of the key tiles ``[lo, hi)`` (``lo`` on a tile edge) from the identity. ``HIDDEN``: a masked
    tile can hold keys some of its rows cannot see (a causal or windowed fold, or packed sequences, whose last
    tile reaches into the next sequence); the fold then takes three runs of :func:`_fold_tiles`: the tiles
    before the full keys ``[full_lo, full_hi)``, masked; the tiles inside them, with no mask; the tiles after
    them, masked. The tiles and the order of their additions are those of one loop. Returns ``(m, l, acc)``."""
    m_i, l_i, acc = _identity(BLOCK_M, BLOCK_DV)
    if HIDDEN:
        _, a, b = tile_loop_bounds(lo, hi, full_lo, full_hi, BLOCK_N)  # lo is on a tile edge
        m_i, l_i, acc = _fold_tiles(m_i, l_i, acc, q, q_base, sqt, k_base, v_base, skt, svt, K_DESC, V_DESC, bat, hk,
                                    row0, lo, a, offs_m, offs_n0, offs_d, offs_dv, Tb, Sb, qk_scale, D, DV, BLOCK_M,
                                    BLOCK_N, BLOCK_D, BLOCK_DV, CAUSAL, WINDOW, HIDDEN, EVEN_N, True, PREC,
                                    ROUND_TF32, POS_SCALE, TMA, q_lo, kl_base, vl_base, ks_base, q_rs, SPLIT)
        m_i, l_i, acc = _fold_tiles(m_i, l_i, acc, q, q_base, sqt, k_base, v_base, skt, svt, K_DESC, V_DESC, bat, hk,
                                    row0, a, b, offs_m, offs_n0, offs_d, offs_dv, Tb, Sb, qk_scale, D, DV, BLOCK_M,
                                    BLOCK_N, BLOCK_D, BLOCK_DV, CAUSAL, WINDOW, HIDDEN, EVEN_N, False, PREC,
                                    ROUND_TF32, POS_SCALE, TMA, q_lo, kl_base, vl_base, ks_base, q_rs, SPLIT)
        m_i, l_i, acc = _fold_tiles(m_i, l_i, acc, q, q_base, sqt, k_base, v_base, skt, svt, K_DESC, V_DESC, bat, hk,
                                    row0, b, hi, offs_m, offs_n0, offs_d, offs_dv, Tb, Sb, qk_scale, D, DV, BLOCK_M,
                                    BLOCK_N, BLOCK_D, BLOCK_DV, CAUSAL, WINDOW, HIDDEN, EVEN_N, True, PREC,
                                    ROUND_TF32, POS_SCALE, TMA, q_lo, kl_base, vl_base, ks_base, q_rs, SPLIT)
    else:
        m_i, l_i, acc = _fold_tiles(m_i, l_i, acc, q, q_base, sqt, k_base, v_base, skt, svt, K_DESC, V_DESC, bat, hk,
                                    row0, lo, hi, offs_m, offs_n0, offs_d, offs_dv, Tb, Sb, qk_scale, D, DV, BLOCK_M,
                                    BLOCK_N, BLOCK_D, BLOCK_DV, CAUSAL, WINDOW, HIDDEN, EVEN_N, not EVEN_N, PREC,
                                    ROUND_TF32, POS_SCALE, TMA, q_lo, kl_base, vl_base, ks_base, q_rs, SPLIT)
    return m_i, l_i, acc


@triton.jit
def _fold_tile_t(m_i, l_i, acc_t, n0, qt_base, sqd, kt_base, v_base, skd, svt, pos, offs_m, offs_n0, offs_dv, Tb, Sb,
                 qk_scale, D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
                 WINDOW: tl.constexpr, HIDDEN: tl.constexpr, EVEN_N: tl.constexpr, MASKED: tl.constexpr,
                 PREC: tl.constexpr, DOT_K: tl.constexpr, POS_SCALE: tl.constexpr):
    """The key tile at ``n0`` folded into the state ``(m, l, W^T)`` for strict fp32, with the keys on the rows of the
    tile: ``s^T = k q^T`` (``[BLOCK_N, BLOCK_M]``, ``DOT_K`` features a product, each accumulated into the last) and
    ``W^T += v^T p^T``. ``qt_base`` and ``kt_base`` point into copies of q and k laid out ``[.., D, T]`` (``sqd``,
    ``skd``: the stride of a feature), so that every operand of the FMA products, which Triton stages in shared memory
    unswizzled in the order of its registers, is read along its contiguous axis: the query and key chunks along the
    queries and keys, ``p^T`` along the queries and ``v^T`` along the value columns. ``MASKED``, ``HIDDEN``: as
    :func:`_fold_tiles`; ``pos``: the rows' :func:`_positions`."""
    offs_n = n0 + offs_n0
    s_t = tl.zeros([offs_n0.shape[0], offs_m.shape[0]], tl.float32)
    for d0 in tl.static_range(0, BLOCK_D, DOT_K):
        feats = d0 + tl.arange(0, DOT_K)
        k_c = tl.load(kt_base + feats[None, :].to(tl.int64) * skd + offs_n[:, None],
                      mask=(offs_n[:, None] < Sb) & (feats[None, :] < D), other=0.0)
        q_c = tl.load(qt_base + feats[:, None].to(tl.int64) * sqd + offs_m[None, :],
                      mask=(feats[:, None] < D) & (offs_m[None, :] < Tb), other=0.0)
        s_t = tl.dot(k_c, q_c, s_t, input_precision=PREC)
    s_scale = qk_scale
    if not POS_SCALE:
        s_t = s_t * qk_scale
        s_scale = 1.0
    v = _load_rows(v_base, offs_n, svt, offs_dv, Sb, DV, EVEN_N)
    if MASKED:
        seen_t = visible_mask_t(offs_n, pos, Sb, CAUSAL, WINDOW)
        s_t = tl.where(seen_t, s_t, float("-inf"))
        if HIDDEN:
            hits = sees_non_finite_t(seen_t, v)
    m_i, l_i, p_t, alpha = online_softmax_step(m_i, l_i, s_t, s_scale, AXIS=0)
    if MASKED and HIDDEN:
        acc_t = contained_dot_t(acc_t * alpha[None, :], p_t, v, hits, PREC)
    else:
        acc_t = tl.dot(tl.trans(v), p_t, acc_t * alpha[None, :], input_precision=PREC)
    return m_i, l_i, acc_t


@triton.jit
def _fold_parked(m_i, l_i, w_ptrs, w_mask, qt_base, sqd, kt_base, v_base, skd, svt, lo, hi, offs_m, offs_n0, offs_dv,
                 Tb, Sb, qk_scale, D: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
                 HIDDEN: tl.constexpr, EVEN_N: tl.constexpr, MASKED: tl.constexpr, PREC: tl.constexpr,
                 DOT_K: tl.constexpr, POS_SCALE: tl.constexpr, CHUNK: tl.constexpr):
    """Strict fp32's two-level fold of the key tiles ``[lo, hi)`` (:func:`_fold_tile_t`) in one loop: a chunk of
    ``CHUNK`` tiles (the last: what remains) folds from the identity, then combines into the run's total; the run's
    total then combines into the total whose ``W`` is parked at ``w_ptrs``. Returns that total's ``(m, l)``. (With a
    key loop for each chunk a causal fold took 3% to 8% longer on the H200, its warps waiting on instruction fetch:
    tiles README, "the chunks of the two-level fold in one loop".) ``MASKED`` (and ``HIDDEN``) runs: one or two
    tiles, not pipelined, folded as one chunk."""
    BLOCK_N: tl.constexpr = offs_n0.shape[0]
    RUN: tl.constexpr = MASKED and HIDDEN
    pos = _positions(offs_m, Tb, Sb, CAUSAL)
    m_r, l_r, w = _identity(BLOCK_M, BLOCK_DV)
    m_c, l_c, acc = _identity(BLOCK_M, BLOCK_DV)
    w_t, acc_t = tl.trans(w), tl.trans(acc)
    for n0 in tl.range(lo, hi, BLOCK_N, num_stages=1 if RUN else None):
        m_c, l_c, acc_t = _fold_tile_t(m_c, l_c, acc_t, n0, qt_base, sqd, kt_base, v_base, skd, svt, pos, offs_m,
                                       offs_n0, offs_dv, Tb, Sb, qk_scale, D, DV, BLOCK_D, CAUSAL, WINDOW, HIDDEN,
                                       EVEN_N, MASKED, PREC, DOT_K, POS_SCALE)
        if not RUN:
            if ((n0 - lo) // BLOCK_N % CHUNK == CHUNK - 1) | (n0 + BLOCK_N >= hi):
                m_r, l_r, w_t = _combine(m_r, l_r, w_t, m_c, l_c, acc_t, ROWS_AXIS=1)
                m_c, l_c, acc = _identity(BLOCK_M, BLOCK_DV)
                acc_t = tl.trans(acc)
    if RUN:  # (the run's chunk is its total: no combine inside its loop, whose kernel keeps its registers)
        m_r, l_r, w_t = m_c, l_c, acc_t
    tl.debug_barrier()
    m_i, l_i, w = _combine(m_i, l_i, tl.load(w_ptrs, mask=w_mask, other=0.0), m_r, l_r, tl.trans(w_t))
    tl.store(w_ptrs, w, mask=w_mask)
    return m_i, l_i


@triton.jit
def _fold_tiles(m_i, l_i, acc, q, q_base, sqt, k_base, v_base, skt, svt, K_DESC, V_DESC, bat, hk, row0, lo, hi,
                offs_m, offs_n0, offs_d, offs_dv, Tb, Sb, qk_scale, D: tl.constexpr, DV: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                CAUSAL: tl.constexpr, WINDOW: tl.constexpr, HIDDEN: tl.constexpr, EVEN_N: tl.constexpr,
                MASKED: tl.constexpr, PREC: tl.constexpr, ROUND_TF32: tl.constexpr, POS_SCALE: tl.constexpr,
                TMA: tl.constexpr, q_lo, kl_base, vl_base, ks_base, q_rs, SPLIT: tl.constexpr):
    """Fold the key tiles ``[lo, hi)`` (of the sequence from row ``row0``) into the state ``(m_i, l_i, acc)``: each
    tile's state (its max, the sum of ``p`` and ``p @ v``: tree reductions across the tile) merges into the running
    state by un-sum-renorm (the online-softmax step). ``MASKED``: the scores of hidden pairs are set to -inf, and
    where the tiles are partly hidden (``HIDDEN``, see :func:`_fold_span`) ``p @ v`` multiplies through
    :func:`contained_dot` (strict fp32 folds in :func:`_fold_tile_t` instead). ``SPLIT``: the operands are fp16
    parts (``q, q_lo``, the tiles of ``k_base, kl_base`` and ``v_base, vl_base``) scaled per query row by ``q_rs``,
    per key row by ``ks_base``'s entries and (after the fold) per value column (:mod:`regattn.ops.scan.split`); each
    product is a :func:`split_dot`, ``p`` split as ``2^P_SHIFT p``. ``PREC == "tf32x3"`` (not ``SPLIT``): ``q`` and
    ``q_lo`` are the TF32 parts of the query tile (:func:`tf32_parts`), and ``q k^T`` is the :func:`split_dot` of
    the parts. Returns ``(m, l, acc)``."""
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + offs_n0
        if SPLIT:
            k = _rows_at(K_DESC, k_base, bat, hk, row0, n0, offs_n, skt, offs_d, Sb, D, EVEN_N, TMA)
            k_lo = _load_rows(kl_base, offs_n, skt, offs_d, Sb, D, EVEN_N)
            s = split_dot(q, q_lo, tl.trans(k), tl.trans(k_lo))
            if EVEN_N:
                ks = tl.load(ks_base + offs_n)
            else:
                ks = tl.load(ks_base + offs_n, mask=offs_n < Sb, other=0.0)
            s = s * (q_rs[:, None] * ks[None, :])
        elif PREC == "tf32x3":  # q's parts made once (``q, q_lo``: see _fwd_kernel), the key tile's here
            k_hi, k_lo = tf32_parts(_rows_at(K_DESC, k_base, bat, hk, row0, n0, offs_n, skt, offs_d, Sb, D, EVEN_N,
                                             TMA))
            s = split_dot(q, q_lo, tl.trans(k_hi), tl.trans(k_lo))
        else:
            k = _tf32(_rows_at(K_DESC, k_base, bat, hk, row0, n0, offs_n, skt, offs_d, Sb, D, EVEN_N, TMA), ROUND_TF32)
            s = tl.dot(q, tl.trans(k), input_precision=PREC)
        s_scale = qk_scale  # a positive scale rides in exp2's fused multiply-add (one multiply an entry less)
        if not POS_SCALE:
            s = s * qk_scale
            s_scale = 1.0
        if MASKED:
            seen = _visible(offs_m, offs_n, Tb, Sb, CAUSAL, WINDOW)
            s = tl.where(seen, s, float("-inf"))
        m_i, l_i, p, alpha = online_softmax_step(m_i, l_i, s, s_scale)
        v = _tf32(_rows_at(V_DESC, v_base, bat, hk, row0, n0, offs_n, svt, offs_dv, Sb, DV, EVEN_N, TMA), ROUND_TF32)
        if SPLIT:
            v_lo = _load_rows(vl_base, offs_n, svt, offs_dv, Sb, DV, EVEN_N)
            p = p * P_SCALE
            p_hi = p.to(tl.float16)
            p_lo = (p - p_hi.to(tl.float32)).to(tl.float16)
            if MASKED and HIDDEN:
                acc = contained_split_dot(acc * alpha[:, None], p_hi, p_lo, v, v_lo, seen)
            else:
                acc = acc * alpha[:, None] + split_dot(p_hi, p_lo, v, v_lo)
        else:
            p = _tf32(p.to(v.dtype), ROUND_TF32)
            if MASKED and HIDDEN:
                acc = contained_dot(acc * alpha[:, None], p, v, seen, PREC)
            else:
                acc = tl.dot(p, v, acc * alpha[:, None], input_precision=PREC)
    return m_i, l_i, acc


@triton.jit
def _store_output(O, LSE, acc, m, l, rows, bat, h, row0, sob, soh, sot, offs_m, offs_dv, Tb,
                  DV: tl.constexpr, STORE_LSE: tl.constexpr):
    """Normalise a final state; store ``o`` and (``STORE_LSE``) the base-2 log-sum-exp at ``rows``."""
    o, lse = softmax_finish(acc, m, l)
    _store_rows(_head_rows(O, bat, h, row0, sob, soh, sot), o, offs_m, sot, offs_dv, Tb, DV)
    if STORE_LSE:
        tl.store(LSE + rows, lse, mask=offs_m < Tb)


@triton.jit
def _parked_rows(O, WS_ACC, bat, h, row0, sob, soh, sot, rows, split, ws_stride, offs_m, offs_dv, Tb,
                 DV: tl.constexpr, BLOCK_DV: tl.constexpr, NSPLIT: tl.constexpr):
    """``(pointers, mask)`` of the fp32 rows a program's final ``W`` goes to: its output rows, or with
    ``NSPLIT > 1`` its split's workspace (which no other program touches)."""
    if NSPLIT == 1:
        ptrs = _head_rows(O, bat, h, row0, sob, soh, sot) + offs_m[:, None].to(tl.int64) * sot + offs_dv[None, :]
        mask = (offs_m < Tb)[:, None] & (offs_dv < DV)[None, :]
    else:
        ptrs = WS_ACC + (split.to(tl.int64) * ws_stride + rows)[:, None] * BLOCK_DV + offs_dv[None, :]
        mask = (offs_m < Tb)[:, None] & (offs_dv < BLOCK_DV)[None, :]
    return ptrs, mask


@triton.jit
def _whole_key_tiles(m0, lo, hi, Tb, Sb, WHOLE_ROWS: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr):
    """``[a, b)``: the key tiles of ``[lo, hi)`` that every query of the ``WHOLE_ROWS`` rows around ``m0`` sees; both
    launches of a two-part fold take them from here, whatever their tiles, so that together they fold every key once."""
    full_lo, full_hi = _full_keys(m0 // WHOLE_ROWS * WHOLE_ROWS, Tb, Sb, WHOLE_ROWS, CAUSAL, WINDOW)
    _, a, b = tile_loop_bounds(lo, hi, full_lo, full_hi, WHOLE_ROWS)
    return a, b


@triton.jit
def _park_whole_tiles(O, WS_M, WS_L, q_base, sqt, k_base, v_base, skt, svt, bat, h, row0, sob, soh, sot, HQ, T, m0,
                      Tb, Sb, qk_scale, D: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, CAUSAL: tl.constexpr,
                      WINDOW: tl.constexpr, EVEN_N: tl.constexpr, PREC: tl.constexpr, CHUNK: tl.constexpr,
                      DOT_K: tl.constexpr, POS_SCALE: tl.constexpr, WHOLE_ROWS: tl.constexpr):
    """The first of strict fp32's two launches for the query tile at ``m0``: the key tiles every query of its
    ``WHOLE_ROWS`` rows sees, in chunks of ``CHUNK`` (:func:`_fold_parked`); the total's ``W`` parks in the output
    rows, its ``m, l`` in ``WS_M, WS_L``, for the masked tiles' launch to finish."""
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    rows = _stats_rows(bat, h, HQ, T, row0) + offs_m
    w_ptrs, w_mask = _parked_rows(O, O, bat, h, row0, sob, soh, sot, rows, 0, 0, offs_m, offs_dv, Tb, DV, BLOCK_DV, 1)
    m_i, l_i, w = _identity(BLOCK_M, BLOCK_DV)
    tl.store(w_ptrs, w, mask=w_mask)
    lo, hi = _key_tiles(m0, Tb, Sb, BLOCK_M, BLOCK_N, CAUSAL, WINDOW)
    a, b = _whole_key_tiles(m0, lo, hi, Tb, Sb, WHOLE_ROWS, CAUSAL, WINDOW)
    m_i, l_i = _fold_parked(m_i, l_i, w_ptrs, w_mask, q_base, sqt, k_base, v_base, skt, svt, a, b, offs_m,
                            tl.arange(0, BLOCK_N), offs_dv, Tb, Sb, qk_scale, D, DV, BLOCK_M, BLOCK_D, BLOCK_DV, CAUSAL,
                            WINDOW, True, EVEN_N, False, PREC, DOT_K, POS_SCALE, CHUNK)
    tl.store(WS_M + rows, m_i, mask=offs_m < Tb)
    tl.store(WS_L + rows, l_i, mask=offs_m < Tb)


@triton.heuristics({
    "EVEN_N": lambda a: (not a["VARLEN"]) and a["S"] % a["BLOCK_N"] == 0 and a["D"] == a["BLOCK_D"]
    and a["DV"] == a["BLOCK_DV"],
})
@triton.jit
def _fwd_kernel(Q, K, V, O, LSE, WS_M, WS_L, WS_ACC, CU, K_DESC, V_DESC, QL, KL, VL, QS, KS, VS,
                sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, sob, sot, soh,
                T, S, HQ, GROUP, qk_scale, ws_stride, SIZE_CLASS,
                D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
                VARLEN: tl.constexpr, NSPLIT: tl.constexpr, STORE_LSE: tl.constexpr, EVEN_N: tl.constexpr,
                PREC: tl.constexpr, ROUND_TF32: tl.constexpr, CHUNK: tl.constexpr, DOT_K: tl.constexpr,
                POS_SCALE: tl.constexpr, HAS_DESC: tl.constexpr, SPLIT: tl.constexpr, TMA: tl.constexpr = False,
                PART: tl.constexpr = 0, WHOLE_ROWS: tl.constexpr = 0, PAIRED: tl.constexpr = False):
    """One program: ``BLOCK_M`` queries of one head against key slice ``program_id(2)`` of ``NSPLIT``.

    ``CHUNK > 0`` (strict fp32, with ``DOT_K > 0``): fold in two levels of ``CHUNK`` tiles, the products
    transposed, ``q k^T`` in chunks of ``DOT_K`` columns (:func:`_fold_parked`); ``POS_SCALE``: ``qk_scale > 0``,
    which then multiplies the scores inside exp2's argument (a zero or negative one scales them first);
    ``PART`` (strict fp32, one split): 0 folds every key; 1 only the whole tiles (:func:`_park_whole_tiles`); 2 the
    masked tiles into the total parked by 1, then finishes it. ``WHOLE_ROWS > 0``: the whole tiles are those every
    query of the ``WHOLE_ROWS`` rows around the tile sees, so that the two parts may tile the queries differently
    (each a divisor of ``WHOLE_ROWS``; 0: this tile's rows); ``PAIRED`` (PART 1, causal, no window): program ``i``
    takes the query tiles ``i`` and ``n - 1 - i`` of its sequence's ``n``, so that every program folds as many
    whole tiles (but one);
    ``HAS_DESC``: ``K_DESC``, ``V_DESC`` are tensor descriptors of k and v (else k and v again), through which
    ``TMA`` loads the key and value tiles; ``SPLIT``: ``Q, K, V`` hold the fp16 high parts of fp32 operands,
    ``QL, KL, VL`` their low parts, ``QS [B, HQ, T]``, ``KS [B, H, S]`` and ``VS [sequences, H, DV]`` their
    scales (:mod:`regattn.ops.scan.split`; else these are any tensors).
    """
    pid_m = tl.program_id(0) if PAIRED else query_tile(CAUSAL)
    pid_bh = tl.program_id(1)
    split = tl.program_id(2)
    bat, h, row0, Tb, Sb = _sequence_head(CU, pid_bh, T, S, HQ, VARLEN)
    hk = h // GROUP
    v_base = _head_rows(V, bat, hk, row0, svb, svh, svt)
    if DOT_K > 0:  # strict fp32: q and k from their copies laid out [.., D, T] (QL, KL; see _fold_tile_t)
        q_base = QL + (bat * HQ + h).to(tl.int64) * D * T + row0
        k_base = KL + (bat * (HQ // GROUP) + hk).to(tl.int64) * D * S + row0
        sqt, skt = T, S
    if PART == 1:
        n = tl.cdiv(Tb, BLOCK_M)
        last = n - 1 - pid_m if PAIRED else pid_m  # (a tile count known at run time: the loop is not unrolled)
        for i in range(0, (pid_m < n).to(tl.int32) + (last > pid_m).to(tl.int32)):
            _park_whole_tiles(O, WS_M, WS_L, q_base, sqt, k_base, v_base, skt, svt, bat, h, row0, sob, soh, sot, HQ,
                              T, tl.where(i == 0, pid_m, last) * BLOCK_M, Tb, Sb, qk_scale, D, DV, BLOCK_M, BLOCK_N,
                              BLOCK_D, BLOCK_DV, CAUSAL, WINDOW, EVEN_N, PREC, CHUNK, DOT_K, POS_SCALE, WHOLE_ROWS)
        return
    m0 = pid_m * BLOCK_M
    if m0 >= Tb:
        return
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_n0 = tl.arange(0, BLOCK_N)
    if DOT_K > 0:
        q = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)  # unused: the products load their chunks of q
    else:
        q_base = _head_rows(Q, bat, h, row0, sqb, sqh, sqt)
        k_base = _head_rows(K, bat, hk, row0, skb, skh, skt)
        q = _tf32(_load_rows(q_base, offs_m, sqt, offs_d, Tb, D, False), ROUND_TF32)
    rows = _stats_rows(bat, h, HQ, T, row0) + offs_m
    if SPLIT:
        q_lo = _load_rows(_head_rows(QL, bat, h, row0, sqb, sqh, sqt), offs_m, sqt, offs_d, Tb, D, False)
        q_rs = tl.load(QS + rows, mask=offs_m < Tb, other=0.0)
        kl_base = _head_rows(KL, bat, hk, row0, skb, skh, skt)
        vl_base = _head_rows(VL, bat, hk, row0, svb, svh, svt)
        ks_base = KS + (bat * (HQ // GROUP) + hk).to(tl.int64) * S + row0
    else:
        q_lo, q_rs, kl_base, vl_base, ks_base = q, qk_scale, k_base, v_base, KS
        if PREC == "tf32x3":  # q's parts once, where tl.dot's "tf32x3" would split q again for every key tile
            q, q_lo = tf32_parts(q)

    lo, hi = _key_tiles(m0, Tb, Sb, BLOCK_M, BLOCK_N, CAUSAL, WINDOW)
    full_lo, full_hi = _full_keys(m0, Tb, Sb, BLOCK_M, CAUSAL, WINDOW)
    HIDDEN: tl.constexpr = CAUSAL or WINDOW > 0 or VARLEN  # masked tiles partly hidden (see _fold_span)
    if NSPLIT > 1:
        per = tl.cdiv(tl.cdiv(hi - lo, BLOCK_N), NSPLIT) * BLOCK_N
        lo = lo + split * per
        hi = tl.minimum(hi, lo + per)

    if CHUNK == 0:
        m_i, l_i, acc = _fold_span(q, q_base, sqt, k_base, v_base, skt, svt, K_DESC, V_DESC, bat, hk, row0, lo, hi,
                                   full_lo, full_hi, offs_m, offs_n0, offs_d, offs_dv, Tb, Sb, qk_scale, D, DV,
                                   BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, CAUSAL, WINDOW, HIDDEN, EVEN_N, PREC,
                                   ROUND_TF32, POS_SCALE, TMA, q_lo, kl_base, vl_base, ks_base, q_rs, SPLIT)
        if SPLIT:
            vs = VS + ((pid_bh // HQ) * (HQ // GROUP) + hk).to(tl.int64) * DV + offs_dv
            acc = acc * tl.load(vs, mask=offs_dv < DV, other=0.0)[None, :]
    else:
        # Two levels: CHUNK tiles fold into a chunk state, and the chunk states into the total, so that
        # no accumulator sees more than max(CHUNK * BLOCK_N, n / (CHUNK * BLOCK_N)) sequential additions.
        # The total's W parks in the (fp32) rows it ends in between chunks (the output, or this split's
        # workspace), so the key loop holds one [BLOCK_M, BLOCK_DV] accumulator in registers, not two.
        # With HIDDEN the masked tiles at either end fold apart, after the chunks of whole tiles: inside the chunk
        # loop, the three runs of _fold_span took 64 x 64 on 4 warps to 32 registers and 8.9 KB of spills (sm_90).
        # Each key loop is some 78 KB of SASS at that tile, and a causal fold's warps wait on instruction fetch (a
        # causal fold at 0.55-0.60 of the non-causal time); masking every tile in one loop, or the masked runs in
        # 16-key steps, cost more (benchmarks/results/h200/tiles/README.md, "what a causal fold waits on"); two
        # launches (MASKED_LAUNCH) cost less, and chunks that combine inside one key loop (_fold_parked) less again.
        w_ptrs, w_mask = _parked_rows(O, WS_ACC, bat, h, row0, sob, soh, sot, rows, split, ws_stride, offs_m,
                                      offs_dv, Tb, DV, BLOCK_DV, NSPLIT)
        if PART == 2:  # the whole tiles' total, parked by the launch of PART 1
            m_i = tl.load(WS_M + rows, mask=offs_m < Tb, other=float("-inf"))
            l_i = tl.load(WS_L + rows, mask=offs_m < Tb, other=0.0)
        else:
            m_i, l_i, acc = _identity(BLOCK_M, BLOCK_DV)
            tl.store(w_ptrs, acc, mask=w_mask)
        a, b = lo, hi
        if HIDDEN:
            if WHOLE_ROWS > 0:
                a, b = _whole_key_tiles(m0, lo, hi, Tb, Sb, WHOLE_ROWS, CAUSAL, WINDOW)
            else:
                _, a, b = tile_loop_bounds(lo, hi, full_lo, full_hi, BLOCK_N)
        if PART == 0:
            m_i, l_i = _fold_parked(m_i, l_i, w_ptrs, w_mask, q_base, sqt, k_base, v_base, skt, svt, a, b, offs_m,
                                    offs_n0, offs_dv, Tb, Sb, qk_scale, D, DV, BLOCK_M, BLOCK_D, BLOCK_DV, CAUSAL,
                                    WINDOW, HIDDEN, EVEN_N, not HIDDEN and not EVEN_N, PREC, DOT_K, POS_SCALE, CHUNK)
        if HIDDEN:
            if WINDOW > 0:  # without a window the whole keys start at the first key (a == lo)
                m_i, l_i = _fold_parked(m_i, l_i, w_ptrs, w_mask, q_base, sqt, k_base, v_base, skt, svt, lo, a,
                                        offs_m, offs_n0, offs_dv, Tb, Sb, qk_scale, D, DV, BLOCK_M, BLOCK_D, BLOCK_DV,
                                        CAUSAL, WINDOW, HIDDEN, EVEN_N, True, PREC, DOT_K, POS_SCALE, CHUNK)
            m_i, l_i = _fold_parked(m_i, l_i, w_ptrs, w_mask, q_base, sqt, k_base, v_base, skt, svt, b, hi, offs_m,
                                    offs_n0, offs_dv, Tb, Sb, qk_scale, D, DV, BLOCK_M, BLOCK_D, BLOCK_DV, CAUSAL,
                                    WINDOW, HIDDEN, EVEN_N, True, PREC, DOT_K, POS_SCALE, CHUNK)
        tl.debug_barrier()
        acc = tl.load(w_ptrs, mask=w_mask, other=0.0)

    if NSPLIT == 1:
        _store_output(O, LSE, acc, m_i, l_i, rows, bat, h, row0, sob, soh, sot, offs_m, offs_dv, Tb, DV, STORE_LSE)
    else:
        ws = split.to(tl.int64) * ws_stride + rows
        tl.store(WS_M + ws, m_i, mask=offs_m < Tb)
        tl.store(WS_L + ws, l_i, mask=offs_m < Tb)
        tl.store(WS_ACC + ws[:, None] * BLOCK_DV + offs_dv[None, :], acc, mask=(offs_m < Tb)[:, None])


@triton.jit
def _merge_pairs(m, l, acc, K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr):
    """One tree level: states ``2i`` and ``2i + 1`` of ``K`` merge; ``m, l: [BM, K]``, ``acc: [BM, DV, K]``."""
    ma, mb = tl.split(tl.reshape(m, [BLOCK_M, K // 2, 2]))
    la, lb = tl.split(tl.reshape(l, [BLOCK_M, K // 2, 2]))
    aa, ab = tl.split(tl.reshape(acc, [BLOCK_M, BLOCK_DV, K // 2, 2]))
    mc = tl.maximum(ma, mb)
    anchor = tl.where(mc == float("-inf"), 0.0, mc)
    ea = tl.exp2(ma - anchor)
    eb = tl.exp2(mb - anchor)
    return mc, la * ea + lb * eb, aa * ea[:, None, :] + ab * eb[:, None, :]


@triton.jit
def _merge_kernel(WS_M, WS_L, WS_ACC, O, LSE, CU, sob, sot, soh, T, HQ, ws_stride,
                  DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, VARLEN: tl.constexpr,
                  NSPLIT: tl.constexpr, LOG_NSPLIT: tl.constexpr, STORE_LSE: tl.constexpr):
    """Combine the ``NSPLIT`` key-slice states of ``BLOCK_M`` queries by a balanced pairwise tree."""
    pid_m = tl.program_id(0)
    bat, h, row0, Tb, _ = _sequence_head(CU, tl.program_id(1), T, T, HQ, VARLEN)
    m0 = pid_m * BLOCK_M
    if m0 >= Tb:
        return
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_s = tl.arange(0, NSPLIT)
    rows = _stats_rows(bat, h, HQ, T, row0) + offs_m
    ok = offs_m < Tb
    ws = offs_s[None, :].to(tl.int64) * ws_stride + rows[:, None]  # [BM, NSPLIT]
    m = tl.load(WS_M + ws, mask=ok[:, None], other=float("-inf"))
    l = tl.load(WS_L + ws, mask=ok[:, None], other=0.0)
    acc = tl.load(WS_ACC + ws[:, None, :] * BLOCK_DV + offs_dv[None, :, None], mask=ok[:, None, None], other=0.0)
    for level in tl.static_range(LOG_NSPLIT):
        m, l, acc = _merge_pairs(m, l, acc, NSPLIT >> level, BLOCK_M, BLOCK_DV)
    m = tl.reshape(m, [BLOCK_M])
    l = tl.reshape(l, [BLOCK_M])
    acc = tl.reshape(acc, [BLOCK_M, BLOCK_DV])
    _store_output(O, LSE, acc, m, l, rows, bat, h, row0, sob, soh, sot, offs_m, offs_dv, Tb, DV, STORE_LSE)


# ----------------------------------------------------------------------------- backward

@triton.jit
def _row_stats(LSE, DELTA, stats, offs_m, Tb):
    """``lse`` (``+inf`` past the end) and ``delta = rowsum(o * dO)`` of the query rows ``offs_m``."""
    lse = tl.load(LSE + stats + offs_m, mask=offs_m < Tb, other=float("inf"))
    delta = tl.load(DELTA + stats + offs_m, mask=offs_m < Tb, other=0.0)
    return lse, delta


@triton.jit
def _row_stats_at(LSE_DESC, DELTA_DESC, LSE, DELTA, stats, head_row, m0, offs_m, Tb, TMA: tl.constexpr):
    """:func:`_row_stats` of the query rows ``offs_m = m0 + arange``, or with ``TMA`` through the tensor descriptors
    of ``lse`` and ``delta`` (``[B * HQ, T]``, at row ``head_row``: see :func:`stats_descriptors`), where rows past
    ``T`` read 0 (a masked tile hides them: :func:`_probs_t`): one tensor-memory copy each, where the pointers'
    loads take a few dozen instructions a thread. (Not for packed sequences: a copy's first column must sit on
    16 bytes, and a sequence may start at any row.)"""
    if TMA:
        lse = LSE_DESC.load([head_row, m0]).reshape(offs_m.shape[0])
        delta = DELTA_DESC.load([head_row, m0]).reshape(offs_m.shape[0])
        return lse, delta
    return _row_stats(LSE, DELTA, stats, offs_m, Tb)


@triton.jit
def _probs(q, k, lse, offs_m, offs_n, Tb, Sb, qk_scale, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
           PREC: tl.constexpr, MASKED: tl.constexpr):
    """``p = exp2(s - lse)`` of a ``[BLOCK_M, BLOCK_N]`` tile, with ``MASKED`` 0 where a key is hidden, and
    the visibility."""
    p = tl.exp2(tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale - lse[:, None])
    vis = _visible(offs_m, offs_n, Tb, Sb, CAUSAL, WINDOW)
    if MASKED:
        p = tl.where(vis, p, 0.0)
    return p, vis


@triton.jit
def _score_grads(p, do, v, delta, PREC: tl.constexpr):
    """``ds = p * (dO v^T - delta)`` of a tile."""
    dp = tl.dot(do, tl.trans(v), input_precision=PREC)
    return p * (dp - delta[:, None])


@triton.jit
def _probs_t(k, q, lse, offs_n, offs_m, Tb, Sb, qk_scale, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
             PREC: tl.constexpr, MASKED: tl.constexpr):
    """The transposed tile ``p^T: [BLOCK_N, BLOCK_M]`` (keys on the rows) and its visibility."""
    p = tl.exp2(tl.dot(k, tl.trans(q), input_precision=PREC) * qk_scale - lse[None, :])
    vis = visible_mask_t(offs_n, _positions(offs_m, Tb, Sb, CAUSAL), Sb, CAUSAL, WINDOW) & (offs_m < Tb)[None, :]
    if MASKED:
        p = tl.where(vis, p, 0.0)
    return p, vis


@triton.jit
def _dkdv_tiles(dk, dv, k, v, q_base, do_base, sqt, sdot, LSE, DELTA, stats, lo, hi, offs_n, offs_m0, offs_d,
                offs_dv, Tb, Sb, qk_scale, dq_base, sdqt, Q_DESC, DO_DESC, DQ_DESC, LSE_DESC, DELTA_DESC, bat, h, row0,
                HQ, D: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr,
                WINDOW: tl.constexpr, HIDDEN: tl.constexpr, MASKED: tl.constexpr, PREC: tl.constexpr,
                ROUND_TF32: tl.constexpr, FUSED: tl.constexpr, TMA: tl.constexpr, TMA_REDUCE: tl.constexpr,
                STATS_DESC: tl.constexpr):
    """Add the query tiles ``[lo, hi)`` to ``dk, dv`` of the key tile (keys on the rows). ``MASKED``: hidden
    pairs count 0, and where the masked tiles are partly hidden (``HIDDEN``: a causal or windowed backward, or
    packed sequences, whose last query tile reaches into the next sequence) the products over queries go through
    :func:`contained_dot`, so a non-finite query or dO row reaches only the keys it sees. ``FUSED``: each query
    tile's share of ``dq`` is added to the fp32 rows at ``dq_base`` (atomics, or with ``TMA_REDUCE`` the
    tensor-memory reduction through ``DQ_DESC``), a non-finite key reaching only the queries that see it; with
    ``TMA`` the query and dO tiles come through ``Q_DESC`` and ``DO_DESC``, and with ``STATS_DESC`` too the rows'
    ``lse`` and ``delta`` through ``LSE_DESC`` and ``DELTA_DESC``. Returns ``(dk, dv)``."""
    for m0 in range(lo, hi, BLOCK_M):
        offs_m = m0 + offs_m0
        q = _tf32(_rows_at(Q_DESC, q_base, bat, h, row0, m0, offs_m, sqt, offs_d, Tb, D, False, TMA), ROUND_TF32)
        do = _tf32(_rows_at(DO_DESC, do_base, bat, h, row0, m0, offs_m, sdot, offs_dv, Tb, DV, False, TMA),
                   ROUND_TF32)
        lse, delta = _row_stats_at(LSE_DESC, DELTA_DESC, LSE, DELTA, stats, bat * HQ + h, m0, offs_m, Tb,
                                   TMA and STATS_DESC)
        pt, seen = _probs_t(k, q, lse, offs_n, offs_m, Tb, Sb, qk_scale, CAUSAL, WINDOW, PREC, MASKED)
        dst = pt * (tl.dot(v, tl.trans(do), input_precision=PREC) - delta[None, :])
        if MASKED and HIDDEN:
            dv = contained_dot(dv, _tf32(pt, ROUND_TF32), do, seen, PREC)
            dk = contained_dot(dk, _tf32(tl.where(seen, dst, 0.0), ROUND_TF32), q, seen, PREC)
        else:
            dv = tl.dot(_tf32(pt.to(do.dtype), ROUND_TF32), do, dv, input_precision=PREC)
            dk = tl.dot(_tf32(dst.to(q.dtype), ROUND_TF32), q, dk, input_precision=PREC)
        if FUSED:
            _add_dq(dq_base, sdqt, DQ_DESC, bat, h, row0, m0, offs_m, offs_d, Tb, tl.trans(dst), k, tl.trans(seen),
                    D, MASKED and HIDDEN, PREC, TMA_REDUCE)
    return dk, dv


@triton.jit
def _add_dq(dq_base, sdqt, DQ_DESC, bat, h, row0, m0, offs_m, offs_d, Tb, ds, k, seen, D: tl.constexpr,
            CONTAINED: tl.constexpr, PREC: tl.constexpr, REDUCE: tl.constexpr):
    """Add ``ds @ k`` (``ds: [BLOCK_M, BLOCK_N]``) to the fp32 ``dq`` rows ``offs_m`` (unscaled: the caller scales
    the whole buffer once), through :func:`contained_dot` where ``CONTAINED``; by atomics, or with ``REDUCE`` by the
    tensor-memory reduction through ``DQ_DESC``. The rows past a packed sequence reach the next sequence's rows there
    (past ``T`` the reduction drops them): :func:`_probs_t` hides them, so a masked tile adds exact zeros to them."""
    if CONTAINED:
        part = contained_dot(tl.zeros([ds.shape[0], k.shape[1]], tl.float32), ds, k, seen, PREC)
    else:
        part = tl.dot(ds.to(k.dtype), k, input_precision=PREC)
    if REDUCE:
        DQ_DESC.atomic_add([bat, row0 + m0, h, 0], part.reshape(1, ds.shape[0], 1, k.shape[1]))
    else:
        ptrs = dq_base + offs_m[:, None].to(tl.int64) * sdqt + offs_d[None, :]
        tl.atomic_add(ptrs, part, mask=(offs_m[:, None] < Tb) & (offs_d[None, :] < D), sem="relaxed")


@triton.jit
def _dq_tiles(dq, q, do, lse, delta, k_base, v_base, skt, svt, lo, hi, offs_m, offs_n0, offs_d, offs_dv, Tb, Sb,
              qk_scale, D: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
              WINDOW: tl.constexpr, MASKED: tl.constexpr, PREC: tl.constexpr, ROUND_TF32: tl.constexpr):
    """Add the key tiles ``[lo, hi)`` to ``dq`` of the query tile; ``MASKED`` as in :func:`_dkdv_tiles`, a
    non-finite key or value reaching only the queries that see it."""
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + offs_n0
        k = _tf32(_load_rows(k_base, offs_n, skt, offs_d, Sb, D, False), ROUND_TF32)
        v = _tf32(_load_rows(v_base, offs_n, svt, offs_dv, Sb, DV, False), ROUND_TF32)
        p, seen = _probs(q, k, lse, offs_m, offs_n, Tb, Sb, qk_scale, CAUSAL, WINDOW, PREC, MASKED)
        ds = _score_grads(p, do, v, delta, PREC)
        if MASKED and (CAUSAL or WINDOW > 0):
            dq = contained_dot(dq, _tf32(tl.where(seen, ds, 0.0), ROUND_TF32), k, seen, PREC)
        else:
            dq = tl.dot(_tf32(ds.to(k.dtype), ROUND_TF32), k, dq, input_precision=PREC)
    return dq


@triton.heuristics({"TMA_REDUCE": lambda a: a.get("TMA", False) and not interpreting()})  # (none there: atomics)
@triton.jit
def _bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DVV, CU, DQ, Q_DESC, DO_DESC, DQ_DESC, LSE_DESC, DELTA_DESC,
                     sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, sdob, sdot, sdoh,
                     sdkb, sdkt, sdkh, sdvb, sdvt, sdvh, sdqb, sdqt, sdqh,
                     T, S, HQ, GROUP, qk_scale, sm_scale, SIZE_CLASS,
                     D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                     WINDOW: tl.constexpr, VARLEN: tl.constexpr, PREC: tl.constexpr,
                     ROUND_TF32: tl.constexpr, FUSED: tl.constexpr = False, HAS_DESC: tl.constexpr = False,
                     TMA: tl.constexpr = False, TMA_REDUCE: tl.constexpr = False, STATS_DESC: tl.constexpr = False):
    """``dk, dv`` of ``BLOCK_N`` keys for one query head (summed over the group outside); with ``FUSED`` also
    each query tile's share of ``dq`` (unscaled), added to the zeroed fp32 ``DQ`` (see :func:`_dkdv_tiles`).
    ``HAS_DESC``: ``Q_DESC, DO_DESC, DQ_DESC`` are tensor descriptors of q, dO and DQ (else any tensors), taken where
    the tile says ``TMA`` (the interpreter, without Triton's TMA reduction, adds dq through atomics: ``TMA_REDUCE``);
    ``STATS_DESC``: ``LSE_DESC, DELTA_DESC`` are descriptors of ``LSE`` and ``DELTA`` (:func:`stats_descriptors`),
    taken likewise (else any tensors).

    The tiles are formed with the keys on the rows (``p^T = exp2(k q^T - lse)``): no product result is
    transposed on its way into the next product but ``dq``'s.
    """
    pid_n = tl.program_id(0)
    bat, h, row0, Tb, Sb = _sequence_head(CU, tl.program_id(1), T, S, HQ, VARLEN)
    n0 = pid_n * BLOCK_N
    if n0 >= Sb:
        return
    hk = h // GROUP
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_base = _head_rows(Q, bat, h, row0, sqb, sqh, sqt)
    do_base = _head_rows(DO, bat, h, row0, sdob, sdoh, sdot)
    dq_base = _head_rows(DQ, bat, h, row0, sdqb, sdqh, sdqt)
    k = _tf32(_load_rows(_head_rows(K, bat, hk, row0, skb, skh, skt), offs_n, skt, offs_d, Sb, D, False), ROUND_TF32)
    v = _tf32(_load_rows(_head_rows(V, bat, hk, row0, svb, svh, svt), offs_n, svt, offs_dv, Sb, DV, False),
              ROUND_TF32)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    stats = _stats_rows(bat, h, HQ, T, row0)
    lo, hi = _query_tiles(n0, Tb, Sb, BLOCK_M, BLOCK_N, CAUSAL, WINDOW)
    _, _, full_lo, full_hi = query_span(n0, tl.minimum(n0 + BLOCK_N, Sb) - 1, Tb, Sb - Tb, CAUSAL, WINDOW)
    _, a, b = tile_loop_bounds(lo, hi, full_lo, full_hi, BLOCK_M)  # lo is on a tile edge
    HIDDEN: tl.constexpr = CAUSAL or WINDOW > 0 or VARLEN  # masked tiles partly hidden (see _dkdv_tiles)
    dk, dv = _dkdv_tiles(dk, dv, k, v, q_base, do_base, sqt, sdot, LSE, DELTA, stats, lo, a, offs_n, offs_m0, offs_d,
                         offs_dv, Tb, Sb, qk_scale, dq_base, sdqt, Q_DESC, DO_DESC, DQ_DESC, LSE_DESC, DELTA_DESC,
                         bat, h, row0, HQ, D, DV, BLOCK_M, CAUSAL, WINDOW, HIDDEN, True, PREC, ROUND_TF32,
                         FUSED, TMA, TMA_REDUCE, STATS_DESC)
    dk, dv = _dkdv_tiles(dk, dv, k, v, q_base, do_base, sqt, sdot, LSE, DELTA, stats, a, b, offs_n, offs_m0, offs_d,
                         offs_dv, Tb, Sb, qk_scale, dq_base, sdqt, Q_DESC, DO_DESC, DQ_DESC, LSE_DESC, DELTA_DESC,
                         bat, h, row0, HQ, D, DV, BLOCK_M, CAUSAL, WINDOW, HIDDEN, False, PREC, ROUND_TF32,
                         FUSED, TMA, TMA_REDUCE, STATS_DESC)
    dk, dv = _dkdv_tiles(dk, dv, k, v, q_base, do_base, sqt, sdot, LSE, DELTA, stats, b, hi, offs_n, offs_m0, offs_d,
                         offs_dv, Tb, Sb, qk_scale, dq_base, sdqt, Q_DESC, DO_DESC, DQ_DESC, LSE_DESC, DELTA_DESC,
                         bat, h, row0, HQ, D, DV, BLOCK_M, CAUSAL, WINDOW, HIDDEN, True, PREC, ROUND_TF32,
                         FUSED, TMA, TMA_REDUCE, STATS_DESC)
    dk = dk * sm_scale
    _store_rows(_head_rows(DK, bat, h, row0, sdkb, sdkh, sdkt), dk, offs_n, sdkt, offs_d, Sb, D)
    _store_rows(_head_rows(DVV, bat, h, row0, sdvb, sdvh, sdvt), dv, offs_n, sdvt, offs_dv, Sb, DV)


@triton.jit
def _bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, CU,
                   sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, sdob, sdot, sdoh, sdqb, sdqt, sdqh,
                   T, S, HQ, GROUP, qk_scale, sm_scale, SIZE_CLASS,
                   D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                   WINDOW: tl.constexpr, VARLEN: tl.constexpr, PREC: tl.constexpr,
                   ROUND_TF32: tl.constexpr):
    """``dq`` of ``BLOCK_M`` queries of one head."""
    pid_m = query_tile(CAUSAL)
    bat, h, row0, Tb, Sb = _sequence_head(CU, tl.program_id(1), T, S, HQ, VARLEN)
    m0 = pid_m * BLOCK_M
    if m0 >= Tb:
        return
    hk = h // GROUP
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = _tf32(_load_rows(_head_rows(Q, bat, h, row0, sqb, sqh, sqt), offs_m, sqt, offs_d, Tb, D, False), ROUND_TF32)
    do = _tf32(_load_rows(_head_rows(DO, bat, h, row0, sdob, sdoh, sdot), offs_m, sdot, offs_dv, Tb, DV, False),
               ROUND_TF32)
    lse, delta = _row_stats(LSE, DELTA, _stats_rows(bat, h, HQ, T, row0), offs_m, Tb)
    k_base = _head_rows(K, bat, hk, row0, skb, skh, skt)
    v_base = _head_rows(V, bat, hk, row0, svb, svh, svt)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    lo, hi = _key_tiles(m0, Tb, Sb, BLOCK_M, BLOCK_N, CAUSAL, WINDOW)
    full_lo, full_hi = _full_keys(m0, Tb, Sb, BLOCK_M, CAUSAL, WINDOW)
    _, a, b = tile_loop_bounds(lo, hi, full_lo, full_hi, BLOCK_N)  # lo is on a tile edge
    dq = _dq_tiles(dq, q, do, lse, delta, k_base, v_base, skt, svt, lo, a, offs_m, offs_n0, offs_d, offs_dv, Tb, Sb,
                   qk_scale, D, DV, BLOCK_N, CAUSAL, WINDOW, True, PREC, ROUND_TF32)
    dq = _dq_tiles(dq, q, do, lse, delta, k_base, v_base, skt, svt, a, b, offs_m, offs_n0, offs_d, offs_dv, Tb, Sb,
                   qk_scale, D, DV, BLOCK_N, CAUSAL, WINDOW, False, PREC, ROUND_TF32)
    dq = _dq_tiles(dq, q, do, lse, delta, k_base, v_base, skt, svt, b, hi, offs_m, offs_n0, offs_d, offs_dv, Tb, Sb,
                   qk_scale, D, DV, BLOCK_N, CAUSAL, WINDOW, True, PREC, ROUND_TF32)
    dq = dq * sm_scale
    _store_rows(_head_rows(DQ, bat, h, row0, sdqb, sdqh, sdqt), dq, offs_m, sdqt, offs_d, Tb, D)


# ----------------------------------------------------------------------------- tile choices

# "tensor" and "ieee" first list the tiles that compile for sm_90 without spill traffic in the key loop (see
# benchmarks/results/sm90-registers/scan.txt: ``python -m regattn.bench.registers scan --candidates``), then
# tiles that spill but won on the H100: without them the forward at B1 H16 T16384 D64 took 88.7 ms (ieee in the
# rows form, 55.1 ms with them) and 9.86 ms (tf32, 7.86 ms with them) in regattn bench scan.
# "ieee" with the keys on the rows of every tile (_fold_tile_t) took 27.8 ms there on the H200 where the rows
# form took 55.1 (0.89x SDPA's memory-efficient fp32 against 1.75x: benchmarks/results/h200/tiles/README.md,
# "keys on the rows"). Its last two tiles have no spill traffic in the key loop in that form; 64 x 64 on 2 warps
# (64 outputs a thread, 3.2 FFMA a shared word, no spill in the loop either) took 80.7 ms: six warps an SM.
# Causal, with the masked tiles folded apart, 64 x 64 on 4 warps took 17.0 ms at T 16384, behind 32 x 32 on 2
# warps (16.5) and 32 x 64 on 4 (16.9, first at T 4096); no unlisted tile won (README, "what a causal fold
# waits on").
# fp16/bf16: issuing the next key tile's q k^T before this tile's softmax (so that the tensor cores form it while
# the exp2s run) lost to the plain loop: benchmarks/results/h200/tiles/README.md ("ELSA's fp16 forward"); so did
# moving the running max only past a slack, which saves the rescaling multiplies in most tiles but puts a
# reduction across warps (two barriers) in every one ("the running max moved lazily").
# fp16/bf16 tiles are tuned twice: key and value tiles loaded through pointers, and (TMA) as Hopper's tensor-memory
# copies through descriptors of k and v (:func:`kv_descriptors`).


def _set_boxes(args, rows: int) -> None:
    """Give the tensor descriptors among ``args`` a box of ``rows`` rows of one head (all its columns)."""
    for a in args:
        if isinstance(a, TensorDescriptor):
            a.block_shape = [1, rows, 1, a.block_shape[3]] if len(a.block_shape) == 4 else [1, rows]


def _descriptor_boxes(nargs: dict) -> None:
    """Autotune pre-hook: the descriptors' boxes follow the config's key tile."""
    _set_boxes(nargs.values(), nargs["BLOCK_N"])


def _query_boxes(nargs: dict) -> None:
    """Autotune pre-hook: the descriptors' boxes follow the config's query tile (the fused backward's q, dO, dq)."""
    _set_boxes(nargs.values(), nargs["BLOCK_M"])


def _half_configs(pointer_tiles, tma_tiles, boxes=_descriptor_boxes) -> list:
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "TMA": tma}, num_warps=w, num_stages=s,
                          pre_hook=boxes if tma else None)
            for tma, tiles in ((False, pointer_tiles), (True, tma_tiles)) for m, n, w, s in tiles]


# The TMA tiles hold fewer registers (128 x 64 on 4 warps: 195 against 228), so deeper pipelines are listed too.
# 64 x 128 on 4 warps, 2 stages, at D 64 (155 registers, 72 KiB of shared memory) runs three programs an SM where
# the 128-row tiles run two: on the H200 the fastest tile non-causal (B1 H16 T16384: 2.53 ms against 2.63 for
# 128 x 64 on 4 warps, 4 stages), and at 3 stages causal ("three programs an SM" in the tiles README).
_HALF_TILES = [(128, 64, 4, 3), (128, 128, 8, 3), (128, 64, 8, 3), (64, 64, 4, 3)]
FWD_CONFIGS = {
    "half": _half_configs(_HALF_TILES, _HALF_TILES + [(128, 64, 4, 4), (128, 128, 8, 2), (64, 128, 4, 3),
                                                      (128, 128, 4, 2), (64, 128, 4, 2)]),
    "tensor": tile_configs([(128, 64, 8, 3), (64, 64, 4, 3), (64, 32, 4, 2), (32, 64, 4, 2), (32, 64, 8, 3),
                        (32, 128, 8, 2), (128, 64, 4, 3), (128, 32, 4, 3), (128, 128, 8, 2), (64, 128, 4, 2)]),
    "ieee": tile_configs([(64, 64, 8, 2), (128, 32, 8, 2), (64, 32, 4, 2), (32, 64, 4, 2), (32, 32, 4, 2),
                      (128, 32, 8, 3), (64, 32, 4, 3), (32, 64, 4, 3), (32, 32, 2, 2),
                      (64, 64, 4, 2), (128, 64, 8, 2), (64, 128, 8, 2), (64, 64, 4, 3), (64, 32, 2, 2)]),
    # fp32 as fp16 parts (precision "fp16x3"): two fp16 tiles of each operand.
    "split": tile_configs([(128, 64, 8, 3), (64, 64, 4, 3), (128, 64, 8, 2), (64, 64, 4, 2), (128, 128, 8, 2),
                           (64, 128, 4, 2), (128, 32, 4, 3), (64, 32, 4, 3)]),
}
# Strict fp32's masked tiles in a launch of their own (MASKED_LAUNCH, PART 2 of _fwd_kernel): one or two tiles at
# either end of each query tile's keys, their loop unpipelined; each tile compiles for sm_90 without a spill.
MASKED_CONFIGS = tile_configs([(64, 32, 4, 1), (32, 64, 4, 1), (32, 32, 2, 1), (32, 32, 4, 1)])
# The two-pass backward (fp32; fp16/bf16 with FUSED_DQ off): one stage. While the backward's loops chose each
# tile's product at run time, Triton 3.6 on the H100 gave the causal dk, dv (and dq at 64 x 64) 0.7 to 1.1
# relative error with the loop software-pipelined (2 or 3 stages). With masked and unmasked tiles in loops of
# their own every tile is exact at 1 to 3 stages, but pipelining was no faster at B1 H16 D64 causal (1.5% at
# T 16384 and 65536, slower at T 4096 and with a window): benchmarks/results/h100/tiles/scan-backward-stages.json.
BWD_CONFIGS = {
    "half": tile_configs([(64, 64, 4, 1), (32, 64, 4, 1), (64, 64, 8, 1)]),
    "fp32": tile_configs([(32, 64, 4, 2), (64, 64, 4, 2), (64, 32, 4, 2)]),
}
# fp16/bf16 backward with dq added by the dK/dV pass (FUSED_DQ): each (key tile, query tile) pair forms p and ds
# once, where the two passes form them twice (five products and one exp2 a pair against seven and two); dq's
# fp32 rows take each query tile's share by atomics or, with TMA, by the tensor-memory reduction (the query and
# dO tiles then load through descriptors too). On the H200, forward+backward in fp16 (benchmarks/results/h200/
# tiles/scan-backward-fused.json, README there): B1 H16 T16384 D64 12.61 ms in two passes, 11.30 fused through
# atomics, 10.52 through TMA (cuDNN 8.71); causal 6.73, 6.19, 5.65 (4.56); D128 causal at T8192 3.09, 3.19, 3.06.
# The TMA tiles take each query tile's lse and delta through descriptors too (stats_descriptors): 9.82 ms against
# 10.05 (cuDNN 8.63), causal 5.32 against 5.40 (tiles README: "the rows' lse and delta through tensor descriptors").
# Packed sequences take the descriptors of q, dO and dq (their masked tiles hold the next sequence's rows and add
# zeros to its dq): B1 H16 D64 causal, 8 sequences, T65536 12.68 ms against 13.92 through pointers and atomics.
# The tiles add ds @ k unscaled and the call scales the buffer once as it casts it (the query loop 443 -> 411
# instructions on sm_90): T16384 10.00 ms against 10.06, causal 5.39 against 5.46 (tiles README: "dq scaled once").
# The fp32 buffer costs 4 bytes a query-row column while a call runs.
FUSED_DQ = True
# The tiles without spills on sm_90 at D 64 (python -m regattn.bench.registers scan_bwd); 128 x 64 and 128 x 128 on
# 8 warps, 64 x 128 and 32 x 128 on 4 spill. 4 stages (64 x 64 on 4 warps, 64 x 128 on 8) lost to 3 on the H200.
_FUSED_TILES = [(64, 64, 4, 1), (64, 128, 8, 1), (64, 64, 4, 2), (64, 128, 8, 2), (64, 64, 4, 3), (64, 128, 8, 3),
                (32, 128, 8, 2), (32, 64, 4, 2)]
FUSED_CONFIGS = _half_configs(_FUSED_TILES, _FUSED_TILES, boxes=_query_boxes)
SMEM_BUDGET = 180 * 1024  # bytes of shared memory a config may plan for (H100: 227 KiB per block)


def _smem_bytes(cfg, block_d: int, block_dv: int, elsize: int, *, streamed: str) -> int:
    """Estimated shared memory: the resident q (or k) tile plus ``num_stages`` copies of the streamed pair.

    ``streamed="N"``: key/value tiles stream past a query tile (forward, dq); ``"M"``: query/dO tiles
    stream past a key/value tile (dk, dv); ``"fused"``: as ``"M"``, with the value tile, the transposed ``ds``
    tile and (TMA) the fp32 ``dq`` tile of the reduction (within 15% of what triton 3.6 gives the fused
    backward's tiles on sm_90 at D 64 and 128).
    """
    m, n = cfg.kwargs["BLOCK_M"], cfg.kwargs["BLOCK_N"]
    resident, moving = (m, n) if streamed == "N" else (n, m)
    total = (resident * block_d + cfg.num_stages * moving * (block_d + block_dv)) * elsize
    if streamed == "fused":
        total += (resident * block_dv + m * n) * elsize + (4 * m * block_d if cfg.kwargs.get("TMA") else 0)
    return total


def fitting(configs, block_d: int, block_dv: int, elsize: int, *, streamed: str):
    """The configs whose tiles fit in shared memory (the smallest one when none does)."""
    ok = [c for c in configs if _smem_bytes(c, block_d, block_dv, elsize, streamed=streamed) <= SMEM_BUDGET]
    return ok or [min(configs, key=lambda c: _smem_bytes(c, block_d, block_dv, elsize, streamed=streamed))]


def usable(configs, meta: dict) -> list:
    """The configs a launch can take: those loading through descriptors (TMA) only where it passes them, and
    tiles no longer than ``WHOLE_ROWS`` where the launch is one of two parts (see :data:`WHOLE_ROWS`)."""
    side = meta.get("WHOLE_ROWS") or float("inf")
    return [c for c in configs if (meta.get("HAS_DESC") or not c.kwargs.get("TMA"))
            and max(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]) <= side]


def _operand_bytes(q, meta: dict) -> int:
    """Bytes an element of each operand takes in shared memory: two fp16 parts with ``SPLIT``."""
    return q.element_size() * (2 if meta.get("SPLIT") else 1)


def _pruner(streamed: str):
    def prune(configs, named_args, **kwargs):
        return fitting(usable(configs, kwargs), kwargs["BLOCK_D"], kwargs["BLOCK_DV"],
                       _operand_bytes(named_args["Q"], kwargs), streamed=streamed)
    return {"early_config_prune": prune}


_KEY = ["D", "DV", "CAUSAL", "WINDOW", "VARLEN", "PREC", "SIZE_CLASS"]
_FWD_KEY = _KEY + ["NSPLIT", "STORE_LSE", "HAS_DESC", "SPLIT", "PART", "WHOLE_ROWS", "PAIRED"]
_FWD_TUNED = {family: triton.autotune(cfgs, key=_FWD_KEY, prune_configs_by=_pruner("N"))(_fwd_kernel)
              for family, cfgs in FWD_CONFIGS.items()}
_MASKED_TUNED = triton.autotune(MASKED_CONFIGS, key=_FWD_KEY, prune_configs_by=_pruner("N"))(_fwd_kernel)
_DKDV_TUNED = {family: triton.autotune(cfgs, key=_KEY, prune_configs_by=_pruner("M"))(_bwd_dkdv_kernel)
               for family, cfgs in BWD_CONFIGS.items()}
_DQ_TUNED = {family: triton.autotune(cfgs, key=_KEY, prune_configs_by=_pruner("N"))(_bwd_dq_kernel)
             for family, cfgs in BWD_CONFIGS.items()}
_FUSED_TUNED = triton.autotune(FUSED_CONFIGS, key=_KEY + ["HAS_DESC", "STATS_DESC"], prune_configs_by=_pruner("fused"),
                               reset_to_zero=["DQ"])(_bwd_dkdv_kernel)  # each timed run adds into DQ
INTERPRET_BLOCK = 16
AUTOTUNE = True  # False: every launch takes the first config of its list (no tuning runs)


def _family(dtype: torch.dtype, precision: str) -> str:
    if dtype in (torch.float16, torch.bfloat16):
        return "half"
    return {"ieee": "ieee", "fp16x3": "split"}.get(precision, "tensor")


def dot_precision(dtype: torch.dtype, precision: str) -> str:
    """The ``input_precision`` of every ``tl.dot``: the requested one for fp32 (``"tf32x3"`` for ``"fp16x3"``,
    whose forward multiplies fp16 parts and whose backward takes tf32x3's products), unused for fp16/bf16."""
    if dtype != torch.float32:
        return "tf32"
    return "tf32x3" if precision == "fp16x3" else precision


# Strict fp32 folds a causal, windowed or packed forward (one split) in two launches: the whole tiles, then the masked
# ones (PART 1, PART 2 of _fwd_kernel), so that each launch's kernel holds one key loop, where one launch's holds three
# (188 KB of SASS at 64 x 64 on 4 warps, whose warps wait on instruction fetch). On the H200 at B1 H16 D64 causal,
# T 4096 / 16384 / 65536: 1.267 / 16.08 / 234.4 ms against 1.283 / 16.59 / 250.8 in one launch; 8 packed sequences
# 0.311 / 2.908 / 38.57 against 0.306 / 3.027 / 39.07 (tiles README: "the masked tiles in a launch of their own").
MASKED_LAUNCH = True
# The two launches find the whole keys of each WHOLE_ROWS rows together, so that each may tile the queries its own
# way; both take tiles no longer than that. 128-row groups leave the masked launch half again as many keys a row:
# 1.326 / 16.11 / 234.4 ms causal, 0.321 / 2.876 / 37.68 packed.
WHOLE_ROWS = 64
# A causal fold without a window pairs its whole-tile query tiles (PAIRED of _fwd_kernel): each program folds as many
# whole tiles (but one), where unpaired they differ in length. On the H200 at B1 H16 D64 causal, T 4096 / 16384 /
# 65536: 1.168 / 16.06 / 239.6 ms against 1.275 / 16.22 / 245.0 unpaired; 8 packed sequences at T 16384 2.767
# against 2.873 (tiles README: "the masked tiles in a launch of their own").
PAIRED_ROWS = True
DOT_K = 16  # columns of q and k per FMA dot of strict fp32's q k^T (triton 3.6 needs K >= 16)
# Tiles per chunk of strict fp32's two-level fold; the chunks combine inside one key loop (_fold_parked). On the H200
# at B1 H16 D64 causal, T 4096 / 16384 / 65536: 1.135 / 14.78 / 224.2 ms against 1.171 / 16.07 / 239.3 with a key
# loop for each chunk; 8 packed sequences at T 4096 0.552 against 0.288 (tiles README: "the chunks of the two-level
# fold in one loop").
CHUNK_TILES = 16
INTERPRET_CHUNK = 2  # ... in the interpreter, so that small tests reach it


def _numerics(dtype: torch.dtype, precision: str) -> dict:
    """Strict fp32 folds in two levels (its FMA dot adds every key of a tile into the running ``W``: in one
    level that is a chain of n additions, an error growing like n), and forms ``q k^T`` in chunks of
    :data:`DOT_K` columns (fewer operand registers: sm_90 spills less); TF32 rounds its operands.

    Forming each tile's ``p @ v`` from zero before adding it compiled to the same sm_90 code: Triton folds
    ``acc * alpha + dot(p, v)`` into the dot's accumulator, so the kernels add into the running ``W`` in the
    interpreter as on the GPU."""
    strict = dtype == torch.float32 and precision == "ieee"
    chunk = INTERPRET_CHUNK if interpreting() else CHUNK_TILES
    return dict(CHUNK=chunk if strict else 0, DOT_K=DOT_K if strict else 0,
                ROUND_TF32=dtype == torch.float32 and precision == "tf32")


def _launch(configs, tuned, plain, grid, *args, streamed, **meta):
    """Run the autotuned kernel on a GPU (or its first fitting config when ``AUTOTUNE`` is off), or
    the plain one with 16 x 16 tiles in the interpreter."""
    if interpreting():
        tiles = dict(BLOCK_M=INTERPRET_BLOCK, BLOCK_N=INTERPRET_BLOCK)
        if meta.get("HAS_DESC"):
            _set_boxes(args, INTERPRET_BLOCK)
            tiles["TMA"] = True
        plain[grid(tiles)](*args, **tiles, **meta)
    elif not AUTOTUNE:
        c = fitting(usable(configs, meta), meta["BLOCK_D"], meta["BLOCK_DV"], _operand_bytes(args[0], meta),
                    streamed=streamed)[0]
        _set_boxes(args, c.kwargs["BLOCK_N" if streamed == "N" else "BLOCK_M"])  # the streamed tile's rows
        plain[grid(c.kwargs)](*args, **c.all_kwargs(), **meta)
    else:
        launch_tuned(tuned, grid, *args, **meta)


def _head_dims(D: int, DV: int):
    return head_block(D), head_block(DV)


def auto_splits(batch_heads: int, T: int, device: torch.device) -> int:
    """Split the keys when too few query tiles would fill the GPU (power of two, at most 16)."""
    if interpreting() or device.type != "cuda":
        return 1
    sms = sm_count(device)
    tiles = batch_heads * ceil_div(T, 128)
    n = 1
    while tiles * n < 2 * sms and n < 16:
        n *= 2
    return n


def _strides(x):
    return x.stride(0), x.stride(1), x.stride(2)


TENSOR_DESCRIPTORS = True  # False: fp16/bf16 key and value tiles load through pointers only


def _paying_descriptors(work: int, *boxes):
    """``tma_descriptors(*boxes)`` (their boxes set per launch: :func:`_set_boxes`), or None where the kernel loads
    through pointers: where descriptors are switched off (:data:`TENSOR_DESCRIPTORS`), do not pay for a call of
    ``work`` (:func:`regattn.ops._common.attention_tiles.tma_pays`) or TMA cannot read the tensors."""
    if not TENSOR_DESCRIPTORS or not tma_pays(work):
        return None
    return tma_descriptors(*boxes)


def kv_descriptors(k, v, block_d: int, block_dv: int, work: int):
    """Tensor descriptors of ``k [B, S, H, D]`` and ``v`` for the forward's TMA loads, or None
    (:func:`_paying_descriptors`)."""
    return _paying_descriptors(work, (k, [1, 16, 1, block_d]), (v, [1, 16, 1, block_dv]))


def query_descriptors(q, do, dq32, block_d: int, block_dv: int, work: int):
    """Tensor descriptors of the fused backward's ``q``, ``do`` and fp32 ``dq`` (``[B, T, HQ, *]``), or None, where
    the kernel loads through pointers and adds through atomics (:func:`_paying_descriptors`)."""
    return _paying_descriptors(work, (q, [1, 16, 1, block_d]), (do, [1, 16, 1, block_dv]),
                               (dq32, [1, 16, 1, block_d]))


def stats_descriptors(lse, delta, heads: int, T: int):
    """Tensor descriptors of the backward's per-row ``lse`` and ``delta`` (``[heads, T]`` each, one sequence a batch
    row), or None where TMA cannot read them (``T`` not a multiple of 4: a head's row of fp32 off 16 bytes); the
    fused backward's TMA tiles then load them through pointers."""
    return tma_descriptors((lse.view(heads, T), [1, 16]), (delta.view(heads, T), [1, 16]))


def forward(q, k, v, *, causal, window, scale, precision, cu_seqlens, num_splits, need_lse, max_seqlen=None):
    """``o [B, T, HQ, Dv]`` (q's dtype) and ``lse [B * HQ * T]`` (fp32, base 2) or None.

    With ``cu_seqlens`` (``B == 1``) the programs run over sequences (``max_seqlen``: the longest, read
    from the device when None); ``num_splits`` key slices are merged by the tree kernel.
    """
    B, T, HQ, D = q.shape
    S, H, DV = k.shape[1], k.shape[2], v.shape[3]
    BLOCK_D, BLOCK_DV = _head_dims(D, DV)
    o = torch.empty(B, T, HQ, DV, dtype=q.dtype, device=q.device)
    lse = torch.empty(B * HQ * T, dtype=torch.float32, device=q.device) if need_lse else o
    varlen = cu_seqlens is not None
    nseq = cu_seqlens.numel() - 1 if varlen else B
    rows = max_rows = T
    if varlen:
        max_rows = longest_sequence(cu_seqlens, max_seqlen)
    cu = cu_seqlens if varlen else o
    ws_stride = B * HQ * T
    if num_splits > 1:
        ws_m = torch.empty(num_splits * ws_stride, dtype=torch.float32, device=q.device)
        ws_l = torch.empty_like(ws_m)
        ws_acc = torch.empty(num_splits * ws_stride * BLOCK_DV, dtype=torch.float32, device=q.device)
    else:
        ws_m = ws_l = ws_acc = lse
    prec = dot_precision(q.dtype, precision)
    fam = _family(q.dtype, precision)
    descriptors = None
    if fam == "half":  # (a packed sequence's query row sees at most max_rows keys)
        descriptors = kv_descriptors(k, v, BLOCK_D, BLOCK_DV, work=B * HQ * T * (max_rows if varlen else S) * D)
    (qk, kk, vk), parts = (q, k, v), (q, k, v, q, k, v)  # the kernel's operands; parts unused but by SPLIT
    if fam == "ieee":  # q and k laid out [.., D, T] for the transposed products (_fold_tile_t)
        parts = (q.permute(0, 2, 3, 1).contiguous(), k.permute(0, 2, 3, 1).contiguous(), v, q, k, v)
    if fam == "split":
        (qk, q_lo, q_scale), (kk, k_lo, k_scale) = row_parts(q), row_parts(k)
        vk, v_lo, v_scale = column_parts(v, cu_seqlens)
        parts = (q_lo, k_lo, v_lo, q_scale, k_scale, v_scale)
    parted = fam == "ieee" and (causal or bool(window) or varlen) and num_splits == 1 and MASKED_LAUNCH
    if parted:  # the whole tiles' (m, l) parked for the masked launch
        ws_m, ws_l = (torch.empty(ws_stride, dtype=torch.float32, device=q.device) for _ in range(2))
    args = (qk, kk, vk, o, lse, ws_m, ws_l, ws_acc, cu, *(descriptors or (k, v)), *parts,
            *_strides(qk), *_strides(kk), *_strides(vk), *_strides(o),
            rows, S, HQ, HQ // H, scale * LOG2E, ws_stride, size_class(B * HQ * T))
    meta = dict(D=D, DV=DV, BLOCK_D=BLOCK_D, BLOCK_DV=BLOCK_DV, CAUSAL=causal, WINDOW=window or 0,
                VARLEN=varlen, NSPLIT=num_splits, STORE_LSE=need_lse, PREC=prec, POS_SCALE=scale > 0,
                HAS_DESC=descriptors is not None, SPLIT=fam == "split", streamed="N", **_numerics(q.dtype, precision))
    grid = lambda m: (ceil_div(max_rows, m["BLOCK_M"]), nseq * HQ, num_splits)  # noqa: E731
    if parted:
        whole_rows = 2 * INTERPRET_BLOCK if interpreting() else WHOLE_ROWS
        paired = causal and not window and PAIRED_ROWS
        pairs = lambda m: (ceil_div(ceil_div(max_rows, m["BLOCK_M"]), 2), nseq * HQ, 1)  # noqa: E731
        _launch(FWD_CONFIGS[fam], _FWD_TUNED[fam], _fwd_kernel, pairs if paired else grid, *args, PART=1,
                WHOLE_ROWS=whole_rows, PAIRED=paired, **meta)
        _launch(MASKED_CONFIGS, _MASKED_TUNED, _fwd_kernel, grid, *args, PART=2, WHOLE_ROWS=whole_rows, **meta)
    else:
        _launch(FWD_CONFIGS[fam], _FWD_TUNED[fam], _fwd_kernel, grid, *args, **meta)
    if num_splits > 1:
        block = max(1, min(64, 8192 // (num_splits * BLOCK_DV)))
        _merge_kernel[(ceil_div(max_rows, block), nseq * HQ)](
            ws_m, ws_l, ws_acc, o, lse, cu, *_strides(o), rows, HQ, ws_stride,
            DV=DV, BLOCK_DV=BLOCK_DV, BLOCK_M=block, VARLEN=varlen, NSPLIT=num_splits,
            LOG_NSPLIT=num_splits.bit_length() - 1, STORE_LSE=need_lse)
    return o, (lse if need_lse else None)


def backward(do, q, k, v, o, lse, *, causal, window, scale, precision, cu_seqlens, max_seqlen=None):
    """``dq, dk, dv`` in the inputs' dtypes; ``dk, dv`` summed over each query-head group."""
    B, T, HQ, D = q.shape
    S, H, DV = k.shape[1], k.shape[2], v.shape[3]
    BLOCK_D, BLOCK_DV = _head_dims(D, DV)
    do = do.contiguous()
    bfam = "fp32" if q.dtype == torch.float32 else "half"
    fused = bfam == "half" and FUSED_DQ and not torch.are_deterministic_algorithms_enabled()
    dq32 = torch.empty(B, T, HQ, D, dtype=torch.float32, device=q.device) if fused else None
    delta = row_dot(o, do, heads_first=True, zeros=dq32)  # [B, HQ, T]; dq32 zeroed for its atomics
    dk = torch.empty(B, S, HQ, D, dtype=torch.float32 if HQ != H else k.dtype, device=k.device)
    dv = torch.empty(B, S, HQ, DV, dtype=torch.float32 if HQ != H else v.dtype, device=v.device)
    varlen = cu_seqlens is not None
    nseq = cu_seqlens.numel() - 1 if varlen else B
    max_t = max_s = None
    if varlen:
        max_t = max_s = longest_sequence(cu_seqlens, max_seqlen)
    cu = cu_seqlens if varlen else q
    prec = dot_precision(q.dtype, precision)
    meta = dict(D=D, DV=DV, BLOCK_D=BLOCK_D, BLOCK_DV=BLOCK_DV, CAUSAL=causal, WINDOW=window or 0,
                VARLEN=varlen, PREC=prec, ROUND_TF32=_numerics(q.dtype, precision)["ROUND_TF32"])
    common = (T, S, HQ, HQ // H, scale * LOG2E, scale, size_class(B * HQ * T))
    key_grid = lambda m: (ceil_div(max_s or S, m["BLOCK_N"]), nseq * HQ)  # noqa: E731
    if fused:  # dq added by atomics, in any order
        desc = query_descriptors(q, do, dq32, BLOCK_D, BLOCK_DV, work=B * HQ * T * (max_s or S) * D)
        stats = None if varlen or desc is None else stats_descriptors(lse, delta, B * HQ, T)
        _launch(FUSED_CONFIGS, _FUSED_TUNED, _bwd_dkdv_kernel, key_grid, q, k, v, do, lse, delta, dk, dv, cu, dq32,
                *(desc or (q, do, dq32)), *(stats or (lse, delta)), *_strides(q), *_strides(k), *_strides(v),
                *_strides(do), *_strides(dk), *_strides(dv), *_strides(dq32), *common, streamed="fused", FUSED=True,
                HAS_DESC=desc is not None, STATS_DESC=stats is not None, **meta)
        dq = torch.mul(dq32, scale, out=torch.empty_like(dq32, dtype=q.dtype))  # its tiles add ds @ k unscaled
    else:
        dq = torch.empty_like(q)
        _launch(BWD_CONFIGS[bfam], _DKDV_TUNED[bfam], _bwd_dkdv_kernel, key_grid, q, k, v, do, lse, delta, dk, dv,
                cu, dq, q, do, dq, lse, delta, *_strides(q), *_strides(k), *_strides(v), *_strides(do), *_strides(dk),
                *_strides(dv), *_strides(dq), *common, streamed="M", **meta)
        _launch(BWD_CONFIGS[bfam], _DQ_TUNED[bfam], _bwd_dq_kernel,
                lambda m: (ceil_div(max_t or T, m["BLOCK_M"]), nseq * HQ),
                q, k, v, do, lse, delta, dq, cu, *_strides(q), *_strides(k), *_strides(v), *_strides(do),
                *_strides(dq), *common, streamed="N", **meta)
    if HQ != H:
        dk = dk.view(B, S, H, HQ // H, D).sum(3).to(k.dtype)
        dv = dv.view(B, S, H, HQ // H, DV).sum(3).to(v.dtype)
    return dq, dk, dv
