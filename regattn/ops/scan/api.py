"""ELSA: exact softmax attention as a scan over the (m, S, W) monoid (elsa-supplementary.txt A.1-A.4)."""
from __future__ import annotations

import torch

from regattn.reference.elsa import blocked_scan_attention
from regattn.ops._common.checks import (
    check_attention_inputs, check_choice, check_cu_seqlens, check_int, check_scale, check_seqlens_device,
    check_window, last_dim_contiguous, resolve_kernel_backend,
)

HAS_TRITON = True
PRECISIONS = ("ieee", "tf32x3", "fp16x3", "tf32")


def scan_attention(q, k, v, *, causal=False, scale=None, precision="ieee", window=None, partition=None,
                   cu_seqlens=None, max_seqlen=None, num_splits=None, backend="auto"):
    """Softmax attention computed as a scan over the monoid ``(m, S, W)``.

    Each key contributes ``(s_j, 1, v_j)`` with ``s_j = scale * q.k_j``; two states merge by
    un-sum-renorm: ``m = max(m_a, m_b)``, ``S = S_a e^(m_a - m) + S_b e^(m_b - m)``,
    ``W = W_a e^(m_a - m) + W_b e^(m_b - m)``; the identity is ``(-inf, 0, 0)`` and the
    output is ``W / S`` (0 for a query that sees no key).

    Args:
        q: ``[B, T, HQ, D]``; k: ``[B, S, H, D]``; v: ``[B, S, H, Dv]``; ``HQ % H == 0`` (GQA).
            With ``S != T`` the queries are the last ``T`` positions of the keys.
        causal: query ``i`` sees keys ``j <= i``.
        scale: defaults to ``D ** -0.5``.
        precision: for fp32 inputs on the Triton backend, ``"ieee"`` (strict fp32, no TF32; the forward
            works from copies of ``q`` and ``k`` laid out ``[B, H, D, T]``, so it holds twice their memory more),
            ``"tf32x3"`` (fp32-accurate products on the tensor cores), ``"fp16x3"`` (as accurate, from fp16
            parts at twice TF32's rate; values spanning more than 2^14 in one column of ``v`` lose bits below
            2^-38 of its largest: :mod:`regattn.ops.scan.split`; the backward is tf32x3's) or ``"tf32"``
            (operands rounded to the nearest TF32 value); fp16/bf16
            inputs compute in their own precision with fp32 accumulation. Their backward adds ``dq`` in fp32
            atomically (its last bits may differ between runs); under
            ``torch.use_deterministic_algorithms(True)`` it forms ``dq`` in a pass of its own instead.
        window: sliding window ``w``: keys ``i - w < j`` (and ``j <= i`` when causal).
        partition: ``w`` splits the sequence into consecutive non-overlapping windows of ``w``
            tokens (the last may be shorter), each attending only within itself — Swin's window
            attention with tokens flattened window by window. Needs ``T == S``; not with ``cu_seqlens``.
        cu_seqlens: ``[N + 1]`` int offsets of packed sequences (``B == 1``, ``T == S``), each
            attended on its own without padding.
        max_seqlen: the longest packed sequence (an int bound, as in flash-attn); given, no offset is read
            on the host (no device sync); None reads it from ``cu_seqlens``.
        num_splits: key slices per query tile, merged by a pairwise tree (a power of two, at most 64);
            None picks one from the GPU's size. Triton backend only.
        backend: ``"auto" | "torch" | "triton"``; float64 under ``"auto"`` runs the reference.

    Returns:
        ``o: [B, T, HQ, Dv]`` in q's dtype.
    """
    B, T, S, HQ, H, D, Dv = check_attention_inputs(q, k, v)
    if not isinstance(causal, bool):
        raise TypeError(f"causal: expected a bool, got {type(causal).__name__}")
    scale = check_scale(scale, D)
    check_choice("precision", precision, PRECISIONS)
    window = check_window(window)
    check_seqlens_device("cu_seqlens", cu_seqlens, q)
    cu_seqlens = check_cu_seqlens(cu_seqlens, B, T, max_seqlen)
    if cu_seqlens is not None:
        _check_self_attention("cu_seqlens", T, S)
        if cu_seqlens.device != q.device:
            raise ValueError(f"cu_seqlens: expected device {q.device} (as q), got {cu_seqlens.device}")
    if partition is not None:
        check_int("partition", partition, minimum=1)
        _check_self_attention("partition", T, S)
        if cu_seqlens is not None:
            raise ValueError("partition: expected None when cu_seqlens is given, got both")
    if num_splits is not None:
        check_int("num_splits", num_splits, minimum=1)
        if num_splits > 64 or num_splits & (num_splits - 1):
            raise ValueError(f"num_splits: expected a power of two in [1, 64], got {num_splits}")
    backend = resolve_kernel_backend(backend, q, op="scan_attention", has_triton=HAS_TRITON)
    if partition is not None:
        return _partitioned(q, k, v, partition, causal=causal, scale=scale, precision=precision, window=window,
                            num_splits=num_splits, backend=backend)
    if backend == "torch":
        return blocked_scan_attention(q, k, v, causal=causal, scale=scale, window=window,
                                      cu_seqlens=cu_seqlens)
    return _ScanAttention.apply(q, k, v, causal, window, scale, precision, cu_seqlens, num_splits, max_seqlen)


