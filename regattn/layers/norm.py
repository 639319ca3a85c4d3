"""RMSNorm that keeps its input's dtype."""
from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.RMSNorm):
    """``torch.nn.RMSNorm`` returning its input's dtype.

    Under CUDA autocast ``rms_norm`` computes and returns fp32, so normalised bf16 queries and keys
    would reach the attention ops in fp32 beside bf16 values; the ops require one dtype.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x).to(x.dtype)
