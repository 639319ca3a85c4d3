"""Tile steps of the FlashLLA kernels (lla-local-linear-attention.txt eq. 12-13, Algorithm 2).

Shared by the forward, the backward and decode. Conventions (those of ``ops/_common/attention_tiles``):
logits in base 2, ``s2 = log2(e) * scale * q.k``, with the row maximum ``m2`` in base 2, so the kernel
weights are ``w = exp2(s2 - m2) = exp(scale q.k - m)``. Queries sit at key position ``pos = i + S - T``.
Solver state and every accumulator are fp32; ``tl.dot`` operands are in the input dtype.
"""
from __future__ import annotations

import triton
import triton.language as tl

from regattn.ops._common.attention_tiles import key_span, query_tile, visible_mask, visible_mask_t
from regattn.reference.lla import CURVATURE_FLOOR as REFERENCE_CURVATURE_FLOOR

CURVATURE_FLOOR = tl.constexpr(REFERENCE_CURVATURE_FLOOR)  # the reference's, as a kernel constant
FP32_EPS = tl.constexpr(2.0 ** -23)


@triton.jit
def query_head(HQ, GROUPS, BLOCK_M: tl.constexpr):
    """``(first query, batch, query head, key/value head)`` of a program of the grid ``(query tiles, B * HQ)``, the
    last tile first (LLA is causal: ``attention_tiles.query_tile``)."""
    start_m = query_tile(True) * BLOCK_M
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
def key_head(H, BLOCK_N: tl.constexpr):
    """``(first key, batch, key/value head)`` of a program of the grid ``(key tiles, B * H)``."""
    bh = tl.program_id(1)
    return tl.program_id(0) * BLOCK_N, bh // H, bh % H


