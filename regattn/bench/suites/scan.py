"""ELSA (elsa-supplementary.txt): exact softmax attention as a scan, non-causal, in strict fp32,
tf32x3, tf32 and fp16, against SDPA in the same precision. The suite sets its own dtypes (fp32 and
fp16): ``--dtype`` does not apply. The reference scan is sequential (one step a key): a peer for
small shapes only, asked for with ``--peers``."""
from __future__ import annotations

import torch

import regattn
from regattn import reference
from regattn.bench import counts
from regattn.bench.check import Check, Slice
from regattn.bench.runner import ours, randn, reference_case, sdpa_cases
from regattn.ops.scan.api import PRECISIONS

NAME = "scan"
PEERS = ("sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "sdpa-math")
QUICK_PEERS = ("sdpa-efficient", "sdpa-flash")
MAIN = {"fp32": ("sdpa:efficient",), "fp16": ("sdpa:flash",)}
GOAL = [dict(B=1, H=16, T=16384, D=64)]
GRIDS = {
    "tiny": [dict(B=1, H=2, T=40, D=16)],
    "goal": GOAL,
    "quick": GOAL,
    "full": [dict(B=1, H=16, T=T, D=64) for T in (1024, 4096, 16384, 32768, 65536)],
}
CHECK_ROWS = 512


def cases(shape: dict, setup):
    """Shape keys: B, H, T, D (non-causal). Modes: "fp32" and "fp16" (the input dtype)."""
    B, H, T, D = shape["B"], shape["H"], shape["T"], shape["D"]
    for mode, dtype in (("fp32", torch.float32), ("fp16", torch.float16)):
        q, k, v = (randn(setup, B, T, H, D, dtype=dtype) for _ in range(3))
        truth = Check(lambda q, k, v: reference.softmax_attention(q, k, v, causal=False), dict(q=q, k=k, v=v),
                      Slice(kv_heads=H, rows=min(T, CHECK_ROWS), last=True, causal=False))
        n = dict(flops=counts.attention_flops(B, T, T, H, D, D, causal=False),
                 bytes=counts.attention_bytes(B, T, T, H, H, D, D, q.element_size()))
        for precision in (PRECISIONS if dtype == torch.float32 else ("ieee",)):
            tag = f"[{precision}]" if dtype == torch.float32 else ""
            call = lambda p=precision: regattn.scan_attention(q, k, v, precision=p, backend=setup.backend)
            yield mode, ours(regattn.scan_attention, q, setup, call, [], tag=tag, check=truth, **n)
        yield from sdpa_cases(setup, mode, q, k, v, causal=False, check=truth, **n)
        yield from reference_case(setup, mode, lambda: reference.scan_attention(q, k, v), [], check=truth, **n)
