"""The checks every layer shares: sizes and options at construction, the input ``x`` at forward.

``None`` means a documented default; ``0``, negative sizes and non-finite numbers are refused, never
replaced. Every error names the argument, what was expected and what came.
"""
from __future__ import annotations

import torch
from torch import nn

from regattn.ops._common.checks import (
    BACKENDS, check_bool, check_choice, check_device, check_int, check_positive, check_tensor,
)


def per_head_dim(name: str, value, width: int, num_heads: int, *, width_name: str = "d_model") -> int:
    """``value`` (an int >= 1) or, for None, ``width // num_heads`` (which must then be >= 1)."""
    if value is not None:
        return check_int(name, value, minimum=1)
    if width < num_heads:
        raise ValueError(f"num_heads: expected at most {width_name} = {width} (the default {name} is "
                         f"{width_name} // num_heads), got {num_heads}")
    return width // num_heads


def head_layout(d_model, num_heads, num_kv_heads=None, head_dim=None) -> tuple[int, int, int]:
    """``(HQ, H, D)``: query heads, key/value heads (a divisor of HQ; None means HQ) and head dim
    (None means ``d_model // HQ``), each a positive int."""
    check_int("d_model", d_model, minimum=1)
    HQ = check_int("num_heads", num_heads, minimum=1)
    H = HQ if num_kv_heads is None else check_int("num_kv_heads", num_kv_heads, minimum=1)
    if HQ % H:
        raise ValueError(f"num_kv_heads: expected a divisor of num_heads = {HQ}, got {H}")
    return HQ, H, per_head_dim("head_dim", head_dim, d_model, HQ)


def check_options(*, backend, flags: dict | None = None, positive: dict | None = None) -> str:
    """A layer's options: ``backend`` one of ``BACKENDS``, every entry of ``flags`` a bool and every
    entry of ``positive`` a finite number > 0 (eps, rope_base, ...). Returns ``backend``."""
    for name, value in (flags or {}).items():
        check_bool(name, value)
    for name, value in (positive or {}).items():
        check_positive(name, value)
    return check_choice("backend", backend, BACKENDS)


def check_fraction(name: str, value) -> float:
    """A number in the open interval (0, 1)."""
    value = check_positive(name, value)
    if value >= 1:
        raise ValueError(f"{name}: expected a number in (0, 1), got {value}")
    return value


def check_layer_input(x, proj: nn.Linear, layout: str = "[B, T, d_model]", *, name: str = "x") -> torch.Tensor:
    """``x`` (called ``name``): the input of a layer whose first projection of ``x`` is ``proj``.

    A floating tensor of ``layout`` (no dim empty, the last ``proj.in_features``) on ``proj``'s device,
    in ``proj``'s dtype except under ``torch.autocast`` (where the layer computes in the autocast dtype
    whatever x's floating dtype). Only metadata is read: no device sync, no graph break.
    """
    width, weight = proj.in_features, proj.weight
    check_tensor(name, x, layout.count(",") + 1)
    if x.shape[-1] != width or 0 in x.shape:
        raise ValueError(f"{name}: expected shape {layout} with last dim {width} and no empty dim, "
                         f"got {tuple(x.shape)}")
    check_device(name, x, weight, "the layer's parameters")
    if x.dtype != weight.dtype and not torch.is_autocast_enabled(x.device.type):
        raise TypeError(f"{name}: expected dtype {weight.dtype} (as the layer's parameters; others only under "
                        f"torch.autocast), got {x.dtype}")
    return x
