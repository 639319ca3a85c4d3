"""MesaNet's chunk algebra (``regattn.ops.mesanet.api``) in Triton, with the gradients; only the Cholesky
factorisations stay torch's. One program a chunk (``[N, C, D]`` tensors: the chunks of every sequence and head,
flattened), but for the sums over chunks, one program a sequence and head.

**Sums** (:class:`ChunkSums`). Over the chunks before each chunk: ``G = lam I + sum U^T U``, ``S = sum V^T U``;
back, with the sums ``dG'``, ``dS'`` of ``dG``, ``dS`` over the chunks after: ``dU = U (dG' + dG'^T) + V dS'``,
``dV = U dS'^T``.

**Inverse factor** (:func:`lower_inverse`, :func:`inverse_factor_backward`). ``X = L^-1`` of ``A = L L^T`` (for
``G`` and ``M``), and back ``dA = sym(X^T P X)``, ``P = tril(L^T dL)`` with its diagonal halved,
``dL = -tril(X^T dX X^T)``.

**Precondition** (:class:`Precondition`). From a chunk's queries ``Q``, keys ``U`` and ``Ig`` (``G^-1 = Ig^T Ig``):

    A = Ig^T Ig,   QA = Q A,   UA = U A,   M = I + UA U^T

and back: ``dUA' = dUA + dM U``, ``dQ = dQA A``, ``dU = dM^T UA + dUA' A``, ``dA = Q^T dQA + U^T dUA'``,
``dIg = Ig (dA + dA^T)``.

**Outputs** (:class:`ChunkOutput`). With ``Im = L^-1``, ``M = L L^T``:

    W = QA U^T,   P = tril(W Im^T),   Y = P Im,   X = QA - Y UA,   R = tril(X U^T),   O = X S^T + R V

(row ``r`` of ``X`` is ``H_r^-1 q_r``). The forward keeps ``X, W, P, Y`` for the backward, which takes with ``dO``:

    dS = dO^T X,   dR = tril(dO V^T),   dV = R^T dO,   dX = dO S + dR U,   dY = -dX UA^T,   dUA = -Y^T dX,
    dZ = tril(dY Im^T),   dIm = tril(P^T dY + dZ^T W),   dW = dZ Im,   dQA = dX + dW U,   dU = dR^T X + dW^T QA

in two launches (the values' side, then the factors'; one program holding all of it spills). Only the lower
triangle of ``dIm`` is written (``Im`` is lower triangular: the gradient of its upper part is zero).

On the torch path each product is a batched cuBLAS call (fp32: its FMA kernels) with masks, sums and copies
between, and each inverse a batched triangular solve. Here the products run on the tensor cores as three TF32
products each (``tf32x3``: fp32's accuracy), operands wanted transposed are read from memory transposed, not moved
in registers, and tiles are at most 64 wide (:data:`regattn.ops.mesanet.api.KERNEL_MAX`: wider ones spill and
overflow shared memory).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from regattn.ops._common.attention_tiles import head_block, split_dot, tf32_parts
from regattn.ops._common.launch import launch
from regattn.ops._common.vmap import fold_rule

PRECISION = "tf32x3"
WARPS = 4


@triton.jit
def _load(ptr, n, R, K, BR: tl.constexpr, BK: tl.constexpr, TRANS: tl.constexpr = False):
    """Tile ``[BR, BK]`` of the ``n``-th ``[R, K]`` matrix at ``ptr`` (contiguous), zeros outside, in fp32; with
    ``TRANS``, the tile ``[BK, BR]`` of its transpose (read from memory as it lies, not moved in registers)."""
    r = tl.arange(0, BR)
    k = tl.arange(0, BK)
    if TRANS:
        offs, mask = r[None, :] * K + k[:, None], (r[None, :] < R) & (k[:, None] < K)
    else:
        offs, mask = r[:, None] * K + k[None, :], (r[:, None] < R) & (k[None, :] < K)
    return tl.load(ptr + n.to(tl.int64) * R * K + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _store(ptr, n, x, R, K, BR: tl.constexpr, BK: tl.constexpr, TRANS: tl.constexpr = False):
    """``x [BR, BK]`` into the ``n``-th ``[R, K]`` matrix at ``ptr``; with ``TRANS``, ``x [BK, BR]`` into its
    transpose."""
    ptr += n.to(tl.int64) * R * K
    r = tl.arange(0, BR)
    k = tl.arange(0, BK)
    if TRANS:
        tl.store(ptr + r[None, :] * K + k[:, None], x, mask=(r[None, :] < R) & (k[:, None] < K))
    else:
        tl.store(ptr + r[:, None] * K + k[None, :], x, mask=(r[:, None] < R) & (k[None, :] < K))


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr):
    """``a @ b`` in fp32: ``"tf32x3"`` as three TF32 products of the operands' halves (the low halves' product,
    below fp32's rounding, left out), else ``tl.dot``'s ``PRECISION``. The halves are exact TF32 values, so the
    tensor cores' truncation to TF32 changes nothing."""
    if PRECISION == "tf32x3":
        a_hi, a_lo = tf32_parts(a, False)
        b_hi, b_lo = tf32_parts(b, False)
        return split_dot(a_hi, a_lo, b_hi, b_lo)
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _sums_kernel(U, V, G, S, n_chunks, lam, C, D, DV, BC: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr,
                 PRECISION: tl.constexpr):
    """``G = lam I + sum U^T U`` and ``S = sum V^T U`` over the chunks before each chunk of one sequence and head."""
    first = tl.program_id(0) * n_chunks
    eye = tl.arange(0, BD)[:, None] == tl.arange(0, BD)[None, :]
    g = tl.where(eye, lam, 0.0)
    s = tl.zeros([BV, BD], tl.float32)
    for c in range(n_chunks):
        _store(G, first + c, g, D, D, BD, BD)
        _store(S, first + c, s, DV, D, BV, BD)
        u = _load(U, first + c, C, D, BC, BD)
        g += _dot(_load(U, first + c, C, D, BC, BD, TRANS=True), u, PRECISION)
        s += _dot(_load(V, first + c, C, DV, BC, BV, TRANS=True), u, PRECISION)


