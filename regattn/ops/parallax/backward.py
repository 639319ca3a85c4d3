"""Parallax backward in Triton: parallax.txt Appendix D, eq. (35)-(41), streamed like FlashAttention's.

With ``p_ij`` from the saved row maximum and sum, ``t_ij = r_i.k_j``, ``a_ij = dO_i.v_j`` and the row
scalars ``tau_i = dO_i.o_i``, ``beta_i = dO_i.vbar_i`` (the preprocess):

    ``g1 = p [a - tau + (tbar - t)(a - beta)]``, ``g2 = -p (a - beta)``,
    ``dQ = scale g1 K``, ``dR = g2 K``, ``dK = scale g1^T Q + g2^T R``, ``dV = (p (1 + tbar - t))^T dO``.

A row-tile pass streams key tiles to build dQ and dR; a column-tile pass streams query tiles (packed
GQA rows, so every query head of a key/value head lands in one program) to build dK and dV without
atomics.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from regattn.ops._common.ints import ceil_div
from regattn.ops.parallax.tiles import (
    LOG2E, contained_dot, dot_precision, group_pad, head_block, interpreting, key_range, kv_tile, load_row_scalars,
    packed_rows, prefill_descriptors, program_tile, query_range, tile_config, visible, visible_t,
)


@triton.jit
def _row_scalars_kernel(O, VBAR, DO, MROW, LROW, TAU, BETA, LSE, N, T, HQ, DV,
                        BLOCK: tl.constexpr, BLOCK_DV: tl.constexpr):
    """``tau = dO.o``, ``beta = dO.vbar`` and ``lse = m + log2(l)`` (``+inf`` where a row sees no key)."""
    n = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = n < N
    b = n // (T * HQ)
    t = (n // HQ) % T
    hq = n % HQ
    row = (b * HQ + hq) * T + t
    offs = tl.arange(0, BLOCK_DV)
    mask = ok[:, None] & (offs[None, :] < DV)
    ptr = n[:, None] * DV + offs[None, :]
    do = tl.load(DO + ptr, mask=mask, other=0.0).to(tl.float32)
    o = tl.load(O + ptr, mask=mask, other=0.0).to(tl.float32)
    vbar = tl.load(VBAR + ptr, mask=mask, other=0.0).to(tl.float32)
    tl.store(TAU + row, tl.sum(do * o, 1), mask=ok)
    tl.store(BETA + row, tl.sum(do * vbar, 1), mask=ok)
    m = tl.load(MROW + row, mask=ok, other=0.0)
    l = tl.load(LROW + row, mask=ok, other=0.0)
    lse = tl.where(l > 0, m + tl.math.log2(tl.where(l > 0, l, 1.0)), float("inf"))
    tl.store(LSE + row, lse, mask=ok)


@triton.jit
def _coefficients(s1, t, a, lse, tau, beta, tbar):
    """``p``, ``g1`` and ``g2`` of eq. (37) from the base-2 scores (``-inf`` where hidden; row scalars
    broadcast by the caller)."""
    p = tl.math.exp2(s1 - lse)
    delta = a - beta
    g1 = p * (a - tau + (tbar - t) * delta)
    g2 = -p * delta
    return p, g1, g2


@triton.jit
def _dq_tile(q, r, do, K, V, K_DESC, V_DESC, seq, h, j0, qpos, klen, window, sk_t, sv_t, lse, tau, beta, tbar, dq, dr,
             qk_scale, D, DV, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
             MASK: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, PRECISION: tl.constexpr,
             TMA: tl.constexpr):
    j = j0 + tl.arange(0, BLOCK_N)
    kt = kv_tile(K_DESC, K, seq, h, j0, klen, sk_t, D, BLOCK_N, BLOCK_D, True, TMA)
    vt = kv_tile(V_DESC, V, seq, h, j0, klen, sv_t, DV, BLOCK_N, BLOCK_DV, True, TMA)
    s1 = tl.dot(q, kt, input_precision=PRECISION) * qk_scale
    t = tl.dot(r, kt, input_precision=PRECISION)
    a = tl.dot(do, vt, input_precision=PRECISION)
    if MASK:  # every score branch: hidden keys give exact zeros
        seen = visible(qpos, j, klen, window, CAUSAL, HAS_WINDOW)
        s1 = tl.where(seen, s1, float("-inf"))
        t = tl.where(seen, t, 0.0)
        a = tl.where(seen, a, 0.0)
    p, g1, g2 = _coefficients(s1, t, a, lse[:, None], tau[:, None], beta[:, None], tbar[:, None])
    k = tl.trans(kt)
    if MASK:
        dq = contained_dot(dq, g1, k, seen, PRECISION)
        dr = contained_dot(dr, g2, k, seen, PRECISION)
    else:
        dq += tl.dot(g1.to(k.dtype), k, input_precision=PRECISION)
        dr += tl.dot(g2.to(k.dtype), k, input_precision=PRECISION)
    return dq, dr


@triton.jit
def _parallax_bwd_dq_kernel(
    Q, R, K, V, DO, DQ, DR, LSE, TAU, BETA, TBAR, CU, K_DESC, V_DESC,
    sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, so_b, so_t, so_h,
    T, S, HQ, H, D, DV, scale, qk_scale, window,
    G: tl.constexpr, GP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    VARLEN: tl.constexpr, PRECISION: tl.constexpr, TMA: tl.constexpr,
):
    """Row-tile pass: dQ and dR of one packed row tile (q, r, dq, dr share strides ``sq``; dO ``so``); ``TMA``: key
    and value tiles through the tensor descriptors ``K_DESC``, ``V_DESC``."""
    BLOCK_T: tl.constexpr = BLOCK_M // GP
    t0, h, start, qlen, klen, seq = program_tile(CU, T, S, H, BLOCK_T, VARLEN, CAUSAL)
    if t0 >= qlen:
        return
    bb = 0 if VARLEN else seq.to(tl.int64)  # 64-bit batch offsets
    off = klen - qlen
    t, hq, row_ok = packed_rows(t0, h, qlen, G, GP, BLOCK_M)
    qpos = t + off
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_off = bb * sq_b + (start + t)[:, None] * sq_t + hq[:, None] * sq_h + offs_d[None, :]
    dmask = row_ok[:, None] & (offs_d[None, :] < D)
    q = tl.load(Q + q_off, mask=dmask, other=0.0)
    r = tl.load(R + q_off, mask=dmask, other=0.0)
    do = tl.load(DO + bb * so_b + (start + t)[:, None] * so_t + hq[:, None] * so_h + offs_dv[None, :],
                 mask=row_ok[:, None] & (offs_dv[None, :] < DV), other=0.0)
    lse, tau, beta, tbar = load_row_scalars(LSE, TAU, BETA, TBAR, (bb * HQ + hq) * T + start + t, row_ok)
    K += bb * sk_b + start * sk_t + h * sk_h
    V += bb * sv_b + start * sv_t + h * sv_h
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    dr = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    lo, a, b, hi = key_range(t0 + off, t0 + BLOCK_T - 1 + off, klen, window, BLOCK_N, CAUSAL, HAS_WINDOW)
    for j0 in range(lo, a, BLOCK_N):
        dq, dr = _dq_tile(q, r, do, K, V, K_DESC, V_DESC, seq, h, j0, qpos, klen, window, sk_t, sv_t, lse, tau,
                          beta, tbar, dq, dr, qk_scale, D, DV, BLOCK_N, BLOCK_D, BLOCK_DV, True, CAUSAL,
                          HAS_WINDOW, PRECISION, TMA)
    for j0 in range(a, b, BLOCK_N):
        dq, dr = _dq_tile(q, r, do, K, V, K_DESC, V_DESC, seq, h, j0, qpos, klen, window, sk_t, sv_t, lse, tau,
                          beta, tbar, dq, dr, qk_scale, D, DV, BLOCK_N, BLOCK_D, BLOCK_DV, False, CAUSAL,
                          HAS_WINDOW, PRECISION, TMA)
    for j0 in range(b, hi, BLOCK_N):
        dq, dr = _dq_tile(q, r, do, K, V, K_DESC, V_DESC, seq, h, j0, qpos, klen, window, sk_t, sv_t, lse, tau,
                          beta, tbar, dq, dr, qk_scale, D, DV, BLOCK_N, BLOCK_D, BLOCK_DV, True, CAUSAL,
                          HAS_WINDOW, PRECISION, TMA)
    tl.store(DQ + q_off, (dq * scale).to(DQ.dtype.element_ty), mask=dmask)
    tl.store(DR + q_off, dr.to(DR.dtype.element_ty), mask=dmask)


@triton.jit
def _dk_tile(k, v, Q, R, DO, LSE, TAU, BETA, TBAR, t0, h, qlen, off, start, bb, j, klen, window,
             sq_t, sq_h, so_t, so_h, HQ, T, dk, dv, scale, qk_scale, offs_d, offs_dv, D, DV,
             G: tl.constexpr, GP: tl.constexpr, BLOCK_M: tl.constexpr, MASK: tl.constexpr,
             CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, PRECISION: tl.constexpr):
    t, hq, row_ok = packed_rows(t0, h, qlen, G, GP, BLOCK_M)
    q_off = (start + t)[None, :] * sq_t + hq[None, :] * sq_h + offs_d[:, None]
    dmask = row_ok[None, :] & (offs_d[:, None] < D)
    qt = tl.load(Q + q_off, mask=dmask, other=0.0)
    rt = tl.load(R + q_off, mask=dmask, other=0.0)
    dot_ = tl.load(DO + (start + t)[None, :] * so_t + hq[None, :] * so_h + offs_dv[:, None],
                   mask=row_ok[None, :] & (offs_dv[:, None] < DV), other=0.0)
    lse, tau, beta, tbar = load_row_scalars(LSE, TAU, BETA, TBAR, (bb * HQ + hq) * T + start + t, row_ok)
    # Each product is formed just before its use and the dV update is made before ``a`` is, so fewer
    # [N, M] tiles are live at once. Where MASK, contained_dot counts only the pairs seen (it selects
    # the hidden ones to 0, whatever non-finite values they hold).
    s1 = tl.dot(k, qt, input_precision=PRECISION) * qk_scale  # [N, M]
    if MASK:
        seen = visible_t(j, t + off, klen, window, CAUSAL, HAS_WINDOW)
        s1 = tl.where(seen, s1, float("-inf"))
    p = tl.math.exp2(s1 - lse[None, :])
    tt = tl.dot(k, rt, input_precision=PRECISION)
    pe = p * (tbar[None, :] - tt)  # p (tbar - t): dV's weight is p + pe
    if MASK:  # a non-finite query, probe or dO row reaches only the keys it sees
        dv = contained_dot(dv, p + pe, tl.trans(dot_), seen, PRECISION)
    else:
        dv += tl.dot((p + pe).to(v.dtype), tl.trans(dot_), input_precision=PRECISION)
    a = tl.dot(v, dot_, input_precision=PRECISION)
    delta = a - beta[None, :]
    g1 = (p * (a - tau[None, :]) + pe * delta) * scale
    g2 = -p * delta
    if MASK:
        dk = contained_dot(dk, g1, tl.trans(qt), seen, PRECISION)
        dk = contained_dot(dk, g2, tl.trans(rt), seen, PRECISION)
    else:
        dk += tl.dot(g1.to(k.dtype), tl.trans(qt), input_precision=PRECISION)
        dk += tl.dot(g2.to(k.dtype), tl.trans(rt), input_precision=PRECISION)
    return dk, dv


@triton.jit
def _parallax_bwd_dk_kernel(
    Q, R, K, V, DO, DK, DV_, LSE, TAU, BETA, TBAR, CU,
    sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, so_b, so_t, so_h,
    T, S, HQ, H, D, DV, scale, qk_scale, window,
    G: tl.constexpr, GP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    VARLEN: tl.constexpr, PRECISION: tl.constexpr,
):
    """Column-tile pass: dK and dV of one key tile (k, dk share strides ``sk``; v, dv ``sv``)."""
    BLOCK_T: tl.constexpr = BLOCK_M // GP
    j0, h, start, qlen, klen, seq = program_tile(CU, T, S, H, BLOCK_N, VARLEN, False)
    if j0 >= klen:
        return
    bb = 0 if VARLEN else seq.to(tl.int64)  # 64-bit batch offsets
    off = klen - qlen
    j = j0 + tl.arange(0, BLOCK_N)
    kv_ok = j < klen
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    # scalar bases and 32-bit offsets within the tile: less to hold through the loops for the final stores
    k_base = bb * sk_b + (start + j0) * sk_t + h * sk_h
    v_base = bb * sv_b + (start + j0) * sv_t + h * sv_h
    k_off = tl.arange(0, BLOCK_N)[:, None] * sk_t + offs_d[None, :]
    v_off = tl.arange(0, BLOCK_N)[:, None] * sv_t + offs_dv[None, :]
    kmask = kv_ok[:, None] & (offs_d[None, :] < D)
    vmask = kv_ok[:, None] & (offs_dv[None, :] < DV)
    k = tl.load(K + k_base + k_off, mask=kmask, other=0.0)
    v = tl.load(V + v_base + v_off, mask=vmask, other=0.0)
    Q += bb * sq_b
    R += bb * sq_b
    DO += bb * so_b
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)

    lo, a, b, hi = query_range(j0, j0 + BLOCK_N - 1, qlen, off, window, BLOCK_T, CAUSAL, HAS_WINDOW)
    # partially masked tiles take half as many rows at a time: their NaN containment holds more registers
    MASKED_M: tl.constexpr = max(BLOCK_M // 2, 16, GP)
    MASKED_T: tl.constexpr = MASKED_M // GP
    for t0 in range(lo, a, MASKED_T):
        dk, dv = _dk_tile(k, v, Q, R, DO, LSE, TAU, BETA, TBAR, t0, h, qlen, off, start, bb, j, klen, window,
                          sq_t, sq_h, so_t, so_h, HQ, T, dk, dv, scale, qk_scale, offs_d, offs_dv, D, DV,
                          G, GP, MASKED_M, True, CAUSAL, HAS_WINDOW, PRECISION)
    for t0 in range(a, b, BLOCK_T):
        dk, dv = _dk_tile(k, v, Q, R, DO, LSE, TAU, BETA, TBAR, t0, h, qlen, off, start, bb, j, klen, window,
                          sq_t, sq_h, so_t, so_h, HQ, T, dk, dv, scale, qk_scale, offs_d, offs_dv, D, DV,
                          G, GP, BLOCK_M, False, CAUSAL, HAS_WINDOW, PRECISION)
    for t0 in range(b, hi, MASKED_T):
        dk, dv = _dk_tile(k, v, Q, R, DO, LSE, TAU, BETA, TBAR, t0, h, qlen, off, start, bb, j, klen, window,
                          sq_t, sq_h, so_t, so_h, HQ, T, dk, dv, scale, qk_scale, offs_d, offs_dv, D, DV,
                          G, GP, MASKED_M, True, CAUSAL, HAS_WINDOW, PRECISION)
    tl.store(DK + k_base + k_off, dk.to(DK.dtype.element_ty), mask=kmask)
    tl.store(DV_ + v_base + v_off, dv.to(DV_.dtype.element_ty), mask=vmask)


def bwd_config(D: int, Dv: int, groups: int, dtype, kind: str) -> dict:
    """Tile sizes of the row-tile pass (``kind="dq"``) or the column-tile pass (``"dk"``).

    ``BLOCK_M`` counts packed query rows and ``BLOCK_N`` keys in both passes; the interpreter gets 16.
    """
    gp = group_pad(groups)
    if interpreting():
        return dict(BLOCK_M=max(16, gp), BLOCK_N=16, num_warps=4, num_stages=1)
    cfg = tile_config(max(D, Dv), kind, dtype)
    return dict(cfg, BLOCK_M=max(cfg["BLOCK_M"], gp))


def parallax_bwd(do, q, r, k, v, o, vbar, tbar, m, l, *, causal: bool, window, scale: float, cu_seqlens=None,
                 max_seqlen=None, config: dict | None = None):
    """Gradients ``dq, dr: [B, T, HQ, D]``, ``dk: [B, S, H, D]``, ``dv: [B, S, H, Dv]`` (inputs' dtypes).

    ``o, vbar, tbar, m, l`` are the forward's saved outputs (see :func:`parallax_fwd`); ``config`` may
    override the tiles of each pass: ``{"dq": {...}, "dk": {...}}``.
    """
    B, T, HQ, D = q.shape
    S, H, Dv = k.shape[1], k.shape[2], v.shape[3]
    G = HQ // H
    GP = group_pad(G)
    config = config or {}
    cfg_dq = dict(bwd_config(D, Dv, G, q.dtype, "dq"), **config.get("dq", {}))
    cfg_dk = dict(bwd_config(D, Dv, G, q.dtype, "dk"), **config.get("dk", {}))
    do = do.contiguous()
    scalars = torch.empty(3, B, HQ, T, device=q.device, dtype=torch.float32)
    tau, beta, lse = scalars[0], scalars[1], scalars[2]
    n_rows = B * T * HQ
    block = 16 if interpreting() else 64
    _row_scalars_kernel[(ceil_div(n_rows, block),)](o, vbar, do, m, l, tau, beta, lse, n_rows, T, HQ, Dv,
                                                       BLOCK=block, BLOCK_DV=head_block(Dv))
    # q, r, dq, dr share one layout; so do k, dk and v, dv
    q, r = q.contiguous(), r.contiguous()
    k, v = k.contiguous(), v.contiguous()
    dq, dr = torch.empty_like(q), torch.empty_like(r)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    if cu_seqlens is None:
        n_seq, rows, keys = B, T, S
    else:
        n_seq, rows, keys = cu_seqlens.numel() - 1, max_seqlen, max_seqlen
    common = (T, S, HQ, H, D, Dv, scale, scale * LOG2E, window if window is not None else 0)
    strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
               v.stride(0), v.stride(1), v.stride(2), do.stride(0), do.stride(1), do.stride(2))
    cu = cu_seqlens if cu_seqlens is not None else q

    def meta(cfg):
        return dict(G=G, GP=GP, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_D=head_block(D),
                    BLOCK_DV=head_block(Dv), CAUSAL=causal, HAS_WINDOW=window is not None,
                    VARLEN=cu_seqlens is not None, PRECISION=dot_precision(q.dtype), num_warps=cfg["num_warps"],
                    num_stages=cfg["num_stages"])

    descriptors = prefill_descriptors(k, v, cfg_dq, cu_seqlens, work=B * HQ * T * S * D)
    _parallax_bwd_dq_kernel[(ceil_div(max(rows, 1), cfg_dq["BLOCK_M"] // GP), n_seq * H)](
        q, r, k, v, do, dq, dr, lse, tau, beta, tbar, cu, *(descriptors or (k, v)), *strides, *common,
        TMA=descriptors is not None, **meta(cfg_dq))
    _parallax_bwd_dk_kernel[(ceil_div(max(keys, 1), cfg_dk["BLOCK_N"]), n_seq * H)](
        q, r, k, v, do, dk, dv, lse, tau, beta, tbar, cu, *strides, *common, **meta(cfg_dk))
    return dq, dr, dk, dv
