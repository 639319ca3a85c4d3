"""The fused per-head RMSNorm (or L2 norm) and RoPE (:mod:`regattn.ops.norm_rope.kernels`) as ``torch.library``
custom ops with a registered backward, so it trains and compiles. ``weight`` None and not ``l2``: no norm; ``cos,
sin`` None: no rotation."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from regattn.ops._common.vmap import fold_rule
from regattn.ops.norm_rope.kernels import norm_rope_bwd, norm_rope_fwd


@torch.library.custom_op("regattn::norm_rope_fwd", mutates_args=())
def norm_rope_fwd_op(x: Tensor, weight: Optional[Tensor], cos: Optional[Tensor], sin: Optional[Tensor],
                     eps: float, dtype: Optional[torch.dtype], l2: bool) -> tuple[Tensor, Tensor]:
    return norm_rope_fwd(x, weight, cos, sin, eps, dtype, l2)


@norm_rope_fwd_op.register_fake
def _(x, weight, cos, sin, eps, dtype, l2):
    B, T, H, _ = x.shape
    normed = weight is not None or l2
    return torch.empty_like(x, dtype=dtype), x.new_empty((B, T, H) if normed else (0,), dtype=torch.float32)


@torch.library.custom_op("regattn::norm_rope_bwd", mutates_args=())
def norm_rope_bwd_op(dy: Tensor, x: Tensor, weight: Optional[Tensor], cos: Optional[Tensor], sin: Optional[Tensor],
                     rstd: Tensor, eps: float, l2: bool) -> tuple[Tensor, Tensor]:
    """``(dx, dweight)``; ``dweight`` is empty without ``weight``."""
    dx, dw = norm_rope_bwd(dy.contiguous(), x, weight, cos, sin, rstd, eps, l2)
    return dx, (dw if dw is not None else x.new_empty(0))


@norm_rope_bwd_op.register_fake
def _(dy, x, weight, cos, sin, rstd, eps, l2):
    return torch.empty_like(x), (torch.empty_like(weight) if weight is not None else x.new_empty(0))


def _setup_context(ctx, inputs, output):
    x, weight, cos, sin, eps, _, l2 = inputs
    ctx.save_for_backward(x, weight, cos, sin, output[1])
    ctx.eps, ctx.l2 = eps, l2
    ctx.mark_non_differentiable(output[1])


def _backward(ctx, dy, _drstd):
    x, weight, cos, sin, rstd = ctx.saved_tensors
    dx, dw = norm_rope_bwd_op(dy, x, weight, cos, sin, rstd, ctx.eps, ctx.l2)
    return dx, (dw if weight is not None else None), None, None, None, None, None


norm_rope_fwd_op.register_autograd(_backward, setup_context=_setup_context)
torch.library.register_vmap(norm_rope_fwd_op, fold_rule(norm_rope_fwd_op, batched=(0,), outputs=(0, 0)))


def norm_rope_triton(x, weight, cos, sin, eps: float, dtype: torch.dtype | None = None, l2: bool = False):
    """``rope(rms_norm(x) * weight)`` (``l2``: ``rope(F.normalize(x))``) of a contiguous ``[B, T, H, D]`` ``x``
    through the kernels, in ``dtype`` (None: x's)."""
    return norm_rope_fwd_op(x, weight, cos, sin, eps, dtype, l2)[0]
