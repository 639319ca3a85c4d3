"""Remember a value computed from a small tensor until that tensor is written to or freed.

Used for gamma: checking a device tensor's values, or taking its log, costs a device round trip
or extra launches on every call; the same gamma tensor (a layer's buffer) usually comes back.
"""
from __future__ import annotations

import weakref

import torch


class TensorMemo:
    """``get(x)`` -> the value stored for ``x`` at its current version counter, else None."""

    def __init__(self, size: int = 256):
        self.size = size
        self.entries: dict[int, tuple] = {}

    @staticmethod
    def _version(x: torch.Tensor):
        try:
            return x._version
        except RuntimeError:      # inference tensors have no version counter
            return None

    def get(self, x: torch.Tensor):
        hit = self.entries.get(id(x))
        if hit is None or hit[0]() is not x or hit[1] != self._version(x) or hit[1] is None:
            return None
        return hit[2]

    def put(self, x: torch.Tensor, value) -> None:
        version = self._version(x)
        if version is None:
            return
        if len(self.entries) >= self.size:
            self.entries.clear()
        self.entries[id(x)] = (weakref.ref(x), version, value)
