"""Parallax: softmax attention plus a covariance correction probed by rho (parallax.txt eq. 8, 14)."""
from __future__ import annotations

import torch

from regattn import reference
from regattn.ops._common.checks import (
    FLOAT_DTYPES, check_attention_inputs, check_cu_seqlens, check_int, check_same, check_scale, check_seqlens_device,
    check_shape, check_tensor, check_window, host_checks_allowed, last_dim_contiguous, longest_sequence,
    resolve_backend,
)
from regattn.ops.parallax.decode import parallax_decode_fwd

HAS_TRITON = True

_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check_kernel_dtype(x: torch.Tensor) -> None:
    if x.dtype not in _KERNEL_DTYPES:
        raise TypeError(f"q: backend='triton' takes fp16, bf16 or fp32, got {x.dtype}; use backend='torch'")


def parallax(q, r, k, v, *, causal=True, window=None, scale=None, cu_seqlens=None, max_seqlen=None,
             backend="auto"):
    """Parallax attention (parallax.txt eq. 8 / 14).

    With ``p_ij = softmax_j(scale * q_i.k_j)`` over the visible keys and ``t_ij = r_i.k_j``
    (not scaled):

        ``o_i = (sum_j p_ij v_j) (1 + sum_j p_ij t_ij) - sum_j p_ij t_ij v_j``.

    Args:
        q: ``[B, T, HQ, D]`` queries; r: ``[B, T, HQ, D]`` probes.
        k: ``[B, S, H, D]``; v: ``[B, S, H, Dv]`` (GQA when ``HQ % H == 0``).
        causal, window, scale, cu_seqlens: as in :func:`regattn.softmax_attention`.
        max_seqlen: the longest packed sequence (an int bound, as in flash-attn). Given, nothing is read
            from the device (no host sync); None reads it from ``cu_seqlens``.
        backend: ``"auto" | "torch" | "triton"``. ``"auto"`` runs the fused kernels on CUDA tensors in
            fp16/bf16/fp32 and the reference otherwise. The kernels are differentiable (Appendix D) and
            work under ``torch.compile``.

    Returns:
        ``o: [B, T, HQ, Dv]`` in q's dtype.
    """
    B, T, S, HQ, H, D, Dv = check_attention_inputs(q, k, v)
    check_tensor("r", r, 4)
    check_shape("r", r, q.shape, "[B, T, HQ, D] (as q)")
    check_same(q=q, r=r)
    window = check_window(window)
    if window is not None and not causal:
        raise ValueError("window: a sliding window needs causal=True")
    scale = check_scale(scale, D)
    check_seqlens_device("cu_seqlens", cu_seqlens, q)
    check_cu_seqlens(cu_seqlens, B, T, max_seqlen)
    if cu_seqlens is not None and S != T:
        raise ValueError(f"cu_seqlens: needs as many keys as queries, got T = {T} and S = {S}")
    if backend == "auto" and q.dtype not in _KERNEL_DTYPES:
        backend = "torch"
    backend = resolve_backend(backend, q, op="parallax", has_triton=HAS_TRITON)
    if backend == "torch":
        return reference.parallax(q, r, k, v, causal=causal, window=window, scale=scale, cu_seqlens=cu_seqlens)
    _check_kernel_dtype(q)
    from regattn.ops.parallax.function import parallax_triton
    max_seqlen = 0 if cu_seqlens is None else longest_sequence(cu_seqlens, max_seqlen)
    q, r, k, v = (last_dim_contiguous(x) for x in (q, r, k, v))
    return parallax_triton(q, r, k, v, causal=causal, window=window, scale=scale, cu_seqlens=cu_seqlens,
                           max_seqlen=max_seqlen)


def _same_float_rank4(q, r, k, v) -> bool:
    """Whether all four are rank-4 floating-point tensors of one device and one dtype, in one pass (what
    :func:`check_tensor` and :func:`check_same` ask of them)."""
    T = torch.Tensor
    if not (isinstance(q, T) and isinstance(r, T) and isinstance(k, T) and isinstance(v, T)):
        return False
    dtype, device = q.dtype, q.device
    return (dtype in FLOAT_DTYPES and r.dtype == dtype and k.dtype == dtype and v.dtype == dtype
            and q.dim() == r.dim() == k.dim() == v.dim() == 4
            and r.device == device and k.device == device and v.device == device)


def _check_decode_tensors(q, r, k_cache, v_cache) -> tuple[int, int, int, int, int, int, int]:
    """``q, r: [B, Tn, HQ, D]``, ``k_cache: [B, S, H, D]``, ``v_cache: [B, S, H, Dv]`` on one device in one
    float dtype, no dim empty (B aside), ``H`` dividing ``HQ`` and ``Tn <= S``; returns ``(B, Tn, HQ, D, S, H, Dv)``."""
    if not _same_float_rank4(q, r, k_cache, v_cache):  # then one of these names the fault
        check_tensor("q", q, 4)
        check_tensor("r", r, 4)
        check_tensor("k_cache", k_cache, 4)
        check_tensor("v_cache", v_cache, 4)
        check_same(q=q, r=r, k_cache=k_cache, v_cache=v_cache)
    q_shape, k_shape, v_shape = q.shape, k_cache.shape, v_cache.shape
    if r.shape != q_shape:
        raise ValueError(f"r: expected shape [B, Tn, HQ, D] (as q) = {tuple(q_shape)}, got {tuple(r.shape)}")
    B, Tn, HQ, D = q_shape
    Bk, S, H, Dk = k_shape
    if Bk != B or Dk != D:
        raise ValueError(f"k_cache: expected shape [B, S, H, D] (B, D as q) = {(B, S, H, D)}, got {tuple(k_shape)}")
    Bv, Sv, Hv, Dv = v_shape
    if Bv != B or Sv != S or Hv != H:
        raise ValueError(f"v_cache: expected shape [B, S, H, Dv] with (B, S, H) = {(B, S, H)} (as k_cache), "
                         f"got {tuple(v_shape)}")
    if min(Tn, S, H, HQ, D, Dv) < 1:
        raise ValueError(f"q, k_cache, v_cache: expected non-empty dims, got q {tuple(q_shape)}, "
                         f"k_cache {tuple(k_shape)}, v_cache {tuple(v_shape)}")
    if HQ % H:
        raise ValueError(f"q: expected a number of heads divisible by k_cache's {H} (grouped-query attention), "
                         f"got {HQ}")
    if Tn > S:
        raise ValueError(f"q: expected at most S = {S} new tokens (they are part of the cache), got {Tn}")
    return B, Tn, HQ, D, S, H, Dv


