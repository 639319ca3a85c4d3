"""Tile steps of the FlashLLA kernels (lla-local-linear-attention.txt eq. 12-13, Algorithm 2).

Shared by the forward, the backward and decode. Conventions (those of ``ops/_common/attention_tiles``):
logits in base 2, ``s2 = log2(e) * scale * q.k``, with the row maximum ``m2`` in base 2, so the kernel
weights are ``w = exp2(s2 - m2) = exp(scale q.k - m)``. Queries sit at key position ``pos = i + S - T``.
Solver state and every accumulator are fp32; ``tl.dot`` operands are in the input dtype.
"""
from __future__ import annotations

import triton
import triton.language as tl

from regattn.ops._common.attention_tiles import key_span, visible_mask
from regattn.reference.lla import CURVATURE_FLOOR as REFERENCE_CURVATURE_FLOOR

CURVATURE_FLOOR = tl.constexpr(REFERENCE_CURVATURE_FLOOR)  # the reference's, as a kernel constant
FP32_EPS = tl.constexpr(2.0 ** -23)


@triton.jit
def query_head(HQ, GROUPS, BLOCK_M: tl.constexpr):
    """``(first query, batch, query head, key/value head)`` of a program of the grid ``(query tiles, B * HQ)``."""
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b = bh // HQ
    h = bh % HQ
    return start_m, b, h, h // GROUPS


