"""Softmax attention (Nadaraya-Watson), sliding window, and the GatedFWA gate bias."""
from __future__ import annotations

import torch

from regattn import reference
from regattn.ops._common.checks import (
    check_attention_inputs, check_cu_seqlens, check_scale, check_shape, check_tensor,
    check_window, check_device, check_seqlens_device, resolve_kernel_backend,
)
from regattn.ops.softmax.function import flash_attention

HAS_TRITON = True
def check_gate(gate, B: int, T: int, HQ: int, q: torch.Tensor, name: str = "gate"):
    """The cumulative log-gate ``u: [B, T, HQ]``, float, on q's device."""
    if gate is None:
        return None
    check_tensor(name, gate, 3)
    check_shape(name, gate, (B, T, HQ), "[B, T, HQ]")
    check_device(name, gate, q, "q")
    return gate


def softmax_attention(q, k, v, *, causal=True, window=None, gate=None, scale=None,
                      cu_seqlens=None, max_seqlen=None, backend="auto"):
    """Softmax attention with an optional sliding window and GatedFWA gate bias.

    Args:
        q: ``[B, T, HQ, D]`` queries; ``HQ`` a multiple of ``H`` (GQA).
        k: ``[B, S, H, D]`` keys. With ``S > T`` the queries are the last ``T`` positions.
        v: ``[B, S, H, Dv]`` values.
        causal: query ``i`` sees keys ``j <= i``.
        window: ``w`` keeps keys ``i - w < j <= i`` (needs ``causal``); None for no window.
        gate: cumulative log-gate ``u: [B, T, HQ]`` (needs ``T == S``); the logit becomes
            ``scale * q_i.k_j + u_i - u_j``.
        scale: defaults to ``D ** -0.5``.
        cu_seqlens: ``[N + 1]`` offsets of packed sequences (``B == 1``, ``T == S``).
        max_seqlen: the longest packed sequence (an int bound, as in flash-attn); given, no offset is read
            on the host (no device sync); None reads it from ``cu_seqlens``.
        backend: ``"auto" | "torch" | "triton"``. The Triton kernel covers every case above
            (causal or not, window, gate, GQA, varlen) for fp16, bf16 and fp32; float64 under
            ``"auto"`` runs the reference.

    Returns:
        ``o: [B, T, HQ, Dv]`` in q's dtype.
    """
    return gated_attention(q, k, v, causal=causal, window=window, gate=gate, scale=scale, cu_seqlens=cu_seqlens,
                           max_seqlen=max_seqlen, backend=backend)


def gated_attention(q, k, v, *, causal, window, gate, scale, cu_seqlens, max_seqlen, backend, gate_name="gate"):
    """:func:`softmax_attention` whose errors about the gate name it ``gate_name``."""
    B, T, S, HQ, H, D, Dv = check_attention_inputs(q, k, v)
    window = check_window(window)
    if window is not None and not causal:
        raise ValueError("window: a sliding window needs causal=True")
    scale = check_scale(scale, D)
    gate = check_gate(gate, B, T, HQ, q, gate_name)
    if gate is not None and S != T:
        raise ValueError(f"{gate_name}: needs as many keys as queries, got T = {T} queries and S = {S} keys")
    check_seqlens_device("cu_seqlens", cu_seqlens, q)
    check_cu_seqlens(cu_seqlens, B, T, max_seqlen)
    if cu_seqlens is not None and S != T:
        raise ValueError(f"cu_seqlens: needs as many keys as queries, got T = {T} and S = {S}")
    if resolve_kernel_backend(backend, q, op="softmax_attention", has_triton=HAS_TRITON) == "triton":
        return flash_attention(q, k, v, gate, causal=causal, window=window, scale=scale, cu_seqlens=cu_seqlens,
                               max_seqlen=max_seqlen)
    return reference.softmax_attention(q, k, v, causal=causal, window=window, gate=gate, scale=scale,
                                       cu_seqlens=cu_seqlens)
