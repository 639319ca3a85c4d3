"""Decaying causal linear attention (leetdecoding.txt Tables 3-6): every method, against
flash-linear-attention's chunked kernels and a device copy of the problem's bytes (the HBM floor)."""
from __future__ import annotations

import torch

import regattn
from regattn import reference
from regattn.bench import counts, peers
from regattn.bench.check import Check, Slice
from regattn.bench.runner import Case, build, ours, randn, reference_case
from regattn.ops.decay.api import METHODS

NAME = "decay"
PEERS = ("fla", "copy", "reference")
QUICK_PEERS = ("copy",)
MAIN = {"fwd": ("fla:chunk_simple_gla",)}
FLA = ("chunk_simple_gla", "chunk_lightning_attn")
KERNELS = ("lightning2", "fleet", "causal_dot_product")  # methods with Triton kernels; the rest are torch forms
TORCH_FORMS_UP_TO = 8192  # B * T up to which the torch forms are timed on a GPU (past it: seconds a call, or OOM)
GOAL = [dict(B=B, H=32, T=T, R=128, D=128, gamma=0.99) for B, T in ((1, 8192), (16, 8192), (1, 100000), (16, 25600))]
GRIDS = {
    "tiny": [dict(B=1, H=2, T=40, R=8, D=8, gamma=g) for g in (None, 0.9)],
    "goal": GOAL,
    "quick": GOAL[:2],
    "full": [dict(B=B, H=32, T=T, R=128, D=128, gamma=g) for B in (1, 16)
             for T in (128, 512, 2048, 8192, 25600, 100000) for g in (None, 0.99)],
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
    # The truth by the blocked float64 form: linear in T, so the longest sequences are checked whole.
    truth = Check(lambda b, c, v, gamma: reference.decay_linear_attention(b, c, v, gamma, method="lightning2"),
                  dict(b=b, c=c, v=v, gamma=gamma), Slice(kv_heads=H))
    n = dict(flops=counts.decay_flops(B, T, H, R, D), bytes=counts.decay_bytes(B, T, H, R, D, b.element_size()))
    if user is not None:
        name, fn = user
        yield "fwd", build(name, lambda: ((lambda: fn(b, c, v, gamma)), []), ours=True, check=truth, **n)
    for method in ("auto",) + METHODS:
        torch_form = method not in KERNELS and method != "auto"
        if setup.cuda and torch_form and B * T > TORCH_FORMS_UP_TO:
            yield "fwd", Case(f"regattn:torch[{method}]", None, ours=user is None,
                              status=f"not timed: a torch form, timed where B*T <= {TORCH_FORMS_UP_TO}")
            continue
        case = ours(regattn.decay_linear_attention, b, setup,
                    lambda method=method: regattn.decay_linear_attention(b, c, v, gamma, method=method,
                                                                      backend=setup.backend), [],
                    tag=f"[{method}]", check=truth, **n)
        if torch_form:  # runs in torch whatever the backend
            case.op = case.op.replace("regattn:triton", "regattn:torch")
        case.ours = user is None
        yield "fwd", case
    if peers.wanted(setup.peers, "fla"):
        for name in FLA:
            yield "fwd", build(f"fla:{name}", lambda: fla_decay(name, b, c, v, gamma),
                               check=truth if name == "chunk_simple_gla" else None, **n)
    if peers.wanted(setup.peers, "copy"):
        yield "fwd", build("copy (memory floor)", lambda: peers.copy_floor(n["bytes"], setup.device), bytes=n["bytes"])
    yield from reference_case(setup, "fwd", lambda: reference.decay_linear_attention(b, c, v, gamma), [],
                              check=truth, **n)