@triton.jit
def _sums_backward_kernel(U, V, DG, DS, DU, DV_, n_chunks, C, D, DV, BC: tl.constexpr, BD: tl.constexpr,
                          BV: tl.constexpr, PRECISION: tl.constexpr):
    """``dU = U (dG' + dG'^T) + V dS'``, ``dV = U dS'^T``, ``dG'``, ``dS'``: the sums of ``dG``, ``dS`` over the
    chunks after each chunk (last chunk first)."""
    first = tl.program_id(0) * n_chunks
    dg = tl.zeros([BD, BD], tl.float32)       # dG' + dG'^T
    ds = tl.zeros([BV, BD], tl.float32)
    for i in range(n_chunks):
        c = first + n_chunks - 1 - i
        u = _load(U, c, C, D, BC, BD)
        du = _dot(u, dg, PRECISION) + _dot(_load(V, c, C, DV, BC, BV), ds, PRECISION)
        _store(DU, c, du, C, D, BC, BD)
        _store(DV_, c, _dot(ds, _load(U, c, C, D, BC, BD, TRANS=True), PRECISION), C, DV, BC, BV, TRANS=True)
        dg += _load(DG, c, D, D, BD, BD) + _load(DG, c, D, D, BD, BD, TRANS=True)
        ds += _load(DS, c, DV, D, BV, BD)


@triton.jit
def _precondition_kernel(Q, U, IG, QA, UA, M, C, D, BC: tl.constexpr, BD: tl.constexpr, PRECISION: tl.constexpr):
    n = tl.program_id(0)
    a = _dot(_load(IG, n, D, D, BD, BD, TRANS=True), _load(IG, n, D, D, BD, BD), PRECISION)
    _store(QA, n, _dot(_load(Q, n, C, D, BC, BD), a, PRECISION), C, D, BC, BD)
    ua = _dot(_load(U, n, C, D, BC, BD), a, PRECISION)
    _store(UA, n, ua, C, D, BC, BD)
    eye = tl.arange(0, BC)[:, None] == tl.arange(0, BC)[None, :]
    _store(M, n, _dot(ua, _load(U, n, C, D, BC, BD, TRANS=True), PRECISION) + tl.where(eye, 1.0, 0.0), C, C, BC, BC)


