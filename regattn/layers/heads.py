"""The head layout every attention layer checks the same way."""
from __future__ import annotations

from regattn.ops._common.checks import check_int


def head_layout(d_model, num_heads, num_kv_heads=None, head_dim=None) -> tuple[int, int, int]:
    """``(HQ, H, D)``: query heads, key/value heads (a divisor of HQ; default HQ) and head dim
    (default ``d_model // HQ``), each checked to be a positive int."""
    check_int("d_model", d_model, minimum=1)
    HQ = check_int("num_heads", num_heads, minimum=1)
    H = check_int("num_kv_heads", num_kv_heads or HQ, minimum=1)
    if HQ % H:
        raise ValueError(f"num_kv_heads: expected a divisor of num_heads = {HQ}, got {H}")
    D = check_int("head_dim", head_dim or d_model // HQ, minimum=1)
    return HQ, H, D
