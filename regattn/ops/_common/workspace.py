"""Zeroed device state kept between eager calls, for kernels that leave it zeroed again (their own counters).

A kernel whose programs count each other's arrivals (the last one of a group then finishes the group's work)
needs its counters at zero when it starts. Zeroing them is a launch of its own; a kernel that sets each counter
back to zero when it is done leaves them ready for its next call instead. :func:`stream_zeros` hands such a
kernel counters kept per device and stream: calls on one stream run in order, so two never use them at once.
Graphs captured on one stream may be replayed on several at once, and torch.compile records what it traces, so
calls there get none, and take a path without counters.
"""
from __future__ import annotations

import torch
from triton.runtime.driver import driver

from regattn.ops._common.checks import capturing

_KEPT: dict = {}  # (device, stream) -> int32 zeros


def stream_zeros(numel: int, device: torch.device) -> torch.Tensor | None:
    """At least ``numel`` int32 zeros on ``device``, kept for the current stream; None while torch.compile
    traces or a CUDA graph is captured. The kernel that takes them must leave every one it used at zero."""
    if torch.compiler.is_compiling() or (device.type == "cuda" and capturing()):
        return None
    key = (device, driver.active.get_current_stream(device.index) if device.type == "cuda" else None)
    zeros = _KEPT.get(key)
    if zeros is None or zeros.numel() < numel:  # a smaller one is freed on its stream, after its calls there
        zeros = _KEPT[key] = torch.zeros(max(numel, 1024), device=device, dtype=torch.int32)
    return zeros
