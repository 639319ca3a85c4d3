"""Local Linear Attention (lla-local-linear-attention.txt eq. 6-16, Algorithm 2, Appendix E.1) in plain PyTorch.

Two formulations of the same function:

* the explicit one (eq. 7-8): centred differences ``z_ij = k_j - q_i``, the statistics
  ``omega_i, mu_i, Sigma_i`` materialised per query and ``rho_i = Sigma_i^-1 mu_i`` by an exact
  solve (``cg_iters=None``; :func:`solve_or_zero`);
* the matrix-free one (eq. 10-16): uncentred sums, conjugate gradients with an active mask
  (Algorithm 2) on the key scatter about its weighted mean (:func:`centred_matvec`, eq. 13 without the
  rank-one term that Sherman-Morrison restores: see :func:`probe_from_centred`), the output through the
  products ``k_j.rho_i`` (eq. 12's relmm, taken about the weighted mean key rather than the query: see
  :func:`lla_output`).

Weights are ``w_ij = exp(scale * q_i.k_j - m_i)`` with ``m_i`` the row maximum over visible keys,
so the largest weight of every row is 1 and the ridge ``lam`` is measured against it.
Low-precision inputs are computed in float32 and returned in their own dtype.
"""
from __future__ import annotations

from functools import partial
from typing import NamedTuple

import torch

from regattn.reference.common import contained_matmul, contained_scores, repeat_kv, visible


class LLAStatistics(NamedTuple):
    """Per-query statistics of eq. 7, heads-first: ``w [B, HQ, T, S]``, ``omega [B, HQ, T]``,
    ``mu [B, HQ, T, D]``, ``Sigma [B, HQ, T, D, D]`` (ridge and block structure included)."""
    w: torch.Tensor
    omega: torch.Tensor
    mu: torch.Tensor
    Sigma: torch.Tensor


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """float64 stays float64; every other dtype computes in float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def heads_first(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """``[B, T, H, D] -> [B, HQ, T, D]`` (key/value heads repeated for GQA)."""
    return repeat_kv(x, num_heads).transpose(1, 2)


def seen_pairs(q, k, window=None) -> torch.Tensor:
    """Boolean ``[T, S]``: the keys each query sees (causal, queries aligned to the end of the keys)."""
    return visible(q.shape[1], k.shape[1], causal=True, window=window, device=q.device)


def lla_weights(q, k, *, scale, window=None):
    """Kernel weights ``w_ij = exp(scale q_i.k_j - m_i)`` over visible keys, 0 elsewhere.

    Args: q ``[B, T, HQ, D]``, k ``[B, S, H, D]``. Returns ``(w [B, HQ, T, S], m [B, HQ, T])``;
    ``m`` is 0 for a query that sees no key. Gradients flow through the row maximum too.
    """
    HQ = q.shape[2]
    s = contained_scores(q.transpose(1, 2), heads_first(k, HQ)) * scale
    s = s.masked_fill(~seen_pairs(q, k, window), float("-inf"))
    m = s.amax(dim=-1)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    return torch.exp(s - m[..., None]), m


def ridge(lam, shape, *, dtype, device) -> torch.Tensor:
    """The ridge as a diagonal ``[B, HQ, T, D]`` from a float, ``[B, T, HQ]`` or ``[B, T, HQ, D]``.

    ``shape = (B, HQ, T, D)``.
    """
    B, HQ, T, D = shape
    if not isinstance(lam, torch.Tensor):
        return torch.full(shape, float(lam), dtype=dtype, device=device)
    lam = lam.to(dtype)
    if lam.dim() == 3:
        lam = lam[..., None]
    return lam.transpose(1, 2).expand(B, HQ, T, D)


def block_mask(D: int, blocks, *, dtype, device) -> torch.Tensor:
    """``[D, D]`` 0/1 mask of ``blocks`` diagonal blocks of size ``D / blocks`` (all ones when None)."""
    if blocks is None:
        return torch.ones(D, D, dtype=dtype, device=device)
    idx = torch.arange(D, device=device) // (D // blocks)
    return (idx[:, None] == idx[None, :]).to(dtype)


def lla_statistics(q, k, *, lam, scale, window=None, blocks=None) -> LLAStatistics:
    """Eq. 7 from the definition: ``z_ij = k_j - q_i`` materialised, ``[B, HQ, T, S, D]``.

    ``Sigma_i = blockdiag_g(sum_j w_ij z_ij z_ij^T) + diag(lam_i)``; BD-LLA keeps only the
    ``g = blocks`` diagonal blocks of the weighted scatter (Appendix E.1).
    """
    B, T, HQ, D = q.shape
    w, _ = lla_weights(q, k, scale=scale, window=window)
    z = heads_first(k, HQ)[:, :, None, :, :] - q.transpose(1, 2)[:, :, :, None, :]
    z = torch.where(seen_pairs(q, k, window)[..., None], z, z.new_zeros(()))  # hidden keys stay out
    omega = w.sum(-1)
    mu = torch.einsum("bhts,bhtsd->bhtd", w, z)
    scatter = torch.einsum("bhts,bhtsd,bhtse->bhtde", w, z, z)
    scatter = scatter * block_mask(D, blocks, dtype=q.dtype, device=q.device)
    lam_diag = ridge(lam, (B, HQ, T, D), dtype=q.dtype, device=q.device)
    return LLAStatistics(w, omega, mu, scatter + torch.diag_embed(lam_diag))


def lla_probe(stats: LLAStatistics) -> torch.Tensor:
    """``rho_i = Sigma_i^-1 mu_i``, ``[B, HQ, T, D]``, by an exact solve (:func:`solve_or_zero`)."""
    return solve_or_zero(stats.Sigma, stats.mu)


def solve_or_zero(A, y) -> torch.Tensor:
    """``A^-1 y`` for every ``A [..., D, D]``, ``y [..., D]``; a system singular in the working precision
    (the ridge lost against ``|z|^2`` in fp32) gets 0, so its row falls back to the kernel-weighted mean of
    the values, and neither the result nor its gradient sees the failed solve's inf or NaN."""
    dtype = torch.promote_types(A.dtype, y.dtype)  # autocast may leave them apart
    A, y = A.to(dtype), y.to(dtype)
    with torch.no_grad():
        x, info = torch.linalg.solve_ex(A, y[..., None])
        bad = (info != 0) | ~torch.isfinite(x[..., 0]).all(-1)
    eye = torch.eye(A.shape[-1], dtype=A.dtype, device=A.device)
    A = torch.where(bad[..., None, None], eye, A)
    y = torch.where(bad[..., None], torch.zeros_like(y), y)
    return torch.linalg.solve_ex(A, y[..., None])[0][..., 0]  # no error check: a host read, and none fails


