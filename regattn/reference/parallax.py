"""Parallax: softmax attention plus a covariance correction read through a probe ``r`` (parallax.txt).

Three equal forms of one output, each written the way the paper writes it:

* ``"eq8"``: the weighted average ``sum_j w_ij (1 - t_ij + tbar_i) v_j / sum_j w_ij (1 - t_ij + tbar_i)``
  with ``w_ij = exp(scale q_i.k_j - m_i)`` (eq. 8, left);
* ``"eq14"``: the streaming form ``(sum_j p_ij v_j)(1 + sum_j p_ij t_ij) - sum_j p_ij t_ij v_j`` (eq. 14);
* ``"score"``: ``sum_j s_ij v_j`` with ``s_ij = p_ij (1 - t_ij + tbar_i)`` (eq. 18).

Here ``p_ij = softmax_j(scale q_i.k_j)`` over the keys query ``i`` sees, ``t_ij = r_i.k_j`` (not scaled)
and ``tbar_i = sum_j p_ij t_ij``. The paper writes ``t_ij = rho_i.(k_j - q_i)``; the shift by
``rho_i.q_i`` is the same for every ``j`` and cancels in ``t_ij - tbar_i``, so it is left out.
A query that sees no key gets a zero output and zero scores.
"""
from __future__ import annotations

import torch

from regattn.reference.common import contained_scores, per_sequence, repeat_kv, visible
from regattn.reference.softmax import attention_logits, mix_values, softmax_weights

FORMS = ("eq8", "eq14", "score")


def _probe_scores(r, k, *, causal, window):
    """``t = r.k``, ``[B, HQ, T, S]``, exactly 0 where hidden (k already repeated to HQ heads)."""
    t = contained_scores(r.transpose(1, 2), k.transpose(1, 2))
    seen = visible(r.shape[1], k.shape[1], causal=causal, window=window, device=r.device)
    return torch.where(seen, t, t.new_zeros(()))


def _weights_and_probe(q, r, k, *, causal, window, scale):
    """Softmax weights ``p``, probe scores ``t`` and their mean ``tbar = sum_j p t`` (``[B, HQ, T, 1]``)."""
    logits = attention_logits(q, k, causal=causal, window=window, scale=scale)
    p = softmax_weights(logits)
    t = _probe_scores(r, repeat_kv(k, q.shape[2]), causal=causal, window=window)
    tbar = (p * t).sum(-1, keepdim=True)
    return logits, p, t, tbar


def _scores(q, r, k, *, causal, window, scale):
    """``s_ij = p_ij (1 - t_ij + tbar_i)``, eq. 18; ``[B, HQ, T, S]``."""
    _, p, t, tbar = _weights_and_probe(q, r, k, causal=causal, window=window, scale=scale)
    return p * (1 + tbar - t)


def _parallax_score(q, r, k, v, *, causal, window, scale):
    s = _scores(q, r, k, causal=causal, window=window, scale=scale)
    return mix_values(s, v, causal=causal, window=window)


def _parallax_eq14(q, r, k, v, *, causal, window, scale):
    _, p, t, tbar = _weights_and_probe(q, r, k, causal=causal, window=window, scale=scale)
    vbar = mix_values(p, v, causal=causal, window=window)
    o2 = mix_values(p * t, v, causal=causal, window=window)
    return vbar * (1 + tbar.transpose(1, 2)) - o2


def _parallax_eq8(q, r, k, v, *, causal, window, scale):
    logits, p, t, tbar = _weights_and_probe(q, r, k, causal=causal, window=window, scale=scale)
    m = logits.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(logits - m)  # zero where hidden
    a = w * (1 - t + tbar)
    num = mix_values(a, v, causal=causal, window=window)
    den = a.sum(-1).transpose(1, 2)[..., None]  # [B, T, HQ, 1]; equals sum_j w_ij
    den = torch.where(den == 0, torch.ones_like(den), den)
    return num / den


_FORM_FNS = {"eq8": _parallax_eq8, "eq14": _parallax_eq14, "score": _parallax_score}


def parallax(q, r, k, v, *, causal=True, window=None, scale=None, cu_seqlens=None, form="eq14"):
    """Parallax attention in plain PyTorch (the inputs' dtype; pass float64 for the exact spec).

    Args:
        q, r: ``[B, T, HQ, D]`` queries and probes; k: ``[B, S, H, D]``; v: ``[B, S, H, Dv]``.
        causal, window: which keys each query sees (queries aligned to the end of the keys).
        scale: softmax scale on ``q.k`` (default ``D ** -0.5``); ``r.k`` is not scaled.
        cu_seqlens: packed sequence offsets (``B == 1``).
        form: ``"eq8"``, ``"eq14"`` or ``"score"`` (the same numbers, see the module docstring).

    Returns:
        ``[B, T, HQ, Dv]``.
    """
    if form not in _FORM_FNS:
        raise ValueError(f"form: expected one of {FORMS}, got {form!r}")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    fn = _FORM_FNS[form]
    return per_sequence(lambda q, r, k, v: fn(q, r, k, v, causal=causal, window=window, scale=scale),
                        cu_seqlens, q, q, r, k, v)


def parallax_scores(q, r, k, *, causal=True, window=None, scale=None):
    """The per-token Parallax weights ``s_ij = p_ij (1 - t_ij + tbar_i)`` (eq. 18), ``[B, HQ, T, S]``.

    Each visible row sums to one; entries may be negative or exceed one.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _scores(q, r, k, causal=causal, window=window, scale=scale)