@triton.jit
def _precondition_backward_kernel(Q, U, IG, DQA, DUA, DM, DQ, DU, DIG, C, D,
                                  BC: tl.constexpr, BD: tl.constexpr, PRECISION: tl.constexpr):
    n = tl.program_id(0)
    a = _dot(_load(IG, n, D, D, BD, BD, TRANS=True), _load(IG, n, D, D, BD, BD), PRECISION)
    u = _load(U, n, C, D, BC, BD)
    dua = _load(DUA, n, C, D, BC, BD) + _dot(_load(DM, n, C, C, BC, BC), u, PRECISION)
    du = _dot(_load(DM, n, C, C, BC, BC, TRANS=True), _dot(u, a, PRECISION), PRECISION)
    _store(DU, n, du + _dot(dua, a, PRECISION), C, D, BC, BD)
    da = _dot(_load(U, n, C, D, BC, BD, TRANS=True), dua, PRECISION)
    dqa = _load(DQA, n, C, D, BC, BD)
    _store(DQ, n, _dot(dqa, a, PRECISION), C, D, BC, BD)
    da += _dot(_load(Q, n, C, D, BC, BD, TRANS=True), dqa, PRECISION)
    _store(DIG, n, _dot(_load(IG, n, D, D, BD, BD), da + tl.trans(da), PRECISION), D, D, BD, BD)


@triton.jit
def _lower(BC: tl.constexpr):
    return tl.arange(0, BC)[:, None] >= tl.arange(0, BC)[None, :]


@triton.jit
def _lower_inverse_kernel(L, X, K, BK: tl.constexpr, NB: tl.constexpr, PRECISION: tl.constexpr):
    """``X = L^-1`` of the ``n``-th lower triangular ``[K, K]`` matrix by blocks of 16: the diagonal blocks'
    inverses by substitution (all ``NB`` at once, a row at a time), then each block row below the first as
    ``X_i = D_i - D_i^-1 L_{i,<i} X_{<i}`` (``D_i``: the row's diagonal block inverse in its place), the rows
    above read back from ``X``. Rows and columns past ``K`` are the identity's."""
    n = tl.program_id(0)
    base = n.to(tl.int64) * K * K
    b = tl.arange(0, NB)[:, None, None]
    i = tl.arange(0, 16)[None, :, None]
    j = tl.arange(0, 16)[None, None, :]
    r, c = b * 16 + i, b * 16 + j
    blocks = tl.load(L + base + r * K + c, mask=(r < K) & (c < K), other=0.0).to(tl.float32)
    blocks = tl.where((r >= K) & (i == j), 1.0, blocks)
    inv = tl.zeros([NB, 16, 16], tl.float32)
    for row in tl.static_range(16):
        lrow = tl.sum(tl.where(i == row, blocks, 0.0), 1)                      # [NB, 16]: row `row` of each block
        diag = tl.sum(tl.where(tl.arange(0, 16)[None, :] == row, lrow, 0.0), 1)
        acc = tl.sum(lrow[:, :, None] * inv, 1)
        new = (tl.where(tl.arange(0, 16)[None, :] == row, 1.0, 0.0) - acc) / diag[:, None]
        inv = tl.where(i == row, new[:, None, :], inv)
    same = tl.arange(0, NB)[:, None, None, None] == tl.arange(0, NB)[None, None, :, None]
    x = tl.reshape(tl.where(same, inv[:, :, None, :], 0.0), [BK, BK])       # block diagonal
    _store(X, n, x, K, K, BK, BK)
    rows = tl.arange(0, 16)[:, None]
    cols = tl.arange(0, BK)[None, :]
    for blk in tl.static_range(1, NB):
        tl.debug_barrier()
        above = _load(X, n, K, K, BK, BK)
        above = tl.where(tl.arange(0, BK)[:, None] < blk * 16, above, 0.0)
        rr = blk * 16 + rows
        lrow = tl.load(L + base + rr * K + cols, mask=(rr < K) & (cols < blk * 16), other=0.0).to(tl.float32)
        slot = tl.load(X + base + rr * K + cols, mask=(rr < K) & (cols < K), other=0.0)
        dinv = tl.load(X + base + rr * K + blk * 16 + tl.arange(0, 16)[None, :],
                       mask=(rr < K) & (blk * 16 + tl.arange(0, 16)[None, :] < K), other=0.0)
        xrow = slot - _dot(dinv, _dot(lrow, above, PRECISION), PRECISION)
        tl.store(X + base + rr * K + cols, xrow, mask=(rr < K) & (cols < K))


