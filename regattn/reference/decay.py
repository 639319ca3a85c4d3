"""Exponentially decaying causal linear attention: the six LeetDecoding methods in plain PyTorch.

``O = (B C^T ⊙ M) V`` with ``M_ij = gamma^(i - j)`` for ``i >= j`` and 0 otherwise
(leetdecoding.txt eq. 4), per batch and head. Every method computes the same numbers;
they differ only in the order of the work:

- ``vanilla``: the ``T x T`` masked matrix, eq. (4) as written.
- ``causal_dot_product``: the row recurrence ``U_i = gamma U_{i-1} + c_i^T v_i``,
  ``o_i = b_i U_i`` (Appendix B.1, Algorithm 1).
- ``block_based``: blocks in sequence, a masked product inside the block plus the carried
  state (Appendix B.2, Algorithm 2, eq. 12-13 with the decay factors).
- ``recursion``: halve, recurse on the diagonal halves, right-multiply the unmasked
  lower-left block (Appendix B.3, Algorithms 3-4).
- ``lightning2``: intra-block products for all blocks at once, per-block state summaries,
  a scan over blocks for the carried state, then the inter-block term (Section 3.2).
- ``fleet``: ``O = sum_r diag(b_r) lambda-cumsum(diag(c_r) V)`` (Section 3.1 eq. 5,
  Algorithm 5, Appendix C.1).

Decay powers are only ever formed with non-negative exponents, so gamma near 0 and long
sequences with gamma = 1 stay finite. A non-finite key (c) or value (v) reaches only the rows that
see it: masked weights are zeros set by ``where``, and a non-finite entry enters no matrix product;
the rows at or after it get NaN instead. Computation runs in the inputs' dtype (float64 for
the exact reference) and is differentiable by autograd, in ``gamma`` too.

Layout: ``b, c: [B, T, H, R]``, ``v: [B, T, H, D]``, ``gamma: [H]`` or None (no decay).
"""
from __future__ import annotations

from functools import partial

import torch

METHODS = ("vanilla", "causal_dot_product", "block_based", "recursion", "lightning2", "fleet")
BLOCK = 64          # block size of block_based and lightning2, chunk of fleet's lambda-cumsum
RECURSION_LEAF = 32  # termination size of the recursion


def _log_gamma(gamma, H: int, like: torch.Tensor) -> torch.Tensor:
    """``log gamma`` as ``[H]`` in like's dtype (zeros when gamma is None)."""
    if gamma is None:
        return torch.zeros(H, dtype=like.dtype, device=like.device)
    return torch.log(gamma.to(like.dtype))


def _powers(log_g: torch.Tensor, exponents: torch.Tensor) -> torch.Tensor:
    """``gamma^e`` for non-negative ``exponents [...]``: returns ``[H, ...]``."""
    e = exponents.to(log_g.dtype)
    return torch.exp(log_g.view(-1, *([1] * e.dim())) * e)


def _decay_mask(log_g: torch.Tensor, n: int) -> torch.Tensor:
    """``M: [H, n, n]`` with ``M_ij = gamma^(i - j)`` for ``i >= j``, else 0."""
    idx = torch.arange(n, device=log_g.device)
    dist = idx[:, None] - idx[None, :]
    return torch.where(dist >= 0, _powers(log_g, dist.clamp_min(0)), torch.zeros((), dtype=log_g.dtype, device=log_g.device))


def _heads_first(*xs):
    """``[B, T, H, X] -> [B, H, T, X]``."""
    return [x.transpose(1, 2) for x in xs]


def _finite(x: torch.Tensor) -> torch.Tensor:
    """``x`` with its non-finite entries set to 0."""
    return torch.where(torch.isfinite(x), x, torch.zeros((), dtype=x.dtype, device=x.device))


def _seen_nonfinite(x: torch.Tensor) -> torch.Tensor:
    """Bool ``[..., n, X]``: row ``i`` sees a non-finite ``x_jd`` at some ``j <= i`` (per column d)."""
    return torch.cumsum((~torch.isfinite(x)).to(torch.int32), dim=-2) > 0


