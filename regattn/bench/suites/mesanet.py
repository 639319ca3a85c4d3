"""MesaNet (lla eq. 2): the exact op in chunks (``regattn.mesanet``) against the per-query solve of the
reference in the same precision, at the MAD model's shape (parallax Table 1a) and at longer sequences.
Ours takes ``--backend`` (on CUDA: its chunk algebra in Triton); ``regattn:torch`` beside it is the same op with
every product a batched cuBLAS call (its factorisations are torch's on either path)."""
from __future__ import annotations

import torch.nn.functional as F

import regattn
from regattn import reference
from regattn.bench import counts
from regattn.bench.check import Check, Slice
from regattn.bench.runner import backward, build, ours, randn, reference_case

NAME = "mesanet"
PEERS = ("reference",)
QUICK_PEERS = ("reference",)
MAIN = {"fwd": ("reference",), "fwd+bwd": ("reference",)}
MODES = ("fwd", "fwd+bwd")
LAM = 1.0
MAD = dict(B=128, H=2, T=128, D=64)
GRIDS = {
    "tiny": [dict(B=1, H=2, T=40, D=16)],
    "goal": [MAD, dict(B=8, H=16, T=2048, D=64)],
    "quick": [MAD],
    "full": [MAD] + [dict(B=8, H=16, T=T, D=64) for T in (512, 1024, 2048, 4096)],
}
CHECK_ROWS = 256


def cases(shape: dict, setup):
    """Shape keys: B, H, T, D, chunk (optional). Keys are L2-normalised, as the MesaNet layer has them."""
    B, H, T, D, chunk = shape["B"], shape["H"], shape["T"], shape["D"], shape.get("chunk", 64)
    for mode in MODES:
        bwd = backward(mode)
        q, v = randn(setup, B, T, H, D, grad=bwd), randn(setup, B, T, H, D, grad=bwd)
        k = F.normalize(randn(setup, B, T, H, D), dim=-1).requires_grad_(bwd)
        where = Slice(kv_heads=H, rows=min(T, CHECK_ROWS), last=not bwd)
        truth = Check(lambda q, k, v: reference.mesanet(q, k, v, lam=LAM), dict(q=q, k=k, v=v), where,
                      grads=("q", "k", "v") if bwd else ())
        leaves = [q, k, v] if bwd else []
        n = dict(bytes=counts.attention_bytes(B, T, T, H, H, D, D, q.element_size(), backward=bwd))
        yield mode, ours(regattn.mesanet, q, setup,
                         lambda: regattn.mesanet(q, k, v, lam=LAM, chunk=chunk, backend=setup.backend), leaves,
                         check=truth, **n)
        if setup.backend != "torch" and q.is_cuda:
            yield mode, build("regattn:torch", lambda: (
                lambda: regattn.mesanet(q, k, v, lam=LAM, chunk=chunk, backend="torch"), leaves), check=truth, **n)
        # the reference in fp32, the precision ours computes in (torch has no half-precision LU on CUDA)
        q32, k32, v32 = (x.detach().float().requires_grad_(bwd) for x in (q, k, v))
        yield from reference_case(setup, mode, lambda: reference.mesanet(q32, k32, v32, lam=LAM),
                                  [q32, k32, v32] if bwd else [], check=truth, **n)
