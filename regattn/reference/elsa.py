"""ELSA: exact softmax attention as a scan over the ``(m, S, W)`` monoid (elsa-supplementary.txt A.1-A.4).

A state ``(m, S, W)`` summarises a set of keys seen by one query: the largest logit ``m``,
``S = sum_j exp(s_j - m)`` and ``W = sum_j exp(s_j - m) v_j``. Key ``j`` is the leaf
``(s_j, 1, v_j)``; two states merge by un-sum-renorm (eq. 4); the identity is
``(-inf, 0, 0)`` (eq. 5). The output of a query is ``W / S`` of the merge of its keys.

The merge is associative, so any order of merges gives the same result up to rounding:
``order="sequential"`` is the left fold of Algorithm 1, ``order="tree"`` a balanced pairwise
reduction of depth ``ceil(log2 n)``. The causal form runs an inclusive prefix scan over the
keys (sequentially, or Hillis-Steele with ``order="tree"``) and reads each query's prefix.
"""
from __future__ import annotations

import torch

from regattn.reference.common import contained_matmul, contained_scores, per_sequence, repeat_kv, visible

ORDERS = ("sequential", "tree")


# ----------------------------------------------------------------------------- the monoid

def identity(shape_m, dv: int, *, dtype=torch.float64, device=None):
    """The identity ``(-inf, 0, 0)``: ``m, S: shape_m``, ``W: [*shape_m, dv]``."""
    m = torch.full(shape_m, float("-inf"), dtype=dtype, device=device)
    s = torch.zeros(shape_m, dtype=dtype, device=device)
    return m, s, torch.zeros(*shape_m, dv, dtype=dtype, device=device)


def leaves(logits: torch.Tensor, v: torch.Tensor):
    """Leaf states of every (query, key) pair.

    Args:
        logits: ``[..., T, S]`` with ``-inf`` where the key is hidden.
        v: ``[..., S, Dv]`` (broadcast against the query dim).

    Returns:
        ``(m [..., T, S], S [..., T, S], W [..., T, S, Dv])``: ``(s_j, 1, v_j)`` for a visible key,
        the identity ``(-inf, 0, 0)`` for a hidden one.
    """
    seen = logits != float("-inf")
    s = seen.to(logits.dtype)
    w = torch.where(seen.unsqueeze(-1), v.unsqueeze(-3), v.new_zeros(()))  # a hidden NaN value stays out
    return logits, s, w


def _anchor(m: torch.Tensor) -> torch.Tensor:
    """``m`` with ``-inf`` replaced by 0, so that ``exp(m_a - anchor)`` is 0, never ``exp(-inf + inf)``."""
    return torch.where(m == float("-inf"), torch.zeros_like(m), m)


def combine(a, b):
    """Un-sum-renorm merge ``a (+) b`` of two states of equal shape (eq. 4).

    ``m = max(m_a, m_b)``; ``S = S_a e^(m_a - m) + S_b e^(m_b - m)``; ``W`` alike. Two identities
    merge to the identity (the exponents are taken against an anchor of 0, not ``-inf``).
    """
    ma, sa, wa = a
    mb, sb, wb = b
    m = torch.maximum(ma, mb)
    ref = _anchor(m)
    ea, eb = torch.exp(ma - ref), torch.exp(mb - ref)
    return m, sa * ea + sb * eb, wa * ea.unsqueeze(-1) + wb * eb.unsqueeze(-1)


def finalize(state) -> torch.Tensor:
    """``W / S``, and 0 for the identity (a query that sees no key): ``[..., Dv]``."""
    _, s, w = state
    return w / torch.where(s > 0, s, torch.ones_like(s)).unsqueeze(-1)


# ----------------------------------------------------------------------------- reductions and scans

def _take(state, index):
    """Slice every part of a state on the key dim (dim -1 of ``m, S``; dim -2 of ``W``)."""
    m, s, w = state
    return m[..., index], s[..., index], w[..., index, :]


def _pad_identity(state, n: int):
    """Append ``n`` identity leaves on the key dim."""
    m, s, w = state
    e = identity((*m.shape[:-1], n), w.shape[-1], dtype=m.dtype, device=m.device)
    return torch.cat([m, e[0]], -1), torch.cat([s, e[1]], -1), torch.cat([w, e[2]], -2)


def reduce_sequential(state):
    """Left fold ``((e (+) x_1) (+) x_2) ...`` over the key dim (Algorithm 1)."""
    m, _, w = state
    acc = identity(m.shape[:-1], w.shape[-1], dtype=m.dtype, device=m.device)
    for j in range(m.shape[-1]):
        acc = combine(acc, _take(state, j))
    return acc


def reduce_tree(state):
    """Balanced pairwise reduction over the key dim: depth ``ceil(log2 n)``."""
    while state[0].shape[-1] > 1:
        if state[0].shape[-1] % 2:
            state = _pad_identity(state, 1)
        state = combine(_take(state, slice(0, None, 2)), _take(state, slice(1, None, 2)))
    return _take(state, 0)


def scan_sequential(state):
    """Inclusive prefix scan over the key dim, left to right: prefix ``j`` merges leaves ``0..j``."""
    m, _, w = state
    acc = identity(m.shape[:-1], w.shape[-1], dtype=m.dtype, device=m.device)
    out = []
    for j in range(m.shape[-1]):
        acc = combine(acc, _take(state, j))
        out.append(acc)
    return (torch.stack([o[0] for o in out], -1), torch.stack([o[1] for o in out], -1),
            torch.stack([o[2] for o in out], -2))