def _poison(o: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
    """``o`` plus NaN where ``seen``; the NaN is a constant, so gradients reach ``o`` unchanged."""
    return o + torch.zeros_like(o).masked_fill(seen, float("nan"))


def _causal_matmul(w, x):
    """``w @ x`` for a lower-triangular ``w [..., n, n]`` whose zeros above the diagonal are exact:
    ``x [..., n, X]`` enters the product with non-finite entries zeroed (a zero weight times NaN is NaN),
    and the rows that see one get NaN."""
    return _poison(w @ _finite(x), _seen_nonfinite(x))


def _masked_block(b, c, v, mask):
    """``(b c^T ⊙ mask) v`` for ``b, c: [..., n, R]``, ``v: [..., n, D]``, ``mask: [..., n, n]`` lower triangular.

    The weights above the diagonal are zeros set by ``where``; a non-finite ``c_j`` or ``v_j`` reaches
    only the rows ``i >= j``, forward and backward.
    """
    n = b.shape[-2]
    causal = torch.ones(n, n, dtype=torch.bool, device=b.device).tril()
    scores = b @ _finite(c).transpose(-1, -2)
    w = torch.where(causal, scores * mask, torch.zeros((), dtype=scores.dtype, device=b.device))
    seen_c = _seen_nonfinite(c).any(dim=-1, keepdim=True)
    return _poison(w @ _finite(v), seen_c | _seen_nonfinite(v))


# --- the six methods, each on [B, H, T, X] tensors ------------------------------------------

def _vanilla(b, c, v, log_g):
    return _masked_block(b, c, v, _decay_mask(log_g, b.shape[2]))


def _causal_dot_product(b, c, v, log_g):
    """Algorithm 1 with decay: ``U <- gamma U + c_i^T v_i``; ``o_i = b_i U``."""
    Bsz, H, T, R = b.shape
    g = torch.exp(log_g).view(1, H, 1, 1)
    U = b.new_zeros(Bsz, H, R, v.shape[-1])
    rows = []
    for i in range(T):
        U = g * U + c[:, :, i, :, None] * v[:, :, i, None, :]
        rows.append((b[:, :, i, None, :] @ U)[:, :, 0])
    return torch.stack(rows, dim=2)


def _block_based(b, c, v, log_g, block: int = BLOCK):
    """Algorithm 2 with decay (eq. 12-13): blocks in order, carrying ``U`` (state after the previous block)."""
    Bsz, H, T, R = b.shape
    U = b.new_zeros(Bsz, H, R, v.shape[-1])
    outs = []
    for s in range(0, T, block):
        bi, ci, vi = b[:, :, s:s + block], c[:, :, s:s + block], v[:, :, s:s + block]
        n = bi.shape[2]
        p = torch.arange(n, device=b.device)
        into = _powers(log_g, p + 1)[None, :, :, None]           # gamma^(p+1): from the carried state to row p
        out_of = _powers(log_g, n - 1 - p)[None, :, :, None]     # gamma^(n-1-p): from row p to the block's end
        outs.append(_masked_block(bi, ci, vi, _decay_mask(log_g, n)) + (into * bi) @ U)
        U = _powers(log_g, torch.tensor(n, device=b.device))[None, :, None, None] * U \
            + (out_of * ci).transpose(-1, -2) @ vi
    return torch.cat(outs, dim=2)


def _recursion(b, c, v, log_g, leaf: int = RECURSION_LEAF):
    """Algorithms 3-4: the lower-left block ``(W1 b2)((W2 c1)^T v1)`` plus two half-size recursions."""
    n = b.shape[2]
    if n <= leaf:
        return _vanilla(b, c, v, log_g)
    n1 = n // 2
    n2 = n - n1
    b1, b2 = b[:, :, :n1], b[:, :, n1:]
    c1, c2 = c[:, :, :n1], c[:, :, n1:]
    v1, v2 = v[:, :, :n1], v[:, :, n1:]
    w1 = _powers(log_g, torch.arange(1, n2 + 1, device=b.device))[None, :, :, None]   # gamma^(p+1)
    w2 = _powers(log_g, torch.arange(n1 - 1, -1, -1, device=b.device))[None, :, :, None]  # gamma^(n1-1-q)
    o3 = (w1 * b2) @ ((w2 * c1).transpose(-1, -2) @ v1)
    return torch.cat([_recursion(b1, c1, v1, log_g, leaf), _recursion(b2, c2, v2, log_g, leaf) + o3], dim=2)


def _pad_blocks(x, block: int):
    """``[B, H, T, X] -> [B, H, N, block, X]`` with zero rows appended to fill the last block."""
    T = x.shape[2]
    N = -(-T // block)
    x = torch.nn.functional.pad(x, (0, 0, 0, N * block - T))
    return x.reshape(*x.shape[:2], N, block, x.shape[-1])


def _lightning2(b, c, v, log_g, block: int = BLOCK):
    """Intra-block ``(b c^T ⊙ M) v`` for all blocks at once; inter-block through the carried states.

    Zero padding at the end only adds rows past T, which never reach earlier rows.
    """
    Bsz, H, T, R = b.shape
    bb, cb, vb = (_pad_blocks(x, block) for x in (b, c, v))          # [B, H, N, L, X]
    N = bb.shape[2]
    p = torch.arange(block, device=b.device)
    intra = _masked_block(bb, cb, vb, _decay_mask(log_g, block)[None, :, None])
    out_of = _powers(log_g, block - 1 - p)[None, :, None, :, None]
    # [B, H, N-1, R, D]: each block's own state (the last block's is never read: left out, so that a
    # non-finite row there cannot reach its earlier rows through a zero gradient)
    summaries = (out_of * cb[:, :, :-1]).transpose(-1, -2) @ vb[:, :, :-1]
    g_block = _powers(log_g, torch.tensor(block, device=b.device))[None, :, None, None]
    states = [b.new_zeros(Bsz, H, R, v.shape[-1])]                   # state before block n
    for n in range(N - 1):
        states.append(g_block * states[-1] + summaries[:, :, n])
    states = torch.stack(states, dim=2)                              # [B, H, N, R, D]
    into = _powers(log_g, p + 1)[None, :, None, :, None]
    inter = (into * bb) @ states
    o = (intra + inter).reshape(Bsz, H, N * block, v.shape[-1])
    return o[:, :, :T]


def _lambda_cumsum(x, log_g, chunk: int = BLOCK):
    """Discounted cumsum along dim 2 (Appendix C.1): ``y_t = x_t + gamma y_{t-1}``.

    ``x: [B, H, T, ...]``. Inside a chunk the operator is the ``chunk x chunk`` decay matrix;
    the last row of each chunk carries into the next with ``gamma^(p+1)``.
    """
    Bsz, H, T = x.shape[:3]
    tail = x.shape[3:]
    flat = x.reshape(Bsz, H, T, -1)
    p = torch.arange(chunk, device=x.device)
    outs, carry = [], None
    for s in range(0, T, chunk):
        xi = flat[:, :, s:s + chunk]
        n = xi.shape[2]
        yi = _causal_matmul(_decay_mask(log_g, n)[None], xi)
        if carry is not None:
            yi = yi + _powers(log_g, p[:n] + 1)[None, :, :, None] * carry[:, :, None]
        carry = yi[:, :, -1]
        outs.append(yi)
    return torch.cat(outs, dim=2).reshape(Bsz, H, T, *tail)


def _fleet(b, c, v, log_g, chunk: int = BLOCK):
    """Eq. (5) / C.1: ``O = sum_r diag(b_r) lambda-cumsum(diag(c_r) V)``, all ranks at once."""
    terms = _lambda_cumsum(c[..., :, None] * v[..., None, :], log_g, chunk)   # [B, H, T, R, D]
    return (b[..., :, None] * terms).sum(dim=3)


_IMPLS = {
    "vanilla": _vanilla,
    "causal_dot_product": _causal_dot_product,
    "block_based": _block_based,
    "recursion": _recursion,
    "lightning2": _lightning2,
    "fleet": _fleet,
}


def decay_linear_attention(b, c, v, gamma=None, *, method: str = "vanilla", block: int | None = None,
                           initial_state=None, output_final_state: bool = False, cu_seqlens=None):
    """``O = (B C^T ⊙ M) V``, ``M_ij = gamma^(i - j)`` for ``i >= j`` (leetdecoding.txt eq. 4), from a state.

    With an initial state ``S_0`` (1-based t): ``o_t = b_t (gamma^t S_0 + sum_{j<=t} gamma^(t-j) c_j^T v_j)``,
    and the state after the last token is ``S_T = gamma^T S_0 + sum_j gamma^(T-j) c_j^T v_j``.

    Args:
        b: ``[B, T, H, R]``; c: ``[B, T, H, R]``; v: ``[B, T, H, D]``.
        gamma: ``[H]`` in (0, 1], or None for 1 (plain causal linear attention).
        method: one of ``METHODS``; all give the same numbers up to rounding.
        block: block size of ``block_based`` and ``lightning2``, chunk of ``fleet``'s
            lambda-cumsum, leaf size of ``recursion`` (defaults 64, 64, 64, 32).
        initial_state: ``[N, H, R, D]`` (N = B, or the number of packed sequences), or None for zeros.
        output_final_state: also return ``S_T: [N, H, R, D]``.
        cu_seqlens: ``[N + 1]`` offsets of packed sequences (B == 1); each starts from its own state.

    Returns:
        ``o: [B, T, H, D]`` in the inputs' dtype; ``(o, S_T)`` with ``output_final_state``, the state in
        float32 (float64 for float64 inputs).
    """
    if method not in _IMPLS:
        raise ValueError(f"method: expected one of {', '.join(map(repr, METHODS))}, got {method!r}")
    return with_state(partial(_parallel, method=method, block=block), b, c, v, gamma, initial_state=initial_state,
                      output_final_state=output_final_state, cu_seqlens=cu_seqlens)


def _parallel(b, c, v, gamma, *, method: str, block: int | None):
    """One method's parallel form from a zero state: ``[B, T, H, X] -> o [B, T, H, D]``."""
    log_g = _log_gamma(gamma, b.shape[2], b)
    bh, ch, vh = _heads_first(b, c, v)
    impl = _IMPLS[method]
    if block is not None and method != "vanilla" and method != "causal_dot_product":
        return impl(bh, ch, vh, log_g, block).transpose(1, 2)
    return impl(bh, ch, vh, log_g).transpose(1, 2)


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """States are float32, float64 for float64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def with_state(parallel, b, c, v, gamma=None, *, initial_state=None, output_final_state: bool = False,
               cu_seqlens=None):
    """Any parallel form ``parallel(b, c, v, gamma) -> o`` (from a zero state) with an initial state, the
    final state and packed sequences, as in ``decay_linear_attention``."""
    if cu_seqlens is not None:
        return _packed(parallel, b, c, v, gamma, initial_state, output_final_state, cu_seqlens)
    o = parallel(b, c, v, gamma)
    if initial_state is None and not output_final_state:
        return o
    o, state = _state_terms(o, b, c, v, gamma, initial_state)
    return (o, state) if output_final_state else o


def _state_terms(o, b, c, v, gamma, initial_state):
    """``o`` plus the initial state's share ``gamma^(t+1) b_t S_0`` (0-based t), and the final state."""
    T, H = b.shape[1], b.shape[2]
    sdt = state_dtype(v.dtype)
    bh, ch, vh = _heads_first(b.to(sdt), c.to(sdt), v.to(sdt))
    log_g = _log_gamma(gamma, H, vh)
    t = torch.arange(T, device=b.device)
    state = (_powers(log_g, T - 1 - t)[None, :, :, None] * ch).transpose(-1, -2) @ vh
    if initial_state is None:
        return o, state
    s0 = initial_state.to(sdt)
    carried = ((_powers(log_g, t + 1)[None, :, :, None] * bh) @ s0).transpose(1, 2)
    state = state + _powers(log_g, torch.tensor(T, device=b.device))[None, :, None, None] * s0
    return (o.to(sdt) + carried).to(o.dtype), state


def _packed(parallel, b, c, v, gamma, initial_state, output_final_state, cu_seqlens):
    """Packed sequences one at a time (reads the offsets on the host)."""
    bounds = cu_seqlens.tolist()
    outs, states = [], []
    for n, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        s0 = None if initial_state is None else initial_state[n:n + 1]
        if end == start:
            H, R, D = b.shape[2], b.shape[3], v.shape[3]
            states.append(b.new_zeros(1, H, R, D, dtype=state_dtype(v.dtype)) if s0 is None
                          else s0.to(state_dtype(v.dtype)))
            continue
        o, state = with_state(parallel, b[:, start:end], c[:, start:end], v[:, start:end], gamma,
                              initial_state=s0, output_final_state=True)
        outs.append(o)
        states.append(state)
    o = torch.cat(outs, dim=1) if outs else v.new_zeros(v.shape)
    return (o, torch.cat(states)) if output_final_state else o


def decay_linear_step(state, b_t, c_t, v_t, gamma=None):
    """One decoding token in O(R * D): ``S <- gamma S + c_t^T v_t``, ``o_t = b_t S``.

    Args:
        state: ``[B, H, R, D]`` (the state after the previous token) or None for zeros.
        b_t, c_t: ``[B, H, R]``; v_t: ``[B, H, D]``; gamma: ``[H]`` or None.

    Returns:
        ``(o_t [B, H, D], state [B, H, R, D])``.
    """
    H = b_t.shape[1]
    kv = c_t[..., :, None] * v_t[..., None, :]
    if state is None:
        state = kv
    else:
        g = torch.exp(_log_gamma(gamma, H, b_t)).view(1, H, 1, 1)
        state = g * state.to(kv.dtype) + kv
    o_t = (b_t[..., None, :] @ state)[..., 0, :]
    return o_t, state


def decay_linear_prefill(b, c, v, gamma=None, *, initial_state=None, method: str = "vanilla"):
    """The parallel form and the state after the last token, ready for ``decay_linear_step``:
    ``decay_linear_attention(..., output_final_state=True)``.

    Args:
        b, c: ``[B, T, H, R]``; v: ``[B, T, H, D]``; gamma: ``[H]`` or None.
        initial_state: ``[B, H, R, D]`` carried from an earlier segment, or None.
        method: the method for the parallel part.

    Returns:
        ``(o [B, T, H, D], state [B, H, R, D])``.
    """
    return decay_linear_attention(b, c, v, gamma, method=method, initial_state=initial_state,
                                  output_final_state=True)