def guarded_denominator(delta, omega, mu, lam_min, blocks) -> torch.Tensor:
    """The denominator ``delta_i = omega_i - mu_i.rho_i`` of eq. 8 kept away from zero with its sign, ``[B, HQ, T]``.

    For full LLA ``delta_i = omega_i^2 / (omega_i + mu_i.A_i^-1 mu_i)`` with ``A_i`` the key scatter about
    its weighted mean plus the ridge, so ``delta_i >= omega_i^2 lam_min / (omega_i lam_min + |mu_i|^2)`` in
    exact arithmetic: a rounded ``delta`` below that (cancellation when ``lam`` is small against ``|z|^2``)
    is raised to it. BD-LLA's ``delta`` may cross zero (each block adds up to ``omega``); its magnitude is
    kept at ``eps * omega`` at least. A query that sees no key (``omega = 0``) gets 1.
    """
    seen_any = omega > 0
    if blocks is None or blocks == 1:
        den = omega * lam_min + (mu * mu).sum(-1)
        floor = omega * omega * lam_min / torch.where(seen_any, den, torch.ones_like(den))
    else:
        floor = torch.finfo(delta.dtype).eps * omega
    sign = torch.where(delta < 0, -torch.ones_like(delta), torch.ones_like(delta))
    guarded = sign * torch.maximum(delta.abs(), floor)
    return torch.where(seen_any, guarded, torch.ones_like(delta))