@triton.jit
def _inverse_factor_backward_kernel(L, X, GX, GA, K, BK: tl.constexpr, PRECISION: tl.constexpr):
    """``dA`` of ``X = L^-1``, ``A = L L^T`` from ``dX``: ``dL = -tril(X^T dX X^T)``, ``P = tril(L^T dL)`` with
    its diagonal halved, ``dA = X^T P X`` symmetrised."""
    n = tl.program_id(0)
    lower = _lower(BK)
    xt = _load(X, n, K, K, BK, BK, TRANS=True)
    gl = -tl.where(lower, _dot(_dot(xt, _load(GX, n, K, K, BK, BK), PRECISION), xt, PRECISION), 0.0)
    p = tl.where(lower, _dot(_load(L, n, K, K, BK, BK, TRANS=True), gl, PRECISION), 0.0)
    p = tl.where(tl.arange(0, BK)[:, None] == tl.arange(0, BK)[None, :], 0.5 * p, p)
    ga = _dot(_dot(xt, p, PRECISION), _load(X, n, K, K, BK, BK), PRECISION)
    _store(GA, n, 0.5 * (ga + tl.trans(ga)), K, K, BK, BK)


@triton.jit
def _forward_kernel(QA, UA, U, V, S, IM, O, X, W, P, Y, C, D, DV,
                    BC: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr, PRECISION: tl.constexpr):
    """``O`` and, for the backward, ``X, W, P, Y`` of one chunk (program ``n``)."""
    n = tl.program_id(0)
    lower = _lower(BC)
    qa = _load(QA, n, C, D, BC, BD)
    ut = _load(U, n, C, D, BC, BD, TRANS=True)
    w = _dot(qa, ut, PRECISION)
    _store(W, n, w, C, C, BC, BC)
    p = tl.where(lower, _dot(w, _load(IM, n, C, C, BC, BC, TRANS=True), PRECISION), 0.0)
    _store(P, n, p, C, C, BC, BC)
    y = _dot(p, _load(IM, n, C, C, BC, BC), PRECISION)
    _store(Y, n, y, C, C, BC, BC)
    x = qa - _dot(y, _load(UA, n, C, D, BC, BD), PRECISION)
    _store(X, n, x, C, D, BC, BD)
    r = tl.where(lower, _dot(x, ut, PRECISION), 0.0)
    o = _dot(x, _load(S, n, DV, D, BV, BD, TRANS=True), PRECISION)
    o += _dot(r, _load(V, n, C, DV, BC, BV), PRECISION)
    _store(O, n, o, C, DV, BC, BV)


@triton.jit
def _backward_values_kernel(U, V, S, X, DO, DX, DU, DV_, DS, C, D, DV,
                            BC: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr, PRECISION: tl.constexpr):
    """The gradients through ``O = X S^T + R V``: ``dS``, ``dV``, ``dX`` and ``dR^T X`` (``dU``'s first term)."""
    n = tl.program_id(0)
    upper = tl.arange(0, BC)[:, None] <= tl.arange(0, BC)[None, :]
    x = _load(X, n, C, D, BC, BD)
    dot_ = _load(DO, n, C, DV, BC, BV, TRANS=True)
    _store(DS, n, _dot(dot_, x, PRECISION), DV, D, BV, BD)
    rt = tl.where(upper, _dot(_load(U, n, C, D, BC, BD), _load(X, n, C, D, BC, BD, TRANS=True), PRECISION), 0.0)
    do = _load(DO, n, C, DV, BC, BV)
    _store(DV_, n, _dot(rt, do, PRECISION), C, DV, BC, BV)
    drt = tl.where(upper, _dot(_load(V, n, C, DV, BC, BV), dot_, PRECISION), 0.0)
    _store(DU, n, _dot(drt, x, PRECISION), C, D, BC, BD)
    dx = _dot(do, _load(S, n, DV, D, BV, BD), PRECISION)
    dx += _dot(tl.trans(drt), _load(U, n, C, D, BC, BD), PRECISION)
    _store(DX, n, dx, C, D, BC, BD)


