"""FlashLLA backward (lla-local-linear-attention.txt Appendix D, eq. 28-50), Theta(n d) memory.

Per query ``i`` with ``g_i = dL/do_i``, ``gamma_ij = g_i.v_j``, ``a_ij = z_ij.rho_i``,
``s_ij = w_ij (1 - a_ij) / delta_i``, ``c_ij = gamma_ij w_ij / delta_i``, ``beta_i = sum_j gamma_ij s_ij / delta_i``:

* ``u_i = Sigma_i^-1 sum_j c_ij z_ij`` (eq. 37), the second CG solve;
* ``dmu_i = 2 beta_i rho_i - u_i`` (eq. 38, 40), ``b_ij = z_ij.u_i``;
* w-path (eq. 41-44): ``Dw_ij = w_ij dL/dw_ij = gamma_ij s_ij + w_ij (-beta_i + 2 beta_i a_ij - b_ij - beta_i a_ij^2 + a_ij b_ij)``;
* z-path (eq. 45-49): ``dL/dz_ij = w_ij dmu_i + F_ij rho_i + w_ij a_ij u_i`` with ``F_ij = -c_ij + w_ij (b_ij - 2 beta_i a_ij)``;
* ``dq_i = scale sum_j Dw_ij k_j - sum_j dL/dz_ij``, ``dk_j = scale sum_i Dw_ij q_i + sum_i dL/dz_ij``,
  ``dv_j = sum_i s_ij g_i``;
* the row maximum ``m_i = scale q_i.k_{j*}`` (the ridge makes the output depend on it):
  ``dm_i = -sum_j Dw_ij`` flows to ``q_i`` and ``k_{j*}``;
* the ridge: ``dlam_i = diag(dL/dSigma_i) = rho_i (u_i - beta_i rho_i)`` per dimension.

BD-LLA with direct solves (``BD = 1``: 1 x 1 blocks, ``BD = 2``: 2 x 2 blocks on feature pairs
``(d, d xor 1)``): ``u_i`` comes from the same block solve, and ``dL/dSigma_i`` is masked to the blocks:
its diagonal ``h0 = rho (u - beta rho)`` and, for pairs, the off-diagonal ``hs_d = (h1_d + h1_{d xor 1}) / 2``
with ``h1_d = rho_d (u_{d xor 1} - beta rho_{d xor 1})``. The quadratic ``a b - beta a^2`` of the w-path
becomes ``sum_d z_d^2 h0_d + sum_d z_d z_{d xor 1} h1_d`` and the z-path's ``F rho + w a u`` becomes
``-c rho + 2 w (h0 z + hs z_swap)``; both are formed from keys and queries less the mean of the program's own key
tile (kernel 2) or query tile (kernel 1), see ``cross_quad``.

Kernel 1 runs per query tile (the solve for ``u``, then dq); kernel 2 per key tile (dk, dv), summing
the query heads of a GQA group in one program. For the block-diagonal variants kernel 2 keeps its keys on the rows
of every tile and runs in two parts, after a small kernel that forms the centred keys' squares
(``lla_bwd_kv_blocks_kernel``); kernel 1 runs only its first pass and the solve, and kernel 2's first part adds
dq's key sum by atomics where it forms ``Dw`` (under ``torch.use_deterministic_algorithms(True)`` kernel 1's
second part forms it instead).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from regattn.ops._common.attention_tiles import (
    LOG2E, dot_precision, head_block, interpreting, size_class, tile_configs,
)
from regattn.ops._common.hidden import finite_copy, hidden_flags, keys_reached, per_query_head, poison_rows, rows_seeing
from regattn.ops._common.ints import ceil_div
from regattn.ops._common.launch import launch_any
from regattn.ops.lla.forward import cross_precision, lam_tensor, moment_precision
from regattn.ops.lla.tiles import (
    cg_solve, direct_moments, key_head, key_query_tiles, key_rows_products, key_rows_weights, load_cols, load_rows,
    one_minus_a, pair_solve, query_head, query_key_tiles, relmm_tile, smallest_ridge, split_dot, swap_pairs,
    tile_weights,
)


@triton.jit
def pair_terms(w, gamma, a, om, bu, beta, delta_safe):
    """``(s, Dw, F, G)`` of one tile from the weights, ``gamma = g.v``, ``a = z.rho``, ``om = 1 - a`` (from
    ``one_minus_a``), ``bu = z.u``."""
    s = w * om / delta_safe[:, None]
    c = gamma * w / delta_safe[:, None]
    bt = beta[:, None]
    dw = gamma * s - w * (bt * om * om + bu * om)
    f = -c + w * (bu - 2.0 * bt * a)
    return s, dw, f, w * a


@triton.jit
def feature_mean(x, ok, AXIS: tl.constexpr):
    """Mean of ``x`` over the entries of ``AXIS`` where ``ok`` and finite (0 where none is): the centre of the cross
    terms, which a non-finite query or key leaves to the others."""
    ok = ok & (tl.abs(x) < float("inf"))
    return tl.sum(tl.where(ok, x, 0.0), AXIS) / tl.maximum(tl.sum(tl.where(ok, 1.0, 0.0), AXIS), 1.0)


@triton.jit
def sigma_grad(rho, u, beta, BD: tl.constexpr):
    """``(h0, h1, hs)`` of the masked ``dL/dSigma`` (see the module text), ``[BM, BD]`` each: its diagonal
    ``h0 = rho (u - beta rho)`` and, with 2 x 2 blocks, ``h1`` and the pair entries ``hs = (h1 + swap(h1)) / 2``
    (``h0`` for both with 1 x 1 blocks)."""
    hd = rho * (u - beta[:, None] * rho)
    if BD == 2:
        h1 = rho * (swap_pairs(u, 1) - beta[:, None] * swap_pairs(rho, 1))
        return hd, h1, 0.5 * (h1 + swap_pairs(h1, 1))
    return hd, hd, hd


@triton.jit
def centred_keys(kt, centre, BD: tl.constexpr):
    """``(kc, ksc)`` of :func:`cross_quad`: the key tile ``kt [BD, BN]`` less ``centre [BD, 1]`` in fp32, and with
    2 x 2 blocks its partner features (else ``kc`` again)."""
    kc = kt.to(tl.float32) - centre
    if BD == 2:
        return kc, swap_pairs(kc, 0)
    return kc, kc


@triton.jit
def cross_quad(hd, h1, lin, const, kc, ksc, BD: tl.constexpr, PREC: tl.constexpr):
    """``sum_d h0_d z_d^2 (+ sum_d h1_d z_d z_(d xor 1))`` on a ``[BM, BN]`` tile, ``z_ij = k_j - q_i``, from keys
    and queries less a shared centre ``c`` (``kc = k - c``, ``ksc`` its partner features, ``[BD, BN]``):
    ``h0.kc^2 (+ h1.(kc ksc)) - lin.kc + const`` with the row terms ``lin`` and ``const`` of :func:`cross_rows`.
    Centred, no term is much larger than the result unless a key and a query sit much nearer each other than
    to the centre, so one ``PREC`` product of each keeps the accuracy that uncentred terms (``k^2`` against
    ``2 q k``) needed three tf32 products for."""
    quad = tl.dot(hd, kc * kc, input_precision=PREC) - tl.dot(lin, kc, input_precision=PREC) + const[:, None]
    if BD == 2:
        quad += tl.dot(h1, kc * ksc, input_precision=PREC)
    return quad


@triton.jit
def cross_rows(hd, h1, qc, qsc, BD: tl.constexpr):
    """``(lin, const)`` of :func:`cross_quad` for centred queries ``qc`` (``qsc``: partner features):
    ``lin = 2 h0 qc (+ swap(h1 qc) + h1 qsc)``, ``const = sum h0 qc^2 (+ sum h1 qc qsc)``."""
    lin = 2.0 * hd * qc
    const = tl.sum(hd * qc * qc, 1)
    if BD == 2:
        lin += swap_pairs(h1 * qc, 1) + h1 * qsc
        const += tl.sum(h1 * qc * qsc, 1)
    return lin, const


@triton.jit
def query_rows(Q, RHO, b, h, offs_m, offs_d, sqb, sqt, sqh, sqd, T, HQ, D):
    """``(q, vec, vec_ok, rho, stat)`` of the query rows ``offs_m`` of batch ``b`` and head ``h``: their tile, the
    offsets (and mask) of their ``[B, T, HQ, D]`` fp32 rows (``rho``, ``u``, ``dq``), their ``rho``, and the offsets of
    their ``[B, HQ, T]`` statistics."""
    q = load_rows(Q + b * sqb + h * sqh, offs_m, offs_d, sqt, sqd, T, D)
    vec = ((b * T + offs_m[:, None]) * HQ + h) * D + offs_d[None, :]
    vec_ok = (offs_m < T)[:, None] & (offs_d < D)[None, :]
    rho = tl.load(RHO + vec, mask=vec_ok, other=0.0)
    return q, vec, vec_ok, rho, (b * HQ + h) * T + offs_m


@triton.jit
def adjoint_sums(q, do, rho, centre, inv_omega, delta_safe, m2, Kb, Vb, sks, skd, svs, svd, offs_d, offs_dv,
                 pos0, lo, hi, S, D, DV, qk_scale2, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr, BD: tl.constexpr,
                 DPREC: tl.constexpr, MPREC: tl.constexpr):
    """Pass A over the keys ``[lo, hi)`` of a query tile: ``(omega, mt, ck, csum, gs, kk, kx)``, the forward's
    ``omega``, ``mu~`` and (direct solves) second moments, recomputed, beside ``sum_j c_ij k_j``, ``sum_j c_ij``
    and ``sum_j gamma_ij s_ij``."""
    BM: tl.constexpr = q.shape[0]
    BLOCK_D: tl.constexpr = q.shape[1]
    omega = tl.zeros((BM,), tl.float32)
    mt = tl.zeros((BM, BLOCK_D), tl.float32)
    ck = tl.zeros((BM, BLOCK_D), tl.float32)
    csum = tl.zeros((BM,), tl.float32)
    gs = tl.zeros((BM,), tl.float32)
    kk = tl.zeros((BM, BLOCK_D), tl.float32)
    kx = tl.zeros((BM, BLOCK_D // 2), tl.float32)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kt = load_cols(Kb, offs_n, offs_d, sks, skd, S, D)
        vt = load_cols(Vb, offs_n, offs_dv, svs, svd, S, DV)
        w = tile_weights(q, kt, m2, pos0, start_n, S, qk_scale2, WINDOW, DPREC)
        gamma = tl.dot(do, vt, input_precision=DPREC)
        c = gamma * w / delta_safe[:, None]
        s = w * one_minus_a(rho, kt, centre, inv_omega, delta_safe, DPREC) / delta_safe[:, None]
        k = tl.trans(kt)
        ck += split_dot(c, k, DPREC)  # in two parts as mu~: y - beta mu cancels (to 0 on a row seeing one key)
        csum += tl.sum(c, 1)
        gs += tl.sum(gamma * s, 1)
        if BD == 0:  # as in the forward: mu~ enters cancelling differences
            omega += tl.sum(w, 1)
            mt += split_dot(w, k, DPREC)
        else:
            tile_omega, mt, tile_kk, tile_kx = direct_moments(w, k, mt, BD, MPREC, DPREC)
            omega += tile_omega
            kk += tile_kk
            kx += tile_kx
    return omega, mt, ck, csum, gs, kk, kx


@triton.jit
def query_grad_sums(q, do, rho, u, beta, centre, inv_omega, delta_safe, m2, row_ok, Kb, Vb, sks, skd, svs, svd,
                    offs_d, offs_dv, pos0, lo, hi, S, D, DV, BD: tl.constexpr, BLOCK_N: tl.constexpr,
                    WINDOW: tl.constexpr, qk_scale2, DPREC: tl.constexpr, XPREC: tl.constexpr):
    """Pass B over the keys ``[lo, hi)`` of a query tile: ``(sum_j Dw_ij k_j, sum_j Dw_ij, sum_j F_ij,
    sum_j w_ij a_ij)``, the w-path of dq and, for full LLA, the row sums of its z-path; the block-diagonal
    variants' cross terms centred on the tile's mean query."""
    BM: tl.constexpr = q.shape[0]
    BLOCK_D: tl.constexpr = q.shape[1]
    q32 = q.to(tl.float32)
    hd, h1, hs = sigma_grad(rho, u, beta, BD)
    if BD > 0:
        centre_q = feature_mean(q32, row_ok[:, None], 0)
        qc = q32 - centre_q[None, :]
        lin, const = cross_rows(hd, h1, qc, swap_pairs(qc, 1), BD)
    dq = tl.zeros((BM, BLOCK_D), tl.float32)
    dwsum = tl.zeros((BM,), tl.float32)
    fsum = tl.zeros((BM,), tl.float32)
    gsum = tl.zeros((BM,), tl.float32)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kt = load_cols(Kb, offs_n, offs_d, sks, skd, S, D)
        vt = load_cols(Vb, offs_n, offs_dv, svs, svd, S, DV)
        w = tile_weights(q, kt, m2, pos0, start_n, S, qk_scale2, WINDOW, DPREC)
        gamma = tl.dot(do, vt, input_precision=DPREC)
        a = relmm_tile(rho, q32, kt, DPREC)
        om = one_minus_a(rho, kt, centre, inv_omega, delta_safe, DPREC)
        bu = relmm_tile(u, q32, kt, DPREC)
        s, dw, f, g = pair_terms(w, gamma, a, om, bu, beta, delta_safe)
        if BD > 0:
            kc, ksc = centred_keys(kt, centre_q[:, None], BD)
            quad = cross_quad(hd, h1, lin, const, kc, ksc, BD, XPREC)
            dw = gamma * s + w * (2.0 * beta[:, None] * a - bu - beta[:, None] + quad)
        dq += tl.dot(dw.to(kt.dtype), tl.trans(kt), input_precision=DPREC)
        dwsum += tl.sum(dw, 1)
        fsum += tl.sum(f, 1)
        gsum += tl.sum(g, 1)
    return dq, dwsum, fsum, gsum


@triton.jit
def lla_bwd_q_kernel(Q, K, V, LAM, DO, RHO, DELTA, M2, OMEGA, CENTRE, DQ, U, BETA, DM,
                     sqb, sqt, sqh, sqd, skb, sks, skh, skd, svb, svs, svh, svd, slb, slt, slh, sld,
                     sdb, sdt, sdh, sdd,
                     T, S, HQ, GROUPS, D, DV, scale, qk_scale2, iters, tol2, SIZE_CLASS,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                     WINDOW: tl.constexpr, BD: tl.constexpr, DPREC: tl.constexpr, MPREC: tl.constexpr,
                     XPREC: tl.constexpr, PART: tl.constexpr):
    """u, beta, dq and dm, one program per query tile: pass A (:func:`adjoint_sums`), the second solve (eq. 37),
    pass B (:func:`query_grad_sums`). ``PART`` 0: all in one launch (full LLA, whose adjoint CG needs the whole
    state); the block-diagonal variants in two launches, so that pass B's dq is not held beside pass A's sums:
    ``PART`` 1, pass A and the solve, stores ``u``, ``beta`` and dq's terms outside the key sums; ``PART`` 2, pass B,
    adds dq's key sum and stores dm."""
    # float arguments come as fp64 when torch.compile launches the kernel: keep the arithmetic fp32
    scale, qk_scale2, tol2 = tl.cast(scale, tl.float32), tl.cast(qk_scale2, tl.float32), tl.cast(tol2, tl.float32)
    start_m, b, h, hk = query_head(HQ, GROUPS, BLOCK_M)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < T
    pos0 = start_m + S - T
    Kb = K + b * skb + hk * skh
    Vb = V + b * svb + hk * svh
    q, vec, vec_ok, rho, stat = query_rows(Q, RHO, b, h, offs_m, offs_d, sqb, sqt, sqh, sqd, T, HQ, D)
    q32 = q.to(tl.float32)
    do = load_rows(DO + b * sdb + h * sdh, offs_m, offs_dv, sdt, sdd, T, DV)
    delta = tl.load(DELTA + stat, mask=row_ok, other=1.0)
    m2 = tl.load(M2 + stat, mask=row_ok, other=0.0)
    delta_safe = tl.where(delta == 0.0, 1.0, delta)  # 0 only for a query that sees no key
    inv_omega = 1.0 / tl.maximum(tl.load(OMEGA + stat, mask=row_ok, other=1.0), 1.0)  # omega >= 1 once a key is seen
    centre = tl.load(CENTRE + stat, mask=row_ok, other=0.0)
    lo, hi = query_key_tiles(start_m, T, S, BLOCK_M, BLOCK_N, WINDOW)

    if PART == 2:
        u = tl.load(U + vec, mask=vec_ok, other=0.0)
        beta = tl.load(BETA + stat, mask=row_ok, other=0.0)
    else:
        lam = load_rows(LAM + b * slb + h * slh, offs_m, offs_d, slt, sld, T, D).to(tl.float32)
        lam = tl.where(row_ok[:, None], lam, 1.0)
        omega, mt, ck, csum, gs, kk, kx = adjoint_sums(q, do, rho, centre, inv_omega, delta_safe, m2, Kb, Vb, sks,
                                                       skd, svs, svd, offs_d, offs_dv, pos0, lo, hi, S, D, DV,
                                                       qk_scale2, BLOCK_N, WINDOW, BD, DPREC, MPREC)
        beta = gs / delta_safe
        # the second solve (eq. 37) and dmu (eq. 38)
        y = ck - csum[:, None] * q32
        mu = mt - omega[:, None] * q32
        sdiag = kk - 2.0 * q32 * mt + omega[:, None] * q32 * q32 + lam
        if BD == 1:
            u = y / tl.where(sdiag == 0.0, 1.0, sdiag)
        elif BD == 2:
            u = pair_solve(y, sdiag, kx, q32, mt, omega)
        else:  # u = Sigma^-1 (y - beta mu) + beta rho: equal to Sigma^-1 y when rho = Sigma^-1 mu, and with a
            # truncated CG rho the implicit gradient at that rho (the adjoint Sigma^-1 dL/drho by CG on Sigma itself:
            # by the forward's centred scatter and Sherman-Morrison it would cancel where mu.A^-1 mu >> omega)
            u = cg_solve(y - beta[:, None] * mu, q, mt, omega, lam, smallest_ridge(lam, offs_d < D), m2, pos0,
                         Kb, sks, skd, lo, hi, S, D, offs_d, qk_scale2, iters, tol2, Kb, 0, 1, BLOCK_N, WINDOW, 1,
                         DPREC, False, False, 1) + beta[:, None] * rho
        dmu = 2.0 * beta[:, None] * rho - u
        tl.store(U + vec, u, mask=vec_ok)
        tl.store(BETA + stat, beta, mask=row_ok)
    if PART == 1:  # dq less its key sum (part 2 or the dk/dv kernel adds that, and dm):
        # -sum_j dL/dz_ij = -(omega dmu - sum_j c_ij rho + 2 (h0 mu + hs mu_swap))
        hd, _, hs = sigma_grad(rho, u, beta, BD)
        zsum = omega[:, None] * dmu - csum[:, None] * rho + 2.0 * hd * mu
        if BD == 2:
            zsum += 2.0 * hs * swap_pairs(mu, 1)
        tl.store(DQ + vec, -zsum, mask=vec_ok)
        tl.store(DM + stat, tl.zeros_like(beta), mask=row_ok)
    else:
        dq, dwsum, fsum, gsum = query_grad_sums(q, do, rho, u, beta, centre, inv_omega, delta_safe, m2, row_ok, Kb,
                                                Vb, sks, skd, svs, svd, offs_d, offs_dv, pos0, lo, hi, S, D, DV, BD,
                                                BLOCK_N, WINDOW, qk_scale2, DPREC, XPREC)
        if PART == 2:
            dq = scale * dq + tl.load(DQ + vec, mask=vec_ok, other=0.0)
        else:
            dq = scale * dq - (omega[:, None] * dmu + fsum[:, None] * rho + gsum[:, None] * u)
        tl.store(DQ + vec, dq, mask=vec_ok)
        tl.store(DM + stat, -dwsum, mask=row_ok)


