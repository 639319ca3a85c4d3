"""FLOP and byte counts of each op, written once: TFLOP/s = flops / time, GB/s = bytes / time.

Counts are of the problem, not of a method: every method of one op is divided by the same
count, so ratios of TFLOP/s are ratios of time. A multiply-add is 2 FLOPs. Bytes count each
input read once and each output written once (the HBM floor), at ``elt`` bytes an element.
"""
from __future__ import annotations


def visible_pairs(T: int, S: int, *, causal: bool = True, window: int | None = None) -> int:
    """Number of (query, key) pairs a query sees, queries aligned to the end of the keys.

    Query ``i`` sits at position ``p = i + S - T`` and sees ``min(p + 1, window)`` keys when
    causal, ``S`` otherwise: the sum over ``p`` of ``min(p + 1, w)``.
    """
    if not causal:
        return T * S
    lo, hi = S - T + 1, S
    cap = hi if window is None else window
    mid = min(hi, cap)
    below = (lo + mid) * (mid - lo + 1) // 2 if lo <= mid else 0
    above = (hi - max(lo, cap + 1) + 1) * cap if hi > cap else 0
    return below + above


def attention_flops(B, T, S, HQ, D, Dv, *, causal=True, window=None, backward=False) -> float:
    """Softmax attention: ``2 * pairs * (D + Dv)`` per head (``QK^T`` and ``PV``), times B * HQ.

    With ``backward`` add 2.5x the forward (five products against two, FlashAttention's count).
    """
    fwd = 2.0 * visible_pairs(T, S, causal=causal, window=window) * (D + Dv) * B * HQ
    return fwd * (3.5 if backward else 1.0)


def attention_bytes(B, T, S, HQ, H, D, Dv, elt, *, backward=False, extra_per_query=0) -> float:
    """Read q ``[B,T,HQ,D]``, k ``[B,S,H,D]``, v ``[B,S,H,Dv]``, write o ``[B,T,HQ,Dv]``.

    ``extra_per_query`` elements more per query row (a probe r, a gate u). The backward reads
    q, k, v, o, do (and the extras) and writes dq, dk, dv (and their gradients).
    """
    q, kv, o = B * T * HQ * (D + extra_per_query), B * S * H * (D + Dv), B * T * HQ * Dv
    fwd = q + kv + o
    bwd = 2 * q + 2 * kv + 2 * o
    return float(elt * (fwd + (bwd if backward else 0)))


def parallax_flops(B, T, S, HQ, D, Dv, *, causal=True, window=None, backward=False) -> float:
    """Parallax (parallax.txt eq. 14): four products a pair, ``QK^T``, ``RK^T``, ``PV`` and
    ``(P*T)V``: ``4 * pairs * (D + Dv)`` per head, twice softmax attention's count."""
    return 2.0 * attention_flops(B, T, S, HQ, D, Dv, causal=causal, window=window, backward=backward)


def nsa_flops(B, T, HQ, D, Dv, *, block_cmp, stride_cmp, block_slc, topk, backward=False) -> float:
    """NSA's compression and selection branches (gatedfwa.md eq. 16-22) as softmax attention over the pairs
    each query sees: the compressed blocks that end at or before it (``n_t``) and the tokens at or before it
    of its ``topk`` selected blocks (``min(t + 1, topk block_slc)``, the selection's most)."""
    window = topk * block_slc
    cmp_pairs = sum(max(0, (t - block_cmp + 1) // stride_cmp + 1) for t in range(T))
    pairs = cmp_pairs + visible_pairs(T, T, window=window)
    return 2.0 * pairs * (D + Dv) * B * HQ * (3.5 if backward else 1.0)


def gate_flops(B, T, H) -> float:
    """GatedFWA gate (gatedfwa.md eq. 9-11): per element the product ``beta*h``, the safe
    softplus (max, exp, log1p: 3), the division and the scan's add: 6 FLOPs."""
    return 6.0 * B * T * H


def gate_bytes(B, T, H, elt) -> float:
    """Read h and beta (``elt`` bytes each), write u in fp32 (4 bytes)."""
    return float(B * T * H * (2 * elt + 4))


def decay_flops(B, T, H, R, D) -> float:
    """Decaying linear attention (leetdecoding.txt eq. 4) by its recurrent form: per token the
    state update ``S = gamma S + c v^T`` and the read-out ``b^T S``, ``2 * R * D`` multiply-adds:
    ``4 * B * T * H * R * D``. Quadratic methods do more work; this is the problem's count."""
    return 4.0 * B * T * H * R * D


def decay_bytes(B, T, H, R, D, elt) -> float:
    """Read b, c ``[B,T,H,R]`` and v ``[B,T,H,D]``, write o ``[B,T,H,D]``."""
    return float(elt * B * T * H * (2 * R + 2 * D))


def lla_flops(B, T, S, HQ, D, Dv, *, causal=True, window=None, cg_iters=None, blocks=None) -> float:
    """Local Linear Attention (lla eq. 6-8), per visible pair and head:

    logits ``q.k`` (D MACs), the weighted key moment ``mu`` (D), the output pass with the
    logits again, ``z.rho`` and ``v`` (2D + Dv); the solve either by ``cg_iters`` conjugate-
    gradient iterations, each streaming K for ``Sigma p = sum w z (z.p)`` (2D MACs, with or without
    ``blocks``), or exactly: building ``Sigma`` (D^2 MACs a pair) plus a ``D^3 / 3`` factorisation per
    query; BD-LLA's exact solve builds and factors only its ``blocks`` diagonal blocks of ``b = D / blocks``
    (``D b`` MACs a pair, ``blocks b^3 / 3`` per query).
    """
    pairs = visible_pairs(T, S, causal=causal, window=window) * B * HQ
    base = 2.0 * pairs * (4 * D + Dv)
    if cg_iters is not None:
        return base + 2.0 * pairs * cg_iters * 2 * D
    b = D // (blocks or 1)
    return base + 2.0 * pairs * D * b + (2.0 / 3.0) * (blocks or 1) * b ** 3 * B * T * HQ
