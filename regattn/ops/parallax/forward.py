"""Parallax forward in Triton: Algorithm 1 of parallax.txt, one pass over K/V.

The softmax branch keeps ``(m, d1, O1)`` as FlashAttention does; the covariance branch adds
``(d2, O2)`` from ``S2 = R K^T`` and ``P2 = P1 * S2`` on the same K/V tiles, the same running maximum
and the same rescale factor. Scores are in base 2: ``S1 = Q K^T * scale * log2(e)``, ``P1 = exp2(S1 - m)``.
At the end ``vbar = O1 / d1``, ``tbar = d2 / d1`` and ``o = vbar (1 + tbar) - O2 / d1`` (eq. 14).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from regattn.ops._common.ints import ceil_div
from regattn.ops.parallax.tiles import (
    LOG2E, dot_precision, group_pad, head_block, interpreting, key_range, kv_tile, packed_rows, prefill_descriptors,
    program_tile, tile_config, visible,
)


@triton.jit
def _fwd_tile(q, r, K, V, K_DESC, V_DESC, seq, h, j0, qpos, klen, window, sk_t, sv_t, m_i, d1, d2, o1, o2,
              qk_scale, D, DV, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
              MASK: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, PRECISION: tl.constexpr,
              TMA: tl.constexpr):
    """One step of Algorithm 1 (lines 2-12) on the key tile starting at ``j0``."""
    j = j0 + tl.arange(0, BLOCK_N)
    kt = kv_tile(K_DESC, K, seq, h, j0, klen, sk_t, D, BLOCK_N, BLOCK_D, True, TMA)
    vt = kv_tile(V_DESC, V, seq, h, j0, klen, sv_t, DV, BLOCK_N, BLOCK_DV, False, TMA)
    s1 = tl.dot(q, kt, input_precision=PRECISION) * qk_scale
    s2 = tl.dot(r, kt, input_precision=PRECISION)
    if MASK:
        s1 = tl.where(visible(qpos, j, klen, window, CAUSAL, HAS_WINDOW), s1, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s1, 1))
    alpha = tl.math.exp2(m_i - m_new)
    p1 = tl.math.exp2(s1 - m_new[:, None])
    p2 = p1 * s2
    d1 = d1 * alpha + tl.sum(p1, 1)
    d2 = d2 * alpha + tl.sum(p2, 1)
    o1 = o1 * alpha[:, None] + tl.dot(p1.to(vt.dtype), vt, input_precision=PRECISION)
    o2 = o2 * alpha[:, None] + tl.dot(p2.to(vt.dtype), vt, input_precision=PRECISION)
    return m_new, d1, d2, o1, o2


@triton.jit
def _parallax_fwd_kernel(
    Q, R, K, V, O, VBAR, TBAR, MROW, LROW, CU, K_DESC, V_DESC,
    sq_b, sq_t, sq_h, sr_b, sr_t, sr_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, so_b, so_t, so_h,
    T, S, HQ, H, D, DV, qk_scale, window,
    G: tl.constexpr, GP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    VARLEN: tl.constexpr, PRECISION: tl.constexpr, TMA: tl.constexpr,
):
    """Grid ``(cdiv(max_T, BLOCK_M // GP), B * H)``: one packed row tile of one key/value head. ``TMA``: key and
    value tiles through the tensor descriptors ``K_DESC``, ``V_DESC`` (one sequence a batch row)."""
    BLOCK_T: tl.constexpr = BLOCK_M // GP
    t0, h, start, qlen, klen, seq = program_tile(CU, T, S, H, BLOCK_T, VARLEN, CAUSAL)
    if t0 >= qlen:
        return
    bb = 0 if VARLEN else seq.to(tl.int64)  # 64-bit batch offsets
    off = klen - qlen  # queries sit at the end of the keys
    t, hq, row_ok = packed_rows(t0, h, qlen, G, GP, BLOCK_M)
    qpos = t + off
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)

    dmask = row_ok[:, None] & (offs_d[None, :] < D)
    q = tl.load(Q + bb * sq_b + (start + t)[:, None] * sq_t + hq[:, None] * sq_h + offs_d[None, :], mask=dmask,
                other=0.0)
    r = tl.load(R + bb * sr_b + (start + t)[:, None] * sr_t + hq[:, None] * sr_h + offs_d[None, :], mask=dmask,
                other=0.0)
    K += bb * sk_b + start * sk_t + h * sk_h
    V += bb * sv_b + start * sv_t + h * sv_h

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    d1 = tl.zeros([BLOCK_M], tl.float32)
    d2 = tl.zeros([BLOCK_M], tl.float32)
    o1 = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    o2 = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)

    lo, a, b, hi = key_range(t0 + off, t0 + BLOCK_T - 1 + off, klen, window, BLOCK_N, CAUSAL, HAS_WINDOW)
    for j0 in range(lo, a, BLOCK_N):
        m_i, d1, d2, o1, o2 = _fwd_tile(q, r, K, V, K_DESC, V_DESC, seq, h, j0, qpos, klen, window, sk_t, sv_t,
                                        m_i, d1, d2, o1, o2, qk_scale, D, DV, BLOCK_N, BLOCK_D, BLOCK_DV, True,
                                        CAUSAL, HAS_WINDOW, PRECISION, TMA)
    for j0 in range(a, b, BLOCK_N):
        m_i, d1, d2, o1, o2 = _fwd_tile(q, r, K, V, K_DESC, V_DESC, seq, h, j0, qpos, klen, window, sk_t, sv_t,
                                        m_i, d1, d2, o1, o2, qk_scale, D, DV, BLOCK_N, BLOCK_D, BLOCK_DV, False,
                                        CAUSAL, HAS_WINDOW, PRECISION, TMA)
    for j0 in range(b, hi, BLOCK_N):
        m_i, d1, d2, o1, o2 = _fwd_tile(q, r, K, V, K_DESC, V_DESC, seq, h, j0, qpos, klen, window, sk_t, sv_t,
                                        m_i, d1, d2, o1, o2, qk_scale, D, DV, BLOCK_N, BLOCK_D, BLOCK_DV, True,
                                        CAUSAL, HAS_WINDOW, PRECISION, TMA)

    # Algorithm 1, line 14; a row that sees no key gets zeros
    inv = tl.where(d1 > 0, 1.0 / tl.where(d1 > 0, d1, 1.0), 0.0)
    vbar = o1 * inv[:, None]
    tbar = d2 * inv
    o = vbar * (1.0 + tbar[:, None]) - o2 * inv[:, None]
    omask = row_ok[:, None] & (offs_dv[None, :] < DV)
    o_off = bb * so_b + (start + t)[:, None] * so_t + hq[:, None] * so_h + offs_dv[None, :]
    tl.store(O + o_off, o.to(O.dtype.element_ty), mask=omask)
    tl.store(VBAR + o_off, vbar.to(VBAR.dtype.element_ty), mask=omask)
    row = (bb * HQ + hq) * T + start + t
    tl.store(TBAR + row, tbar, mask=row_ok)
    tl.store(MROW + row, m_i, mask=row_ok)
    tl.store(LROW + row, d1, mask=row_ok)


def fwd_config(D: int, Dv: int, groups: int, dtype) -> dict:
    """Tile sizes and launch settings for the forward (small tiles in the interpreter)."""
    gp = group_pad(groups)
    if interpreting():
        return dict(BLOCK_M=max(16, gp), BLOCK_N=16, num_warps=4, num_stages=1)
    cfg = tile_config(max(D, Dv), "fwd", dtype)
    return dict(cfg, BLOCK_M=max(cfg["BLOCK_M"], gp))


def parallax_fwd(q, r, k, v, *, causal: bool, window, scale: float, cu_seqlens=None, max_seqlen=None,
                 config: dict | None = None):
    """Run the forward kernel.

    Args:
        q, r: ``[B, T, HQ, D]``; k: ``[B, S, H, D]``; v: ``[B, S, H, Dv]`` (last dims contiguous).
        cu_seqlens: int offsets ``[N + 1]`` with ``B == 1`` and ``S == T``; max_seqlen its largest length.

    Returns:
        ``o, vbar: [B, T, HQ, Dv]`` (q's dtype) and ``stats: [3, B, HQ, T]`` (fp32), the row statistics
        ``tbar``, ``m`` (running maximum, base 2) and ``l`` (row sum ``d1``) in one tensor.
    """
    B, T, HQ, D = q.shape
    S, H, Dv = k.shape[1], k.shape[2], v.shape[3]
    G = HQ // H
    cfg = dict(fwd_config(D, Dv, G, q.dtype), **(config or {}))
    GP = group_pad(G)
    block_t = cfg["BLOCK_M"] // GP
    o = torch.empty(B, T, HQ, Dv, device=q.device, dtype=q.dtype)
    vbar = torch.empty_like(o)
    stats = torch.empty(3, B, HQ, T, device=q.device, dtype=torch.float32)
    tbar, m, l = stats[0], stats[1], stats[2]
    if cu_seqlens is None:
        n_seq, rows = B, T
    else:
        n_seq, rows = cu_seqlens.numel() - 1, max_seqlen
    grid = (ceil_div(max(rows, 1), block_t), n_seq * H)
    descriptors = prefill_descriptors(k, v, cfg, cu_seqlens, work=B * HQ * T * S * D)
    _parallax_fwd_kernel[grid](
        q, r, k, v, o, vbar, tbar, m, l, cu_seqlens if cu_seqlens is not None else q, *(descriptors or (k, v)),
        q.stride(0), q.stride(1), q.stride(2), r.stride(0), r.stride(1), r.stride(2),
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        o.stride(0), o.stride(1), o.stride(2),
        T, S, HQ, H, D, Dv, scale * LOG2E, window if window is not None else 0,
        G=G, GP=GP, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_D=head_block(D), BLOCK_DV=head_block(Dv),
        CAUSAL=causal, HAS_WINDOW=window is not None, VARLEN=cu_seqlens is not None,
        PRECISION=dot_precision(q.dtype), TMA=descriptors is not None, num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    return o, vbar, stats