@triton.jit
def lla_bwd_kv_kernel(Q, K, V, DO, RHO, U, DELTA, M2, OMEGA, CENTRE, BETA, DK, DV_OUT,
                      sqb, sqt, sqh, sqd, skb, sks, skh, skd, svb, svs, svh, svd, sdb, sdt, sdh, sdd,
                      T, S, HQ, H, GROUPS, D, DV, scale, qk_scale2, SIZE_CLASS,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                      BLOCK_DV: tl.constexpr, WINDOW: tl.constexpr, BD: tl.constexpr, DPREC: tl.constexpr):
    """dk and dv of full LLA (``BD = 0``), one program per key tile, streaming the query tiles."""
    # float arguments come as fp64 when torch.compile launches the kernel: keep the arithmetic fp32
    scale, qk_scale2 = tl.cast(scale, tl.float32), tl.cast(qk_scale2, tl.float32)
    start_n, b, hk = key_head(H, BLOCK_N)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    kt = load_cols(K + b * skb + hk * skh, offs_n, offs_d, sks, skd, S, D)
    vt = load_cols(V + b * svb + hk * svh, offs_n, offs_dv, svs, svd, S, DV)
    i_lo, i_hi = key_query_tiles(start_n, T, S, BLOCK_M, BLOCK_N, WINDOW)
    dk = tl.zeros((BLOCK_D, BLOCK_N), tl.float32)
    dv = tl.zeros((BLOCK_DV, BLOCK_N), tl.float32)
    col_ok = offs_n < S
    for g in range(GROUPS):
        h = hk * GROUPS + g
        for start_m in range(i_lo, i_hi, BLOCK_M):
            offs_m = start_m + tl.arange(0, BLOCK_M)
            row_ok = offs_m < T
            pos0 = start_m + S - T
            q, vec, vec_ok, rho, stat = query_rows(Q, RHO, b, h, offs_m, offs_d, sqb, sqt, sqh, sqd, T, HQ, D)
            q32 = q.to(tl.float32)
            do = load_rows(DO + b * sdb + h * sdh, offs_m, offs_dv, sdt, sdd, T, DV)
            u = tl.load(U + vec, mask=vec_ok, other=0.0)
            delta = tl.load(DELTA + stat, mask=row_ok, other=1.0)
            delta_safe = tl.where(delta == 0.0, 1.0, delta)
            inv_omega = 1.0 / tl.maximum(tl.load(OMEGA + stat, mask=row_ok, other=1.0), 1.0)
            centre = tl.load(CENTRE + stat, mask=row_ok, other=0.0)
            m2 = tl.load(M2 + stat, mask=row_ok, other=0.0)
            beta = tl.load(BETA + stat, mask=row_ok, other=0.0)
            w = tile_weights(q, kt, m2, pos0, start_n, S, qk_scale2, WINDOW, DPREC)
            w = tl.where(row_ok[:, None], w, 0.0)
            gamma = tl.dot(do, vt, input_precision=DPREC)
            a = relmm_tile(rho, q32, kt, DPREC)
            om = one_minus_a(rho, kt, centre, inv_omega, delta_safe, DPREC)
            bu = relmm_tile(u, q32, kt, DPREC)
            s, dw, _, _ = pair_terms(w, gamma, a, om, bu, beta, delta_safe)
            # column reductions, kept transposed ([D, BN]) so every product is a plain tl.dot
            dk += scale * tl.dot(tl.trans(q), dw.to(q.dtype), input_precision=DPREC)
            # dL/dz_ij = w_ij dmu_i + f_ij rho_i + w_ij a_ij u_i = rho_i (w_ij (2 beta_i om_ij + z_ij.u_i) - c_ij)
            # - u_i w_ij om_ij with om = 1 - a from one_minus_a: summed term by term, w dmu and w a u cancel where
            # a nears 1, and each half-precision operand's rounding came back amplified by 1 / om
            wom = w * om
            rho_coef = 2.0 * beta[:, None] * wom + w * bu - gamma * w / delta_safe[:, None]
            dk += tl.dot(tl.trans(rho.to(q.dtype)), rho_coef.to(q.dtype), input_precision=DPREC)
            dk -= tl.dot(tl.trans(u.to(q.dtype)), wom.to(q.dtype), input_precision=DPREC)
            dv += tl.dot(tl.trans(do), s.to(do.dtype), input_precision=DPREC)
    dk_ptrs = DK + ((b * S + offs_n[None, :]) * H + hk) * D + offs_d[:, None]
    tl.store(dk_ptrs, dk, mask=col_ok[None, :] & (offs_d < D)[:, None])
    dv_ptrs = DV_OUT + ((b * S + offs_n[None, :]) * H + hk) * DV + offs_dv[:, None]
    tl.store(dv_ptrs, dv, mask=col_ok[None, :] & (offs_dv < DV)[:, None])