@triton.jit
def key_query_tiles(start_n, T, S, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr):
    """Queries ``[lo, hi)`` whose position can see a key of the tile at ``start_n`` (``start_n <= pos < start_n +
    BLOCK_N + WINDOW - 1``), ``lo`` on a tile edge."""
    lo = tl.maximum(start_n - (S - T), 0)
    hi = T
    if WINDOW > 0:
        hi = tl.minimum(start_n + BLOCK_N - 1 + WINDOW - 1 - (S - T) + 1, T)
    return (lo // BLOCK_M) * BLOCK_M, hi


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
def partial_tile(first_pos, start_n, S, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr):
    """Whether some key of ``[start_n, start_n + BLOCK_N)`` is hidden from some query of the positions
    ``[first_pos, first_pos + BLOCK_M)`` (causal, windowed): only such tiles need the mask."""
    partial = (start_n + BLOCK_N - 1 > first_pos) | (start_n + BLOCK_N > S)
    if WINDOW > 0:
        partial = partial | (start_n <= first_pos + BLOCK_M - 1 - WINDOW)
    return partial


@triton.jit
def tile_weights(q, kt, m2, pos0, start_n, S, qk_scale2, WINDOW: tl.constexpr, DPREC: tl.constexpr):
    """Kernel weights ``w = exp2(s2 - m2)`` of one ``[BM, BN]`` tile (query rows from position ``pos0``, keys
    from ``start_n``), 0 where a key is hidden; the mask is formed only on a ``partial_tile``."""
    s2 = tl.dot(q, kt, input_precision=DPREC) * qk_scale2
    w = tl.exp2(s2 - m2[:, None])
    if partial_tile(pos0, start_n, S, q.shape[0], kt.shape[1], WINDOW):
        pos = pos0 + tl.arange(0, q.shape[0])
        offs_n = start_n + tl.arange(0, kt.shape[1])
        w = tl.where(visible_mask(pos, offs_n, S, True, WINDOW), w, 0.0)
    return w


@triton.jit
def key_rows_weights(k, q, m2, pos0, start_n, S, qk_scale2, WINDOW: tl.constexpr, DPREC: tl.constexpr):
    """The transpose of :func:`tile_weights`, ``[BN, BM]``, for kernels that keep the keys ``k [BN, BD]`` on the
    rows and stream the queries ``q [BM, BD]``."""
    s2 = tl.dot(k, tl.trans(q), input_precision=DPREC) * qk_scale2
    w = tl.exp2(s2 - m2[None, :])
    if partial_tile(pos0, start_n, S, q.shape[0], k.shape[0], WINDOW):
        pos = pos0 + tl.arange(0, q.shape[0])
        offs_n = start_n + tl.arange(0, k.shape[0])
        w = tl.where(visible_mask_t(offs_n, pos, S, True, WINDOW), w, 0.0)
    return w


@triton.jit
def split_halves(x, dtype: tl.constexpr):
    """``(hi, lo)`` in ``dtype`` with ``hi + lo ~ x`` for fp32 ``x`` (``lo`` unused for fp32, see ``halves_dot``)."""
    hi = x.to(dtype)
    return hi, (x - hi.to(tl.float32)).to(dtype)


@triton.jit
def halves_dot(hi, lo, y, DPREC: tl.constexpr):
    """``(hi + lo) @ y`` from the parts of ``split_halves``: two products for fp16/bf16 ``y``, one for fp32."""
    xy = tl.dot(hi, y, input_precision=DPREC)
    if y.dtype != tl.float32:
        xy += tl.dot(lo, y, input_precision=DPREC)
    return xy


@triton.jit
def split_dot(x, y, DPREC: tl.constexpr):
    """``x @ y`` for fp32 ``x`` and ``y`` in the input dtype; with fp16/bf16 ``y``, ``x`` is split into a high
    and a low half-precision part (two products), so later cancellations do not see a half-precision ``x``."""
    hi, lo = split_halves(x, y.dtype)
    return halves_dot(hi, lo, y, DPREC)


@triton.jit
def key_products(x, kt, DPREC: tl.constexpr):
    """``x_i.k_j`` on a tile, ``[BM, BN]`` (``x`` fp32 ``[BM, BD]``, ``kt [BD, BN]``)."""
    return split_dot(x, kt, DPREC)


@triton.jit
def key_rows_products(k, x, DPREC: tl.constexpr):
    """The transpose of :func:`key_products`, ``[BN, BM]`` for keys ``k [BN, BD]`` on the rows, with ``x`` fp32
    ``[BM, BD]`` in the same parts."""
    hi, lo = split_halves(x, k.dtype)
    xk = tl.dot(k, tl.trans(hi), input_precision=DPREC)
    if k.dtype != tl.float32:
        xk += tl.dot(k, tl.trans(lo), input_precision=DPREC)
    return xk


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
def block_columns(BLOCK_D: tl.constexpr, D, BLK: tl.constexpr, G: tl.constexpr):
    """Feature of each of the ``BLOCK_D`` kernel columns, ``D`` (masked) for padding: ``G`` column blocks of
    ``BLOCK_D // G``, block ``b`` holding features ``[b g, (b + 1) g)`` (``g = BLK``) then padding, so
    that a reshape to ``[.., G, BLOCK_D // G]`` splits the features into their BD-LLA blocks. Where the blocks
    need no padding (full LLA, ``G = 1``, or blocks as wide as their column blocks) the columns are the
    features themselves (masked from ``D`` on), and the compiler sees them contiguous: the tile loads are
    vectorised and pipelined, where the general form loads one element at a time."""
    c = tl.arange(0, BLOCK_D)
    width: tl.constexpr = BLOCK_D // G
    if G == 1 or BLK == width:
        return c
    return tl.where(c % width < BLK, (c // width) * BLK + c % width, D)


@triton.jit
def to_blocks(x, G: tl.constexpr):
    """``[R, BD] -> [G, R, BD // G]``: column block ``b`` of ``x`` as ``x3[b]``."""
    return tl.permute(tl.reshape(x, (x.shape[0], G, x.shape[1] // G)), (1, 0, 2))


@triton.jit
def from_blocks(x3):
    """``[G, R, W] -> [R, G W]``, the inverse of ``to_blocks``."""
    return tl.reshape(tl.permute(x3, (1, 0, 2)), (x3.shape[1], x3.shape[0] * x3.shape[2]))


@triton.jit
def widen(x):
    """``[G, R, W] -> [G, R, 2 W]`` with a zero after each column."""
    return tl.reshape(tl.join(x, tl.zeros_like(x)), (x.shape[0], x.shape[1], 2 * x.shape[2]))


@triton.jit
def pad_to_16(x):
    """``[G, R, W] -> [G, R, max(W, 16)]`` with zeros interleaved (``W`` a power of two): ``tl.dot`` needs a
    contraction of at least 16; both operands padded alike leave the products unchanged."""
    if x.shape[2] < 16:
        x = widen(x)
    if x.shape[2] < 16:
        x = widen(x)
    if x.shape[2] < 16:
        x = widen(x)
    if x.shape[2] < 16:
        x = widen(x)
    return x


@triton.jit
def blocked(x, G: tl.constexpr):
    """``x [R, BD]`` in the form the CG state takes: itself for ``G = 1``, else ``to_blocks``."""
    if G > 1:
        x = to_blocks(x, G)
    return x


@triton.jit
def per_row(v, G: tl.constexpr):
    """A per-row vector ``[BM]`` broadcastable against the CG state (``blocked``)."""
    if G == 1:
        out = v[:, None]
    else:
        out = v[None, :, None]
    return out


@triton.jit
def search_parts(p, dtype: tl.constexpr, G: tl.constexpr):
    """The operands ``key_scatter`` takes for the fp32 search vectors ``p`` (as ``blocked``): for ``G = 1`` a high
    and a low part in ``dtype`` (see ``split_dot``; the low part unused for fp32), for ``G > 1`` one part, its blocks
    padded to 16 columns (``pad_to_16``), twice."""
    if G == 1:
        hi, lo = split_halves(p, dtype)
    else:
        hi = pad_to_16(p.to(dtype))
        lo = hi
    return hi, lo


@triton.jit
def key_scatter(p_hi, p_lo, q, m2, pos0, K, stride_kn, stride_kd, lo, hi, S, D, feat, qk_scale2,
                BLOCK_N: tl.constexpr, WINDOW: tl.constexpr, G: tl.constexpr, DPREC: tl.constexpr):
    """``sum_j w_ij (k_j.p_i) k_j`` for a query tile in one pass over the keys ``[lo, hi)``, fp32 in the form of
    ``blocked``, from the parts of ``search_parts``: per key tile two products, for ``G > 1`` batched over the
    blocks, every inner product within each of the ``G`` feature blocks (the work of full-width products, twice
    that for the first one where blocks narrower than 16 are padded to 16)."""
    BM: tl.constexpr = q.shape[0]
    BD: tl.constexpr = q.shape[1]
    if G == 1:
        acc = tl.zeros((BM, BD), tl.float32)
    else:
        acc = tl.zeros((G, BM, BD // G), tl.float32)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kt = load_cols(K, offs_n, feat, stride_kn, stride_kd, S, D)
        w = tile_weights(q, kt, m2, pos0, start_n, S, qk_scale2, WINDOW, DPREC)
        if G == 1:  # the fp32 vector and products in two half-precision parts each (see split_dot)
            pk = halves_dot(p_hi, p_lo, kt, DPREC)
            acc += split_dot(w * pk, tl.trans(kt), DPREC)
        else:
            k3 = to_blocks(tl.trans(kt), G)  # [G, BN, g]
            pk = tl.dot(p_hi, tl.permute(pad_to_16(k3), (0, 2, 1)), input_precision=DPREC)  # [G, BM, BN]
            acc += tl.dot((w[None, :, :] * pk).to(kt.dtype), k3, input_precision=DPREC)
    return acc


@triton.jit
def system_rest(scatter, p, q, mt, omega, lam, G: tl.constexpr, CENTRED: tl.constexpr):
    """``Sigma_i p_i`` or ``A_i p_i`` (see ``system_matvec``) from ``scatter = key_scatter(p)``."""
    pm = tl.sum(p * mt, -1, keep_dims=True)
    acc = scatter
    if CENTRED:
        acc -= pm * mt / per_row(tl.where(omega > 0.0, omega, 1.0), G)
    else:
        q32 = blocked(q.to(tl.float32), G)
        pq = tl.sum(p * q32, -1, keep_dims=True)
        acc += per_row(omega, G) * pq * q32 - pq * mt - pm * q32
    return acc + lam * p


@triton.jit
def system_matvec(p, q, mt, omega, lam, m2, pos0, K, stride_kn, stride_kd, lo, hi, S, D, feat, qk_scale2,
                  BLOCK_N: tl.constexpr, WINDOW: tl.constexpr, G: tl.constexpr, DPREC: tl.constexpr,
                  CENTRED: tl.constexpr):
    """``Sigma_i p_i`` (eq. 13) or, with ``CENTRED``, ``A_i p_i`` (``reference.lla.centred_matvec``: the key scatter
    about its weighted mean plus the ridge, eq. 13 less its rank-one part) for a query tile in one pass over
    the keys, fp32, ``p``, ``mt``, ``lam`` and the result in the form of ``blocked`` (``feat``: the kernel
    columns' features, see ``block_columns``; ``pos0``: the first row's position):

    ``sum_j w_ij (k_j.p) k_j - (q.p) mu~ - (mu~.p) q + omega (q.p) q + lam p``, or with ``CENTRED``
    ``sum_j w_ij (k_j.p) k_j - (mu~.p) mu~ / omega + lam p``, every inner product within each of the ``G``
    feature blocks (BD-LLA; ``G = 1`` is full LLA; ``key_scatter`` makes the sum over the keys).
    """
    p_hi, p_lo = search_parts(p, q.dtype, G)
    scatter = key_scatter(p_hi, p_lo, q, m2, pos0, K, stride_kn, stride_kd, lo, hi, S, D, feat, qk_scale2,
                          BLOCK_N, WINDOW, G, DPREC)
    return system_rest(scatter, p, q, mt, omega, lam, G, CENTRED)


@triton.jit
def cg_start(y, PRE, pos0, pre_first, pre_blocks, D, PB: tl.constexpr, dtype: tl.constexpr, DPREC: tl.constexpr,
             PRECOND: tl.constexpr):
    """``(r, p, rr, rz)`` of CG on ``y`` (as ``blocked``) from ``x = 0``: the residual, the first search vector (the
    preconditioned residual with ``PRECOND``) and the per-row ``r.r`` and ``r.p`` (sums over the last axis)."""
    r = y
    p = r
    if PRECOND:
        p = precondition_tile(r, PRE, pos0, pre_first, pre_blocks, D, PB, dtype, DPREC)
    return r, p, tl.sum(r * r, -1, keep_dims=True), tl.sum(r * p, -1, keep_dims=True)


@triton.jit
def cg_active(rr, rz, bound):
    """The systems still iterating: residual above the bound (and > 0) and a positive ``r.z``."""
    return (rr > bound) & (rr > 0.0) & (rz > 0.0)


@triton.jit
def cg_step_size(p, sp, rz, active, curvature_floor):
    """``(alpha, active)`` of a CG step from ``sp = A p``: a system stays active only while ``p.A p > curvature_floor
    |p|^2``; inactive systems get ``alpha = 0`` (``x += alpha p``, ``r -= alpha sp`` keep them)."""
    pap = tl.sum(p * sp, -1, keep_dims=True)
    active = active & (pap > curvature_floor * tl.sum(p * p, -1, keep_dims=True))
    return tl.where(active, rz / tl.where(active, pap, 1.0), 0.0), active


@triton.jit
def cg_direction(r, p, rr, rz, active, PRE, pos0, pre_first, pre_blocks, D, PB: tl.constexpr, dtype: tl.constexpr,
                 DPREC: tl.constexpr, PRECOND: tl.constexpr):
    """``(p, rr, rz)`` after a CG step that left the residual ``r``: the next search vector and the per-row ``r.r``
    and ``r.z`` (``z`` the preconditioned residual with ``PRECOND``); inactive systems keep theirs."""
    z = r
    if PRECOND:
        z = precondition_tile(r, PRE, pos0, pre_first, pre_blocks, D, PB, dtype, DPREC)
    rz_new = tl.sum(r * z, -1, keep_dims=True)
    beta = tl.where(active, rz_new / tl.where(active, rz, 1.0), 0.0)
    p = tl.where(active, z + beta * p, p)
    rr = tl.where(active, tl.sum(r * r, -1, keep_dims=True), rr)
    rz = tl.where(active, rz_new, rz)
    return p, rr, rz


@triton.jit
def cg_solve(y, q, mt, omega, lam, lam_min, m2, pos0, K, stride_kn, stride_kd, lo, hi, S, D, feat, qk_scale2,
             iters, tol2, PRE, pre_first, pre_blocks, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr, G: tl.constexpr,
             DPREC: tl.constexpr, CENTRED: tl.constexpr, PRECOND: tl.constexpr, PB: tl.constexpr):
    """Algorithm 2: ``Sigma_i x_i = y_i``, or with ``CENTRED`` ``A_i x_i = y_i`` (see ``system_matvec``), for every
    row of the tile from ``x = 0``, fp32 ``[BM, BD]``; with
    ``G`` feature blocks (BD-LLA, columns laid out by ``block_columns``) one CG per block, exact after
    ``D / G`` iterations in exact arithmetic.

    With ``PRECOND`` (``G = 1``) preconditioned CG with the blocks' matrices at ``PRE`` (``precondition_tile``).
    A system is active while ``||r||^2 > tol2 * ||y||^2`` (and > 0) and ``p.Sigma p > CURVATURE_FLOOR *
    lam_min |p|^2`` (``Sigma, A >= lam_min I`` exactly, ``lam_min`` the smallest ridge of the row; rounding can
    break that for a nearly singular Sigma); inactive systems keep their iterate, so neither early
    convergence nor a breakdown divides by zero. A tile whose systems are all done skips the key pass.
    The state is held as ``blocked``: ``[BM, BD]`` for ``G = 1``, ``[G, BM, g]`` blocks otherwise, and the
    scalars of the recurrence once per row and block (sums over the last axis).
    """
    mt = blocked(mt, G)
    lam = blocked(lam, G)
    r, p, rr, rz = cg_start(blocked(y, G), PRE, pos0, pre_first, pre_blocks, D, PB, q.dtype, DPREC, PRECOND)
    x = tl.zeros(r.shape, dtype=tl.float32)
    bound = tol2 * rr
    curvature_floor = CURVATURE_FLOOR * per_row(lam_min, G)
    for _ in range(iters):
        active = cg_active(rr, rz, bound)
        if tl.max(tl.ravel(active.to(tl.int32)), 0) > 0:
            sp = system_matvec(p, q, mt, omega, lam, m2, pos0, K, stride_kn, stride_kd, lo, hi, S, D, feat,
                               qk_scale2, BLOCK_N, WINDOW, G, DPREC, CENTRED)
            alpha, active = cg_step_size(p, sp, rz, active, curvature_floor)
            x += alpha * p
            r -= alpha * sp
            p, rr, rz = cg_direction(r, p, rr, rz, active, PRE, pos0, pre_first, pre_blocks, D, PB, q.dtype, DPREC,
                                     PRECOND)
    if G > 1:
        x = from_blocks(x)
    return x


@triton.jit
def store_state(ptr, row0, row_ok, x):
    """Store a CG state tile ``x [BM, BD]`` at rows ``row0 + i`` of the ``[rows, BD]`` buffer ``ptr``, in ``ptr``'s
    dtype, where ``row_ok[i]``. The tile's offsets from the scalar ``ptr + row0 BD`` are constants a thread folds
    into its instructions, where offsets of every row would hold registers of their own."""
    BD: tl.constexpr = x.shape[1]
    offs = tl.arange(0, x.shape[0])[:, None] * BD + tl.arange(0, BD)[None, :]
    tl.store(ptr + row0 * BD + offs, x.to(ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def load_state(ptr, row0, row_ok, BD: tl.constexpr):
    """The tile ``store_state`` stored, in ``ptr``'s dtype (0 on rows not ``row_ok``)."""
    offs = tl.arange(0, row_ok.shape[0])[:, None] * BD + tl.arange(0, BD)[None, :]
    return tl.load(ptr + row0 * BD + offs, mask=row_ok[:, None], other=0.0)


@triton.jit
def store_row_scalars(ptr, row0, row_ok, s):
    """Store per-row CG scalars ``s [BM, 1]`` at ``ptr[row0 + i]``."""
    tl.store(ptr + row0 + tl.arange(0, row_ok.shape[0])[:, None], s, mask=row_ok[:, None])


@triton.jit
def load_row_scalars(ptr, row0, row_ok):
    """The scalars ``store_row_scalars`` stored, ``[BM, 1]`` (0 on rows not ``row_ok``)."""
    return tl.load(ptr + row0 + tl.arange(0, row_ok.shape[0])[:, None], mask=row_ok[:, None], other=0.0)


@triton.jit
def precondition_tile(r, PRE, pos0, pre_first, pre_blocks, D, PB: tl.constexpr, dtype: tl.constexpr,
                      DPREC: tl.constexpr):
    """``M_b r_i`` for every row of ``r [BM, BD]`` (fp32; rows from position ``pos0``), ``M_b`` the fp32 ``[D, D]``
    matrix at ``PRE + (b - pre_first) D^2`` of the row's block ``b = pos // PB`` (``reference.lla.key_preconditioner``,
    ``pre_blocks`` of them: rows past the last take the last, a tile across two blocks takes both). ``M_b`` is
    symmetric, so ``M_b r_i`` is the row ``r_i M_b`` (``rows_times_matrix``: about fp32 accuracy)."""
    BM: tl.constexpr = r.shape[0]
    rel = pos0 - pre_first * PB  # >= 0 (positions may be < 0 when S < T; integer division truncates)
    b0 = rel // PB
    z = rows_times_matrix(r, PRE + b0 * D * D, D, dtype, DPREC)
    b1 = tl.minimum((rel + BM - 1) // PB, pre_blocks - 1)
    if b1 != b0:
        z1 = rows_times_matrix(r, PRE + b1 * D * D, D, dtype, DPREC)
        z = tl.where((rel + tl.arange(0, BM) >= b1 * PB)[:, None], z1, z)
    return z


@triton.jit
def rows_times_matrix(r, M, D, dtype: tl.constexpr, DPREC: tl.constexpr):
    """``r @ M`` for ``r [BM, BD]`` (fp32; columns are features, ``G = 1``) and the fp32 ``[D, D]`` matrix at ``M``
    (zeros outside it), in two halves of ``M``'s rows against the two halves of ``r``'s columns (one for
    ``BD < 32``), each a ``[BM, BD / 2] x [BD / 2, BD]`` product with operands of the input ``dtype`` as the key
    loop takes them (see ``matrix_rows_product``): on sm_90 a full-width or fp32 product there put spills into
    the CG key loop (benchmarks/results/sm90-registers/lla.txt)."""
    BM: tl.constexpr = r.shape[0]
    BD: tl.constexpr = r.shape[1]
    if BD >= 32:
        first, second = tl.split(tl.permute(tl.reshape(r, (BM, 2, BD // 2)), (0, 2, 1)))
        z = matrix_rows_product(first, M, 0, D, BD, dtype, DPREC)
        z += matrix_rows_product(second, M, BD // 2, D, BD, dtype, DPREC)
    else:
        z = matrix_rows_product(r, M, 0, D, BD, dtype, DPREC)
    return z


@triton.jit
def matrix_rows_product(r, M, row0, D, BD: tl.constexpr, dtype: tl.constexpr, DPREC: tl.constexpr):
    """``r @ M[row0:row0 + W, :BD]`` for fp32 ``r [BM, W]`` (zeros outside ``D x D``), both in a high and a low part
    of ``dtype`` (three products; one for fp32): about fp32 accuracy."""
    rows = row0 + tl.arange(0, r.shape[1])
    cols = tl.arange(0, BD)
    m = tl.load(M + rows[:, None] * D + cols[None, :], mask=(rows < D)[:, None] & (cols < D)[None, :], other=0.0)
    m_hi, m_lo = split_halves(m, dtype)
    r_hi, r_lo = split_halves(r, dtype)
    z = halves_dot(r_hi, r_lo, m_hi, DPREC)
    if dtype != tl.float32:
        z += tl.dot(r_hi, m_lo, input_precision=DPREC)
    return z


@triton.jit
def centred_probe(y, mu, omega, G: tl.constexpr):
    """``(rho, delta)`` from ``y = A^-1 mu`` (``cg_solve``) by Sherman-Morrison per feature block
    (``reference.lla.probe_from_centred``): ``rho = y omega / (omega + mu.y)`` and ``delta = omega - mu.rho``,
    for full LLA ``omega^2 / (omega + mu.y)`` without cancellation. ``y, mu: [BM, BD]`` (columns as
    ``block_columns`` lays them out for ``G > 1``), ``omega: [BM]``."""
    if G == 1:
        c = tl.maximum(tl.sum(mu * y, 1), 0.0)
        factor = tl.where(omega > 0.0, omega / tl.where(omega > 0.0, omega + c, 1.0), 1.0)
        rho = y * factor[:, None]
        delta = omega * factor
    else:
        yb = to_blocks(y, G)
        c = tl.maximum(tl.sum(to_blocks(mu, G) * yb, 2), 0.0)  # [G, BM]
        om = omega[None, :]
        factor = tl.where(om > 0.0, om / tl.where(om > 0.0, om + c, 1.0), 1.0)
        rho = from_blocks(yb * factor[:, :, None])
        delta = omega - tl.sum(c * factor, 0)
    return rho, delta


@triton.jit
def moment_products(w, x32, PREC: tl.constexpr):
    """``w @ x32`` for weights ``w [BM, BN]`` and ``x32 [BN, C]`` (fp32) holding a product of two input values an
    entry. ``PREC == "parts"`` (bf16 inputs): ``w`` is the tile's weights rounded to bf16, the same ones every
    moment of the direct solves takes (``direct_moments``), and ``x32``, exactly the sum of two bf16 parts,
    enters as those parts (two products). Else fp32 ``w`` in one ``tl.dot`` in ``PREC`` (``tf32x3`` for fp16,
    ``ieee`` for fp32)."""
    if PREC == "parts":
        x_hi, x_lo = split_halves(x32, w.dtype)
        acc = tl.dot(w, x_lo)
        acc = tl.dot(w, x_hi, acc)
    else:
        acc = tl.dot(w, x32, input_precision=PREC)
    return acc


@triton.jit
def square_moments(w, k, PREC: tl.constexpr):
    """``sum_j w_ij k_jd^2`` on a tile, fp32 ``[BM, BD]`` (``k [BN, BD]`` in the input dtype; ``w`` and ``PREC`` as
    ``moment_products`` takes them): see ``direct_moments``."""
    k32 = k.to(tl.float32)
    return moment_products(w, k32 * k32, PREC)


@triton.jit
def pair_moments(w, k, PREC: tl.constexpr):
    """``sum_j w_ij k_j,2d k_j,2d+1`` on a tile, fp32 ``[BM, BD // 2]``: the cross moments of feature pairs."""
    ke, ko = pair_halves(k.to(tl.float32))
    return moment_products(w, ke * ko, PREC)


@triton.jit
def direct_moments(w, k, mt, SOLVER: tl.constexpr, PREC: tl.constexpr, DPREC: tl.constexpr):
    """A key tile's part of the direct solves' moments (``SOLVER`` 1: 1 x 1 blocks; 2: 2 x 2), from fp32 weights
    ``w [BM, BN]`` and ``k [BN, BD]``: ``(omega, mt, kk, kx)``, the tile's ``omega``, ``sum_j w_ij k_jd^2`` and
    ``sum_j w_ij k_j,2d k_j,2d+1`` (zero for 1 x 1 blocks), and the running ``mu~`` ``mt`` with the tile added.

    ``Sigma_dd`` subtracts ``2 q mu~`` and ``omega q^2`` from the second moments, and ``mu = mu~ - omega q``
    cancels too: every term is formed from the same weights, so the differences cancel alike. With ``PREC ==
    "parts"`` (bf16 inputs) those are the weights rounded to bf16, one product each (an exact regression with
    weights off by 2^-9: below the output's bf16 rounding, ``benchmarks/lla_parts.py direct``); else fp32 weights,
    ``mu~``'s in two half-precision parts (``split_dot``).

    With one product ``mu~``'s takes ``mt`` as its accumulator, and comes first: the compiler keeps a product that
    accumulates across key tiles in flight until the next wait on the tensor cores, and the second moments' products
    wait at once, before the next key tile is loaded into the shared buffer it reads. Issued last, it still read
    that buffer while the load overwrote it (``regattn.bench.registers``, column HAZARD)."""
    if PREC == "parts":
        w = w.to(k.dtype)
        omega = tl.sum(w.to(tl.float32), 1)
        mt = tl.dot(w, k, mt)
    else:
        omega = tl.sum(w, 1)
        mt += split_dot(w, k, DPREC)
    kk = square_moments(w, k, PREC)
    if SOLVER == 2:
        kx = pair_moments(w, k, PREC)
    else:
        kx = tl.zeros((w.shape[0], k.shape[1] // 2), tl.float32)
    return omega, mt, kk, kx


@triton.jit
def smallest_ridge(lam, real):
    """``min_d lam_id`` of a ridge tile ``[BM, BD]`` over the columns where ``real [BD]`` holds, ``[BM]``."""
    return tl.min(tl.where(real[None, :], lam, float("inf")), 1)


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
def swap_pairs(x, AXIS: tl.constexpr):
    """Entry ``d`` along ``AXIS`` of ``x`` (2-D) becomes entry ``d xor 1``: the partner feature of each row
    (``AXIS = 1``, ``[BM, BD]``) or of each key (``AXIS = 0``, ``[BD, BN]``)."""
    if AXIS == 0:
        pairs = tl.flip(tl.reshape(x, (x.shape[0] // 2, 2, x.shape[1])), 1)
    else:
        pairs = tl.flip(tl.reshape(x, (x.shape[0], x.shape[1] // 2, 2)), 2)
    return tl.reshape(pairs, x.shape)


@triton.jit
def pair_halves(x):
    """``(x[:, 0::2], x[:, 1::2])`` of ``x [R, BD]``: features ``2d`` and ``2d + 1``, ``[R, BD // 2]`` each."""
    return tl.split(tl.reshape(x, (x.shape[0], x.shape[1] // 2, 2)))


@triton.jit
def pair_solve(mu, sdiag, kx, q32, mt, omega):
    """BD-LLA with 2 x 2 blocks: solve ``[[a, c], [c, b]] rho = mu`` for each feature pair (2d, 2d+1), ``[BM, BD]``.

    ``sdiag`` holds ``Sigma_dd`` at column ``d``; ``c = kx - q_2d mu~_2d+1 - q_2d+1 mu~_2d + omega q_2d q_2d+1``
    from the pair moments ``kx [BM, BD // 2]`` (``pair_moments``).
    """
    q_e, q_o = pair_halves(q32)
    m_e, m_o = pair_halves(mt)
    c = kx - q_e * m_o - q_o * m_e + omega[:, None] * q_e * q_o
    mu_e, mu_o = pair_halves(mu)
    a, b = pair_halves(sdiag)
    det = a * b - c * c
    det = tl.where(det == 0.0, 1.0, det)
    rho_e = (b * mu_e - c * mu_o) / det
    rho_o = (a * mu_o - c * mu_e) / det
    return tl.reshape(tl.join(rho_e, rho_o), mu.shape)