def _check_self_attention(name: str, T: int, S: int) -> None:
    if T != S:
        raise ValueError(f"{name}: expects as many queries as keys (T == S), got T = {T}, S = {S}")


def partition_offsets(B: int, T: int, size: int, device) -> torch.Tensor:
    """``cu_seqlens`` of the ``[B, T]`` tokens flattened to ``[1, B * T]`` and cut into windows of ``size``."""
    starts = torch.arange(0, T, size, device=device)
    starts = (starts[None, :] + T * torch.arange(B, device=device)[:, None]).flatten()
    return torch.cat([starts, torch.tensor([B * T], device=device)]).to(torch.int32)


def _partitioned(q, k, v, size, *, backend, **kwargs):
    """Window-partitioned attention as packed sequences: ``[B, T] -> [1, B * T]`` with window offsets."""
    B, T = q.shape[:2]
    cu = partition_offsets(B, T, size, q.device)
    flat = [x.reshape(1, B * T, *x.shape[2:]) for x in (q, k, v)]
    o = scan_attention(*flat, cu_seqlens=cu, max_seqlen=min(size, T), backend=backend, **kwargs)
    return o.reshape(B, T, *o.shape[2:])


class _ScanAttention(torch.autograd.Function):
    """The Triton forward (with ``lse`` kept when a gradient is needed) and backward."""

    @staticmethod
    def forward(ctx, q, k, v, causal, window, scale, precision, cu_seqlens, num_splits, max_seqlen):
        from regattn.ops.scan import kernels

        q, k, v = (last_dim_contiguous(x) for x in (q, k, v))
        if num_splits is None:
            nseq = q.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1
            num_splits = kernels.auto_splits(nseq * q.shape[2], q.shape[1] if cu_seqlens is None else
                                             q.shape[1] // max(nseq, 1), q.device)
        need_lse = any(ctx.needs_input_grad[:3])
        o, lse = kernels.forward(q, k, v, causal=causal, window=window, scale=scale, precision=precision,
                                 cu_seqlens=cu_seqlens, num_splits=num_splits, need_lse=need_lse,
                                 max_seqlen=max_seqlen)
        if need_lse:
            ctx.save_for_backward(q, k, v, o, lse, cu_seqlens)
            ctx.args = dict(causal=causal, window=window, scale=scale, precision=precision, max_seqlen=max_seqlen)
        return o

    @staticmethod
    def backward(ctx, do):
        from regattn.ops.scan import kernels

        q, k, v, o, lse, cu_seqlens = ctx.saved_tensors
        dq, dk, dv = kernels.backward(do, q, k, v, o, lse, cu_seqlens=cu_seqlens, **ctx.args)
        return dq, dk, dv, None, None, None, None, None, None, None
