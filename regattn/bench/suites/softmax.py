"""Causal and sliding-window softmax attention against SDPA's backends and FlexAttention: the family's
base line, at the Parallax prefill shapes."""
from __future__ import annotations

import regattn
from regattn import reference
from regattn.bench import counts
from regattn.bench.check import Check, Slice
from regattn.bench.runner import backward, flex_case, ours, randn, reference_case, sdpa_cases

NAME = "softmax"
PEERS = ("sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "flex")
QUICK_PEERS = ("sdpa-cudnn",)
MAIN = {"fwd": ("sdpa:cudnn",), "fwd+bwd": ("sdpa:cudnn",)}
MODES = ("fwd", "fwd+bwd")
GOAL = [dict(B=4, H=16, T=8192, D=128)]
GRIDS = {
    "tiny": [dict(B=1, H=2, T=48, D=16, window=w) for w in (None, 16)],
    "goal": GOAL,
    "quick": GOAL,
    "full": [dict(B=4, H=16, T=T, D=D, window=w) for D in (64, 128) for T in (1024, 2048, 4096, 8192, 16384)
             for w in (None, 1024)],
}
CHECK_ROWS = 1024


def check(mode, q, k, v, w, *, causal=True, rows=CHECK_ROWS, batch=0) -> Check:
    """Forward: the last ``rows`` against every key; forward+backward: the first rows (and keys, if causal);
    of batch row ``batch``."""
    bwd = backward(mode)
    where = Slice(kv_heads=k.shape[2], rows=min(q.shape[1], rows), last=not bwd, causal=causal, batch=batch)
    return Check(lambda q, k, v: reference.softmax_attention(q, k, v, causal=causal, window=w), dict(q=q, k=k, v=v),
                 where, grads=("q", "k", "v") if bwd else ())


def cases(shape: dict, setup):
    """Shape keys: B, H (key/value heads), HQ (query heads, default H), T, D, window."""
    B, H, T, D, w = shape["B"], shape["H"], shape["T"], shape["D"], shape.get("window")
    HQ = shape.get("HQ", H)
    q = randn(setup, B, T, HQ, D, grad=True)
    k, v = randn(setup, B, T, H, D, grad=True), randn(setup, B, T, H, D, grad=True)
    for mode in MODES:
        bwd = mode == "fwd+bwd"
        truth = check(mode, q, k, v, w)
        n = dict(flops=counts.attention_flops(B, T, T, HQ, D, D, window=w, backward=bwd),
                 bytes=counts.attention_bytes(B, T, T, HQ, H, D, D, q.element_size(), backward=bwd))
        yield mode, ours(regattn.softmax_attention, q, setup,
                         lambda: regattn.softmax_attention(q, k, v, window=w, backend=setup.backend), [q, k, v],
                         check=truth, **n)
        yield from sdpa_cases(setup, mode, q, k, v, window=w, check=truth, **n)
        yield from flex_case(setup, mode, q, k, v, window=w, check=truth, **n)
        yield from reference_case(setup, mode, lambda: reference.softmax_attention(q, k, v, window=w), [q, k, v],
                                  check=truth, **n)