@triton.jit
def _backward_factors_kernel(QA, UA, U, IM, W, P, Y, DX, DQA, DUA, DU, DIM, C, D,
                             BC: tl.constexpr, BD: tl.constexpr, PRECISION: tl.constexpr):
    """The gradients through ``X = QA - P Im UA``, ``P = tril(QA U^T Im^T)``: ``dQA`` (``DQA``), ``dUA``, ``dIm``,
    and ``dW^T QA`` added to ``dU``."""
    n = tl.program_id(0)
    lower = _lower(BC)
    dx = _load(DX, n, C, D, BC, BD)
    _store(DUA, n, -_dot(_load(Y, n, C, C, BC, BC, TRANS=True), dx, PRECISION), C, D, BC, BD)
    dy = -_dot(dx, _load(UA, n, C, D, BC, BD, TRANS=True), PRECISION)
    dz = tl.where(lower, _dot(dy, _load(IM, n, C, C, BC, BC, TRANS=True), PRECISION), 0.0)
    dim = _dot(_load(P, n, C, C, BC, BC, TRANS=True), dy, PRECISION)
    dim += _dot(tl.trans(dz), _load(W, n, C, C, BC, BC), PRECISION)
    _store(DIM, n, tl.where(lower, dim, 0.0), C, C, BC, BC)
    dw = _dot(dz, _load(IM, n, C, C, BC, BC), PRECISION)
    du = _load(DU, n, C, D, BC, BD) + _dot(tl.trans(dw), _load(QA, n, C, D, BC, BD), PRECISION)
    _store(DU, n, du, C, D, BC, BD)
    _store(DQA, n, _load(DX, n, C, D, BC, BD) + _dot(dw, _load(U, n, C, D, BC, BD), PRECISION), C, D, BC, BD)


def _blocks(C: int, D: int, DV: int | None = None) -> dict:
    """Power-of-two tile sizes of at least 16 (``tl.dot``'s least): ``BC``, ``BD`` (and ``BV`` for ``DV``)."""
    sizes = dict(BC=C, BD=D) if DV is None else dict(BC=C, BD=D, BV=DV)
    return {key: head_block(size) for key, size in sizes.items()}


