"""RMSNorm that keeps its input's dtype."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.RMSNorm):
    """``torch.nn.RMSNorm`` returning its input's dtype.

    Under CUDA autocast ``rms_norm`` computes and returns fp32, so normalised bf16 queries and keys
    would reach the attention ops in fp32 beside bf16 values; the ops require one dtype.

    ``stacked``: set on the norms of a model whose copies run under ``torch.func.vmap`` with a weight each
    (:class:`regattn.train.members.Members`): the norm then goes through :class:`RMSNormFunction`, whose rule
    normalises every copy in one fused call and scales each by its weight.
    """

    stacked = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.stacked:
            return RMSNormFunction.apply(x, self.weight, self.eps).to(x.dtype)
        return super().forward(x).to(x.dtype)


class RMSNormFunction(torch.autograd.Function):
    """``rms_norm(x) * weight`` over the last dim (torch's), with a vmap rule for a weight per copy: ``vmap``'s
    own rule takes torch's fused norm apart into some ten elementwise and reduction kernels (1.5 ms of a 4.2 ms
    step of three copies of the MAD model on an H200); this one calls the fused norm once, without the weight, on
    every copy, and multiplies each copy by its weight."""

    @staticmethod
    def forward(x, weight, eps):
        return F.rms_norm(x, weight.shape, weight, eps)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, ctx.eps = inputs
        ctx.save_for_backward(x, weight)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        with torch.enable_grad():
            x, weight = x.detach().requires_grad_(), weight.detach().requires_grad_()
            out = F.rms_norm(x, weight.shape, weight, ctx.eps)
        return *torch.autograd.grad(out, (x, weight), grad), None

    @staticmethod
    def vmap(info, in_dims, x, weight, eps):
        x_dim, weight_dim, _ = in_dims
        n = info.batch_size
        x = x.expand(n, *x.shape) if x_dim is None else x.movedim(x_dim, 0)
        if weight_dim is None:
            return F.rms_norm(x, weight.shape, weight, eps), 0
        weight = weight.movedim(weight_dim, 0)
        normed = F.rms_norm(x, weight.shape[1:], None, eps)
        return normed * weight.view(n, *[1] * (x.ndim - weight.ndim), *weight.shape[1:]), 0
