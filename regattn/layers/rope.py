"""Rotary position embedding (RoPE), shared by every attention layer."""
from __future__ import annotations

import torch
from torch import nn

from regattn.ops._common.checks import check_int, check_positive


def packed_starts(cu_seqlens: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The first token of the packed sequence holding each of ``tokens``, computed on the device
    (no host sync): the last offset ``cu_seqlens[s] <= t``."""
    offsets = cu_seqlens.to(device=tokens.device, dtype=tokens.dtype)
    return offsets[torch.searchsorted(offsets[1:], tokens, right=True)]


class RotaryEmbedding(nn.Module):
    """Rotates pairs ``(x[..., :D/2], x[..., D/2:])`` of ``[B, T, H, D]`` tensors by position-dependent angles.

    Args:
        head_dim: ``D`` (even).
        base: the frequency base, finite and > 0 (10000 as in the original; Qwen3 uses 1e6).
    """

    def __init__(self, head_dim: int, base: float = 10000.0):
        super().__init__()
        if check_int("head_dim", head_dim, minimum=2) % 2:
            raise ValueError(f"head_dim: expected an even number, got {head_dim}")
        check_positive("base", base)
        inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def cos_sin(self, T: int, offset: int, device, cu_seqlens: torch.Tensor | None = None):
        """fp32 ``cos, sin: [1, T, 1, D]`` of positions ``offset .. offset + T - 1`` (restarting at every packed
        sequence of ``cu_seqlens``); ``sin`` carries the sign of the first half, so that the rotation is
        ``x * cos + swap_halves(x) * sin``."""
        pos = torch.arange(offset, offset + T, device=device)
        if cu_seqlens is not None:
            pos = pos - packed_starts(cu_seqlens, pos)
        angles = pos.float()[:, None] * self.inv_freq.to(device)[None, :]  # [T, D/2]
        cos, sin = angles.cos(), angles.sin()
        return torch.cat((cos, cos), -1)[None, :, None, :], torch.cat((-sin, sin), -1)[None, :, None, :]

    def rotate(self, *xs: torch.Tensor, offset: int = 0, cu_seqlens: torch.Tensor | None = None,
               dtype: torch.dtype | None = None):
        """Rotate each of ``xs: [B, T, heads, D]`` (heads may differ; B and T shared) with one ``cos, sin``;
        returns a tuple. Computed in fp32 at least (the promotion of ``x * cos``), returned in ``dtype`` (default: each
        ``x``'s own)."""
        cos, sin = self.cos_sin(xs[0].shape[1], offset, xs[0].device, cu_seqlens)
        return tuple(_rotate(x, cos, sin).to(dtype or x.dtype) for x in xs)

    def forward(self, x: torch.Tensor, offset: int = 0, *, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        """Rotate ``x: [B, T, H, D]`` whose first token sits at position ``offset``; with packed sequences
        (``cu_seqlens: [N + 1]``, ``B == 1``) positions restart at 0 at every sequence."""
        return self.rotate(x, offset=offset, cu_seqlens=cu_seqlens)[0]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((x2, x1), dim=-1) * sin
