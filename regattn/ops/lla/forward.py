"""FlashLLA forward (lla-local-linear-attention.txt Algorithm 1 with the CG solver of Algorithm 2).

One program per (query tile, query head). Pass 1 streams the visible keys once for the online
maximum, ``omega`` and the weighted key sum ``mu~`` (eq. 10); the solver finds ``rho = Sigma^-1 mu``
(CG on the key scatter about its weighted mean, for full LLA optionally preconditioned by the inverse key
covariance of the row's block of positions, streaming K once per iteration, then Sherman-Morrison: see
``tiles.centred_probe``; or a direct solve for BD-LLA with 1 x 1 / 2 x 2 blocks);
pass 3 streams K, V once more for the output through relmm (eq. 12, 16). Full LLA's CG from ``CG_LAUNCH_ROWS``
query rows runs in ``iters + 2`` launches instead (pass 1, one per CG iteration, pass 3), each row's CG state
in memory between them. Saved for the backward:
``rho`` (fp32), ``delta``, the base-2 row maximum ``m2``, the index of the key that attains it, ``omega``
and ``kbar.rho`` as pass 1 formed them (for ``1 - z.rho`` without cancellation, see ``tiles.one_minus_a``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from regattn.ops._common.attention_tiles import (
    LOG2E, dot_precision, head_block, interpreting, online_softmax_step, size_class, tile_configs, visible_mask,
)
from regattn.ops._common.hidden import finite_copy, hidden_flags, hides_keys, per_query_head, poison_rows, rows_seeing
from regattn.ops._common.ints import ceil_div, next_pow2
from regattn.ops._common.launch import launch_any
from regattn.ops.lla.tiles import (
    CURVATURE_FLOOR, block_columns, centred_probe, cg_active, cg_direction, cg_solve, cg_start, cg_step_size,
    direct_moments, guarded_denominator, halves_dot, key_scatter, load_cols, load_row_scalars, load_rows, load_state,
    pair_solve, partial_tile, query_head, query_key_tiles, smallest_ridge, split_dot, split_halves,
    store_row_scalars, store_state, system_rest, tile_weights,
)
from regattn.reference.lla import PRECONDITIONER_BLOCK, key_preconditioner

SOLVER_CG, SOLVER_DIAG, SOLVER_PAIRS = 0, 1, 2  # the kernel's SOLVER values


@triton.jit
def moments_pass(q, Kb, sks, skd, feat, pos0, lo, hi, S, D, qk_scale2, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr,
                 SOLVER: tl.constexpr, DPREC: tl.constexpr, MPREC: tl.constexpr):
    """Pass 1 over the keys ``[lo, hi)`` of a query tile: ``(m2, arg, omega, mt, kk, kx)``, the online base-2 maximum
    (0 for a row that sees no key) and the key that attains it, ``omega``, ``mu~`` (eq. 10) and, for the direct
    solves, the second moments (``kk``) and for 2 x 2 blocks the cross moments of feature pairs (``kx``)."""
    BM: tl.constexpr = q.shape[0]
    BD: tl.constexpr = q.shape[1]
    pos = pos0 + tl.arange(0, BM)
    m2 = tl.full((BM,), float("-inf"), tl.float32)
    arg = tl.zeros((BM,), tl.int32)
    omega = tl.zeros((BM,), tl.float32)
    mt = tl.zeros((BM, BD), tl.float32)
    kk = tl.zeros((BM, BD), tl.float32)
    kx = tl.zeros((BM, BD // 2), tl.float32)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kt = load_cols(Kb, offs_n, feat, sks, skd, S, D)
        s2 = tl.dot(q, kt, input_precision=DPREC) * qk_scale2
        if partial_tile(pos0, start_n, S, BM, BLOCK_N, WINDOW):
            s2 = tl.where(visible_mask(pos, offs_n, S, True, WINDOW), s2, float("-inf"))
        tile_max = tl.max(s2, 1)
        arg = tl.where(tile_max > m2, tl.argmax(s2, 1).to(tl.int32) + start_n, arg)
        m2, omega_fp32, w, alpha = online_softmax_step(m2, omega, s2, 1.0)
        k = tl.trans(kt)
        if SOLVER == 0:  # mu~ from weights split in two half-precision parts: mu = mu~ - omega q cancels
            omega = omega_fp32
            mt = mt * alpha[:, None] + split_dot(w, k, DPREC)
        else:  # the direct solves: the second moments too, every term from the same weights
            tile_omega, mt, tile_kk, tile_kx = direct_moments(w, k, mt * alpha[:, None], SOLVER, MPREC, DPREC)
            omega = omega * alpha + tile_omega
            kk = kk * alpha[:, None] + tile_kk
            kx = kx * alpha[:, None] + tile_kx
    m2 = tl.where(m2 == float("-inf"), 0.0, m2)
    return m2, arg, omega, mt, kk, kx


@triton.jit
def row_ridge(LAM, offs_m, feat, slt, sld, T, D):
    """The ridge of a query tile, fp32 ``[BM, BD]`` (1 on padding rows: a well-posed system), and its smallest
    entry per row over the real features."""
    lam = load_rows(LAM, offs_m, feat, slt, sld, T, D).to(tl.float32)
    lam = tl.where((offs_m < T)[:, None], lam, 1.0)
    return lam, smallest_ridge(lam, feat < D)


@triton.jit
def output_pass(q, rho, delta, m2, mt, omega, Kb, Vb, sks, skd, svs, svd, feat, offs_m, pos0, lo, hi, S, D, DV, T,
                qk_scale2, O, sot, sod, RHO, DELTA, OMEGA, CENTRE, b, h, HQ,
                BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr, WINDOW: tl.constexpr, DPREC: tl.constexpr,
                ONE_PART: tl.constexpr):
    """Pass 3 and the stores of a query tile (batch ``b``, query head ``h``): ``o`` (``O`` at the tile's batch and
    head) and the saved ``rho``, ``delta``, ``omega`` and ``centre``.

    ``o_i = sum_j w_ij (1 - z_ij.rho_i) v_j / delta_i
          = sum_j w_ij v_j / omega_i
            - (sum_j w_ij (k_j.rho_i - c_i) v_j - (kbar_i.rho_i - c_i) sum_j w_ij v_j) / delta_i``
    with ``kbar_i.rho_i = sum_j w_ij (k_j.rho_i) / omega_i`` from the same products and weights (as rounded for
    the product with V): the weighted mean of the values never passes through ``delta``, which cancels when lam
    is small against ``|z|^2``, and a row with one-hot weights gets exactly its top value (see
    ``tiles.one_minus_a``). ``rho`` leaves the registers before the pass: its half-precision parts are all the
    products need: two, with ``c = 0``; with ``ONE_PART`` (the direct solves' half-precision inputs) one, and ``w (k.rho
    - c)`` in one part too, centred on ``c = mu~.rho / omega`` of pass 1 (``mt``, ``omega``; the same one-part
    ``rho``): rounded after centring it stays below the output's rounding (``benchmarks/lla_parts.py direct``).

    The saved ``omega`` and ``centre = mu~.rho / omega`` (the whole ``rho``, as the backward forms ``k.rho``) are
    pass 1's, whose ``omega`` and ``mu~`` made ``delta = omega - mu.rho``: the backward's ``1 - z.rho`` as
    ``delta / omega - (k.rho - centre)`` (``tiles.one_minus_a``) then sums to ``delta`` over its weights. Pass 3's
    ``omega`` sums the weights rounded to the values' dtype: ``delta`` over it was off by their rounding (1.2e-4
    relative at a row of fp16 inputs), and so was ``beta``, which the ridge's gradient
    ``rho (u - beta rho)`` multiplies by ``|rho|^2``: there 200 times that gradient, which came out 2.5% off.
    Of ``rho_hi`` alone, the centre gave a row that sees one key a ridge gradient of 4e-5 where it is 0."""
    BM: tl.constexpr = q.shape[0]
    row_ok = offs_m < T
    rho_ptrs = RHO + ((b * T + offs_m[:, None]) * HQ + h) * D + feat[None, :]
    tl.store(rho_ptrs, rho, mask=row_ok[:, None] & (feat < D)[None, :])
    rho_hi, rho_lo = split_halves(rho, q.dtype)
    inv_omega_pass1 = 1.0 / tl.where(omega > 0.0, omega, 1.0)
    c = tl.zeros((BM,), tl.float32)
    if ONE_PART:
        c = tl.sum(mt * rho_hi.to(tl.float32), 1) * inv_omega_pass1
    offs_dv = tl.arange(0, BLOCK_DV)
    wv = tl.zeros((BM, BLOCK_DV), tl.float32)
    wkv = tl.zeros((BM, BLOCK_DV), tl.float32)
    wsum = tl.zeros((BM,), tl.float32)
    wk = tl.zeros((BM,), tl.float32)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kt = load_cols(Kb, offs_n, feat, sks, skd, S, D)
        v = load_rows(Vb, offs_n, offs_dv, svs, svd, S, DV)
        w = tile_weights(q, kt, m2, pos0, start_n, S, qk_scale2, WINDOW, DPREC).to(v.dtype)
        if ONE_PART:  # w_ij (k_j.rho_i - c_i)
            wkr = w.to(tl.float32) * (tl.dot(rho_hi, kt, input_precision=DPREC) - c[:, None])
            wkv += tl.dot(wkr.to(v.dtype), v, input_precision=DPREC)
        else:  # w_ij k_j.rho_i
            wkr = w.to(tl.float32) * halves_dot(rho_hi, rho_lo, kt, DPREC)
            wkv += split_dot(wkr, v, DPREC)
        wsum += tl.sum(w.to(tl.float32), 1)
        wk += tl.sum(wkr, 1)
        wv += tl.dot(w, v, input_precision=DPREC)
    inv_omega = 1.0 / tl.where(wsum > 0.0, wsum, 1.0)
    spread = wk * inv_omega  # kbar.rho_hi - c
    acc = wv * inv_omega[:, None] - (wkv - spread[:, None] * wv) / delta[:, None]
    o_ptrs = O + offs_m[:, None] * sot + offs_dv[None, :] * sod
    tl.store(o_ptrs, acc.to(O.dtype.element_ty), mask=row_ok[:, None] & (offs_dv < DV)[None, :])
    stat = (b * HQ + h) * T + offs_m
    tl.store(DELTA + stat, delta, mask=row_ok)
    tl.store(OMEGA + stat, omega, mask=row_ok)
    tl.store(CENTRE + stat, tl.sum(mt * rho, 1) * inv_omega_pass1, mask=row_ok)


@triton.jit
def lla_fwd_kernel(Q, K, V, LAM, PRE, O, RHO, DELTA, M2, ARGMAX, OMEGA, CENTRE,
                   sqb, sqt, sqh, sqd, skb, sks, skh, skd, svb, svs, svh, svd, slb, slt, slh, sld,
                   sob, sot, soh, sod, spb, sph,
                   T, S, HQ, GROUPS, D, DV, qk_scale2, iters, tol2, pre_first, pre_blocks, SIZE_CLASS,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                   BLK: tl.constexpr, WINDOW: tl.constexpr, SOLVER: tl.constexpr, G: tl.constexpr,
                   DPREC: tl.constexpr, MPREC: tl.constexpr, PRECOND: tl.constexpr, PB: tl.constexpr):
    """The forward in one launch: pass 1, the solve (the CG iterations on the tile's state), pass 3."""
    # float arguments come as fp64 when torch.compile launches the kernel: keep the arithmetic fp32
    qk_scale2, tol2 = tl.cast(qk_scale2, tl.float32), tl.cast(tol2, tl.float32)
    start_m, b, h, hk = query_head(HQ, GROUPS, BLOCK_M)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    feat = block_columns(BLOCK_D, D, BLK, G)  # the feature of each column (D: padding)
    pos0 = start_m + S - T
    Kb = K + b * skb + hk * skh
    q = load_rows(Q + b * sqb + h * sqh, offs_m, feat, sqt, sqd, T, D)
    lo, hi = query_key_tiles(start_m, T, S, BLOCK_M, BLOCK_N, WINDOW)
    m2, arg, omega, mt, kk, kx = moments_pass(q, Kb, sks, skd, feat, pos0, lo, hi, S, D, qk_scale2, BLOCK_N,
                                              WINDOW, SOLVER, DPREC, MPREC)
    q32 = q.to(tl.float32)
    mu = mt - omega[:, None] * q32
    lam, lam_min = row_ridge(LAM + b * slb + h * slh, offs_m, feat, slt, sld, T, D)

    # the solve: rho = Sigma^-1 mu, and delta = omega - mu.rho
    if SOLVER == 0:  # conjugate gradients on the centred scatter A = Sigma - mu mu^T / omega, then Sherman-Morrison
        y = cg_solve(mu, q, mt, omega, lam, lam_min, m2, pos0, Kb, sks, skd, lo, hi, S, D, feat, qk_scale2,
                     iters, tol2, PRE + b * spb + hk * sph, pre_first, pre_blocks, BLOCK_N, WINDOW, G, DPREC, True,
                     PRECOND, PB)
        rho, delta = centred_probe(y, mu, omega, G)
    else:
        sdiag = kk - 2.0 * q32 * mt + omega[:, None] * q32 * q32 + lam
        if SOLVER == 1:  # 1 x 1 blocks
            rho = mu / tl.where(sdiag == 0.0, 1.0, sdiag)
        else:
            rho = pair_solve(mu, sdiag, kx, q32, mt, omega)
        delta = omega - tl.sum(mu * rho, 1)
    delta = guarded_denominator(delta, omega, mu, lam_min, SOLVER == 0 and G == 1)
    stat = (b * HQ + h) * T + offs_m
    tl.store(M2 + stat, m2, mask=offs_m < T)
    tl.store(ARGMAX + stat, arg, mask=offs_m < T)
    output_pass(q, rho, delta, m2, mt, omega, Kb, V + b * svb + hk * svh, sks, skd, svs, svd, feat, offs_m, pos0,
                lo, hi, S, D, DV, T, qk_scale2, O + b * sob + h * soh, sot, sod, RHO, DELTA, OMEGA, CENTRE, b, h, HQ,
                BLOCK_N, BLOCK_DV, WINDOW, DPREC, SOLVER != 0 and q.dtype != tl.float32)


# Full LLA's CG in iters + 2 launches (see CG_LAUNCH_ROWS): the CG state of every row lives in memory between
# them (``cg_state``), so each key pass holds only its query tile, the search vector's parts and one accumulator.
@triton.jit
def state_rows(T, HQ, GROUPS, BLOCK_M: tl.constexpr):
    """``(start_m, b, h, hk, offs_m, row_ok, row, row0)`` of a program of the CG launches (``tiles.query_head``): its
    query rows, which are real, their index in the per-row statistics and state, and the first one's (int64, see
    ``tiles.store_state``)."""
    start_m, b, h, hk = query_head(HQ, GROUPS, BLOCK_M)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    first = (b * HQ + h) * T + start_m
    return start_m, b, h, hk, offs_m, offs_m < T, first + tl.arange(0, BLOCK_M), first.to(tl.int64)


@triton.jit
def lla_cg_begin_kernel(Q, K, LAM, PRE, M2, ARGMAX, OMEGA, MT, X, R, P, P_HI, P_LO, RR, RZ, BOUND,
                        sqb, sqt, sqh, sqd, skb, sks, skh, skd, slb, slt, slh, sld, spb, sph,
                        T, S, HQ, GROUPS, D, qk_scale2, tol2, pre_first, pre_blocks, SIZE_CLASS,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, WINDOW: tl.constexpr,
                        DPREC: tl.constexpr, PRECOND: tl.constexpr, PB: tl.constexpr):
    """Pass 1 and CG's start from ``x = 0`` on ``mu``: the statistics and the state of each row to memory."""
    qk_scale2, tol2 = tl.cast(qk_scale2, tl.float32), tl.cast(tol2, tl.float32)
    start_m, b, h, hk, offs_m, row_ok, row, row0 = state_rows(T, HQ, GROUPS, BLOCK_M)
    feat = tl.arange(0, BLOCK_D)
    pos0 = start_m + S - T
    q = load_rows(Q + b * sqb + h * sqh, offs_m, feat, sqt, sqd, T, D)
    lo, hi = query_key_tiles(start_m, T, S, BLOCK_M, BLOCK_N, WINDOW)
    m2, arg, omega, mt, _, _ = moments_pass(q, K + b * skb + hk * skh, sks, skd, feat, pos0, lo, hi, S, D,
                                            qk_scale2, BLOCK_N, WINDOW, 0, DPREC, "ieee")
    tl.store(M2 + row, m2, mask=row_ok)
    tl.store(ARGMAX + row, arg, mask=row_ok)
    tl.store(OMEGA + row, omega, mask=row_ok)
    store_state(MT, row0, row_ok, mt)
    r, p, rr, rz = cg_start(mt - omega[:, None] * q.to(tl.float32), PRE + b * spb + hk * sph, pos0, pre_first,
                            pre_blocks, D, PB, q.dtype, DPREC, PRECOND)
    store_state(X, row0, row_ok, tl.zeros(r.shape, tl.float32))
    store_state(R, row0, row_ok, r)
    store_search(P, P_HI, P_LO, row0, row_ok, p)
    store_row_scalars(RR, row0, row_ok, rr)
    store_row_scalars(RZ, row0, row_ok, rz)
    store_row_scalars(BOUND, row0, row_ok, tol2 * rr)


@triton.jit
def store_search(P, P_HI, P_LO, row0, row_ok, p):
    """The search vectors ``p``: in fp32 for CG's updates, and in the two parts of ``split_halves`` (``P_HI``'s dtype)
    for the key pass's products, which load them as they are (formed there from ``P``, the step's key loop spilled
    on sm_90 with the preconditioner)."""
    hi, lo = split_halves(p, P_HI.dtype.element_ty)
    store_state(P, row0, row_ok, p)
    store_state(P_HI, row0, row_ok, hi)
    store_state(P_LO, row0, row_ok, lo)


@triton.jit
def lla_cg_step_kernel(Q, K, LAM, PRE, M2, OMEGA, MT, X, R, P, P_HI, P_LO, RR, RZ, BOUND,
                       sqb, sqt, sqh, sqd, skb, sks, skh, skd, slb, slt, slh, sld, spb, sph,
                       T, S, HQ, GROUPS, D, qk_scale2, pre_first, pre_blocks, SIZE_CLASS,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, WINDOW: tl.constexpr,
                       DPREC: tl.constexpr, PRECOND: tl.constexpr, PB: tl.constexpr):
    """One CG iteration of the rows of a query tile from their state in memory (``tiles.cg_solve``'s loop body);
    a tile whose systems are all done skips its key pass."""
    qk_scale2 = tl.cast(qk_scale2, tl.float32)
    start_m, b, h, hk, offs_m, row_ok, row, row0 = state_rows(T, HQ, GROUPS, BLOCK_M)
    rr = load_row_scalars(RR, row0, row_ok)
    rz = load_row_scalars(RZ, row0, row_ok)
    active = cg_active(rr, rz, load_row_scalars(BOUND, row0, row_ok))
    if tl.max(tl.ravel(active.to(tl.int32)), 0) > 0:
        feat = tl.arange(0, BLOCK_D)
        pos0 = start_m + S - T
        q = load_rows(Q + b * sqb + h * sqh, offs_m, feat, sqt, sqd, T, D)
        lo, hi = query_key_tiles(start_m, T, S, BLOCK_M, BLOCK_N, WINDOW)
        scatter = key_scatter(load_state(P_HI, row0, row_ok, BLOCK_D), load_state(P_LO, row0, row_ok, BLOCK_D), q,
                              tl.load(M2 + row, mask=row_ok, other=0.0), pos0, K + b * skb + hk * skh, sks, skd, lo,
                              hi, S, D, feat, qk_scale2, BLOCK_N, WINDOW, 1, DPREC)
        p = load_state(P, row0, row_ok, BLOCK_D)  # loaded again rather than held in registers across the key pass
        lam, lam_min = row_ridge(LAM + b * slb + h * slh, offs_m, feat, slt, sld, T, D)
        omega = tl.load(OMEGA + row, mask=row_ok, other=0.0)
        sp = system_rest(scatter, p, q, load_state(MT, row0, row_ok, BLOCK_D), omega, lam, 1, True)
        # each state tile is loaded, updated and stored in turn, so few [BM, BD] tiles are live at once
        alpha, active = cg_step_size(p, sp, rz, active, CURVATURE_FLOOR * lam_min[:, None])
        store_state(X, row0, row_ok, load_state(X, row0, row_ok, BLOCK_D) + alpha * p)
        r = load_state(R, row0, row_ok, BLOCK_D) - alpha * sp
        store_state(R, row0, row_ok, r)
        p, rr, rz = cg_direction(r, p, rr, rz, active, PRE + b * spb + hk * sph, pos0, pre_first, pre_blocks, D, PB,
                                 q.dtype, DPREC, PRECOND)
        store_search(P, P_HI, P_LO, row0, row_ok, p)
        store_row_scalars(RR, row0, row_ok, rr)
        store_row_scalars(RZ, row0, row_ok, rz)


@triton.jit
def lla_cg_end_kernel(Q, K, V, LAM, MT, X, O, RHO, DELTA, M2, OMEGA, CENTRE,
                      sqb, sqt, sqh, sqd, skb, sks, skh, skd, svb, svs, svh, svd, slb, slt, slh, sld,
                      sob, sot, soh, sod, T, S, HQ, GROUPS, D, DV, qk_scale2, SIZE_CLASS,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                      WINDOW: tl.constexpr, DPREC: tl.constexpr):
    """``rho`` and ``delta`` from CG's solution (``tiles.centred_probe``), then pass 3."""
    qk_scale2 = tl.cast(qk_scale2, tl.float32)
    start_m, b, h, hk, offs_m, row_ok, row, row0 = state_rows(T, HQ, GROUPS, BLOCK_M)
    feat = tl.arange(0, BLOCK_D)
    pos0 = start_m + S - T
    q = load_rows(Q + b * sqb + h * sqh, offs_m, feat, sqt, sqd, T, D)
    lo, hi = query_key_tiles(start_m, T, S, BLOCK_M, BLOCK_N, WINDOW)
    omega = tl.load(OMEGA + row, mask=row_ok, other=0.0)
    mt = load_state(MT, row0, row_ok, BLOCK_D)
    mu = mt - omega[:, None] * q.to(tl.float32)
    _, lam_min = row_ridge(LAM + b * slb + h * slh, offs_m, feat, slt, sld, T, D)
    rho, delta = centred_probe(load_state(X, row0, row_ok, BLOCK_D), mu, omega, 1)
    delta = guarded_denominator(delta, omega, mu, lam_min, True)
    output_pass(q, rho, delta, tl.load(M2 + row, mask=row_ok, other=0.0), mt, omega, K + b * skb + hk * skh,
                V + b * svb + hk * svh, sks, skd, svs, svd, feat, offs_m, pos0, lo, hi, S, D, DV, T, qk_scale2,
                O + b * sob + h * soh, sot, sod, RHO, DELTA, OMEGA, CENTRE, b, h, HQ, BLOCK_N, BLOCK_DV, WINDOW, DPREC,
                False)


def lam_tensor(lam, q: torch.Tensor) -> torch.Tensor:
    """The ridge as an fp32 view broadcast to ``[B, T, HQ, D]`` (zero strides where it is shared)."""
    B, T, HQ, D = q.shape
    if not isinstance(lam, torch.Tensor):
        return torch.full((1, 1, 1, 1), float(lam), device=q.device, dtype=torch.float32).expand(B, T, HQ, D)
    lam = lam.to(torch.float32)
    return (lam[..., None] if lam.dim() == 3 else lam).expand(B, T, HQ, D)


def solver_for(blocks, D: int) -> tuple[int, int]:
    """``(SOLVER, G)``: direct solves for 1 x 1 and 2 x 2 blocks, CG over ``G`` blocks otherwise."""
    if blocks is not None and blocks == D:
        return SOLVER_DIAG, 1
    if blocks is not None and 2 * blocks == D:
        return SOLVER_PAIRS, 1
    return SOLVER_CG, 1 if blocks is None else blocks


def direct_solver(blocks, D: int) -> int:
    """The fused kernels' ``bd``: ``SOLVER_DIAG`` (1) or ``SOLVER_PAIRS`` (2) for BD-LLA's direct solves, 0 for
    CG (full LLA or BD-LLA by CG)."""
    solver, _ = solver_for(blocks, D)
    return 0 if solver == SOLVER_CG else solver


def column_blocks(D: int, G: int) -> tuple[int, int]:
    """``(kernel blocks, BLOCK_D)`` for ``G`` feature blocks: ``G`` and each block's width rounded up to powers
    of two (see ``tiles.block_columns``), ``BLOCK_D >= 16``."""
    if G == 1:
        return 1, head_block(D)
    blocks = next_pow2(G)
    return blocks, max(16, blocks * next_pow2(D // G))


def moment_precision(dtype: torch.dtype) -> str:
    """Products of the direct solves' moments (``tiles.direct_moments``): exact for fp32 inputs; for bf16
    ``"parts"``, the weights rounded to bf16 once for every moment and the keys' squares in two bf16 parts (two
    products); for fp16 three tf32 products (an fp16 square does not split into two fp16 parts within fp16's
    range)."""
    return {torch.float32: "ieee", torch.bfloat16: "parts"}.get(dtype, "tf32x3")


def cross_precision(dtype: torch.dtype) -> str:
    """The backward's cross-term products of fp32 factors (``backward.cross_quad``, centred): exact for fp32
    inputs, else one tf32 product."""
    return "ieee" if dtype == torch.float32 else "tf32"


# The tiles (BLOCK_M, BLOCK_N, num_warps, num_stages) the autotuner times on a GPU, by (fp32 inputs, narrow
# key tiles: 2 x 2 blocks and CG over G > 1 feature blocks, whose products hold G weight tiles). The first
# of a list is the fixed tile (short inputs, AUTOTUNE off). On sm_90 (``python -m regattn.bench.registers lla
# --candidates``) the 32-row tiles have no spills in their key loops; 64-row tiles read K half as often in
# each CG iteration and spill outside the CG key loop. Each warpgroup should own 64 whole rows (4 warps on
# 64 rows, 8 on 128): with 8 warps on 64 rows the two warpgroups split each product's columns and trade the
# weight tile through shared memory, 25 barriers a key tile in the CG loop. On the H100 at B 4, H 16, T 8192,
# D 128, bf16, FlashLLA cg=8 took 64.7 ms with 64 x 64 on 4 warps, 67.5 with 128 x 64, 128 with 64 x 64 on
# 8 warps and 262 with 32 x 32; BD-LLA with 2 x 2 blocks 48 ms with 128 x 32 (115 with 64 x 16 on 8 warps),
# with CG over blocks of 16 69 ms with 64 x 32 on 4 warps (148). ptxas serialises the warpgroup products of
# 64 x 64 on 4 warps and of 128 x 64 (``registers`` column SERIAL), for want of registers in pass 3 (two fp32
# accumulators of 128 value columns); taking the columns 64 at a time there lifts it for one more pass over
# K: cg=8 4% and cg=16 10% faster, BD-LLA 6-9% slower on the H100. With the direct solves' moments in bf16
# parts (``moment_precision``) 32 rows of 64 keys on 8 warps compile without spills for 1 x 1 and 2 x 2 blocks,
# but on the H200 took 40.9 and 59.3 ms against 22.2 and 27.2 with 64 rows on 4 warps (840 and 1032 bytes of
# stack; the ``tiles`` of benchmarks/results/h200/lla.json): the 64-row tiles stay. With every moment from the
# weights rounded to bf16 once (``tiles.direct_moments``), 1 x 1 blocks took 13.8 ms at 64 x 64 on 4 warps, 13.2 at
# 128 x 64 on 8 and 55.6 at 32 x 32 on 8; 2 x 2 blocks 18.3 at 64 x 32 on 4, 20.8 at 128 x 32 on 8 and 115 at
# 32 x 16 on 8 (benchmarks/results/h200/tiles/lla-direct-one-part.txt). With 1 x 1 blocks 128 x 64 on 8 warps took
# 14.04 ms on 3 stages against 14.37 on 2 in one process (lla-forward-stages.txt there; 2 x 2 blocks, 3 stages
# lost at 64 x 32 and won by 1% at 128 x 32, which stays behind 64 x 32 on 2): the 3-stage tile is listed, its copies
# clear of the products still reading their buffers (``regattn.bench.registers``, column HAZARD) with every solver.
FORWARD_TILES = {
    (False, False): [(32, 32, 8, 2), (64, 64, 4, 2), (128, 64, 8, 2), (128, 64, 8, 3)],
    (False, True): [(32, 16, 8, 2), (64, 32, 4, 2), (128, 32, 8, 2)],
    (True, False): [(32, 32, 4, 2)],
    (True, True): [(32, 16, 4, 2)],
}
AUTOTUNE = True
SHORT = 32  # query rows up to which the fixed tile runs, cut to the rows (decode, short prefills)


def tile_family(dtype: torch.dtype, solver: int, G: int) -> tuple[bool, bool]:
    """The key of :data:`FORWARD_TILES`: (fp32 inputs, narrow key tiles)."""
    return dtype == torch.float32, solver == SOLVER_PAIRS or G > 1


def forward_tiles(dtype: torch.dtype, solver: int = SOLVER_CG, G: int = 1) -> list[dict]:
    """The forward's tile candidates for ``dtype`` and the solver (see :data:`FORWARD_TILES`)."""
    return [dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s)
            for m, n, w, s in FORWARD_TILES[tile_family(dtype, solver, G)]]


def forward_blocks(T: int, dtype: torch.dtype, solver: int = SOLVER_CG, G: int = 1) -> dict:
    """The fixed tile: small in the interpreter; on a GPU the first candidate, its rows cut to ``T``."""
    if interpreting():
        return dict(BLOCK_M=16, BLOCK_N=16, num_warps=1, num_stages=1)
    cfg = forward_tiles(dtype, solver, G)[0]
    cfg["BLOCK_M"] = min(cfg["BLOCK_M"], max(16, next_pow2(T)))
    return cfg


def tuned_kernels(tiles: dict) -> dict:
    """The forward kernel autotuned over each list of ``tiles`` (as :data:`FORWARD_TILES`), by family."""
    key = ["D", "DV", "WINDOW", "SOLVER", "G", "PRECOND", "SIZE_CLASS"]
    return {family: triton.autotune(tile_configs(configs), key=key)(lla_fwd_kernel)
            for family, configs in tiles.items()}


TUNED = tuned_kernels(FORWARD_TILES)


# Full LLA's CG in iters + 2 launches (``lla_cg_begin_kernel``: pass 1; ``lla_cg_step_kernel``: one CG
# iteration; ``lla_cg_end_kernel``: pass 3) from CG_LAUNCH_ROWS query rows on, their tiles by kernel and by the
# inputs being fp32 (the first is the fixed tile). On the H200 at B 4, H 16, T 8192, D 128, bf16, cg=8: 60.5 ms
# against the one launch's 65.4 (begin 4.0 ms, 8 steps of 5.9, end 7.8; cg=16 3% faster, the preconditioned
# CG alike). BD-LLA's CG over feature blocks stays in one launch: in iters + 2 it took 2.0x the time.
CG_TILES = {
    "begin": {False: [(64, 64, 4, 2), (128, 64, 8, 2)], True: [(32, 32, 4, 2)]},
    "step": {False: [(64, 64, 4, 2), (128, 64, 8, 2), (64, 32, 4, 2), (128, 32, 8, 2)], True: [(32, 32, 4, 2)]},
    "end": {False: [(64, 32, 4, 2), (64, 64, 4, 2), (64, 16, 4, 2), (32, 64, 8, 2), (32, 32, 4, 2), (128, 32, 8, 2)],
            True: [(32, 32, 4, 2)]},
}
CG_LAUNCH_ROWS = 4096  # query rows from which full LLA's CG takes iters + 2 launches (fewer: one launch)
CG_KERNELS = {"begin": lla_cg_begin_kernel, "step": lla_cg_step_kernel, "end": lla_cg_end_kernel}


def tuned_cg_kernels(tiles: dict) -> dict:
    """The CG launches' kernels autotuned over ``tiles`` (as :data:`CG_TILES`), by kernel and fp32 inputs; the
    step kernel updates the state in place, so the autotuner restores it after timing each tile."""
    state = ["X", "R", "P", "P_HI", "P_LO", "RR", "RZ"]
    key = ["D", "WINDOW", "SIZE_CLASS"]
    return {name: {fp32: triton.autotune(tile_configs(configs), key=key + (["PRECOND"] if name != "end" else []),
                                         restore_value=state if name == "step" else None)(CG_KERNELS[name])
                   for fp32, configs in by_dtype.items()}
            for name, by_dtype in tiles.items()}


CG_TUNED = tuned_cg_kernels(CG_TILES)


def cg_launch(name: str, T: int, fp32: bool):
    """``(kernel, fixed config)`` of the CG launch ``name``: autotuned on a GPU, else the fixed tile (as
    :func:`forward_blocks`)."""
    if interpreting():
        return CG_KERNELS[name], dict(BLOCK_M=16, BLOCK_N=16, num_warps=1, num_stages=1)
    if AUTOTUNE:
        return CG_TUNED[name][fp32], {}
    m, n, w, st = CG_TILES[name][fp32][0]
    return CG_KERNELS[name], dict(BLOCK_M=min(m, max(16, next_pow2(T))), BLOCK_N=n, num_warps=w, num_stages=st)


def cg_state(rows: int, block_d: int, dtype: torch.dtype, device) -> dict:
    """The state of the CG launches for ``rows`` query rows: ``mu~``, the iterate, the residual and the search
    vector (fp32, as the one launch holds them), the search vector's two parts of ``dtype`` that the key pass's
    products take (``tiles.search_parts``) and per row ``r.r``, ``r.z`` and the bound on ``r.r``."""
    vec = dict(device=device, dtype=torch.float32)
    state = {name: torch.empty(rows, block_d, **vec) for name in ("MT", "X", "R", "P")}
    state.update({name: torch.empty(rows, block_d, device=device, dtype=dtype) for name in ("P_HI", "P_LO")})
    state.update({name: torch.empty(rows, 1, **vec) for name in ("RR", "RZ", "BOUND")})
    return state


def cg_forward(q, k, v, lam4, pre, outputs, *, scale: float, window, cg_iters: int, cg_tol: float, precond: bool):
    """Full LLA's forward by CG in ``cg_iters + 2`` launches into ``outputs`` (``o, rho, delta, m2, argmax, omega,
    centre``, as :func:`lla_forward` returns them)."""
    B, T, HQ, D = q.shape
    S, H, DV = k.shape[1], k.shape[2], v.shape[3]
    o, rho, delta, m2, argmax, omega, centre = outputs
    st = cg_state(B * HQ * T, head_block(D), q.dtype, q.device)
    grid = lambda meta: (ceil_div(T, meta["BLOCK_M"]), B * HQ)  # noqa: E731
    fp32 = q.dtype == torch.float32
    common = (*q.stride(), *k.stride(), *lam4.stride(), pre.stride(0), pre.stride(1), T, S, HQ, HQ // H, D,
              scale * LOG2E)
    pre_blocks = ((S - T) // PRECONDITIONER_BLOCK, pre.shape[2], size_class(B * HQ * T))
    cg = dict(BLOCK_D=head_block(D), WINDOW=window or 0, DPREC=dot_precision(q.dtype), PRECOND=precond,
              PB=PRECONDITIONER_BLOCK)
    kernel, cfg = cg_launch("begin", T, fp32)
    launch_any(kernel, grid, q, k, lam4, pre, m2, argmax, omega, *st.values(), *common, cg_tol ** 2, *pre_blocks,
               **cg, **cfg)
    kernel, cfg = cg_launch("step", T, fp32)
    for _ in range(cg_iters):
        launch_any(kernel, grid, q, k, lam4, pre, m2, omega, *st.values(), *common, *pre_blocks, **cg, **cfg)
    kernel, cfg = cg_launch("end", T, fp32)
    launch_any(kernel, grid, q, k, v, lam4, st["MT"], st["X"], o, rho, delta, m2, omega, centre,
               *q.stride(), *k.stride(), *v.stride(), *lam4.stride(), *o.stride(), T, S, HQ, HQ // H, D, DV,
               scale * LOG2E, size_class(B * HQ * T), BLOCK_D=cg["BLOCK_D"], BLOCK_DV=head_block(DV),
               WINDOW=cg["WINDOW"], DPREC=cg["DPREC"], **cfg)
    return outputs


def lla_forward(q, k, v, lam, *, scale: float, window, blocks, cg_iters: int, cg_tol: float,
                cg_precondition: bool = False):
    """Launch the forward. ``q [B, T, HQ, D]``, ``k [B, S, H, D]``, ``v [B, S, H, Dv]``; with ``cg_precondition``
    full LLA's CG is preconditioned (``reference.lla.key_preconditioner``).

    Returns ``o [B, T, HQ, Dv]`` (q's dtype) and the saved ``rho [B, T, HQ, D]``, ``delta, m2 [B, HQ, T]``
    (fp32), ``argmax [B, HQ, T]`` (int32), ``omega`` and ``centre = kbar.rho [B, HQ, T]`` (fp32). A row that sees
    a non-finite key or value gets ``o = NaN``; the kernels read copies with such entries zero
    (``ops._common.hidden``), so no other row depends on them.
    """
    solve = dict(scale=scale, window=window, blocks=blocks, cg_iters=cg_iters, cg_tol=cg_tol,
                 cg_precondition=cg_precondition)
    if not hides_keys(q.shape[1], k.shape[1], window):
        return launch_forward(q, k, v, lam, **solve)
    flags = hidden_flags(k, v)
    outputs = launch_forward(q, finite_copy(k), finite_copy(v), lam, **solve)
    poison_rows(outputs[0], per_query_head(rows_seeing(flags, q.shape[1], window), q.shape[2] // k.shape[2]))
    return outputs


def launch_forward(q, k, v, lam, *, scale: float, window, blocks, cg_iters: int, cg_tol: float,
                   cg_precondition: bool):
    """The kernels of :func:`lla_forward` on keys and values that are finite."""
    B, T, HQ, D = q.shape
    S, H, DV = k.shape[1], k.shape[2], v.shape[3]
    solver, G = solver_for(blocks, D)
    o = torch.empty(B, T, HQ, DV, device=q.device, dtype=q.dtype)
    rho = torch.empty(B, T, HQ, D, device=q.device, dtype=torch.float32)
    delta = torch.empty(B, HQ, T, device=q.device, dtype=torch.float32)
    m2 = torch.empty_like(delta)
    argmax = torch.empty(B, HQ, T, device=q.device, dtype=torch.int32)
    omega, centre = torch.empty_like(delta), torch.empty_like(delta)
    lam4 = lam_tensor(lam, q)
    precond = cg_precondition and solver == SOLVER_CG and G == 1
    pre = key_preconditioner(k, T, window).float().contiguous() if precond else lam4.new_zeros(1, 1, 1, 1, 1)
    outputs = (o, rho, delta, m2, argmax, omega, centre)
    if solver == SOLVER_CG and G == 1 and T >= CG_LAUNCH_ROWS:
        return cg_forward(q, k, v, lam4, pre, outputs, scale=scale, window=window, cg_iters=cg_iters, cg_tol=cg_tol,
                          precond=precond)
    kernel_blocks, block_d = column_blocks(D, G)
    if AUTOTUNE and T > SHORT and not interpreting():
        kernel, cfg = TUNED[tile_family(q.dtype, solver, G)], {}
    else:
        kernel, cfg = lla_fwd_kernel, forward_blocks(T, q.dtype, solver, G)
    grid = lambda meta: (ceil_div(T, meta["BLOCK_M"]), B * HQ)  # noqa: E731
    launch_any(
        kernel, grid, q, k, v, lam4, pre, o, rho, delta, m2, argmax, omega, centre,
        *q.stride(), *k.stride(), *v.stride(), *lam4.stride(), *o.stride(), pre.stride(0), pre.stride(1),
        T, S, HQ, HQ // H, D, DV, scale * LOG2E, cg_iters, cg_tol ** 2, (S - T) // PRECONDITIONER_BLOCK,
        pre.shape[2], size_class(B * HQ * T),
        BLOCK_D=block_d, BLK=D // G, BLOCK_DV=head_block(DV), WINDOW=window or 0, SOLVER=solver, G=kernel_blocks,
        DPREC=dot_precision(q.dtype), MPREC=moment_precision(q.dtype), PRECOND=precond, PB=PRECONDITIONER_BLOCK,
        **cfg)
    return outputs
