"""Fused softmax attention with an optional causal mask, sliding window and GatedFWA gate bias.

gatedfwa.md Algorithm 2 (forward) and Algorithm 4 (backward), FlashAttention-2 style:

* forward: one program per (query tile, sequence, query head); only key tiles that meet the
  causal window are visited, in one loop that masks the partial tiles only; online softmax in base 2;
  saves the log-sum-exp.
* backward: ``delta = rowsum(o * dO)``; one kernel per key tile accumulates ``dK, dV`` over the
  query heads of its group and the gate gradient ``du_j = -sum_i dS_ij``; a second kernel per query
  tile gives ``dQ``.

The gate bias ``u_i - u_j``: a row's own ``u_i`` shifts all its logits alike, so the softmax does not
see it. The kernels add only ``-(u_j - r)`` to the logits, one vector per tile with ``r`` the gate at the
program's first row (differences of nearby ``u``, exact where ``|u|`` is large), and move ``u_i - r`` into
the saved log-sum-exp. For the same reason the query part of the gate gradient, ``sum_j dS_ij =
sum_j P_ij dP_ij - delta_i``, is zero: ``du`` is the key part alone. Its rounding therefore does not cancel
in the reverse cumulative sums the gate's backward takes of it, as it does where both parts come from the same
``dS`` (autograd of the torch path): where a GatedFWA amplitude ``beta`` nears 0 (``d alpha / d beta`` grows as
``1 / beta^2``) the fp32 ``dbeta`` there is far less accurate than the torch path's (at ``beta`` ~ 1e-3, up to
0.25% relative error in ``beta_proj``'s weight gradient of a small layer, against 5e-5).

Layout: ``q: [B, T, HQ, D]``, ``k: [B, S, H, D]``, ``v: [B, S, H, Dv]``, ``u: [B, T, HQ]`` (the kernels
read it as :func:`gate_rows` lays it out); with ``cu_seqlens`` the batch is one packed row (``B == 1``,
``S == T``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from regattn.ops._common.attention_tiles import (
    LOG2E, attention_blocks, dot_precision, full_key_span, head_block, key_span, online_softmax_step, query_span,
    query_tile, row_dot, softmax_finish, tile_loop_bounds, visible_mask, visible_mask_t,
)
from regattn.ops._common.checks import last_dim_contiguous, longest_sequence
from regattn.ops._common.ints import ceil_div

GATE2 = tl.constexpr(LOG2E)  # u in base 2


@triton.jit
def _sequence(CU, n, T, S, VARLEN: tl.constexpr):
    """``(batch, first token, Tq, Sk)`` of sequence ``n``: a batch row, or a packed slice of row 0."""
    if VARLEN:  # offsets clamped to [0, T]: unchecked offsets read nothing outside the tensors
        bos = tl.minimum(tl.maximum(tl.load(CU + n).to(tl.int32), 0), T)
        eos = tl.minimum(tl.maximum(tl.load(CU + n + 1).to(tl.int32), bos), T)
        return 0, bos, eos - bos, eos - bos
    return n, 0, T, S


@triton.jit
def _query_program(CU, T, S, GROUP: tl.constexpr, VARLEN: tl.constexpr, BLOCK_M: tl.constexpr,
                   CAUSAL: tl.constexpr):
    """``(batch, first token, Tq, Sk, query head, key/value head, first query)`` of a program of the
    grid ``(query tiles, sequences, HQ)`` (causal: the last tile first, see ``query_tile``)."""
    pid_m = query_tile(CAUSAL)
    n = tl.program_id(1)
    hq = tl.program_id(2)
    hk = hq // GROUP
    b, bos, Tq, Sk = _sequence(CU, n, T, S, VARLEN)
    return b, bos, Tq, Sk, hq, hk, pid_m * BLOCK_M


@triton.jit
def _head_base(P, b, bos, head, stride_b, stride_t, stride_h):
    """``P`` moved to the first token of ``head`` in the sequence at ``(b, bos)``."""
    return P + b * stride_b + bos * stride_t + head * stride_h


@triton.jit
def _tile_ptrs(P, b, bos, rows, head, stride_b, stride_t, stride_h, BLOCK_C: tl.constexpr):
    """Pointers ``[len(rows), BLOCK_C]`` to tokens ``bos + rows`` of ``head`` in batch row ``b``."""
    return P + b * stride_b + (bos + rows[:, None]) * stride_t + head * stride_h + tl.arange(0, BLOCK_C)[None, :]


@triton.jit
def _tile_mask(rows, n_rows, n_cols, BLOCK_C: tl.constexpr):
    """Where :func:`_tile_ptrs` points inside ``n_rows x n_cols``."""
    return (rows < n_rows)[:, None] & (tl.arange(0, BLOCK_C) < n_cols)[None, :]


@triton.jit
def _load_tile(P, b, bos, rows, head, stride_b, stride_t, stride_h, n_rows, n_cols, BLOCK_C: tl.constexpr):
    """Tile ``[len(rows), BLOCK_C]`` of ``head``; rows ``>= n_rows`` and columns ``>= n_cols`` read 0."""
    return tl.load(_tile_ptrs(P, b, bos, rows, head, stride_b, stride_t, stride_h, BLOCK_C),
                   mask=_tile_mask(rows, n_rows, n_cols, BLOCK_C), other=0.0)


@triton.jit
def _gate_origin(G_h, row, GATED: tl.constexpr):
    """``r``: the gate at ``row`` where finite, else 0 (0 without a gate)."""
    r = 0.0
    if GATED:
        r = tl.load(G_h + row)
        r = tl.where(tl.abs(r) < float("inf"), r, 0.0)
    return r


@triton.jit
def _gate_from(G_h, rows, r, unit, GATED: tl.constexpr, BLOCK: tl.constexpr):
    """``(u - r) * unit`` at ``rows`` (``[BLOCK]``, zeros without a gate). The gate rows are padded (see
    :func:`gate_rows`), so rows up to two tiles past the end read without a mask."""
    g = tl.zeros([BLOCK], dtype=tl.float32)
    if GATED:
        g = (tl.load(G_h + rows) - r) * unit
    return g


@triton.jit
def _row_stats(LSE_h, DELTA_h, G_h, rows, slt, Tq, r, GATED: tl.constexpr, BLOCK: tl.constexpr):
    """``(lse2, delta)`` of query ``rows``: the base-2 log-sum-exp without the rows' own gate ``u_i - r``, and
    ``rowsum(o * dO)``."""
    rmask = rows < Tq
    lse2 = tl.load(LSE_h + rows * slt, mask=rmask, other=float("inf"))
    if GATED:
        lse2 -= _gate_from(G_h, rows, r, GATE2, GATED, BLOCK)
    return lse2, tl.load(DELTA_h + rows * slt, mask=rmask, other=0.0)


@triton.jit
def _in_mask(start, full_lo, full_hi):
    """Whether the tile at ``start`` lies outside the full tiles ``[full_lo, full_hi)``: it takes the mask."""
    return (start < full_lo) | (start >= full_hi)


@triton.jit
def _key_tiles(start_m, Tq, Sk, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """Key tiles of the query tile at ``start_m``: masked ``[a, bb)``, full ``[bb, c)``, masked ``[c, hi)``."""
    off = Sk - Tq
    pos_hi = tl.minimum(start_m + BLOCK_M, Tq) - 1 + off
    lo, hi = key_span(start_m + off, pos_hi, Sk, CAUSAL, WINDOW)
    full_lo, full_hi = full_key_span(start_m + off, pos_hi, Sk, CAUSAL, WINDOW)
    a, bb, c = tile_loop_bounds(lo, hi, full_lo, full_hi, BLOCK_N)
    return a, bb, c, hi


@triton.jit
def _fwd_tiles(acc, m_i, l_i, q, pos, K_h, V_h, G_h, stride_kt, stride_vt, Sk, start, end, full_lo, full_hi,
               sm_scale2, r, gate_unit, D, DV, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, GATED: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, PRECISION: tl.constexpr):
    """Key tiles ``[start, end)``, masked outside ``[full_lo, full_hi)``, in one loop (one software pipeline).
    Logits ``s`` in the units of ``q.k`` (``sm_scale2 * s`` in base 2), the key gate ``u_j - r`` among them
    (loaded a tile ahead, so that its latency hides behind a tile's products)."""
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    gate_next = _gate_from(G_h, start + tl.arange(0, BLOCK_N), r, gate_unit, GATED, BLOCK_N)
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        gate = gate_next
        gate_next = _gate_from(G_h, offs_n + BLOCK_N, r, gate_unit, GATED, BLOCK_N)
        kmask = offs_n < Sk
        kt = tl.load(K_h + offs_n[None, :] * stride_kt + offs_d[:, None],
                     mask=kmask[None, :] & (offs_d < D)[:, None], other=0.0)
        s = tl.dot(q, kt, input_precision=PRECISION)
        if GATED:
            s -= gate[None, :]
        if _in_mask(start_n, full_lo, full_hi):
            s = tl.where(visible_mask(pos, offs_n, Sk, CAUSAL, WINDOW), s, float("-inf"))
        m_i, l_i, p, alpha = online_softmax_step(m_i, l_i, s, sm_scale2)
        v = tl.load(V_h + offs_n[:, None] * stride_vt + offs_dv[None, :],
                    mask=kmask[:, None] & (offs_dv < DV)[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_i, l_i


@triton.jit
def _fwd_kernel(Q, K, V, G, O, LSE, CU, sm_scale2, T, S, D, DV,
                sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, sgb, sgt, sgh, sob, sot, soh, slb, slt, slh,
                GROUP: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, GATED: tl.constexpr,
                VARLEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                BLOCK_DV: tl.constexpr, PRECISION: tl.constexpr):
    """``o`` and the base-2 log-sum-exp of ``BLOCK_M`` queries of one query head."""
    b, bos, Tq, Sk, hq, hk, start_m = _query_program(CU, T, S, GROUP, VARLEN, BLOCK_M, CAUSAL)
    if start_m >= Tq:
        return
    off = Sk - Tq
    offs_m = start_m + tl.arange(0, BLOCK_M)
    pos = offs_m + off
    q = _load_tile(Q, b, bos, offs_m, hq, sqb, sqt, sqh, Tq, D, BLOCK_D)
    G_h = _head_base(G, b, bos, hq, sgb, sgt, sgh)
    r = _gate_origin(G_h, start_m, GATED)
    K_h = _head_base(K, b, bos, hk, skb, skt, skh)
    V_h = _head_base(V, b, bos, hk, svb, svt, svh)
    a, bb, c, hi = _key_tiles(start_m, Tq, Sk, CAUSAL, WINDOW, BLOCK_M, BLOCK_N)

    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc, m_i, l_i = _fwd_tiles(acc, m_i, l_i, q, pos, K_h, V_h, G_h, skt, svt, Sk, a, hi, bb, c, sm_scale2, r,
                               GATE2 / sm_scale2, D, DV, CAUSAL, WINDOW, GATED, BLOCK_N, BLOCK_D, BLOCK_DV,
                               PRECISION)
    o, lse2 = softmax_finish(acc, m_i, l_i)
    if GATED:  # the rows' own gate, u_i - r in base 2; a non-finite u_i makes its row NaN
        row2 = _gate_from(G_h, offs_m, r, GATE2, GATED, BLOCK_M)
        lse2 += row2
        o = tl.where(tl.abs(row2)[:, None] < float("inf"), o, float("nan"))
    tl.store(_tile_ptrs(O, b, bos, offs_m, hq, sob, sot, soh, BLOCK_DV), o.to(O.dtype.element_ty),
             mask=_tile_mask(offs_m, Tq, DV, BLOCK_DV))
    tl.store(LSE + b * slb + (bos + offs_m) * slt + hq * slh, lse2, mask=offs_m < Tq)


@triton.jit
def _bwd_kv_tiles(dk, dv, du, k, v, key_gate, offs_n, Q_h, DO_h, G_h, LSE_h, DELTA_h, sqt, sdot, slt, Tq, Sk, off,
                  start, end, full_lo, full_hi, sm_scale2, r, D, DV, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
                  GATED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                  PRECISION: tl.constexpr):
    """Query tiles ``[start, end)``, masked outside ``[full_lo, full_hi)``. Keys on the rows (``[BLOCK_N,
    BLOCK_M]`` tiles), so no computed tile is transposed before a dot. ``key_gate``: ``u_j - r`` in the units
    of ``q.k``."""
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    for start_m in range(start, end, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        lse2, delta = _row_stats(LSE_h, DELTA_h, G_h, offs_m, slt, Tq, r, GATED, BLOCK_M)
        rmask = offs_m < Tq
        qt = tl.load(Q_h + offs_m[None, :] * sqt + offs_d[:, None], mask=rmask[None, :] & (offs_d < D)[:, None],
                     other=0.0)
        do = tl.load(DO_h + offs_m[:, None] * sdot + offs_dv[None, :],
                     mask=rmask[:, None] & (offs_dv < DV)[None, :], other=0.0)
        st = tl.dot(k, qt, input_precision=PRECISION)                               # [BLOCK_N, BLOCK_M]
        if GATED:
            st -= key_gate[:, None]
        if _in_mask(start_m, full_lo, full_hi):
            st = tl.where(visible_mask_t(offs_n, offs_m + off, Sk, CAUSAL, WINDOW) & rmask[None, :], st,
                          float("-inf"))
        pt = tl.exp2(st * sm_scale2 - lse2[None, :])
        dv += tl.dot(pt.to(do.dtype), do, input_precision=PRECISION)
        dpt = tl.dot(v, tl.trans(do), input_precision=PRECISION)
        dst = pt * (dpt - delta[None, :])
        dk += tl.dot(dst.to(qt.dtype), tl.trans(qt), input_precision=PRECISION)
        if GATED:
            du -= tl.sum(dst, 1)
    return dk, dv, du


@triton.jit
def _bwd_kv_kernel(Q, K, V, G, DO, LSE, DELTA, DK, DV, DU, CU, sm_scale, sm_scale2, T, S, D, DV_DIM,
                   sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, sgb, sgt, sgh, sdob, sdot, sdoh,
                   slb, slt, slh, sdkb, sdkt, sdkh, sdvb, sdvt, sdvh,
                   GROUP: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, GATED: tl.constexpr,
                   VARLEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_DV: tl.constexpr, PRECISION: tl.constexpr):
    """``dK, dV`` of ``BLOCK_N`` keys of one key/value head (its query heads summed in the program), and
    the gate gradient of each query head at these positions."""
    pid_n = tl.program_id(0)
    n = tl.program_id(1)
    hk = tl.program_id(2)
    b, bos, Tq, Sk = _sequence(CU, n, T, S, VARLEN)
    start_n = pid_n * BLOCK_N
    if start_n >= Sk:
        return
    off = Sk - Tq
    offs_n = start_n + tl.arange(0, BLOCK_N)
    k = _load_tile(K, b, bos, offs_n, hk, skb, skt, skh, Sk, D, BLOCK_D)
    v = _load_tile(V, b, bos, offs_n, hk, svb, svt, svh, Sk, DV_DIM, BLOCK_DV)

    key_hi = tl.minimum(start_n + BLOCK_N, Sk) - 1
    lo, hi, full_lo, full_hi = query_span(start_n, key_hi, Tq, off, CAUSAL, WINDOW)
    a, bb, c = tile_loop_bounds(lo, hi, full_lo, full_hi, BLOCK_M)

    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    for g in range(GROUP):
        hq = hk * GROUP + g
        Q_h = _head_base(Q, b, bos, hq, sqb, sqt, sqh)
        DO_h = _head_base(DO, b, bos, hq, sdob, sdot, sdoh)
        G_h = _head_base(G, b, bos, hq, sgb, sgt, sgh)
        LSE_h = _head_base(LSE, b, bos, hq, slb, slt, slh)
        DELTA_h = _head_base(DELTA, b, bos, hq, slb, slt, slh)
        du = tl.zeros([BLOCK_N], dtype=tl.float32)
        r = _gate_origin(G_h, start_n, GATED)
        key_gate = _gate_from(G_h, offs_n, r, GATE2 / sm_scale2, GATED, BLOCK_N)
        dk, dv, du = _bwd_kv_tiles(dk, dv, du, k, v, key_gate, offs_n, Q_h, DO_h, G_h, LSE_h, DELTA_h, sqt, sdot,
                                   slt, Tq, Sk, off, a, hi, bb, c, sm_scale2, r, D, DV_DIM, CAUSAL, WINDOW, GATED,
                                   BLOCK_M, BLOCK_D, BLOCK_DV, PRECISION)
        if GATED:
            tl.store(DU + b * slb + (bos + offs_n) * slt + hq * slh, du, mask=offs_n < Sk)
    tl.store(_tile_ptrs(DK, b, bos, offs_n, hk, sdkb, sdkt, sdkh, BLOCK_D), (dk * sm_scale).to(DK.dtype.element_ty),
             mask=_tile_mask(offs_n, Sk, D, BLOCK_D))
    tl.store(_tile_ptrs(DV, b, bos, offs_n, hk, sdvb, sdvt, sdvh, BLOCK_DV), dv.to(DV.dtype.element_ty),
             mask=_tile_mask(offs_n, Sk, DV_DIM, BLOCK_DV))


@triton.jit
def _bwd_q_tiles(dq, q, do, lse2, delta, pos, K_h, V_h, G_h, skt, svt, Sk, start, end, full_lo, full_hi, sm_scale2,
                 r, gate_unit, D, DV, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, GATED: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, PRECISION: tl.constexpr):
    """Key tiles and logits as in :func:`_fwd_tiles`; ``lse2`` without the rows' own gate."""
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kmask = offs_n < Sk
        k = tl.load(K_h + offs_n[:, None] * skt + offs_d[None, :], mask=kmask[:, None] & (offs_d < D)[None, :],
                    other=0.0)
        vt = tl.load(V_h + offs_n[None, :] * svt + offs_dv[:, None],
                     mask=kmask[None, :] & (offs_dv < DV)[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        if GATED:
            s -= _gate_from(G_h, offs_n, r, gate_unit, GATED, BLOCK_N)[None, :]
        if _in_mask(start_n, full_lo, full_hi):
            s = tl.where(visible_mask(pos, offs_n, Sk, CAUSAL, WINDOW), s, float("-inf"))
        p = tl.exp2(s * sm_scale2 - lse2[:, None])
        dp = tl.dot(do, vt, input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    return dq


@triton.jit
def _bwd_q_kernel(Q, K, V, G, DO, LSE, DELTA, DQ, CU, sm_scale, sm_scale2, T, S, D, DV,
                  sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, sgb, sgt, sgh, sdob, sdot, sdoh,
                  slb, slt, slh, sdqb, sdqt, sdqh,
                  GROUP: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, GATED: tl.constexpr,
                  VARLEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_DV: tl.constexpr, PRECISION: tl.constexpr):
    """``dQ`` of ``BLOCK_M`` queries of one query head."""
    b, bos, Tq, Sk, hq, hk, start_m = _query_program(CU, T, S, GROUP, VARLEN, BLOCK_M, CAUSAL)
    if start_m >= Tq:
        return
    off = Sk - Tq
    offs_m = start_m + tl.arange(0, BLOCK_M)
    pos = offs_m + off
    q = _load_tile(Q, b, bos, offs_m, hq, sqb, sqt, sqh, Tq, D, BLOCK_D)
    do = _load_tile(DO, b, bos, offs_m, hq, sdob, sdot, sdoh, Tq, DV, BLOCK_DV)
    G_h = _head_base(G, b, bos, hq, sgb, sgt, sgh)
    r = _gate_origin(G_h, start_m, GATED)
    lse2, delta = _row_stats(_head_base(LSE, b, bos, hq, slb, slt, slh), _head_base(DELTA, b, bos, hq, slb, slt, slh),
                             G_h, offs_m, slt, Tq, r, GATED, BLOCK_M)
    K_h = _head_base(K, b, bos, hk, skb, skt, skh)
    V_h = _head_base(V, b, bos, hk, svb, svt, svh)
    a, bb, c, hi = _key_tiles(start_m, Tq, Sk, CAUSAL, WINDOW, BLOCK_M, BLOCK_N)

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    dq = _bwd_q_tiles(dq, q, do, lse2, delta, pos, K_h, V_h, G_h, skt, svt, Sk, a, hi, bb, c, sm_scale2, r,
                      GATE2 / sm_scale2, D, DV, CAUSAL, WINDOW, GATED, BLOCK_N, BLOCK_D, BLOCK_DV, PRECISION)
    tl.store(_tile_ptrs(DQ, b, bos, offs_m, hq, sdqb, sdqt, sdqh, BLOCK_D), (dq * sm_scale).to(DQ.dtype.element_ty),
             mask=_tile_mask(offs_m, Tq, D, BLOCK_D))


def _strides3(x: torch.Tensor):
    return x.stride(0), x.stride(1), x.stride(2)


def _grid_sizes(q, k, cu_seqlens, max_seqlen):
    """``(number of sequences, longest query length, longest key length)``."""
    if cu_seqlens is None:
        return q.shape[0], q.shape[1], k.shape[1]
    longest = longest_sequence(cu_seqlens, max_seqlen)
    return cu_seqlens.numel() - 1, longest, longest


def gate_rows(u: torch.Tensor | None, *configs: dict) -> torch.Tensor | None:
    """The gate as the kernels read it: ``[B, T + pad, HQ]`` fp32, contiguous along time (so a tile's gates
    are one vector load), with ``pad`` zeros after each row: twice the largest tile of ``configs``, as far as a
    tile (and the next tile, loaded ahead) reaches past a sequence's end. None without a gate."""
    if u is None:
        return None
    pad = 2 * max(max(cfg["BLOCK_M"], cfg["BLOCK_N"]) for cfg in configs)
    return torch.nn.functional.pad(u.transpose(1, 2).to(torch.float32), (0, pad)).transpose(1, 2)


def _launch_flags(q, k, u, causal, window, cu_seqlens):
    return dict(GROUP=q.shape[2] // k.shape[2], CAUSAL=bool(causal), WINDOW=int(window or 0),
                GATED=u is not None, VARLEN=cu_seqlens is not None, BLOCK_D=head_block(q.shape[3]),
                PRECISION=dot_precision(q.dtype))


def attention_forward(q, k, v, u, *, causal, window, scale, cu_seqlens, max_seqlen=None):
    """Returns ``(o: [B, T, HQ, Dv] in q's dtype, lse2: [B, T, HQ] fp32)`` (base-2 log-sum-exp)."""
    q, k, v = (last_dim_contiguous(x) for x in (q, k, v))
    B, T, HQ, D = q.shape
    S, DV = k.shape[1], v.shape[3]
    o = torch.empty(B, T, HQ, DV, device=q.device, dtype=q.dtype)
    lse = torch.empty(B, T, HQ, device=q.device, dtype=torch.float32)
    cu = cu_seqlens if cu_seqlens is not None else lse
    n_seq, t_max, _ = _grid_sizes(q, k, cu_seqlens, max_seqlen)
    cfg = attention_blocks(D, q.dtype, "fwd", gated=u is not None)
    g = gate_rows(u, cfg)
    g_arg = g if g is not None else lse
    grid = (ceil_div(t_max, cfg["BLOCK_M"]), n_seq, HQ)
    _fwd_kernel[grid](q, k, v, g_arg, o, lse, cu, scale * LOG2E, T, S, D, DV,
                      *_strides3(q), *_strides3(k), *_strides3(v), *_strides3(g_arg), *_strides3(o),
                      *_strides3(lse), BLOCK_DV=head_block(DV), **_launch_flags(q, k, u, causal, window, cu_seqlens),
                      **cfg)
    return o, lse


def attention_backward(do, q, k, v, u, o, lse, *, causal, window, scale, cu_seqlens, max_seqlen=None):
    """Returns ``(dq, dk, dv, du)``; ``du`` is None without a gate, else fp32 ``[B, T, HQ]``."""
    do = do.contiguous()
    q, k, v = (last_dim_contiguous(x) for x in (q, k, v))
    B, T, HQ, D = q.shape
    S, H, DV = k.shape[1], k.shape[2], v.shape[3]
    delta = row_dot(o.contiguous(), do)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    du = torch.empty(B, T, HQ, device=q.device, dtype=torch.float32) if u is not None else None
    du_arg = du if du is not None else lse
    cu = cu_seqlens if cu_seqlens is not None else lse
    n_seq, t_max, s_max = _grid_sizes(q, k, cu_seqlens, max_seqlen)
    flags = _launch_flags(q, k, u, causal, window, cu_seqlens)
    kv_cfg = attention_blocks(D, q.dtype, "bwd_kv", gated=u is not None)
    q_cfg = attention_blocks(D, q.dtype, "bwd_q", gated=u is not None)
    g = gate_rows(u, kv_cfg, q_cfg)
    g_arg = g if g is not None else lse
    common = (*_strides3(q), *_strides3(k), *_strides3(v), *_strides3(g_arg), *_strides3(do), *_strides3(lse))

    grid = (ceil_div(s_max, kv_cfg["BLOCK_N"]), n_seq, H)
    _bwd_kv_kernel[grid](q, k, v, g_arg, do, lse, delta, dk, dv, du_arg, cu, scale, scale * LOG2E, T, S, D, DV,
                         *common, *_strides3(dk), *_strides3(dv), BLOCK_DV=head_block(DV), **flags, **kv_cfg)
    grid = (ceil_div(t_max, q_cfg["BLOCK_M"]), n_seq, HQ)
    _bwd_q_kernel[grid](q, k, v, g_arg, do, lse, delta, dq, cu, scale, scale * LOG2E, T, S, D, DV,
                        *common, *_strides3(dq), BLOCK_DV=head_block(DV), **flags, **q_cfg)
    return dq, dk, dv, du
