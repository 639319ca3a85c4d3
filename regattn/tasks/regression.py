"""Non-stationary piecewise-linear test-time regression (lla-local-linear-attention.txt Section 4, Appendix F.1).

A sequence of ``L`` key/value pairs is cut into contiguous segments of ``S`` positions
(``C = ceil(L / S)`` segments; the last one is shorter when ``S`` does not divide ``L``).
Segment ``c`` (0-based) has

* a cone: the sign pattern ``s_c in {-1, +1}^m`` with ``m = ceil(log2 C)``, read from the bits
  of ``c`` (bit ``j`` set gives ``s_cj = -1``), least significant first;
* keys ``k = (s_c * |z_1..m|, z_m+1..d)`` with ``z ~ N(0, I_d)``, eq. 51: a Gaussian folded into
  the cone ``{x : s_cj x_j >= 0, j < m}``; cones of different segments are disjoint;
* values ``v = A_c k + noise * eps`` with ``A_c ~ N(0, I)`` (``[d, d]``, per sequence and
  segment) and ``eps ~ N(0, I_d)``.

Appendix F.1 writes the fold two ways: eq. 51 leaves coordinates ``j > m`` Gaussian, the map
``T_c`` folds them too (``|z_m+1..d|``). This generator follows eq. 51.

Everything is drawn from one ``torch.Generator`` on the target device seeded with ``seed``:
the same seed on the same device gives the same tensors; no files are read or written.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

from regattn.ops._common.checks import check_int, check_positive


class RegressionData(NamedTuple):
    """One draw of the task.

    keys, values: ``[N, L, d]``; maps: ``[N, C, d, d]`` (``A_c``); segment: ``[L]`` (int64, the
    segment of each position); signs: ``[C, m]`` (the cone sign patterns, ``+-1`` in the data dtype).
    """
    keys: torch.Tensor
    values: torch.Tensor
    maps: torch.Tensor
    segment: torch.Tensor
    signs: torch.Tensor


def cone_bits(num_segments: int) -> int:
    """``m = ceil(log2 C)``: the number of sign-constrained coordinates for ``C`` segments."""
    return math.ceil(math.log2(num_segments)) if num_segments > 1 else 0


def cone_signs(num_segments: int, bits: int, *, dtype=torch.float64, device=None) -> torch.Tensor:
    """``[C, m]`` sign patterns: ``s_cj = -1`` where bit ``j`` of ``c`` is set, else ``+1``."""
    c = torch.arange(num_segments, device=device)[:, None]
    j = torch.arange(bits, device=device)[None, :]
    return (1 - 2 * ((c >> j) & 1)).to(dtype)


def segment_index(length: int, segment: int, *, device=None) -> torch.Tensor:
    """``[L]`` int64: position ``i`` (0-based) belongs to segment ``i // S``."""
    return torch.arange(length, device=device) // segment


def piecewise_linear_regression(num_sequences: int, length: int, dim: int, segment: int, *, noise: float = 0.1,
                                seed: int = 0, device="cpu", dtype=torch.float64) -> RegressionData:
    """Draw ``num_sequences`` independent sequences of the piecewise-linear task.

    Args:
        num_sequences: ``N``; length: ``L``; dim: ``d`` (keys and values); segment: ``S``, the
            positions per segment; noise: ``delta``, the standard deviation of the value noise;
            seed: seeds a generator on ``device``; dtype: a floating dtype.
    Returns:
        :class:`RegressionData` with keys and values ``[N, L, d]``.
    Raises:
        ValueError when ``ceil(log2 ceil(L / S)) > d`` (not enough coordinates for disjoint cones).
    """
    check_int("num_sequences", num_sequences, minimum=1)
    check_int("length", length, minimum=1)
    check_int("dim", dim, minimum=1)
    check_int("segment", segment, minimum=1)
    check_positive("noise", noise, allow_zero=True)
    check_int("seed", seed, minimum=0)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype: expected a floating torch.dtype, got {dtype!r}")
    num_segments = -(-length // segment)
    bits = cone_bits(num_segments)
    if bits > dim:
        raise ValueError(f"segment: ceil(L / S) = {num_segments} segments need ceil(log2 C) = {bits} "
                         f"sign-constrained coordinates, more than dim = {dim}")
    device = torch.device(device)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    draw = dict(generator=gen, device=device, dtype=dtype)
    z = torch.randn(num_sequences, length, dim, **draw)
    maps = torch.randn(num_sequences, num_segments, dim, dim, **draw)
    eps = torch.randn(num_sequences, length, dim, **draw)

    seg = segment_index(length, segment, device=device)
    signs = cone_signs(num_segments, bits, dtype=dtype, device=device)
    keys = torch.cat([z[..., :bits].abs() * signs[seg], z[..., bits:]], dim=-1)
    values = apply_maps(maps, keys, segment) + noise * eps
    return RegressionData(keys, values, maps, seg, signs)


def apply_maps(maps: torch.Tensor, keys: torch.Tensor, segment: int) -> torch.Tensor:
    """``f_c(k_i) = A_c k_i`` with ``c = i // S`` the segment of position ``i``.

    maps ``[N, C, d, d]``, keys ``[N, L, d]`` with ``C = ceil(L / S)`` -> ``[N, L, d]``.
    """
    N, L, d = keys.shape
    C = maps.shape[1]
    padded = torch.nn.functional.pad(keys, (0, 0, 0, C * segment - L)).view(N, C, segment, d)
    return torch.einsum("ncij,ncsj->ncsi", maps, padded).reshape(N, C * segment, d)[:, :L]
