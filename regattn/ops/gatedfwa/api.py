"""GatedFWA: the gate preprocessing (Algorithm 1) and windowed gated attention (eq. 12)."""
from __future__ import annotations

import torch

from regattn import reference
from regattn.ops._common.checks import (
    check_positive, check_same, check_shape, check_tensor, check_window, host_checks_allowed,
    resolve_backend,
)
from regattn.ops.gatedfwa.gate import gate_scan
from regattn.ops.softmax.api import gated_attention

HAS_TRITON = True


def gatedfwa_gate(h, beta, *, eps=1e-6, backend="auto"):
    """GatedFWA gate preprocessing (gatedfwa.md eq. 9-11, Algorithm 1).

    ``alpha = softplus(beta * h) / (beta + eps)`` with the numerically safe softplus, and
    ``u = -cumsum(alpha)`` over time, accumulated in fp32.

    ``h`` and ``beta`` are checked finite and ``beta > 0`` by one read on the host (one device sync on a
    GPU) in eager code; compiled and captured calls skip that check, as do the layers, which call
    :func:`gate_dispatch`.

    Args:
        h: ``[B, T, H]`` gate pre-activations, finite.
        beta: ``[B, T, H]`` positive finite amplitudes.
        eps: positive constant in the denominator.
        backend: ``"auto" | "torch" | "triton"``. The Triton kernel scans time chunks in parallel, each
            chunk's offset from the earlier chunks' sums by a decoupled look-back (see
            :mod:`regattn.ops.gatedfwa.gate`).

    Returns:
        ``u: [B, T, H]`` in fp32 (float64 for float64 inputs on the torch backend), non-increasing over T.
    """
    check_tensor("h", h, 3)
    check_tensor("beta", beta, 3)
    check_shape("beta", beta, h.shape, "[B, T, H] (as h)")
    check_same(h=h, beta=beta)
    eps = check_positive("eps", eps)
    if h.shape[1] < 1:
        raise ValueError(f"h: expected at least one token, got shape {tuple(h.shape)}")
    if h.numel() and host_checks_allowed():
        check_gate_values(h, beta)
    return gate_dispatch(h, beta, eps=eps, backend=backend)


def check_gate_values(h, beta):
    """``h`` finite, ``beta`` finite and > 0: one read of three flags (one device sync on a GPU)."""
    h_finite, beta_finite, beta_positive = torch.stack(
        [torch.isfinite(h).all(), torch.isfinite(beta).all(), (beta > 0).all()]).tolist()
    for name, x, ok in (("h", h, h_finite), ("beta", beta, beta_finite)):
        if not ok:
            bad = ~torch.isfinite(x)
            raise ValueError(f"{name}: expected finite values, got {int(bad.sum())} non-finite "
                             f"(first {x[bad][0].item()})")
    if not beta_positive:
        raise ValueError(f"beta: expected every amplitude > 0, got a minimum of {beta.min().item():g}")


def gate_dispatch(h, beta, *, eps, backend="auto"):
    """:func:`gatedfwa_gate` on already checked inputs (no value check of ``beta``, so no device sync).

    The Triton kernels cover fp16, bf16 and fp32; float64 always runs the reference.
    """
    backend = resolve_backend(backend, h, op="gatedfwa_gate", has_triton=HAS_TRITON)
    if backend == "triton" and h.dtype.is_floating_point and h.element_size() < 8:
        return gate_scan(h, beta, eps=eps)
    return reference.gatedfwa_gate(h, beta, eps=eps)


def gatedfwa(q, k, v, u, *, window, scale=None, cu_seqlens=None, max_seqlen=None, backend="auto"):
    """GatedFWA attention (gatedfwa.md eq. 12): causal sliding-window softmax with gate bias.

    ``o_i = sum_{i-w < j <= i} softmax_j(scale * q_i.k_j + u_i - u_j) v_j``.

    Args:
        q: ``[B, T, HQ, D]``; k: ``[B, T, H, D]``; v: ``[B, T, H, Dv]``.
        u: ``[B, T, HQ]`` cumulative log-gate from :func:`gatedfwa_gate`.
        window: ``w >= 1`` keys including the query's own; None for full causal attention.
        scale: defaults to ``D ** -0.5``.
        cu_seqlens: ``[N + 1]`` offsets of packed sequences (``B == 1``).
        max_seqlen: the longest packed sequence; given, no device sync (see :func:`regattn.softmax_attention`).
        backend: ``"auto" | "torch" | "triton"`` (the kernel of :func:`regattn.softmax_attention`).

    Returns:
        ``o: [B, T, HQ, Dv]`` in q's dtype.
    """
    if u is None:
        raise TypeError("u: expected a [B, T, HQ] tensor, got None")
    return gated_attention(q, k, v, causal=True, window=check_window(window), gate=u, scale=scale,
                           cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, backend=backend, gate_name="u")