def scan_hillis_steele(state):
    """Inclusive prefix scan over the key dim in ``ceil(log2 n)`` steps (Hillis-Steele).

    Step ``d`` merges each prefix with the one ``d`` keys before it (the identity before the start).
    """
    n = state[0].shape[-1]
    d = 1
    while d < n:
        m, s, w = _take(state, slice(0, n - d))
        e = identity((*m.shape[:-1], d), w.shape[-1], dtype=m.dtype, device=m.device)
        shifted = torch.cat([e[0], m], -1), torch.cat([e[1], s], -1), torch.cat([e[2], w], -2)
        state = combine(shifted, state)
        d *= 2
    return state


REDUCE = {"sequential": reduce_sequential, "tree": reduce_tree}
SCAN = {"sequential": scan_sequential, "tree": scan_hillis_steele}


# ----------------------------------------------------------------------------- attention

def _scan_attention(q, k, v, *, causal, window, scale, order):
    B, T, HQ, _ = q.shape
    S = k.shape[1]
    k, v = repeat_kv(k, HQ), repeat_kv(v, HQ)
    logits = contained_scores(q.transpose(1, 2), k.transpose(1, 2)) * scale
    vv = v.transpose(1, 2)  # [B, HQ, S, Dv]
    if not causal:
        mask = visible(T, S, causal=False, window=window, device=q.device)
        state = REDUCE[order](leaves(logits.masked_fill(~mask, float("-inf")), vv))
        return finalize(state).transpose(1, 2)
    # Causal: keys outside the window (if any) are identity leaves; query i reads the prefix
    # that ends at its own position i + S - T (the identity when that lies before the first key).
    mask = visible(T, S, causal=False, window=window, device=q.device)
    state = SCAN[order](leaves(logits.masked_fill(~mask, float("-inf")), vv))
    pos = torch.arange(T, device=q.device) + (S - T)
    rows = torch.arange(T, device=q.device)
    ok = pos >= 0
    m, s, w = state
    idx = pos.clamp_min(0)
    m, s, w = m[:, :, rows, idx], s[:, :, rows, idx], w[:, :, rows, idx, :]
    s = s * ok.to(s.dtype)
    return finalize((m, s, w * ok.to(w.dtype)[:, None])).transpose(1, 2)


def block_states(logits: torch.Tensor, v: torch.Tensor, block: int):
    """States of consecutive key blocks in closed form (Appendix C.2, Figure 2).

    Args:
        logits: ``[..., T, S]`` with ``-inf`` where hidden; v: ``[..., S, Dv]``.

    Returns:
        ``(m [..., T, nb], S [..., T, nb], W [..., T, nb, Dv])``, ``nb = ceil(S / block)``; block ``b``
        holds ``m = max_j s_j``, ``S = sum_j exp(s_j - m)``, ``W = sum_j exp(s_j - m) v_j`` over its keys.
    """
    T, S = logits.shape[-2:]
    nb = -(-S // block)
    pad = nb * block - S
    if pad:
        logits = torch.nn.functional.pad(logits, (0, pad), value=float("-inf"))
        v = torch.nn.functional.pad(v, (0, 0, 0, pad))
    s = logits.unflatten(-1, (nb, block))  # [..., T, nb, block]
    m = s.amax(-1)
    e = torch.exp(s - _anchor(m).unsqueeze(-1))
    seen = (s != float("-inf")).transpose(-3, -2)  # [..., nb, T, block]
    w = contained_matmul(e.transpose(-3, -2), v.unflatten(-2, (nb, block)), seen).transpose(-3, -2)
    return m, e.sum(-1), w


def _blocked_attention(q, k, v, *, causal, window, scale, block):
    T, HQ, S = q.shape[1], q.shape[2], k.shape[1]
    logits = contained_scores(q.transpose(1, 2), repeat_kv(k, HQ).transpose(1, 2)) * scale
    mask = visible(T, S, causal=causal, window=window, device=q.device)
    state = block_states(logits.masked_fill(~mask, float("-inf")), repeat_kv(v, HQ).transpose(1, 2), block)
    return finalize(reduce_tree(state)).transpose(1, 2)


def blocked_scan_attention(q, k, v, *, causal=False, scale=None, window=None, cu_seqlens=None, block=128):
    """The two-level form: each block of ``block`` keys reduced in closed form, the blocks by a tree.

    Same arguments and result as :func:`scan_attention`, with the memory of plain attention
    (``[B, HQ, T, S]`` logits) instead of one state per (query, key) pair.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return per_sequence(_blocked_attention, cu_seqlens, q, q, k, v, causal=causal, window=window, scale=scale,
                        block=block)


def scan_attention(q, k, v, *, causal=False, scale=None, order="sequential", window=None, cu_seqlens=None):
    """Softmax attention as a monoid scan; ``[B, T, HQ, Dv]`` in the inputs' dtype.

    Args:
        q: ``[B, T, HQ, D]``; k: ``[B, S, H, D]``; v: ``[B, S, H, Dv]`` (GQA when ``HQ % H == 0``).
        causal: query ``i`` (at key position ``i + S - T``) sees keys ``j <= i + S - T``, computed
            as an inclusive prefix scan; otherwise every query reduces all of its keys.
        scale: defaults to ``D ** -0.5``.
        order: ``"sequential"`` (left fold / left-to-right scan) or ``"tree"`` (pairwise tree /
            Hillis-Steele scan); equal up to rounding.
        window: keep keys ``pos - window < j`` (and ``j <= pos`` when causal).
        cu_seqlens: packed sequences (``B == 1``), each attended separately.

    A query that sees no key returns 0. Pass float64 for the exact spec.
    """
    if order not in ORDERS:
        raise ValueError(f"order: expected one of {ORDERS}, got {order!r}")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return per_sequence(_scan_attention, cu_seqlens, q, q, k, v, causal=causal, window=window, scale=scale,
                        order=order)