@triton.jit
def query_key_tiles(start_m, T, S, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr):
    """Keys ``[lo, hi)`` the causal (windowed) query tile at ``start_m`` sees, ``lo`` on a tile edge."""
    lo, hi = key_span(start_m + S - T, start_m + BLOCK_M - 1 + S - T, S, True, WINDOW)
    lo = (lo // BLOCK_N) * BLOCK_N
    return lo, hi


@triton.jit
def load_rows(ptr, offs_r, offs_c, stride_r, stride_c, n_rows, n_cols):
    """``[R, C]`` tile ``ptr[offs_r, offs_c]`` (zeros outside ``n_rows x n_cols``), in the stored dtype."""
    mask = (offs_r < n_rows)[:, None] & (offs_c < n_cols)[None, :]
    return tl.load(ptr + offs_r[:, None] * stride_r + offs_c[None, :] * stride_c, mask=mask, other=0.0)


@triton.jit
def load_cols(ptr, offs_r, offs_c, stride_r, stride_c, n_rows, n_cols):
    """Transposed tile ``[C, R]`` of ``ptr[offs_r, offs_c]`` (``K^T`` for ``q @ K^T``)."""
    mask = (offs_r < n_rows)[None, :] & (offs_c < n_cols)[:, None]
    return tl.load(ptr + offs_r[None, :] * stride_r + offs_c[:, None] * stride_c, mask=mask, other=0.0)


@triton.jit
def tile_weights(q, kt, m2, pos, offs_n, S, qk_scale2, WINDOW: tl.constexpr, DPREC: tl.constexpr):
    """Kernel weights ``w = exp2(s2 - m2)`` of one ``[BM, BN]`` tile, 0 where a key is hidden."""
    s2 = tl.dot(q, kt, input_precision=DPREC) * qk_scale2
    keep = visible_mask(pos, offs_n, S, True, WINDOW)
    return tl.where(keep, tl.exp2(s2 - m2[:, None]), 0.0)


@triton.jit
def split_dot(x, y, DPREC: tl.constexpr):
    """``x @ y`` for fp32 ``x`` and ``y`` in the input dtype; with fp16/bf16 ``y``, ``x`` is split into a high
    and a low half-precision part (two products), so later cancellations do not see a half-precision ``x``."""
    xy = tl.dot(x.to(y.dtype), y, input_precision=DPREC)
    if y.dtype != tl.float32:
        lo = x - x.to(y.dtype).to(tl.float32)
        xy += tl.dot(lo.to(y.dtype), y, input_precision=DPREC)
    return xy


@triton.jit
def key_products(x, kt, DPREC: tl.constexpr):
    """``x_i.k_j`` on a tile, ``[BM, BN]`` (``x`` fp32 ``[BM, BD]``, ``kt [BD, BN]``)."""
    return split_dot(x, kt, DPREC)


@triton.jit
def relmm_tile(x, q32, kt, DPREC: tl.constexpr):
    """Eq. 12 on a tile: ``z_ij.x_i = x_i.k_j - x_i.q_i``, ``[BM, BN]`` (``x`` fp32 ``[BM, BD]``)."""
    return key_products(x, kt, DPREC) - tl.sum(x * q32, 1)[:, None]


@triton.jit
def one_minus_a(rho, kt, centre, inv_omega, delta, DPREC: tl.constexpr):
    """``1 - z_ij.rho_i`` as ``delta_i / omega_i - (k_j.rho_i - kbar_i.rho_i)`` (``centre = kbar.rho``), ``[BM, BN]``:
    the same value for every ``rho``, without the cancellation of ``1 - z.rho`` when ``z.rho`` nears 1."""
    return delta[:, None] * inv_omega[:, None] - (key_products(rho, kt, DPREC) - centre[:, None])


@triton.jit
def block_sums(a, offs_d, blk_size, G: tl.constexpr):
    """Per-column sum of ``a [BM, BD]`` over the feature block the column belongs to (``G`` blocks)."""
    if G == 1:
        out = tl.sum(a, 1)[:, None] + tl.zeros_like(a)
    else:
        blk = offs_d // blk_size
        out = tl.zeros_like(a)
        for b in tl.static_range(G):
            sel = (blk == b)[None, :]
            out += tl.where(sel, tl.sum(tl.where(sel, a, 0.0), 1)[:, None], 0.0)
    return out


@triton.jit
def sigma_matvec(p, q, q32, mt, omega, lam, m2, pos, K, stride_kn, stride_kd, lo, hi, S, D, blk_size, qk_scale2,
                 BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, WINDOW: tl.constexpr, G: tl.constexpr,
                 DPREC: tl.constexpr):
    """Eq. 13, one pass over the keys: ``Sigma_i p_i`` for a query tile, fp32 ``[BM, BD]``.

    ``sum_j w_ij (k_j.p) k_j - (q.p) mu~ - (mu~.p) q + omega (q.p) q + lam p``, every inner product
    within each of the ``G`` feature blocks (BD-LLA; ``G = 1`` is full LLA).
    """
    offs_d = tl.arange(0, BLOCK_D)
    acc = tl.zeros(p.shape, dtype=tl.float32)
    pl = p.to(q.dtype)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kt = load_cols(K, offs_n, offs_d, stride_kn, stride_kd, S, D)
        w = tile_weights(q, kt, m2, pos, offs_n, S, qk_scale2, WINDOW, DPREC)
        if G == 1:
            pk = split_dot(p, kt, DPREC)
            acc += split_dot(w * pk, tl.trans(kt), DPREC)
        else:
            blk = offs_d // blk_size
            for b in tl.static_range(G):
                sel = blk == b
                pk = tl.dot(tl.where(sel[None, :], pl, 0.0), kt, input_precision=DPREC)
                acc += tl.dot((w * pk).to(kt.dtype), tl.trans(tl.where(sel[:, None], kt, 0.0)),
                              input_precision=DPREC)
    pq = block_sums(p * q32, offs_d, blk_size, G)
    pm = block_sums(p * mt, offs_d, blk_size, G)
    return acc - pq * mt - pm * q32 + omega[:, None] * pq * q32 + lam * p


@triton.jit
def cg_solve(y, q, q32, mt, omega, lam, m2, pos, K, stride_kn, stride_kd, lo, hi, S, D, blk_size, qk_scale2,
             iters, tol2, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, WINDOW: tl.constexpr,
             G: tl.constexpr, DPREC: tl.constexpr):
    """Algorithm 2: ``Sigma_i x_i = y_i`` for every row of the tile from ``x = 0``, fp32; with ``G`` feature
    blocks (BD-LLA) one CG per block, exact after ``D / G`` iterations in exact arithmetic.

    A system is active while ``||r||^2 > tol2 * ||y||^2`` (and > 0) and ``p.Sigma p > CURVATURE_FLOOR *
    lam_min |p|^2`` (``Sigma >= lam_min I`` exactly; rounding can break that for a nearly singular Sigma);
    inactive systems keep their iterate, so neither early convergence nor a breakdown divides by zero.
    A tile whose systems are all done skips the key pass.
    """
    offs_d = tl.arange(0, BLOCK_D)
    x = tl.zeros(y.shape, dtype=tl.float32)
    r = y
    p = y
    # every scalar of the recurrence is per row and feature block, held at each of the block's columns
    rr = block_sums(r * r, offs_d, blk_size, G)
    bound = tol2 * rr
    curvature_floor = CURVATURE_FLOOR * smallest_ridge(lam, D, BLOCK_D)[:, None]
    for _ in range(iters):
        active = (rr > bound) & (rr > 0.0)
        if tl.sum(tl.sum(active.to(tl.int32), 1), 0) > 0:
            sp = sigma_matvec(p, q, q32, mt, omega, lam, m2, pos, K, stride_kn, stride_kd, lo, hi, S, D,
                              blk_size, qk_scale2, BLOCK_N, BLOCK_D, WINDOW, G, DPREC)
            pap = block_sums(p * sp, offs_d, blk_size, G)
            active = active & (pap > curvature_floor * block_sums(p * p, offs_d, blk_size, G))
            alpha = tl.where(active, rr / tl.where(active, pap, 1.0), 0.0)
            x += alpha * p
            r -= alpha * sp
            rr_new = block_sums(r * r, offs_d, blk_size, G)
            beta = tl.where(active, rr_new / tl.where(active, rr, 1.0), 0.0)
            p = tl.where(active, r + beta * p, p)
            rr = tl.where(active, rr_new, rr)
    return x


@triton.jit
def smallest_ridge(lam, D, BLOCK_D: tl.constexpr):
    """``min_d lam_id`` of a ridge tile ``[BM, BD]`` over the ``D`` real columns, ``[BM]``."""
    return tl.min(tl.where((tl.arange(0, BLOCK_D) < D)[None, :], lam, float("inf")), 1)


@triton.jit
def guarded_denominator(delta, omega, mu, lam_min, FULL: tl.constexpr):
    """``delta`` raised in magnitude, keeping its sign, to ``omega^2 lam_min / (omega lam_min + |mu|^2)``
    for full LLA (its exact lower bound) or to ``eps * omega`` for BD-LLA (see
    ``reference.lla.guarded_denominator``); 1 where ``omega = 0``."""
    seen_any = omega > 0.0
    if FULL:
        den = omega * lam_min + tl.sum(mu * mu, 1)
        floor = omega * omega * lam_min / tl.where(seen_any, den, 1.0)
    else:
        floor = FP32_EPS * omega
    guarded = tl.where(delta < 0.0, -1.0, 1.0) * tl.maximum(tl.abs(delta), floor)
    return tl.where(seen_any, guarded, 1.0)


@triton.jit
def swap_pairs(x, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """Column ``d`` of the result is column ``d xor 1`` of ``x [BM, BD]`` (the partner feature)."""
    return tl.reshape(tl.flip(tl.reshape(x, (BLOCK_M, BLOCK_D // 2, 2)), 2), (BLOCK_M, BLOCK_D))


@triton.jit
def pair_solve(mu, sdiag, soff, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """BD-LLA with 2 x 2 blocks: solve ``[[a, c], [c, b]] rho = mu`` for each feature pair (2d, 2d+1).

    ``sdiag`` holds ``Sigma_dd`` and ``soff`` holds ``Sigma_{d, d xor 1}`` at column ``d``.
    """
    mu_e, mu_o = tl.split(tl.reshape(mu, (BLOCK_M, BLOCK_D // 2, 2)))
    a, b = tl.split(tl.reshape(sdiag, (BLOCK_M, BLOCK_D // 2, 2)))
    c, _ = tl.split(tl.reshape(soff, (BLOCK_M, BLOCK_D // 2, 2)))
    det = a * b - c * c
    det = tl.where(det == 0.0, 1.0, det)
    rho_e = (b * mu_e - c * mu_o) / det
    rho_o = (a * mu_o - c * mu_e) / det
    return tl.reshape(tl.join(rho_e, rho_o), (BLOCK_M, BLOCK_D))
