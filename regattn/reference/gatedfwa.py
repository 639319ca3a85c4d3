"""GatedFWA in plain PyTorch: the gate preprocessing (eq. 9-11) and windowed gated attention (eq. 12)."""
from __future__ import annotations

import torch

from regattn.reference.softmax import softmax_attention


def safe_softplus(z: torch.Tensor) -> torch.Tensor:
    """``softplus(z) = nu + log(exp(z - nu) + exp(-nu))`` with ``nu = max(z, 0)`` (gatedfwa.md Sec. 3.3).

    One of the two exponentials is ``exp(0) = 1`` and the other ``exp(-|z|)``, so this is
    ``max(z, 0) + log1p(exp(-|z|))``: no overflow, and exact for very negative ``z``.
    """
    return z.clamp_min(0) + torch.log1p(torch.exp(-z.abs()))


def gate_alpha(h: torch.Tensor, beta: torch.Tensor, *, eps: float = 1e-6) -> torch.Tensor:
    """Per-token decay ``alpha = softplus(beta * h) / (beta + eps) > 0`` (eq. 9), in h's dtype."""
    return safe_softplus(beta * h) / (beta + eps)


def gatedfwa_gate(h: torch.Tensor, beta: torch.Tensor, *, eps: float = 1e-6) -> torch.Tensor:
    """Cumulative log-gate ``u_t = -sum_{s <= t} alpha_s`` (eq. 11); ``h, beta: [B, T, H] -> u: [B, T, H]``.

    Accumulated in fp32 (float64 when the inputs are float64); ``u`` is returned in that dtype.
    """
    acc = torch.float64 if h.dtype == torch.float64 else torch.float32
    alpha = gate_alpha(h.to(acc), beta.to(acc), eps=eps)
    return -torch.cumsum(alpha, dim=1)


def gatedfwa(q, k, v, u, *, window, scale=None, cu_seqlens=None, upcast=True):
    """GatedFWA attention (eq. 12): ``o_i = sum_{i-w < j <= i} softmax_j(scale q_i.k_j + u_i - u_j) v_j``.

    ``q: [B, T, HQ, D]``, ``k: [B, T, H, D]``, ``v: [B, T, H, Dv]``, ``u: [B, T, HQ]``;
    ``window=None`` is full causal attention. Returns ``[B, T, HQ, Dv]`` in q's dtype; the scores, ``u`` and
    the softmax are computed in fp32 (float64 for float64 inputs), or with ``upcast=False`` in the inputs'
    dtype (the low-precision baseline; see :func:`regattn.reference.softmax_attention`).
    """
    return softmax_attention(q, k, v, causal=True, window=window, gate=u, scale=scale, cu_seqlens=cu_seqlens,
                             upcast=upcast)