@triton.jit
def key_offsets(b, hk, offs_n, cols, S, H, width):
    """Offsets of ``[keys, cols]`` in a contiguous ``[B, S, H, width]`` tensor (dk, dv and the centred keys'
    moments, which ``centred_key_tiles_kernel`` writes and the dk kernel reads)."""
    return ((b * S + offs_n[:, None]) * H + hk) * width + cols[None, :]


@triton.jit
def key_tile_offsets(b, hk, H, BLOCK_D: tl.constexpr):
    """Offsets of this program's key tile in ``[B * H, key tiles, BLOCK_D]`` (the tiles' mean keys)."""
    return ((b * H + hk) * tl.num_programs(0) + tl.program_id(0)) * BLOCK_D + tl.arange(0, BLOCK_D)


@triton.jit
def centred_key_tiles_kernel(K, KSQ, KX, KMEAN, skb, sks, skh, skd, S, H, D,
                             BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BD: tl.constexpr):
    """Per key tile of ``BLOCK_N``: its mean key ``c`` (``feature_mean``) and, fp32, the squares of the keys less it
    (``[B, S, H, D]``) and with 2 x 2 blocks the products of each pair's two features (``[B, S, H, BLOCK_D / 2]``):
    the second moments of :func:`cross_quad` in the dk kernel."""
    start_n, b, hk = key_head(H, BLOCK_N)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    k = load_rows(K + b * skb + hk * skh, offs_n, offs_d, sks, skd, S, D).to(tl.float32)
    key_ok = offs_n < S
    centre = feature_mean(k, key_ok[:, None], 0)
    kc = k - centre[None, :]
    tl.store(KSQ + key_offsets(b, hk, offs_n, offs_d, S, H, D), kc * kc, mask=key_ok[:, None] & (offs_d < D)[None, :])
    if BD == 2:
        first, second = tl.split(tl.reshape(kc, (BLOCK_N, BLOCK_D // 2, 2)))
        pairs = key_offsets(b, hk, offs_n, tl.arange(0, BLOCK_D // 2), S, H, BLOCK_D // 2)
        tl.store(KX + pairs, first * second, mask=key_ok[:, None])
    tl.store(KMEAN + key_tile_offsets(b, hk, H, BLOCK_D), centre)


@triton.jit
def lla_bwd_kv_blocks_kernel(Q, K, V, DO, RHO, U, DELTA, M2, OMEGA, CENTRE, BETA, KSQ, KX, KMEAN, DK, DV_OUT, DQ, DM,
                             sqb, sqt, sqh, sqd, skb, sks, skh, skd, svb, svs, svh, svd, sdb, sdt, sdh, sdd,
                             T, S, HQ, H, GROUPS, D, DV, scale, qk_scale2, SIZE_CLASS,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                             BLOCK_DV: tl.constexpr, WINDOW: tl.constexpr, BD: tl.constexpr, DPREC: tl.constexpr,
                             XPREC: tl.constexpr, PART: tl.constexpr, FUSED_DQ: tl.constexpr):
    """dk and dv of the block-diagonal variants (``BD`` 1 or 2), one program per key tile, in two launches of two
    ``[BN, BD]`` sums each. ``PART`` 1: dv and dk's terms through ``Dw`` and ``c``, which take every product of
    the tile; ``PART`` 2, added to part 1's dk: the terms of the weights alone,
    ``sum_i w_ij (2 kc_j h0_i (+ 2 ksc_j hs_i) + dmu_i - 2 (h0_i qc_i (+ hs_i qsc_i)))`` (module text).

    The ``BLOCK_N`` keys sit on the rows of every tile (``[BN, BM]``, as FlashAttention's dK/dV kernel keeps
    them), so that every product has the key tile as its rows. The second moments of :func:`cross_quad` come from
    ``centred_key_tiles_kernel`` (same ``BLOCK_N``) through memory: loaded operands stay in shared memory across
    the query loop, where operands computed here were held in registers. Its linear term ``kc.lin`` is
    ``k.lin - c.lin``, with ``lin`` in two parts against the exact keys: within the tf32 rounding of ``kc`` for
    keys up to 2^5 times farther from the centre than the tile's spread.

    With ``FUSED_DQ`` part 1 also adds each query tile's share of dq's key sum, ``scale sum_j Dw_ij k_j``, and of
    ``dm = -sum_j Dw_ij`` to ``DQ`` and ``DM`` by fp32 atomics (in any order), in place of the q kernel's pass B,
    which forms the same ``Dw`` again."""
    scale, qk_scale2 = tl.cast(scale, tl.float32), tl.cast(qk_scale2, tl.float32)
    start_n, b, hk = key_head(H, BLOCK_N)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    k = load_rows(K + b * skb + hk * skh, offs_n, offs_d, sks, skd, S, D)
    key_vec = key_offsets(b, hk, offs_n, offs_d, S, H, D)
    key_ok = (offs_n < S)[:, None] & (offs_d < D)[None, :]
    centre_k = tl.load(KMEAN + key_tile_offsets(b, hk, H, BLOCK_D))
    if PART == 1:
        v = load_rows(V + b * svb + hk * svh, offs_n, offs_dv, svs, svd, S, DV)
        ksq = tl.load(KSQ + key_vec, mask=key_ok, other=0.0)
        kx = ksq
        if BD == 2:
            pairs = key_offsets(b, hk, offs_n, tl.arange(0, BLOCK_D // 2), S, H, BLOCK_D // 2)
            kx = tl.load(KX + pairs, mask=(offs_n < S)[:, None], other=0.0)
    i_lo, i_hi = key_query_tiles(start_n, T, S, BLOCK_M, BLOCK_N, WINDOW)
    dk = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    acc = tl.zeros((BLOCK_N, BLOCK_DV if PART == 1 else BLOCK_D), tl.float32)  # dv, or sum_i w_ij h0_i
    whs = tl.zeros((BLOCK_N, BLOCK_D if BD == 2 and PART == 2 else 16), tl.float32)  # sum_i w_ij hs_i
    for g in range(GROUPS):
        h = hk * GROUPS + g
        for start_m in range(i_lo, i_hi, BLOCK_M):
            offs_m = start_m + tl.arange(0, BLOCK_M)
            row_ok = offs_m < T
            q, vec, vec_ok, rho, stat = query_rows(Q, RHO, b, h, offs_m, offs_d, sqb, sqt, sqh, sqd, T, HQ, D)
            q32 = q.to(tl.float32)
            u = tl.load(U + vec, mask=vec_ok, other=0.0)
            m2 = tl.load(M2 + stat, mask=row_ok, other=0.0)
            beta_row = tl.load(BETA + stat, mask=row_ok, other=0.0)
            w = key_rows_weights(k, q, m2, start_m + S - T, start_n, S, qk_scale2, WINDOW, DPREC)
            w = tl.where(row_ok[None, :], w, 0.0)
            hd, h1, hs = sigma_grad(rho, u, beta_row, BD)
            qc = q32 - centre_k[None, :]
            qsc = qc
            if BD == 2:
                qsc = swap_pairs(qc, 1)
            if PART == 1:
                do = load_rows(DO + b * sdb + h * sdh, offs_m, offs_dv, sdt, sdd, T, DV)
                delta = tl.load(DELTA + stat, mask=row_ok, other=1.0)
                delta_safe = tl.where(delta == 0.0, 1.0, delta)
                inv_omega = 1.0 / tl.maximum(tl.load(OMEGA + stat, mask=row_ok, other=1.0), 1.0)
                centre = tl.load(CENTRE + stat, mask=row_ok, other=0.0)
                beta = beta_row[None, :]
                gamma = tl.dot(v, tl.trans(do), input_precision=DPREC)
                krho = key_rows_products(k, rho, DPREC)
                a = krho - tl.sum(rho * q32, 1)[None, :]
                om = (delta_safe * inv_omega)[None, :] - (krho - centre[None, :])  # as one_minus_a
                bu = key_rows_products(k, u, DPREC) - tl.sum(u * q32, 1)[None, :]
                s = w * om / delta_safe[None, :]
                lin, const = cross_rows(hd, h1, qc, qsc, BD)
                quad = (tl.dot(ksq, tl.trans(hd), input_precision=XPREC) - key_rows_products(k, lin, DPREC)
                        + (tl.sum(lin * centre_k[None, :], 1) + const)[None, :])
                if BD == 2:  # sum_d h1_d kc_d kc_(d xor 1) by pairs
                    first, second = tl.split(tl.reshape(h1, (BLOCK_M, BLOCK_D // 2, 2)))
                    quad += tl.dot(kx, tl.trans(first + second), input_precision=XPREC)
                dw = gamma * s + w * (2.0 * beta * a - bu - beta + quad)
                f = -gamma * w / delta_safe[None, :]   # -c: the rho term of dL/dz
                dw_half = dw.to(q.dtype)
                dk += scale * tl.dot(dw_half, q, input_precision=DPREC)
                dk += tl.dot(f.to(q.dtype), rho.to(q.dtype), input_precision=DPREC)
                if FUSED_DQ:
                    dq = scale * tl.dot(tl.trans(dw_half), k, input_precision=DPREC)
                    tl.atomic_add(DQ + vec, dq, mask=vec_ok, sem="relaxed")
                    tl.atomic_add(DM + stat, -tl.sum(dw, 0), mask=row_ok, sem="relaxed")
                acc += tl.dot(s.to(do.dtype), do, input_precision=DPREC)
            else:  # 2 sum_i w_ij (h0_i z_ij + hs_i z_ij,swap) with z = kc - qc: the centred keys' share (acc,
                # whs), then w dmu and the centred queries' share
                acc += tl.dot(w, hd, input_precision=XPREC)
                zq = hd * qc
                if BD == 2:
                    whs += tl.dot(w, hs, input_precision=XPREC)
                    zq += hs * qsc
                dk += tl.dot(w, 2.0 * beta_row[:, None] * rho - u - 2.0 * zq, input_precision=XPREC)
    if PART == 1:
        tl.store(DK + key_vec, dk, mask=key_ok)
        dv_ok = (offs_n < S)[:, None] & (offs_dv < DV)[None, :]
        tl.store(DV_OUT + key_offsets(b, hk, offs_n, offs_dv, S, H, DV), acc, mask=dv_ok)
    else:
        kc = tl.where(key_ok, k.to(tl.float32) - centre_k[None, :], 0.0)
        dk += 2.0 * kc * acc
        if BD == 2:
            dk += 2.0 * swap_pairs(kc, 1) * whs
        dk += tl.load(DK + key_vec, mask=key_ok, other=0.0)
        tl.store(DK + key_vec, dk, mask=key_ok)


# fp16/bf16 tiles (BLOCK_M, BLOCK_N, num_warps, num_stages) beyond D = 64 that the autotuner times on a GPU,
# for full LLA (0) and the block-diagonal variants' first part (1: 1 x 1 blocks, 2: 2 x 2 blocks); the first is the
# fixed tile (AUTOTUNE off), which fits both parts.
# Full LLA: the sm_90 compile at D = 128, bf16 (stack bytes of the q and kv kernels): 1768 / 1712 at 64 x 64 on
# 8 warps, 0 / 352 at 32 x 32 on 8. The forward's spill-free 32-row tile was the slower one on the H100 (see
# forward.FORWARD_TILES), so the former tiles are timed beside these. Forward+backward (B 4, H 16, T 8192,
# D 128, bf16, cg=8, each tile alone) took 267 ms with 128 x 64 on 8 warps, whose warpgroups own 64 rows each,
# 280 with 64 x 64 on 4 warps, 316 with 64 x 64 on 8 and 511 with 32 x 32.
# Block-diagonal, the q kernel's two parts (``python -m regattn.bench.registers lla_bwd --kinds diag pairs``): the
# first holds the sums of pass A (mu~, the second moments, sum c k), the second dq alone; each spills at 64 and
# 128 rows (0.8 to 3 KB a thread) and compiles without spills at 32 x 64 on 8 warps. On the H200 at the shape
# above (bf16, as the autotuner timed them in one run), 1 x 1 blocks, part 1: 20.7 ms at 128 x 64 on 8 warps, 26.5
# at 128 x 32 on 8 and at 64 x 32 on 4, 34.1 at 32 x 64 on 8; part 2: 37.5 at 64 x 32 on 4, 43.6 at 32 x 32 on 4,
# 48.4 at 32 x 64 on 8. 2 x 2 blocks, part 1: 32.0, 34.5, 36.5, 42.5; part 2: 62.6 at 32 x 64 on 8, 65.4 at 64 x 16
# on 4, 76.9 at 32 x 32 on 4 (its 64 x 32 and 128-row tiles need more than 227 KB of shared memory). The kernel in
# one launch took 81 ms (1 x 1, 32 x 32 on 4 warps) and 131 (2 x 2, 16 x 32 on 4).
BACKWARD_TILES = {0: [(32, 32, 8, 1), (64, 64, 8, 1), (128, 64, 8, 1)],
                  1: [(32, 64, 8, 1), (128, 64, 8, 1), (128, 32, 8, 1)],
                  2: [(32, 64, 8, 1), (128, 64, 8, 1), (128, 32, 8, 1)]}
# The block-diagonal q kernel's second part (pass B: dq, run by the deterministic backward), by block size.
PASS_B_TILES = {1: [(32, 64, 8, 1), (64, 32, 4, 1), (32, 32, 4, 1)],
                2: [(32, 64, 8, 1), (64, 16, 4, 1), (32, 32, 4, 1)]}
# The block-diagonal dk/dv kernel's tiles (BLOCK_M query rows a step, BLOCK_N keys a program), one BLOCK_N for
# centred_key_tiles. 128 keys on 8 warps: its products chain (the weights enter the next products), so the
# compiler gives each warpgroup 64 of their rows; 64 keys on 8 warps had both warpgroups compute the same rows.
# On sm_90, 1 x 1 blocks, stack bytes of parts 1 / 2: 320 / 264 at 16 x 128 (key loop 46 spill loads / none),
# 792 / 160 at 32 x 128. On the H200 at the shape above the autotuner took 16 x 128 but for 1 x 1 blocks' part 2
# (32 x 128), and both parts took 54.6 ms (1 x 1) and 69.8 (2 x 2), where the kernel with 16 queries on the rows
# took 170 and 213. Adding dq by atomics (FUSED_DQ) took part 1 from 37.8 to 52.2 ms at 16 x 128 (1 x 1 blocks;
# 52.6 at 32 x 128, 57.7 at 16 x 128 on 2 stages) and the parts to 69.0 and 87.5 ms; 2 x 2 blocks' part 1 needs
# more than 227 KB of shared memory at 32 x 128 (stack 392 / 264 bytes at 16 x 128 on sm_90, 1 x 1).
BLOCKS_KV_TILES = [(16, 128, 8, 1), (32, 128, 8, 1)]
AUTOTUNE = True


def pairs_block(D: int) -> int:
    """The feature tile of the 2 x 2 blocks' dk kernel: at least 32, so that its product over the ``BLOCK_D / 2``
    pairs has the 16 terms a ``tl.dot`` needs."""
    return max(head_block(D), 32)


def centred_key_tiles(k, bd: int, block_n: int, block_d: int) -> tuple:
    """``(kc^2, pair products, mean)`` of ``centred_key_tiles_kernel`` for key tiles of ``block_n`` (the dk
    kernel's) and ``block_d`` features; the pair products are ``kc^2`` itself with 1 x 1 blocks."""
    B, S, H, D = k.shape
    ksq = torch.empty(B, S, H, D, device=k.device, dtype=torch.float32)
    kx = torch.empty(B, S, H, block_d // 2, device=k.device, dtype=torch.float32) if bd == 2 else ksq
    tiles = ceil_div(S, block_n)
    mean = torch.empty(B * H, tiles, block_d, device=k.device, dtype=torch.float32)
    centred_key_tiles_kernel[(tiles, B * H)](k, ksq, kx, mean, *k.stride(), S, H, D, BLOCK_N=block_n,
                                             BLOCK_D=block_d, BD=bd)
    return ksq, kx, mean


def backward_blocks(D: int, dtype: torch.dtype, bd: int) -> tuple[dict, dict]:
    """The fixed tiles of the q and the kv kernel. The q kernel's: 16 in the interpreter; on a GPU 32 x 32 for
    fp32 (16 x 16 with the block-diagonal variants' second moments); for fp16/bf16 at D <= 64 64 x 64 (32 x 32
    block-diagonal) on 4 warps, beyond the first of :data:`BACKWARD_TILES`. Full LLA's kv kernel takes the same;
    the block-diagonal one 16 x 16 in the interpreter and for fp32, 64 keys on 4 warps at D <= 64, beyond the
    first of :data:`BLOCKS_KV_TILES`."""
    def tile(m, n, warps, stages=1):
        return dict(BLOCK_M=m, BLOCK_N=n, num_warps=warps, num_stages=stages)
    if interpreting():
        return tile(16, 16, 1), tile(16, 16, 1)
    if dtype == torch.float32:
        size = 16 if bd else 32
        q_tile = tile(size, size, 4)
    elif D <= 64:
        size = 32 if bd else 64
        q_tile = tile(size, size, 4)
    else:
        q_tile = tile(*BACKWARD_TILES[bd][0])
    if not bd:
        return q_tile, q_tile
    if dtype == torch.float32:
        return q_tile, tile(16, 16, 4)
    return q_tile, tile(16, 64, 4) if D <= 64 else tile(*BLOCKS_KV_TILES[0])


def tuned_kernels(tiles: dict, kv_tiles: list, pass_b_tiles: dict) -> dict:
    """The q and kv kernels autotuned over each list of ``tiles`` (as :data:`BACKWARD_TILES`; the block-diagonal q
    kernel's second part over ``pass_b_tiles``, as :data:`PASS_B_TILES`), the block-diagonal kv kernel over
    ``kv_tiles`` (as :data:`BLOCKS_KV_TILES`), which share the key tile of ``centred_key_tiles``. The second parts
    add to the first's dq and dk, and the first part of the kv kernel adds to dq and dm: each timed run of them
    starts from the values it was given."""
    if len({n for _, n, _, _ in kv_tiles}) != 1:
        raise ValueError(f"kv_tiles: the block-diagonal dk tiles must share BLOCK_N, got {kv_tiles}")

    def tune(kernel, configs, key=(), restore=None, prune=None):
        return triton.autotune(tile_configs(configs), key=["D", "DV", "WINDOW", "BD", "SIZE_CLASS", *key],
                               restore_value=restore, prune_configs_by=prune)(kernel)

    def part_tiles(first, second):
        def prune(configs, named_args, **kwargs):
            listed = first if kwargs["PART"] == 1 else second
            return [c for c in configs if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages)
                    in listed]
        return first + [t for t in second if t not in first], {"early_config_prune": prune}
    tuned = {0: (tune(lla_bwd_q_kernel, tiles[0]), tune(lla_bwd_kv_kernel, tiles[0]))}
    for bd in (1, 2):
        q_tiles, prune = part_tiles(tiles[bd], pass_b_tiles[bd])
        tuned[bd] = (tune(lla_bwd_q_kernel, q_tiles, ["PART"], ["DQ"], prune),
                     tune(lla_bwd_kv_blocks_kernel, kv_tiles, ["PART", "FUSED_DQ"], ["DK", "DQ", "DM"]))
    return tuned


KV_KERNELS = {False: lla_bwd_kv_kernel, True: lla_bwd_kv_blocks_kernel}
TUNED = tuned_kernels(BACKWARD_TILES, BLOCKS_KV_TILES, PASS_B_TILES)


def adjoint_iterations(cg_iters: int, D: int) -> int:
    """The adjoint CG's budget: the forward's ``cg_iters``, doubled once it reaches ``D``.

    In exact arithmetic CG on the ``D x D`` system ends within ``D`` iterations, so such a budget asks for the
    converged solve; in fp32 the lost conjugacy delays convergence on an ill-conditioned ``Sigma``. At a row
    with ``D + 1`` keys (lam = 0.01, D 16, condition number 4e3) the adjoint needed 36 to 42 iterations where
    float64 needs 21, and its 32 left dq 4e-2 from float64. ``Sigma`` keeps the eigenvalue ``omega
    |kbar - q|^2`` that the forward's centred scatter drops, and ``y - beta mu`` lies mostly along it; the
    centred adjoint would cancel there (``omega / delta`` = 1.6e3 at that row), and a restart discards the
    Krylov space. The extra iterations run only on rows still above the tolerance (a tile skips the key
    pass once all of its rows are done); below ``D`` both solves stay truncated alike, as on the torch
    backend."""
    return 2 * cg_iters if cg_iters >= D else cg_iters


def row_max_path(dq, dk, q, k, dm, argmax, scale):
    """Add the row-maximum path: ``m_i = scale q_i.k_{j*(i)}`` receives ``dm_i`` (fp32, in place)."""
    B, T, HQ, D = q.shape
    H = k.shape[2]
    dm_t = dm.transpose(1, 2)                           # [B, T, HQ]
    idx = argmax.transpose(1, 2).long()                 # [B, T, HQ]
    kv_head = torch.arange(HQ, device=q.device) // (HQ // H)
    k_star = k.float()[torch.arange(B, device=q.device)[:, None, None], idx, kv_head[None, None, :]]
    dq += scale * dm_t[..., None] * k_star
    flat = (torch.arange(B, device=q.device)[:, None, None] * k.shape[1] + idx) * H + kv_head[None, None, :]
    dk.view(-1, D).index_add_(0, flat.reshape(-1), (scale * dm_t[..., None] * q.float()).reshape(-1, D))


def poison_hidden(dq, dk, dv, flags, window):
    """NaN (in place) in ``dq`` at the rows that see a position ``flags`` marks (``ops._common.hidden``), and in
    ``dk`` and ``dv`` at the keys those rows see: the kernels read such a position as zeros, so the gradients of
    every other row and key never depend on it."""
    rows = rows_seeing(flags, dq.shape[1], window)
    poison_rows(dq, per_query_head(rows, dq.shape[2] // dk.shape[2]))
    keys = keys_reached(rows, dk.shape[1], window)
    poison_rows(dk, keys)
    poison_rows(dv, keys)


def lla_backward(do, q, k, v, lam, rho, delta, m2, argmax, omega, centre, *, scale, window, cg_iters, cg_tol,
                 lam_grad: bool, bd: int = 0):
    """Gradients ``(dq, dk, dv, dlam)`` for full LLA (``bd = 0``) or BD-LLA with 1 x 1 (``bd = 1``) or
    2 x 2 blocks (``bd = 2``); ``dlam`` shaped like ``lam`` or None. A non-finite key or value makes NaN the dq of
    the rows that see it and the dk, dv of the keys those rows see (``poison_hidden``), and nothing else."""
    flags = hidden_flags(k, v)
    k, v = finite_copy(k), finite_copy(v)
    B, T, HQ, D = q.shape
    S, H, DV = k.shape[1], k.shape[2], v.shape[3]
    do = do.contiguous()
    lam4 = lam_tensor(lam, q)
    dq = torch.empty(B, T, HQ, D, device=q.device, dtype=torch.float32)
    u = torch.empty_like(dq)
    beta = torch.empty_like(delta)
    dm = torch.empty_like(delta)
    dk = torch.empty(B, S, H, D, device=q.device, dtype=torch.float32)
    dv = torch.empty(B, S, H, DV, device=q.device, dtype=torch.float32)
    if AUTOTUNE and not interpreting() and q.dtype != torch.float32 and D > 64:
        (q_kernel, kv_kernel), q_tile, kv_tile = TUNED[bd], {}, {}
    else:
        q_kernel, kv_kernel = lla_bwd_q_kernel, KV_KERNELS[bool(bd)]
        q_tile, kv_tile = backward_blocks(D, q.dtype, bd)
    common = dict(BLOCK_D=head_block(D), BLOCK_DV=head_block(DV), WINDOW=window or 0, BD=bd,
                  DPREC=dot_precision(q.dtype))
    fused = bool(bd) and not torch.are_deterministic_algorithms_enabled()
    for part in (1,) if fused else (1, 2) if bd else (0,):
        launch_any(
            q_kernel, lambda meta: (ceil_div(T, meta["BLOCK_M"]), B * HQ),
            q, k, v, lam4, do, rho, delta, m2, omega, centre, dq, u, beta, dm,
            *q.stride(), *k.stride(), *v.stride(), *lam4.stride(), *do.stride(),
            T, S, HQ, HQ // H, D, DV, scale, scale * LOG2E, adjoint_iterations(cg_iters, D), cg_tol ** 2,
            size_class(B * HQ * T),
            MPREC=moment_precision(q.dtype), XPREC=cross_precision(q.dtype), PART=part, **common, **q_tile)
    key_tile = kv_tile["BLOCK_N"] if kv_tile else kv_kernel.configs[0].kwargs["BLOCK_N"]
    kv_common = dict(common, BLOCK_D=pairs_block(D) if bd == 2 else head_block(D))
    centred = centred_key_tiles(k, bd, key_tile, kv_common["BLOCK_D"]) if bd else ()
    for part in (1, 2) if bd else (None,):
        launch_any(
            kv_kernel, lambda meta: (ceil_div(S, meta["BLOCK_N"]), B * H),
            q, k, v, do, rho, u, delta, m2, omega, centre, beta, *centred, dk, dv, *((dq, dm) if bd else ()),
            *q.stride(), *k.stride(), *v.stride(), *do.stride(),
            T, S, HQ, H, HQ // H, D, DV, scale, scale * LOG2E, size_class(B * HQ * T),
            **(dict(PART=part, XPREC=cross_precision(q.dtype), FUSED_DQ=fused) if bd else {}), **kv_common,
            **kv_tile)
    row_max_path(dq, dk, q, k, dm, argmax, scale)
    poison_hidden(dq, dk, dv, flags, window)
    dlam = None
    if lam_grad:
        per_dim = rho * (u - beta.transpose(1, 2)[..., None] * rho)
        dlam = per_dim if lam.dim() == 4 else per_dim.sum(-1)
    return dq, dk, dv, dlam