def _check_cache_seqlens(cache_seqlens, B: int, Tn: int, S: int, max_seqlen) -> None:
    """int32/int64 ``[B]`` (on q's device: :func:`check_seqlens_device` first) with every length in ``[Tn, S]``;
    ``max_seqlen`` an int in ``[Tn, S]``.

    The lengths' values are read on the host only without ``max_seqlen`` and where :func:`host_checks_allowed`;
    otherwise the caller vouches for them (the kernel clamps them to ``S``, so none reads past the cache).
    """
    if cache_seqlens is None:
        if max_seqlen is not None:
            raise ValueError(f"max_seqlen: bounds cache_seqlens, expected None without them, got {max_seqlen!r}")
        return
    if not isinstance(cache_seqlens, torch.Tensor):
        raise TypeError(f"cache_seqlens: expected a torch.Tensor, got {type(cache_seqlens).__name__}")
    if cache_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"cache_seqlens: expected an int32 or int64 tensor, got {cache_seqlens.dtype}")
    if cache_seqlens.shape != (B,):
        raise ValueError(f"cache_seqlens: expected shape [B] = ({B},), got {tuple(cache_seqlens.shape)}")
    if max_seqlen is not None:
        check_int("max_seqlen", max_seqlen, minimum=Tn)
        if max_seqlen > S:
            raise ValueError(f"max_seqlen: expected at most the cache size S = {S}, got {max_seqlen}")
        return
    if not host_checks_allowed():
        return  # no host sync in compiled or captured code; the caller vouches for the lengths
    lo, hi = torch.aminmax(cache_seqlens)
    lo, hi = int(lo), int(hi)
    if lo < Tn or hi > S:
        raise ValueError(f"cache_seqlens: expected lengths in [Tn, S] = [{Tn}, {S}] (the new tokens are in the "
                         f"cache, and no length may exceed it), got min {lo} and max {hi}")


def parallax_decode(q, r, k_cache, v_cache, *, cache_seqlens=None, max_seqlen=None, window=None, scale=None,
                    backend="auto"):
    """Parallax for new tokens against a KV cache (parallax.txt Appendix C): decode and chunked prefill.

    The new tokens' keys and values must already be in the cache: new token ``t`` of ``Tn`` sits at
    position ``cache_seqlens[b] - Tn + t`` and sees the cache causally (and within ``window``).

    Args:
        q, r: ``[B, Tn, HQ, D]`` queries and probes of the new tokens (``Tn = 1`` for one decode step).
        k_cache: ``[B, S, H, D]``; v_cache: ``[B, S, H, Dv]`` (GQA when ``HQ % H == 0``).
        cache_seqlens: int32/int64 ``[B]``, valid length of each cache in ``[Tn, S]``; None means ``S``.
        max_seqlen: an int bound on ``cache_seqlens`` in ``[Tn, S]`` (as in flash-attn). Given, the lengths
            are not read on the host (no device sync per step; lengths past ``S`` are clamped to it) and the
            K/V loop is split for ``max_seqlen`` keys. None checks the lengths on the host.
        window, scale: as in :func:`parallax`.
        backend: ``"auto" | "torch" | "triton"``.

    Returns:
        ``o: [B, Tn, HQ, Dv]`` in q's dtype (inference only: no gradient flows through the kernel).
    """
    B, Tn, HQ, D, S, H, Dv = _check_decode_tensors(q, r, k_cache, v_cache)
    window = check_window(window)
    scale = check_scale(scale, D)
    check_seqlens_device("cache_seqlens", cache_seqlens, q)
    _check_cache_seqlens(cache_seqlens, B, Tn, S, max_seqlen)
    if backend == "auto" and q.dtype not in _KERNEL_DTYPES:
        backend = "torch"
    backend = resolve_backend(backend, q, op="parallax_decode", has_triton=HAS_TRITON)
    if backend == "torch":
        return _decode_reference(q, r, k_cache, v_cache, cache_seqlens, window, scale)
    _check_kernel_dtype(q)
    return parallax_decode_fwd(q, r, k_cache, v_cache, cache_seqlens=cache_seqlens, window=window, scale=scale,
                               max_seqlen=max_seqlen)


def _decode_reference(q, r, k_cache, v_cache, cache_seqlens, window, scale):
    """The reference on each sequence's valid cache."""
    if cache_seqlens is None:
        return reference.parallax(q, r, k_cache, v_cache, window=window, scale=scale)
    outs = [reference.parallax(q[b:b + 1], r[b:b + 1], k_cache[b:b + 1, :n], v_cache[b:b + 1, :n], window=window,
                               scale=scale) for b, n in enumerate(cache_seqlens.tolist())]
    return torch.cat(outs)