def sums_forward(u, v, lam: float, n_chunks: int, precision: str = PRECISION) -> tuple:
    """``(G [N, D, D], S [N, Dv, D])`` (fp32) of ``u [N, C, D]``, ``v [N, C, Dv]`` (contiguous fp32), ``N`` a
    whole number of sequences of ``n_chunks`` chunks."""
    N, C, D = u.shape
    DV = v.shape[-1]
    g = torch.empty(N, D, D, device=u.device, dtype=torch.float32)
    s = torch.empty(N, DV, D, device=u.device, dtype=torch.float32)
    if N:
        launch(_sums_kernel, (N // n_chunks,), u, v, g, s, n_chunks, lam, C, D, DV, **_blocks(C, D, DV),
               PRECISION=precision, num_warps=WARPS)
    return g, s


def sums_backward(u, v, dg, ds, n_chunks: int, precision: str = PRECISION) -> tuple:
    """``(dU, dV)`` of :func:`sums_forward` (gradients contiguous fp32)."""
    N, C, D = u.shape
    DV = v.shape[-1]
    du, dv = torch.empty_like(u), torch.empty_like(v)
    if N:
        launch(_sums_backward_kernel, (N // n_chunks,), u, v, dg, ds, du, dv, n_chunks, C, D, DV,
               **_blocks(C, D, DV), PRECISION=precision, num_warps=WARPS)
    return du, dv


def precondition_forward(q, u, ig, precision: str = PRECISION) -> tuple:
    """``(QA, UA, M)`` (fp32) from ``q, u [N, C, D]`` and ``ig [N, D, D]`` (contiguous fp32)."""
    N, C, D = q.shape
    qa, ua = torch.empty_like(q), torch.empty_like(u)
    m = torch.empty(N, C, C, device=q.device, dtype=torch.float32)
    if N:
        launch(_precondition_kernel, (N,), q, u, ig, qa, ua, m, C, D, **_blocks(C, D), PRECISION=precision,
               num_warps=WARPS)
    return qa, ua, m


def precondition_backward(q, u, ig, dqa, dua, dm, precision: str = PRECISION) -> tuple:
    """``(dQ, dU, dIg)`` of :func:`precondition_forward` (gradients contiguous fp32)."""
    N, C, D = q.shape
    dq, du, dig = torch.empty_like(q), torch.empty_like(u), torch.empty_like(ig)
    if N:
        launch(_precondition_backward_kernel, (N,), q, u, ig, dqa, dua, dm, dq, du, dig, C, D, **_blocks(C, D),
               PRECISION=precision, num_warps=WARPS)
    return dq, du, dig


def lower_inverse(L: torch.Tensor, precision: str = PRECISION) -> torch.Tensor:
    """``L^-1`` of lower triangular ``L [N, K, K]`` (contiguous fp32), one program a matrix."""
    N, K, _ = L.shape
    X = torch.empty_like(L)
    if N:
        BK = head_block(K)
        launch(_lower_inverse_kernel, (N,), L, X, K, BK=BK, NB=BK // 16, PRECISION=precision, num_warps=WARPS)
    return X


def inverse_factor_backward(L, X, gX, precision: str = PRECISION) -> torch.Tensor:
    """``dA [N, K, K]`` of ``X = L^-1``, ``A = L L^T`` for ``gX`` (all ``[N, K, K]``, contiguous fp32)."""
    N, K, _ = L.shape
    gA = torch.empty_like(gX)
    if N:
        launch(_inverse_factor_backward_kernel, (N,), L, X, gX, gA, K, BK=head_block(K),
               PRECISION=precision, num_warps=WARPS)
    return gA


def chunk_output_forward(qa, ua, u, v, s, im, precision: str = PRECISION) -> tuple:
    """``(O [N, C, Dv], X, W, P, Y)`` (fp32; the last four for the backward) from ``qa, ua, u [N, C, D]``,
    ``v [N, C, Dv]``, ``s [N, Dv, D]``, ``im [N, C, C]`` (contiguous fp32)."""
    N, C, D = qa.shape
    DV = v.shape[-1]
    o = torch.empty(N, C, DV, device=qa.device, dtype=torch.float32)
    x = torch.empty_like(qa)
    w, p, y = (torch.empty_like(im) for _ in range(3))
    if N:
        launch(_forward_kernel, (N,), qa, ua, u, v, s, im, o, x, w, p, y, C, D, DV, **_blocks(C, D, DV),
               PRECISION=precision, num_warps=WARPS)
    return o, x, w, p, y


def chunk_output_backward(qa, ua, u, v, s, im, x, w, p, y, do, precision: str = PRECISION) -> tuple:
    """``(dQA, dUA, dU, dV, dS, dIm)`` of :func:`chunk_output_forward` for ``do [N, C, Dv]`` (contiguous fp32),
    in two launches: the values' side, then the factors'."""
    N, C, D = qa.shape
    DV = v.shape[-1]
    dx, dqa, dua, du, dv, ds, dim = (torch.empty_like(t) for t in (qa, qa, ua, u, v, s, im))
    if N:
        launch(_backward_values_kernel, (N,), u, v, s, x, do, dx, du, dv, ds, C, D, DV, **_blocks(C, D, DV),
               PRECISION=precision, num_warps=WARPS)
        launch(_backward_factors_kernel, (N,), qa, ua, u, im, w, p, y, dx, dqa, dua, du, dim, C, D, **_blocks(C, D),
               PRECISION=precision, num_warps=WARPS)
    return dqa, dua, du, dv, ds, dim


class ChunkSums(torch.autograd.Function):
    """:func:`sums_forward` with its gradients (``u``, ``v``); inputs contiguous fp32 ``[N, ...]``."""

    @staticmethod
    def forward(u, v, lam, n_chunks):
        return sums_forward(u, v, lam, n_chunks)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs[:2])
        ctx.n_chunks = inputs[3]

    @staticmethod
    def backward(ctx, dg, ds):
        return *sums_backward(*ctx.saved_tensors, dg.contiguous(), ds.contiguous(), ctx.n_chunks), None, None

    vmap = staticmethod(fold_rule(lambda *a: ChunkSums.apply(*a), batched=(0, 1), outputs=(0, 0)))


class Precondition(torch.autograd.Function):
    """:func:`precondition_forward` with its gradients; inputs contiguous fp32 ``[N, ...]``."""

    @staticmethod
    def forward(q, u, ig):
        return precondition_forward(q, u, ig)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, dqa, dua, dm):
        return precondition_backward(*ctx.saved_tensors, *(g.contiguous() for g in (dqa, dua, dm)))

    vmap = staticmethod(fold_rule(lambda *a: Precondition.apply(*a), batched=range(3), outputs=(0,) * 3))


class ChunkOutput(torch.autograd.Function):
    """:func:`chunk_output_forward`'s ``O`` with its gradients (all six inputs); inputs contiguous fp32
    ``[N, ...]``."""

    @staticmethod
    def forward(qa, ua, u, v, s, im):
        return chunk_output_forward(qa, ua, u, v, s, im)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs, *output[1:])
        ctx.mark_non_differentiable(*output[1:])

    @staticmethod
    def backward(ctx, do, *_):
        return chunk_output_backward(*ctx.saved_tensors, do.contiguous())

    vmap = staticmethod(fold_rule(lambda *a: ChunkOutput.apply(*a), batched=range(6), outputs=(0,) * 5))