def lla_output(w, omega, mu, rho, k, v, seen, lam_min, blocks=None) -> torch.Tensor:
    """Eq. 8 / 16: ``o_i = sum_j w_ij (1 - z_ij.rho_i) v_j / delta_i`` with ``delta_i = omega_i - mu_i.rho_i``.

    Heads-first ``w [B, HQ, T, S]``, ``omega [B, HQ, T]``, ``mu, rho [B, HQ, T, D]``, ``lam_min [B, HQ, T]``
    (the smallest ridge), ``blocks`` (BD-LLA's g or None), ``k [B, HQ, S, D]``, ``v [B, HQ, S, Dv]``,
    ``seen [T, S]``; returns ``[B, T, HQ, Dv]``. Computed as ``w_ij (1 / omega_i - (k_j - kbar_i).rho_i / delta_i)``
    with ``kbar_i = sum_j w_ij k_j / omega_i`` (the same for every ``rho``, since ``1 - z_ij.rho_i =
    delta_i / omega_i - (k_j - kbar_i).rho_i``), and ``kbar_i.rho_i`` as the weighted mean of the products
    ``k_j.rho_i`` themselves (so a row with one-hot weights gets exactly its top value): the weighted mean
    of the values never passes through ``delta``, which cancels when ``lam`` is small against
    ``|z|^2`` and is kept away from zero (:func:`guarded_denominator`). A query that sees no key
    (``omega = 0``) gets zeros; a hidden key or value never reaches a row.
    """
    seen_any = omega > 0
    omega_safe = torch.where(seen_any, omega, torch.ones_like(omega))
    kr = torch.where(seen, contained_scores(rho, k), w.new_zeros(()))  # no 0 * NaN in the product or its gradient
    spread = kr - (w * kr).sum(-1, keepdim=True) / omega_safe[..., None]  # (k_j - kbar_i).rho_i
    delta = guarded_denominator(omega - (mu * rho).sum(-1), omega, mu, lam_min, blocks)
    scores = w * (1 / omega_safe[..., None] - spread / delta[..., None])
    return contained_matmul(scores, v, seen).transpose(1, 2)


def sigma_matvec(p, q, k, w, omega, mu_tilde, lam_diag, blocks, seen=None) -> torch.Tensor:
    """Eq. 13 without materialising ``Sigma_i``: ``Sigma_i p_i`` for every query, ``[B, HQ, T, D]``.

    ``p, q, mu_tilde (= sum_j w_ij k_j), lam_diag: [B, HQ, T, D]``, ``k: [B, HQ, S, D]``,
    ``w: [B, HQ, T, S]``, ``omega: [B, HQ, T]``. With ``blocks = g`` every inner product runs
    within each of the g feature blocks (BD-LLA). ``seen [T, S]`` (default: where ``w`` is nonzero)
    keeps hidden keys out.
    """
    B, HQ, T, D = p.shape
    pb, qb, mb = split_blocks(p, blocks), split_blocks(q, blocks), split_blocks(mu_tilde, blocks)
    qp = (qb * pb).sum(-1, keepdim=True)
    mp = (mb * pb).sum(-1, keepdim=True)
    out = scatter_matvec(p, k, w, blocks, seen) - qp * mb - mp * qb + omega[..., None, None] * qp * qb
    return out.reshape(B, HQ, T, D) + lam_diag * p


def scatter_matvec(p, k, w, blocks, seen=None) -> torch.Tensor:
    """``sum_j w_ij (k_j.p_i) k_j`` within each feature block, ``[B, HQ, T, g, D / g]`` (shapes as
    :func:`sigma_matvec`)."""
    seen = (w != 0 if seen is None else seen).unsqueeze(-3)  # [.., 1, T, S]
    heads_blocks = (0, 1, 3, 2, 4)  # [B, HQ, N, g, c] <-> [B, HQ, g, N, c]
    kg = split_blocks(k, blocks).permute(heads_blocks)
    kp = contained_scores(split_blocks(p, blocks).permute(heads_blocks), kg)  # k_j.p_i per block
    kp = torch.where(seen, kp, kp.new_zeros(()))
    return contained_matmul(w[:, :, None] * kp, kg, seen).permute(heads_blocks)


