"""Softmax attention (Nadaraya-Watson), sliding window and the GatedFWA gate bias, in plain PyTorch."""
from __future__ import annotations

import torch

from regattn.reference.common import accumulation_dtype, contained_matmul, contained_scores, per_sequence, repeat_kv, visible


def attention_logits(q, k, *, causal=True, window=None, gate=None, scale):
    """Masked logits ``[B, HQ, T, S]`` in q's dtype: ``scale * q.k (+ u_i - u_j)``, ``-inf`` where hidden.

    A non-finite key is NaN in its own column only, and the mask selects it away where hidden.
    """
    HQ, T, S = q.shape[2], q.shape[1], k.shape[1]
    k = repeat_kv(k, HQ)
    s = contained_scores(q.transpose(1, 2), k.transpose(1, 2)) * scale
    if gate is not None:
        u = gate.to(s.dtype).transpose(1, 2)  # [B, HQ, T]
        s = s + u[:, :, :, None] - u[:, :, None, :]
    mask = visible(T, S, causal=causal, window=window, device=q.device)
    return s.masked_fill(~mask, float("-inf"))


def softmax_weights(logits):
    """Row softmax that gives zero rows (not NaN) where a query sees no key."""
    p = torch.softmax(logits, dim=-1)
    return torch.nan_to_num(p, nan=0.0)


def mix_values(p, v, *, causal=True, window=None):
    """``o_i = sum_j p_ij v_j`` over the visible keys, ``p: [B, HQ, T, S]``, ``v: [B, S, H, Dv] -> [B, T, HQ, Dv]``.

    A non-finite value reaches only the rows that see it (:func:`contained_matmul`).
    """
    T, S = p.shape[-2:]
    seen = visible(T, S, causal=causal, window=window, device=p.device)
    return contained_matmul(p, repeat_kv(v, p.shape[1]).transpose(1, 2), seen).transpose(1, 2)


def _softmax_attention(q, k, v, *, causal, window, gate, scale):
    """In the inputs' dtype (``gate`` cast to it)."""
    p = softmax_weights(attention_logits(q, k, causal=causal, window=window, gate=gate, scale=scale))
    return mix_values(p, v, causal=causal, window=window)


def _upcast_attention(q, k, v, gate, **kw):
    """:func:`_softmax_attention` with the scores, ``u`` and the softmax in :func:`accumulation_dtype`."""
    acc = accumulation_dtype(q.dtype)
    gate = None if gate is None else gate.to(acc)
    return _softmax_attention(q.to(acc), k.to(acc), v.to(acc), gate=gate, **kw).to(q.dtype)


def softmax_attention(q, k, v, *, causal=True, window=None, gate=None, scale=None, cu_seqlens=None, upcast=True):
    """``o_i = sum_j softmax_j(scale q_i.k_j + u_i - u_j) v_j`` over the visible keys; ``[B, T, HQ, Dv]``.

    The scores, the gate ``u`` and the softmax are computed in fp32 (float64 for float64 inputs) and the
    output returned in q's dtype. ``upcast=False`` computes everything in the inputs' dtype, ``u`` cast to
    it: the plain low-precision computation, the baseline of the low-precision accuracy rule.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    attend = _upcast_attention if upcast else _softmax_attention
    if gate is None:
        return per_sequence(attend, cu_seqlens, q, q, k, v, causal=causal, window=window, gate=None, scale=scale)
    return per_sequence(lambda q, k, v, g: attend(q, k, v, causal=causal, window=window, gate=g, scale=scale),
                        cu_seqlens, q, q, k, v, gate)
