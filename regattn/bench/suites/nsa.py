"""NSA's compression and selection branches (gatedfwa.md Appendix B, ``regattn.ops.nsa.nsa_attention``) at
NSA's default blocks (compressed 32 with stride 16, selection 64, top 16), forward and forward+backward:
the selection by the Triton kernel against the same op's torch path (each chunk's selected tokens
gathered), and the dense float64-style reference in the run's dtype where it fits. A case returns the
two branches' outputs side by side, ``[B, T, HQ, 2 Dv]``."""
from __future__ import annotations

import torch

from regattn import reference
from regattn.bench import counts
from regattn.bench.check import Check, Slice
from regattn.bench.runner import backward, build, ours, randn, reference_case
from regattn.ops.nsa import nsa_attention

NAME = "nsa"
PEERS = ("reference",)
QUICK_PEERS = ("reference",)
MAIN = {"fwd": ("regattn:torch",), "fwd+bwd": ("regattn:torch",)}
MODES = ("fwd", "fwd+bwd")
BLOCKS = dict(block_cmp=32, stride_cmp=16, block_slc=64, topk=16)
GRIDS = {
    "tiny": [dict(B=1, HQ=4, H=2, T=80, D=16, block_cmp=8, stride_cmp=4, block_slc=16, topk=2)],
    "goal": [dict(B=1, HQ=16, H=4, T=T, D=128) for T in (8192, 32768)],
    "quick": [dict(B=1, HQ=16, H=4, T=8192, D=128)],
    "full": [dict(B=1, HQ=16, H=4, T=T, D=128) for T in (4096, 8192, 16384, 32768, 65536)],
}
CHECK_ROWS = 1024
REFERENCE_MAX_T = 8192  # the dense reference builds [T, T] masks per head


def both(fn, **blocks):
    """The call as a case times it: the two branch outputs side by side."""
    return lambda q, k, v, kc, vc: torch.cat(fn(q, k, v, kc, vc, **blocks), -1)


def cases(shape: dict, setup):
    """Shape keys: B, HQ, H, T, D; optionally block_cmp, stride_cmp, block_slc, topk (NSA's by default)."""
    B, HQ, H, T, D = shape["B"], shape["HQ"], shape["H"], shape["T"], shape["D"]
    blocks = {name: shape.get(name, value) for name, value in BLOCKS.items()}
    n = (T - blocks["block_cmp"]) // blocks["stride_cmp"] + 1
    for mode in MODES:
        bwd = backward(mode)
        x = dict(q=randn(setup, B, T, HQ, D, grad=bwd), k=randn(setup, B, T, H, D, grad=bwd),
                 v=randn(setup, B, T, H, D, grad=bwd), kc=randn(setup, B, n, H, D, grad=bwd),
                 vc=randn(setup, B, n, H, D, grad=bwd))
        leaves = list(x.values()) if bwd else []
        truth = Check(both(reference.nsa_attention, **blocks), x, Slice(kv_heads=H, rows=min(T, CHECK_ROWS)),
                      grads=tuple(x) if bwd else ())
        n_counts = dict(flops=counts.nsa_flops(B, T, HQ, D, D, backward=bwd, **blocks),
                        bytes=counts.attention_bytes(B, T, T, HQ, H, D, D, x["q"].element_size(), backward=bwd))
        case = ours(nsa_attention, x["q"], setup, lambda: both(nsa_attention, **blocks, backend=setup.backend)(**x),
                    leaves, check=truth, **n_counts)
        yield mode, case
        if case.op.startswith("regattn:triton"):  # the torch path is the peer the kernel is measured against
            torch_path = both(nsa_attention, **blocks, backend="torch")
            yield mode, build("regattn:torch", lambda: (lambda: torch_path(**x), leaves), check=truth, **n_counts)
        if T <= REFERENCE_MAX_T:
            call = both(reference.nsa_attention, **blocks)
            yield from reference_case(setup, mode, lambda call=call: call(**x), leaves, check=truth, **n_counts)
