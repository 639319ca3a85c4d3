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

    def forward(self, x: torch.Tensor, offset: int = 0, *, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        """Rotate ``x: [B, T, H, D]`` whose first token sits at position ``offset``; with packed sequences
        (``cu_seqlens: [N + 1]``, ``B == 1``) positions restart at 0 at every sequence."""
        T = x.shape[1]
        pos = torch.arange(offset, offset + T, device=x.device)
        if cu_seqlens is not None:
            pos = pos - packed_starts(cu_seqlens, pos)
        angles = pos.float()[:, None] * self.inv_freq.to(x.device)[None, :]  # [T, D/2]
        cos = angles.cos()[None, :, None, :]
        sin = angles.sin()[None, :, None, :]
        x1, x2 = x.float().chunk(2, dim=-1)
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return out.to(x.dtype)
