"""The uniform-weight rows of the family (parallax.txt Section 3.2, lla eq. 2) in plain PyTorch.

Every function is causal with queries aligned to the end of the keys (query ``i`` sits at
key position ``pos = i + S - T`` and reads keys ``j <= pos``); ``q: [B, T, HQ, D]``,
``k: [B, S, H, D]``, ``v: [B, S, H, Dv]`` (GQA when ``HQ % H == 0``); outputs ``[B, T, HQ, Dv]``.
Computed in the inputs' dtype (float64 for the exact spec), differentiable by autograd.

With uniform weights (parallax eq. 9-10), at query ``i`` over its ``n_i = pos + 1`` keys:
``v_bar = mean v_j``, ``k_bar = mean k_j``, ``S = mean v_j k_j^T``, ``H = mean k_j k_j^T + lam I``,
``q_tilde = k_bar - q``, ``S_tilde = S - v_bar k_bar^T``, ``H_tilde = H - k_bar k_bar^T``.
The affine forms share the template ``o = v_bar - S_tilde rho`` and differ only in the probe
``rho``: 0 (value averaging, eq. 11), given (affine linear attention, eq. 12), or
``H_tilde^-1 q_tilde`` (affine MesaNet, eq. 13).
"""
from __future__ import annotations

import torch

from regattn.reference.common import repeat_kv


def _running(x: torch.Tensor, T: int) -> torch.Tensor:
    """Prefix sums over time of ``[B, S, ...]`` read at the last ``T`` positions."""
    return x.cumsum(1)[:, x.shape[1] - T:]


def _counts(T: int, S: int, like: torch.Tensor) -> torch.Tensor:
    """``n_i = pos + 1``, the number of keys query ``i`` reads, ``[T]``."""
    return torch.arange(S - T + 1, S + 1, dtype=like.dtype, device=like.device)


def _ridge(lam, B: int, T: int, HQ: int, D: int, like: torch.Tensor) -> torch.Tensor:
    """Diagonal ridge ``[B, T, HQ, D]`` from a float, ``[B, T, HQ]`` or ``[B, T, HQ, D]``."""
    if not isinstance(lam, torch.Tensor):
        return torch.full((B, T, HQ, D), float(lam), dtype=like.dtype, device=like.device)
    lam = lam.to(like.dtype)
    return (lam[..., None] if lam.dim() == 3 else lam).expand(B, T, HQ, D)


def linear_attention(q, k, v):
    """Causal linear attention ``o_i = sum_{j <= i} v_j k_j^T q_i`` (no normalisation)."""
    HQ, T, S = q.shape[2], q.shape[1], k.shape[1]
    k, v = repeat_kv(k, HQ), repeat_kv(v, HQ)
    scores = torch.einsum("bthd,bshd->bhts", q, k)
    pos = torch.arange(T, device=q.device)[:, None] + (S - T)
    scores = scores.masked_fill(torch.arange(S, device=q.device)[None, :] > pos, 0.0)
    return torch.einsum("bhts,bshd->bthd", scores, v)


def _moments(k, v, T: int, HQ: int):
    """Uniform running moments at the queries: ``n [T], k_sum [B,T,HQ,D], v_sum, kk [.., D, D], vk [.., Dv, D]``."""
    k, v = repeat_kv(k, HQ), repeat_kv(v, HQ)
    n = _counts(T, k.shape[1], k)
    k_sum, v_sum = _running(k, T), _running(v, T)
    kk = _running(k[..., :, None] * k[..., None, :], T)
    vk = _running(v[..., :, None] * k[..., None, :], T)
    return n, k_sum, v_sum, kk, vk


def mesanet(q, k, v, *, lam):
    """MesaNet (lla eq. 2, parallax eq. 5): ``o_i = (sum_j v_j k_j^T) (sum_j k_j k_j^T + diag(lam_i))^-1 q_i``.

    ``lam``: float, ``[B, T, HQ]`` or ``[B, T, HQ, D]`` (sums are not normalised by ``n_i``).
    """
    B, T, HQ, D = q.shape
    _, _, _, kk, vk = _moments(k, v, T, HQ)
    H = kk + torch.diag_embed(_ridge(lam, B, T, HQ, D, q))
    x = torch.linalg.solve_ex(H, q[..., None])[0]      # H is positive definite; no error check (a host read)
    return (vk @ x)[..., 0]


def value_averaging(v, T: int | None = None):
    """Value averaging (parallax eq. 11): ``o_i = mean_{j <= i} v_j``; ``[B, S, H, Dv] -> [B, T, H, Dv]``.

    ``T`` (default ``S``) queries aligned to the end of the keys.
    """
    T = v.shape[1] if T is None else T
    n = _counts(T, v.shape[1], v)
    return _running(v, T) / n[None, :, None, None]


def _affine_readout(rho, k_sum, v_sum, vk, n):
    """The shared template ``o = v_bar - S_tilde rho``, ``S_tilde = mean v k^T - v_bar k_bar^T``."""
    inv = (1.0 / n)[None, :, None, None]
    k_bar, v_bar = k_sum * inv, v_sum * inv
    s_rho = (vk @ rho[..., None])[..., 0] * inv
    return v_bar - s_rho + v_bar * (k_bar * rho).sum(-1, keepdim=True)


def affine_linear_attention(r, k, v):
    """Affine linear attention (parallax eq. 12): ``o_i = v_bar_i - S_tilde_i r_i``.

    ``r: [B, T, HQ, D]`` is the probe (``W_R x_i`` in Parallax; the h -> inf limit of
    :func:`regattn.reference.parallax` with probe ``r``). ``r = 0`` gives value averaging.
    """
    T, HQ = r.shape[1], r.shape[2]
    n, k_sum, v_sum, _, vk = _moments(k, v, T, HQ)
    return _affine_readout(r, k_sum, v_sum, vk, n)


def affine_mesanet_probe(q, k, *, lam):
    """The solved probe of parallax eq. 13: ``rho*_i = H_tilde_i^-1 q_tilde_i``, ``[B, T, HQ, D]``.

    ``H_tilde_i = mean k k^T + diag(lam_i) - k_bar k_bar^T`` (ridge added to the normalised moment, eq. 9).
    """
    B, T, HQ, D = q.shape
    n = _counts(T, k.shape[1], q)
    kh = repeat_kv(k, HQ)
    inv = (1.0 / n)[None, :, None, None]
    k_bar = _running(kh, T) * inv
    kk = _running(kh[..., :, None] * kh[..., None, :], T) * inv[..., None]
    H_tilde = kk - k_bar[..., :, None] * k_bar[..., None, :] + torch.diag_embed(_ridge(lam, B, T, HQ, D, q))
    return torch.linalg.solve_ex(H_tilde, (k_bar - q)[..., None])[0][..., 0]   # positive definite, as in mesanet


def affine_mesanet(q, k, v, *, lam):
    """Affine MesaNet (parallax eq. 13): ``o_i = v_bar_i - S_tilde_i H_tilde_i^-1 (k_bar_i - q_i)``.

    ``lam``: float, ``[B, T, HQ]`` or ``[B, T, HQ, D]``, the ridge on the normalised moment
    ``H_i = mean k k^T + lam I`` (eq. 9). LLA with uniform weights (``scale = 0``) and ridge ``lam``
    equals this with ``lam / n_i`` (``n_i`` keys seen), since LLA's sums are not normalised.
    """
    r = affine_mesanet_probe(q, k, lam=lam)
    return affine_linear_attention(r, k, v)
