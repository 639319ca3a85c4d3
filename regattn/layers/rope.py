"""Rotary position embedding (RoPE), shared by every attention layer."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from regattn.layers.norm import L2Norm
from regattn.ops._common.checks import (
    KERNEL_DTYPES, check_int, check_positive, check_shape, check_tensor, resolve_backend,
)
from regattn.ops.norm_rope.function import norm_rope_triton


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

    def angles(self, T: int, offset: int, device, cu_seqlens: torch.Tensor | None = None):
        """fp32 ``cos, sin: [T, D/2]`` of the angles of positions ``offset .. offset + T - 1`` (restarting at every
        packed sequence of ``cu_seqlens``)."""
        pos = torch.arange(offset, offset + T, device=device)
        if cu_seqlens is not None:
            pos = pos - packed_starts(cu_seqlens, pos)
        angles = pos.float()[:, None] * self.inv_freq.to(device)[None, :]
        return angles.cos(), angles.sin()

    def forward(self, x: torch.Tensor, offset: int = 0, *, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        """Rotate ``x: [B, T, H, D]`` whose first token sits at position ``offset`` (in fp32 at least, returned in
        x's dtype); with packed sequences (``cu_seqlens: [N + 1]``, ``B == 1``) positions restart at 0 at every
        sequence."""
        return norm_rope(x, None, self.angles(x.shape[1], offset, x.device, cu_seqlens))


def norm_rope(x: torch.Tensor, norm: nn.Module | None, angles=None, *, backend: str = "auto") -> torch.Tensor:
    """``rope(norm(x))`` of ``x: [B, T, H, D]`` (queries or keys) in fp32 at least, rounded once to x's dtype.

    ``norm``: an ``nn.RMSNorm`` over ``D``, an :class:`regattn.layers.norm.L2Norm`, or None or ``nn.Identity``
    for none; ``angles``: the tokens' ``(cos, sin)`` (:meth:`RotaryEmbedding.angles`), or None for no rotation.
    Where ``backend`` resolves to Triton, one kernel does both (and one their backward); else, and under
    ``torch.compile`` (whose own generated kernels fuse these ops with their neighbours), torch ops.
    """
    norm = norm if isinstance(norm, (nn.RMSNorm, L2Norm)) else None
    if norm is None and angles is None:
        return x
    _check_norm_rope(x, norm, angles)
    l2 = isinstance(norm, L2Norm)
    weight = None if norm is None or l2 else norm.weight
    eps = None if norm is None else norm.eps if norm.eps is not None else torch.finfo(x.dtype).eps
    if (resolve_backend(backend, x, op="norm_rope", has_triton=True) == "triton" and x.dtype in KERNEL_DTYPES
            and x.shape[-1] % 2 == 0 and (norm is None or l2 or weight is not None)
            and not torch.compiler.is_compiling()):
        cos, sin = angles if angles is not None else (None, None)
        return norm_rope_triton(x.contiguous(), weight, cos, sin, eps or 0.0, None, l2)
    y = x.to(torch.promote_types(x.dtype, torch.float32))
    if l2:
        y = F.normalize(y, dim=-1, eps=eps)
    elif norm is not None:  # written out (not F.rms_norm), so that torch.compile fuses it with the rotation
        y = y * torch.rsqrt(y.square().mean(-1, keepdim=True) + eps)
        y = y if weight is None else y * weight.to(y.dtype)
    if angles is not None:
        cos, sin = (a[None, :, None, :] for a in angles)
        y1, y2 = y.chunk(2, -1)
        y = torch.cat((y1 * cos - y2 * sin, y2 * cos + y1 * sin), -1)
    return y.to(x.dtype)


def _check_norm_rope(x, norm, angles) -> None:
    """``x: [B, T, H, D]``; ``norm`` over ``D``; ``angles``: two ``[T, D/2]`` tensors on x's device."""
    check_tensor("x", x, 4)
    T, D = x.shape[1], x.shape[3]
    if isinstance(norm, nn.RMSNorm) and tuple(norm.normalized_shape) != (D,):
        raise ValueError(f"norm: expected an RMSNorm over the head dim ({D},), got {tuple(norm.normalized_shape)}")
    if angles is not None:
        if D % 2:
            raise ValueError(f"x: a rotation needs an even head dim, got {D}")
        for name, a in zip(("angles[0] (cos)", "angles[1] (sin)"), angles):
            check_tensor(name, a, 2)
            check_shape(name, a, (T, D // 2), "[T, D/2]")
            if a.device != x.device:
                raise ValueError(f"{name}: expected device {x.device} (as x), got {a.device}")
