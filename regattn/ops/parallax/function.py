"""Parallax as ``torch.library`` custom ops with a registered backward, so it trains and compiles.

``regattn::parallax_fwd`` returns ``(o, vbar, stats)`` with ``stats = [tbar, m, l]`` of shape
``[3, B, HQ, T]`` (fp32); only ``o`` carries gradients. ``regattn::parallax_bwd`` is Appendix D.
``window <= 0`` means no window and ``max_seqlen`` is the longest packed sequence (ignored without
``cu_seqlens``).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from regattn.ops._common.vmap import fold_rule
from regattn.ops.parallax.backward import parallax_bwd
from regattn.ops.parallax.forward import parallax_fwd


def _window(window: int):
    return window if window > 0 else None


@torch.library.custom_op("regattn::parallax_fwd", mutates_args=())
def parallax_fwd_op(q: Tensor, r: Tensor, k: Tensor, v: Tensor, causal: bool, window: int, scale: float,
                    cu_seqlens: Optional[Tensor], max_seqlen: int) -> tuple[Tensor, Tensor, Tensor]:
    return parallax_fwd(q, r, k, v, causal=causal, window=_window(window), scale=scale, cu_seqlens=cu_seqlens,
                        max_seqlen=max_seqlen)


@parallax_fwd_op.register_fake
def _(q, r, k, v, causal, window, scale, cu_seqlens, max_seqlen):
    B, T, HQ, _ = q.shape
    o = q.new_empty(B, T, HQ, v.shape[3])
    return o, torch.empty_like(o), q.new_empty(3, B, HQ, T, dtype=torch.float32)


@torch.library.custom_op("regattn::parallax_bwd", mutates_args=())
def parallax_bwd_op(do: Tensor, q: Tensor, r: Tensor, k: Tensor, v: Tensor, o: Tensor, vbar: Tensor,
                    stats: Tensor, causal: bool, window: int, scale: float, cu_seqlens: Optional[Tensor],
                    max_seqlen: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return parallax_bwd(do, q, r, k, v, o, vbar, stats[0], stats[1], stats[2], causal=causal,
                        window=_window(window), scale=scale, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)


@parallax_bwd_op.register_fake
def _(do, q, r, k, v, o, vbar, stats, causal, window, scale, cu_seqlens, max_seqlen):
    return torch.empty_like(q), torch.empty_like(r), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, r, k, v, causal, window, scale, cu_seqlens, max_seqlen = inputs
    o, vbar, stats = output
    ctx.save_for_backward(q, r, k, v, o, vbar, stats, cu_seqlens)
    ctx.args = (causal, window, scale, max_seqlen)
    ctx.mark_non_differentiable(vbar, stats)


def _backward(ctx, do, _dvbar, _dstats):
    q, r, k, v, o, vbar, stats, cu_seqlens = ctx.saved_tensors
    causal, window, scale, max_seqlen = ctx.args
    dq, dr, dk, dv = parallax_bwd_op(do, q, r, k, v, o, vbar, stats, causal, window, scale, cu_seqlens,
                                     max_seqlen)
    return dq, dr, dk, dv, None, None, None, None, None


parallax_fwd_op.register_autograd(_backward, setup_context=_setup_context)
torch.library.register_vmap(parallax_fwd_op, fold_rule(parallax_fwd_op, batched=(0, 1, 2, 3), outputs=(0, 0, 1),
                                                       whole=(7,)))


def parallax_triton(q, r, k, v, *, causal: bool, window, scale: float, cu_seqlens=None, max_seqlen: int = 0):
    """Differentiable Parallax through the Triton kernels; returns ``o: [B, T, HQ, Dv]``."""
    o, _, _ = parallax_fwd_op(q, r, k, v, causal, window or 0, scale, cu_seqlens, max_seqlen)
    return o
