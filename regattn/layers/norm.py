"""Norms: an RMSNorm that keeps its input's dtype, the L2 norm, and the residual stream's pre-norm."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from regattn.ops._common.checks import KERNEL_DTYPES, resolve_backend
from regattn.ops.norm_rope.function import norm_rope_triton


class RMSNorm(nn.RMSNorm):
    """``torch.nn.RMSNorm`` returning its input's dtype.

    Under CUDA autocast ``rms_norm`` computes and returns fp32, so normalised bf16 queries and keys
    would reach the attention ops in fp32 beside bf16 values; the ops require one dtype.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x).to(x.dtype)


class L2Norm(nn.Module):
    """``F.normalize(x, dim=-1, eps=eps)``: each row over the last dim scaled to unit length, its norm clamped
    below at ``eps``; no parameters. As the norm of :func:`regattn.layers.rope.norm_rope` it runs in that
    op's kernels."""

    def __init__(self, eps: float = 1e-12):
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(x, dim=-1, eps=self.eps)


class PreNorm(nn.RMSNorm):
    """``torch.nn.RMSNorm`` of the residual stream before a block's mixer or MLP, or before the readout.

    Its output is in the autocast dtype under ``torch.autocast`` (else in x's): the matrix products that read
    it would round it so, and it is rounded once, here, with no cast of its own forward or backward.
    ``backend="auto"`` takes, on CUDA and eagerly, one Triton pass forward and one backward (the kernels of
    :mod:`regattn.ops.norm_rope`, over rows of ``dim``; fp16, bf16 or fp32, an even ``dim``, a weight): torch's
    backward of its fused norm spent 36 us a call on the weight's gradient at 16384 rows of 128 on an H200, its
    forward and input gradient 14 and 12 us. Else, and under ``torch.compile`` (which fuses it with its
    neighbours), torch's norm. ``"triton"`` asks for the kernels (on the CPU: ``TRITON_INTERPRET=1``).
    """

    def __init__(self, dim: int, eps: float | None = None, *, backend: str = "auto", **kwargs):
        super().__init__(dim, eps=eps, **kwargs)
        self.backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kind = x.device.type
        dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype
        if self._kernels_take(x):
            eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
            rows = x.reshape(1, -1, 1, x.shape[-1]).contiguous()
            return norm_rope_triton(rows, self.weight, None, None, eps, dtype).view(x.shape)
        return super().forward(x).to(dtype)

    def _kernels_take(self, x: torch.Tensor) -> bool:
        """Whether the kernels run on ``x``; with ``backend="triton"``, a ValueError where they cannot."""
        if resolve_backend(self.backend, x, op="PreNorm", has_triton=True) == "torch" or torch.compiler.is_compiling():
            return False
        if x.dtype in KERNEL_DTYPES and self.weight is not None and x.shape[-1] % 2 == 0 and x.numel():
            return True
        if self.backend == "triton":
            raise ValueError(f"backend: PreNorm's kernels take fp16, bf16 or fp32 rows of an even width with a "
                             f"weight, got {x.dtype} of shape {tuple(x.shape)}, weight {self.weight is not None}")
        return False
