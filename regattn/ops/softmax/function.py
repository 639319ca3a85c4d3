"""Fused softmax attention as ``torch.library`` custom ops with a registered backward, so it trains and
compiles: torch.compile treats the kernels as opaque calls (as it does Parallax's) instead of tracing their
launches.

``regattn::attention_fwd`` returns ``(o, lse2)``; only ``o`` carries gradients. ``window <= 0`` means no
window, ``max_seqlen <= 0`` that the longest packed sequence is read from ``cu_seqlens``. Without a gate the
backward's ``du`` is an empty tensor.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from regattn.ops._common.vmap import fold_rule
from regattn.ops.softmax.kernels import attention_backward, attention_forward


def _options(causal: bool, window: int, scale: float, max_seqlen: int) -> dict:
    return dict(causal=causal, window=window if window > 0 else None, scale=scale,
                max_seqlen=max_seqlen if max_seqlen > 0 else None)


@torch.library.custom_op("regattn::attention_fwd", mutates_args=())
def attention_fwd_op(q: Tensor, k: Tensor, v: Tensor, u: Optional[Tensor], causal: bool, window: int, scale: float,
                     cu_seqlens: Optional[Tensor], max_seqlen: int) -> tuple[Tensor, Tensor]:
    return attention_forward(q, k, v, u, cu_seqlens=cu_seqlens, **_options(causal, window, scale, max_seqlen))


@attention_fwd_op.register_fake
def _(q, k, v, u, causal, window, scale, cu_seqlens, max_seqlen):
    B, T, HQ, _ = q.shape
    return q.new_empty(B, T, HQ, v.shape[3]), q.new_empty(B, T, HQ, dtype=torch.float32)


@torch.library.custom_op("regattn::attention_bwd", mutates_args=())
def attention_bwd_op(do: Tensor, q: Tensor, k: Tensor, v: Tensor, u: Optional[Tensor], o: Tensor, lse: Tensor,
                     causal: bool, window: int, scale: float, cu_seqlens: Optional[Tensor],
                     max_seqlen: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    dq, dk, dv, du = attention_backward(do, q, k, v, u, o, lse, cu_seqlens=cu_seqlens,
                                        **_options(causal, window, scale, max_seqlen))
    return dq, dk, dv, du if du is not None else q.new_empty(0, dtype=torch.float32)


@attention_bwd_op.register_fake
def _(do, q, k, v, u, o, lse, causal, window, scale, cu_seqlens, max_seqlen):
    du = q.new_empty(q.shape[:3], dtype=torch.float32) if u is not None else q.new_empty(0, dtype=torch.float32)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), du


def _setup_context(ctx, inputs, output):
    q, k, v, u, causal, window, scale, cu_seqlens, max_seqlen = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, u, o, lse, cu_seqlens)
    ctx.args = (causal, window, scale, max_seqlen)
    ctx.mark_non_differentiable(lse)


def _backward(ctx, do, _dlse):
    q, k, v, u, o, lse, cu_seqlens = ctx.saved_tensors
    dq, dk, dv, du = attention_bwd_op(do, q, k, v, u, o, lse, *ctx.args[:3], cu_seqlens, ctx.args[3])
    return dq, dk, dv, None if u is None else du.to(u.dtype), None, None, None, None, None


attention_fwd_op.register_autograd(_backward, setup_context=_setup_context)
torch.library.register_vmap(attention_fwd_op, fold_rule(attention_fwd_op, batched=(0, 1, 2, 3), outputs=(0, 0),
                                                        whole=(7,)))


def flash_attention(q, k, v, u=None, *, causal=True, window=None, scale, cu_seqlens=None, max_seqlen=None):
    """Fused attention; inputs as in :func:`regattn.softmax_attention` (already checked)."""
    o, _ = attention_fwd_op(q, k, v, u, bool(causal), int(window or 0), float(scale), cu_seqlens,
                            int(max_seqlen or 0))
    return o