def split_blocks(x, blocks) -> torch.Tensor:
    """``[..., D] -> [..., g, D / g]``: the features of each of the ``g = blocks`` BD-LLA blocks (``g = 1``:
    full LLA)."""
    g = 1 if blocks is None else blocks
    return x.reshape(*x.shape[:-1], g, x.shape[-1] // g)


def block_dot(a, b, blocks) -> torch.Tensor:
    """``a.b`` within each feature block, ``[..., g, 1]`` (see :func:`split_blocks`)."""
    return (split_blocks(a, blocks) * split_blocks(b, blocks)).sum(-1, keepdim=True)


def centred_matvec(p, k, w, omega, mu_tilde, lam_diag, blocks, seen=None) -> torch.Tensor:
    """``A_i p_i`` for every query, ``[B, HQ, T, D]``, without materialising ``A_i``: the key scatter about its
    weighted mean ``kbar_i = mu~_i / omega_i`` plus the ridge,

    ``A_i p = sum_j w_ij (k_j.p) k_j - (mu~_i.p) mu~_i / omega_i + lam_i p = Sigma_i p - mu_i (mu_i.p) / omega_i``

    (``Sigma_i`` of eq. 7 is ``A_i`` plus the rank-one ``mu_i mu_i^T / omega_i``), every inner product within
    each of the ``g = blocks`` feature blocks (BD-LLA). ``A_i`` has no eigenvalue of the size of
    ``omega_i |kbar_i - q_i|^2``, the one eq. 7's ``Sigma_i`` gets from a query far from its keys, so CG
    converges faster on it; :func:`probe_from_centred` turns ``A_i^-1 mu_i`` into ``rho_i``.
    Shapes as :func:`sigma_matvec`; a query that sees no key (``omega = 0``) has ``mu~ = 0``.
    """
    B, HQ, T, D = p.shape
    omega_safe = torch.where(omega > 0, omega, torch.ones_like(omega))[..., None, None]
    mean = block_dot(mu_tilde, p, blocks) * split_blocks(mu_tilde, blocks) / omega_safe
    return (scatter_matvec(p, k, w, blocks, seen) - mean).reshape(B, HQ, T, D) + lam_diag * p


def probe_from_centred(y, mu, omega, blocks) -> torch.Tensor:
    """``rho_i = Sigma_i^-1 mu_i`` from ``y_i = A_i^-1 mu_i`` (:func:`centred_matvec`) by Sherman-Morrison, per
    feature block: ``rho = y omega / (omega + mu.y)``, ``[B, HQ, T, D]``. So ``delta = omega - mu.rho =
    omega^2 / (omega + mu.y)`` for full LLA, and ``rho / delta = y / omega``: the output's correction is
    ``Sigma_KV y``, which a truncated ``y`` reaches without the ``omega / delta`` amplification a truncated
    solve of eq. 7 sees when ``delta << omega``. ``mu.y >= 0`` in exact arithmetic (kept so)."""
    c = block_dot(mu, y, blocks).clamp_min(0)
    omega = omega[..., None, None]
    factor = torch.where(omega > 0, omega / torch.where(omega > 0, omega + c, torch.ones_like(c)), torch.ones_like(c))
    return (split_blocks(y, blocks) * factor).reshape(y.shape)


PRECONDITIONER_BLOCK = 128  # query positions [b P, (b + 1) P) share one CG preconditioner
PRECONDITIONER_RIDGE = 0.1  # its ridge, relative to the keys' mean variance


def key_preconditioner(k, T: int, window=None) -> torch.Tensor:
    """The CG preconditioner of every block of ``P = PRECONDITIONER_BLOCK`` query positions, ``[B, H, NB, D, D]``
    (``k [B, S, H, D]``, the ``T`` queries at the last positions, ``NB`` the blocks they fall in):
    ``M_b = (C_b / c_b + PRECONDITIONER_RIDGE I)^-1`` with ``C_b`` the covariance of the keys before the block
    that every query of the block sees (whole blocks of ``P`` keys: all of ``[0, b P)``, or with a window the
    last ``window // P - 1`` of them) and ``c_b = tr(C_b) / D`` (1 where it is 0).

    The keys' own sampling noise shapes the spectrum of each query's weighted scatter ``A_i`` (a sample of
    few effective keys in ``D`` dimensions), and the queries of a block share it, so ``M_b A_i`` is far
    better conditioned than ``A_i``: on the H100 (bf16 random inputs, D 128, T 512) 8 CG iterations came within
    0.035 of the exact solve instead of 0.084. Only keys every query of the block sees enter it, so the output of a
    row never depends on a key it cannot see. A block without keys, or whose ``C_b`` fails Cholesky, gets
    ``I / PRECONDITIONER_RIDGE``. A fixed operator: no gradient flows through it.
    """
    B, S, H, D = k.shape
    P = PRECONDITIONER_BLOCK
    first, last = (S - T) // P, (S - 1) // P
    with torch.no_grad():
        sums, grams, count = key_block_sums(k.detach(), first, last, window)
        n = count.to(grams.dtype).clamp(min=1)
        eye = torch.eye(D, dtype=grams.dtype, device=k.device)
        for i in range(0, last - first + 1, BUILD_SLICE):  # in place, a slice of blocks at a time
            part = slice(i, i + BUILD_SLICE)
            ni = n[part, None, None]
            cov = grams[:, :, part].sub_(sums[:, :, part, :, None] * sums[:, :, part, None, :] / ni).div_(ni)
            trace = torch.diagonal(cov, dim1=-2, dim2=-1).sum(-1)
            spread = torch.where(trace > 0, trace / D, torch.ones_like(trace))
            cov.div_(spread[..., None, None]).diagonal(dim1=-2, dim2=-1).add_(PRECONDITIONER_RIDGE)
            chol, info = torch.linalg.cholesky_ex(cov)
            chol = torch.where((info == 0)[..., None, None], chol, eye * PRECONDITIONER_RIDGE ** 0.5)
            inv_chol = torch.linalg.solve_triangular(chol, eye.expand_as(chol), upper=False)
            del chol
            cov.copy_(inv_chol.mT @ inv_chol)  # symmetric in every rounding
    return grams


BUILD_SLICE = 16  # blocks a step of the preconditioner's build takes: its temporaries stay a fraction of the result


def key_block_sums(k, first: int, last: int, window):
    """``(sums [B, H, NB, D], grams [B, H, NB, D, D], count [NB])``: the sum, the sum of outer products and the
    number of the keys of ``k [B, S, H, D]`` that enter :func:`key_preconditioner` for the query blocks
    ``first..last``, in the compute dtype, formed :data:`BUILD_SLICE` blocks at a time (the keys before the
    first query block, in one step)."""
    B, S, H, D = k.shape
    P, NB = PRECONDITIONER_BLOCK, last - first + 1
    blocks = torch.arange(first, last + 1, device=k.device).clamp(min=0)
    sums = k.new_zeros(B, H, NB, D, dtype=compute_dtype(k))
    grams = k.new_zeros(B, H, NB, D, D, dtype=sums.dtype)
    lead = max(-first, 0)  # query blocks before the first key (S < T): no key before them
    if window is None:  # every key before the block: the keys before the first query block, then running sums
        start = first + lead
        base = k[:, :start * P].transpose(1, 2).to(sums.dtype)  # in one step: a decoding query's cache
        sums[:, :, lead] = base.sum(2)
        grams[:, :, lead] = base.mT @ base
        del base
        key_moments(k, start, last, sums[:, :, lead + 1:], grams[:, :, lead + 1:])
        sums.cumsum_(2)
        grams.cumsum_(2)
        return sums, grams, blocks * P
    # the last `span` key blocks before each query block, summed directly (a running sum's differences would
    # carry a non-finite key from outside the window)
    span = max(window // P - 1, 0)  # key blocks each query block sees whole
    if span == 0:
        return sums, grams, blocks * 0
    for a in range(0, NB, BUILD_SLICE):  # query blocks first+a..first+b-1 see key blocks lo..hi-1
        b = min(a + BUILD_SLICE, NB)
        lo, hi = first + a - span, first + b - 1
        block_sums = k.new_zeros(B, H, hi - lo, D, dtype=sums.dtype)
        block_grams = k.new_zeros(B, H, hi - lo, D, D, dtype=sums.dtype)
        none = max(-lo, 0)  # key blocks before the first key: zeros
        key_moments(k, lo + none, hi, block_sums[:, :, none:], block_grams[:, :, none:])
        sums[:, :, a:b] = block_sums.unfold(2, span, 1).sum(-1)
        grams[:, :, a:b] = block_grams.unfold(2, span, 1).sum(-1)
    return sums, grams, blocks.clamp(max=span) * P


def key_moments(k, lo: int, hi: int, sums, grams) -> None:
    """Write the sum and the sum of outer products of the keys of each key block ``lo..hi-1`` of ``k [B, S, H, D]``
    into ``sums [B, H, hi - lo, D]`` and ``grams [B, H, hi - lo, D, D]`` (in their dtype), :data:`BUILD_SLICE`
    blocks at a time."""
    P = PRECONDITIONER_BLOCK
    for j in range(lo, hi, BUILD_SLICE):
        e = min(j + BUILD_SLICE, hi)
        chunk = k[:, j * P:e * P].transpose(1, 2).to(sums.dtype).unflatten(2, (e - j, P))  # [B, H, blocks, P, D]
        sums[:, :, j - lo:e - lo] = chunk.sum(3)
        grams[:, :, j - lo:e - lo] = chunk.mT @ chunk


def precondition_rows(M, r, S: int) -> torch.Tensor:
    """``M_b r_i`` for each row ``i`` of ``r [B, HQ, T, D]`` with ``M_b`` its block's preconditioner
    (:func:`key_preconditioner`, ``[B, H, NB, D, D]``, repeated over the query heads of a group)."""
    B, HQ, T, D = r.shape
    P, NB = PRECONDITIONER_BLOCK, M.shape[2]
    before = (S - T) % P  # positions of the first block before the first query
    rows = torch.nn.functional.pad(r, (0, 0, before, NB * P - before - T)).unflatten(2, (NB, P))
    heads = M.repeat_interleave(HQ // M.shape[1], dim=1)  # M is symmetric: r M = (M r)^T
    return (rows @ heads).flatten(2, 3)[:, :, before:before + T]


CURVATURE_FLOOR = 0.1  # a CG step needs p.Ap > CURVATURE_FLOOR * lam_min * |p|^2 (the exact value is >= lam_min |p|^2)


def conjugate_gradient(matvec, y, *, iters: int, tol: float, lam_min, blocks=None, precondition=None) -> torch.Tensor:
    """Algorithm 2: solve ``A x = y`` for every row of ``y [..., D]`` from ``x = 0``; with ``precondition`` (a
    symmetric positive definite ``M`` as a function ``r -> M r``, full LLA only) preconditioned CG, whose
    steps take ``r.Mr`` where plain CG takes ``r.r`` (the residual norm still decides convergence).

    With ``blocks = g`` (BD-LLA) ``A`` is block diagonal and each of its ``g`` blocks is its own system
    with its own step sizes, so ``D / g`` iterations solve it exactly in exact arithmetic.
    ``A >= lam_min I`` (``lam_min [...]``, the smallest ridge). A system is active while its residual
    norm exceeds ``tol * ||y||`` (and is > 0) and its curvature ``p.Ap`` exceeds ``CURVATURE_FLOOR *
    lam_min * |p|^2`` (rounding can break ``p.Ap >= lam_min |p|^2`` for a nearly singular ``A``);
    inactive systems keep their iterate unchanged, so a converged or broken-down row never divides
    by zero and every step is at most ``rr / (CURVATURE_FLOOR lam_min |p|^2)``.
    """
    shape = y.shape
    lam_min = lam_min[..., None]  # the same bound for every block

    def block_matvec(p):  # one system per block
        return split_blocks(matvec(p.reshape(shape)), blocks)

    def block_precondition(r):
        return r if precondition is None else split_blocks(precondition(r.reshape(shape)), blocks)

    y = split_blocks(y, blocks)
    x = torch.zeros_like(y)
    r = y
    p = block_precondition(r)
    rr, rz = (r * r).sum(-1), (r * p).sum(-1)
    bound = (tol ** 2) * rr
    for _ in range(iters):
        active = (rr > bound) & (rr > 0) & (rz > 0)
        Ap = block_matvec(p)
        pAp = (p * Ap).sum(-1)
        active = active & (pAp > CURVATURE_FLOOR * lam_min * (p * p).sum(-1))
        alpha = torch.where(active, rz / torch.where(active, pAp, torch.ones_like(pAp)), torch.zeros_like(rz))
        x = x + alpha[..., None] * p
        r = r - alpha[..., None] * Ap
        z = block_precondition(r)
        rz_new = (r * z).sum(-1)
        beta = torch.where(active, rz_new / torch.where(active, rz, torch.ones_like(rz)), torch.zeros_like(rz))
        p = torch.where(active[..., None], z + beta[..., None] * p, p)
        rr = torch.where(active, (r * r).sum(-1), rr)
        rz = torch.where(active, rz_new, rz)
    return x.reshape(shape)


def _lla_explicit(q, k, v, *, lam, scale, window, blocks):
    stats = lla_statistics(q, k, lam=lam, scale=scale, window=window, blocks=blocks)
    rho = lla_probe(stats)
    HQ = q.shape[2]
    lam_min = ridge(lam, (q.shape[0], HQ, q.shape[1], q.shape[3]), dtype=q.dtype, device=q.device).amin(-1)
    return lla_output(stats.w, stats.omega, stats.mu, rho, heads_first(k, HQ),
                      heads_first(v, HQ), seen_pairs(q, k, window), lam_min, blocks)


CG_GRADIENTS = ("implicit", "unrolled")


class ImplicitSolve(torch.autograd.Function):
    """Zero in the forward; in the backward, ``-solve(g, *theta)`` (``~ -Sigma^-1 g``, ``Sigma`` symmetric)
    as the gradient of the residual ``r = Sigma rho - mu`` it was given.

    ``rho.detach() + ImplicitSolve.apply(residual(rho.detach(), *theta), solve, *theta)`` is ``rho`` with the
    implicit-function gradient ``-(d r / d theta)^T Sigma^-1 g``, whatever the number of iterations that
    produced ``rho``: what the FlashLLA backward computes (its second CG). The residual's own graph carries
    the gradient to ``theta``, so the backward calls no autograd itself and compiles.
    """

    @staticmethod
    def forward(ctx, r, solve, *theta):
        ctx.solve = solve
        ctx.save_for_backward(*theta)
        return torch.zeros_like(r)

    @staticmethod
    def backward(ctx, g):
        u = ctx.solve(g, *ctx.saved_tensors)
        return (-u, None, *[None] * len(ctx.saved_tensors))


def lla_matrix_free(q, k, v, *, lam, scale, window=None, blocks=None, cg_iters: int, cg_tol=1e-6,
                    cg_gradient: str = "implicit", cg_precondition: bool = False):
    """Eq. 10-16 with Algorithm 2: uncentred sums, CG on the centred scatter ``A_i`` (:func:`centred_matvec`)
    for ``y = A^-1 mu``, ``rho`` from it (:func:`probe_from_centred`), the output of :func:`lla_output`.

    Same arguments and result as :func:`lla` with an integer ``cg_iters``. The gradient treats the CG
    result as the exact ``Sigma^-1 mu`` (:class:`ImplicitSolve`, its adjoint system ``Sigma^-1 g`` solved by
    the same number of CG iterations on ``Sigma``), as the FlashLLA backward does;
    ``cg_gradient="unrolled"`` differentiates through the iterations run (the preconditioner held fixed).
    ``cg_precondition``: precondition full LLA's CG by :func:`key_preconditioner` (BD-LLA's blocks run plain
    CG).
    """
    if cg_gradient not in CG_GRADIENTS:
        raise ValueError(f"cg_gradient: expected one of {CG_GRADIENTS}, got {cg_gradient!r}")
    B, T, HQ, D = q.shape
    w, _ = lla_weights(q, k, scale=scale, window=window)
    seen = seen_pairs(q, k, window)
    qh, kh, vh = q.transpose(1, 2), heads_first(k, HQ), heads_first(v, HQ)
    omega = w.sum(-1)
    mu_tilde = contained_matmul(w, kh, seen)            # eq. 10
    mu = mu_tilde - omega[..., None] * qh               # eq. 11
    lam_diag = ridge(lam, (B, HQ, T, D), dtype=q.dtype, device=q.device)

    def probe():  # rho from y = A^-1 mu by CG on the centred scatter (see centred_matvec)
        def matvec(p):
            return centred_matvec(p, kh, w, omega, mu_tilde, lam_diag, blocks, seen)
        precondition = None
        if cg_precondition and blocks in (None, 1):
            precondition = partial(precondition_rows, key_preconditioner(k, T, window), S=k.shape[1])
        y = conjugate_gradient(matvec, mu, iters=cg_iters, tol=cg_tol, lam_min=lam_diag.amin(-1), blocks=blocks,
                               precondition=precondition)
        return probe_from_centred(y, mu, omega, blocks)

    def sigma_solve(g, qh, kh, w, omega, mu_tilde, lam_diag):
        """``Sigma^-1 g`` by CG on ``Sigma`` itself: by the centred scatter and Sherman-Morrison, ``z - (mu.z /
        omega) rho`` with ``z = A^-1 g``, it would cancel where ``mu.A^-1 mu >> omega`` (at ``lam = 0.01``, D = 8, fp32
        dq 70 to 800 times further from float64 than the float32 exact solve's)."""
        def matvec(p):
            return sigma_matvec(p, qh, kh, w, omega, mu_tilde, lam_diag, blocks, seen)
        return conjugate_gradient(matvec, g, iters=cg_iters, tol=cg_tol, lam_min=lam_diag.amin(-1), blocks=blocks)

    if cg_gradient == "implicit":
        with torch.no_grad():
            rho = probe()
        residual = sigma_matvec(rho, qh, kh, w, omega, mu_tilde, lam_diag, blocks, seen) - mu
        fixed = [t.detach() for t in (qh, kh, w, omega, mu_tilde, lam_diag)]
        rho = rho + ImplicitSolve.apply(residual, sigma_solve, *fixed)
    else:
        rho = probe()
    return lla_output(w, omega, mu, rho, kh, vh, seen, lam_diag.amin(-1), blocks)


def lla_blocks_uncentred(q, k, v, *, lam, scale, window=None, blocks: int):
    """BD-LLA through eq. 10-11 per feature block, without ``z_ij``: ``[B, T, HQ, Dv]``.

    Each of the ``g = blocks`` diagonal blocks of ``Sigma_i`` is ``sum_j w_ij k_j^b k_j^bT`` (from the
    per-block products ``k^b k^bT``, ``[S, g, D/g, D/g]``) centred by eq. 11, plus the ridge; the
    ``g`` small systems are solved exactly. Memory ``O(T S + S D^2 / g + T D^2 / g)``.
    """
    B, T, HQ, D = q.shape
    c = D // blocks
    w, _ = lla_weights(q, k, scale=scale, window=window)
    seen = seen_pairs(q, k, window)
    qh, kh, vh = q.transpose(1, 2), heads_first(k, HQ), heads_first(v, HQ)
    omega = w.sum(-1)
    mt = contained_matmul(w, kh, seen)
    mu = mt - omega[..., None] * qh

    def split(x):  # [..., D] -> [..., g, c]
        return split_blocks(x, blocks)

    kb = split(kh)
    kk = (kb[..., :, None] * kb[..., None, :]).flatten(-3)                     # [B, HQ, S, g c c]
    second = contained_matmul(w, kk, seen).view(B, HQ, T, blocks, c, c)
    qb, mb = split(qh), split(mt)
    sigma = (second - mb[..., :, None] * qb[..., None, :] - qb[..., :, None] * mb[..., None, :]
             + omega[..., None, None, None] * qb[..., :, None] * qb[..., None, :])
    lam_diag = ridge(lam, (B, HQ, T, D), dtype=q.dtype, device=q.device)
    sigma = sigma + torch.diag_embed(split(lam_diag))
    rho = solve_or_zero(sigma, split(mu)).reshape(B, HQ, T, D)
    return lla_output(w, omega, mu, rho, kh, vh, seen, lam_diag.amin(-1), blocks)


def lla(q, k, v, *, lam, scale=None, window=None, blocks=None, cg_iters=None, cg_tol=1e-6, cg_gradient="implicit",
        cg_precondition=False):
    """Local Linear Attention, ``[B, T, HQ, Dv]`` (see :func:`regattn.lla` for the definition).

    Args:
        q: ``[B, T, HQ, D]``; k: ``[B, S, H, D]``; v: ``[B, S, H, Dv]``; queries aligned to the end of the keys.
        lam: float, ``[B, T, HQ]`` or ``[B, T, HQ, D]``; scale: defaults to ``D ** -0.5``.
        window: SW-LLA; blocks: BD-LLA with ``g`` diagonal blocks; cg_iters: None (exact solve,
            eq. 7-8) or CG iterations (matrix-free eq. 10-16, Algorithm 2); cg_tol: relative residual;
            cg_gradient: ``"implicit"`` or ``"unrolled"``; cg_precondition (see :func:`lla_matrix_free`).
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    dtype = compute_dtype(q)
    q32, k32, v32 = q.to(dtype), k.to(dtype), v.to(dtype)
    if isinstance(lam, torch.Tensor):
        lam = lam.to(dtype)
    if cg_iters is None:
        o = _lla_explicit(q32, k32, v32, lam=lam, scale=scale, window=window, blocks=blocks)
    else:
        o = lla_matrix_free(q32, k32, v32, lam=lam, scale=scale, window=window, blocks=blocks,
                            cg_iters=cg_iters, cg_tol=cg_tol, cg_gradient=cg_gradient, cg_precondition=cg_precondition)
    return o.to(q.dtype)


def lla_decomposition(q, k, v, *, lam, scale=None, window=None):
    """Parallax eq. 7 pieces, heads-first: ``o_SA, Sigma_KV [.., Dv, D], rho*, tbar, eta``.

    ``o_LLA = o_SA - (1 + eta) Sigma_KV rho*`` with ``p_i = w_i / omega_i``, ``tbar_i = E_p[z_ij.rho*_i]``
    and ``eta_i = tbar_i / (1 - tbar_i)`` (parallax Prop. 3.1: ``tbar in [0, 1)``).
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    HQ = q.shape[2]
    stats = lla_statistics(q, k, lam=lam, scale=scale, window=window)
    rho = lla_probe(stats)
    p = stats.w / stats.omega[..., None]
    kh, vh, qh = heads_first(k, HQ), heads_first(v, HQ), q.transpose(1, 2)
    k_bar, v_bar = p @ kh, p @ vh
    cross = torch.einsum("bhts,bhse,bhsd->bhted", p, vh, kh)
    sigma_kv = cross - v_bar[..., :, None] * k_bar[..., None, :]
    t_bar = ((k_bar - qh) * rho).sum(-1)
    return v_bar, sigma_kv, rho, t_bar, t_bar / (1 - t_bar)
