"""Decaying causal linear attention (leetdecoding.txt Tables 3-6): every method, with and
without decay, against flash-linear-attention's chunked kernels and the vanilla torch form."""
from __future__ import annotations

import torch

import regattn
from regattn import reference
from regattn.bench import counts, peers
from regattn.bench.runner import build, ours, randn, reference_case
from regattn.ops.decay.api import METHODS

NAME = "decay"
PEERS = ("fla", "reference")
FLA = ("chunk_simple_gla", "chunk_lightning_attn")
SEQLENS = (128, 512, 2048, 8192, 25600, 100000)
GRIDS = {
    "tiny": [dict(B=1, H=2, T=40, R=8, D=8, gamma=g) for g in (None, 0.9)],
    "default": [dict(B=B, H=32, T=T, R=128, D=128, gamma=g) for B, T in ((1, 2048), (1, 8192), (16, 8192))
                for g in (None, 0.99)],
    "full": [dict(B=B, H=32, T=T, R=128, D=128, gamma=g) for B in (1, 16) for T in SEQLENS for g in (None, 0.99)],
}


def inputs(shape: dict, setup):
    """``b, c: [B, T, H, R]`` scaled by ``R ** -0.25`` (so ``b.c`` is O(1)), ``v: [B, T, H, D]``, gamma ``[H]``."""
    B, H, T, R, D, g = shape["B"], shape["H"], shape["T"], shape["R"], shape["D"], shape.get("gamma")
    b, c = randn(setup, B, T, H, R, scale=R ** -0.25), randn(setup, B, T, H, R, scale=R ** -0.25)
    v = randn(setup, B, T, H, D)
    gamma = None if g is None else torch.full((H,), float(g), device=setup.device, dtype=torch.float32)
    return b, c, v, gamma


def fla_decay(name: str, b, c, v, gamma):
    """``chunk_simple_gla`` with per-token log-decay ``log gamma`` (the same mask), or
    ``chunk_lightning_attn`` (its own per-head decay: the same work, other numbers)."""
    fn = peers.fla_function(name)
    if name == "chunk_lightning_attn":
        return (lambda: fn(b, c, v, layer_idx=0, num_layers=1, scale=1.0)[0]), []
    B, T, H = b.shape[:3]
    log_g = torch.zeros(B, T, H, device=b.device) if gamma is None else gamma.log().expand(B, T, H).contiguous()
    return (lambda: fn(b, c, v, g=log_g, scale=1.0)[0]), []


def cases(shape: dict, setup, user=None):
    """Shape keys: B, H, T, R, D, gamma (None or a float). ``user``: ``(name, fn)`` of a user's
    method ``fn(b, c, v, gamma) -> o``; then it is ours and the built-in methods are its peers."""
    b, c, v, gamma = inputs(shape, setup)
    B, T, H, R, D = b.shape[0], b.shape[1], b.shape[2], b.shape[3], v.shape[3]
    n = dict(flops=counts.decay_flops(B, T, H, R, D), bytes=counts.decay_bytes(B, T, H, R, D, b.element_size()))
    if user is not None:
        name, fn = user
        yield "fwd", build(name, lambda: ((lambda: fn(b, c, v, gamma)), []), mode="fwd", ours=True, **n)
    for method in ("auto",) + METHODS:
        case = ours(regattn.decay_linear_attention, b, setup,
                    lambda method=method: regattn.decay_linear_attention(b, c, v, gamma, method=method,
                                                                      backend=setup.backend), [],
                    mode="fwd", tag=f"[{method}]", **n)
        case.ours = user is None
        yield "fwd", case
    if peers.wanted(setup.peers, "fla"):
        for name in FLA:
            yield "fwd", build(f"fla:{name}", lambda: fla_decay(name, b, c, v, gamma), mode="fwd",
                               compare=name == "chunk_simple_gla", **n)
    yield from reference_case(setup, "fwd", lambda: reference.decay_linear_attention(b, c, v, gamma), [], **n)
