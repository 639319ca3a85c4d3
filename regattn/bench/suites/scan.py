"""ELSA (elsa-supplementary.txt): exact softmax attention as a scan, non-causal, in strict fp32,
tf32x3, tf32 and fp16, against SDPA in the same precision; ``err`` is the relative error to a
float64 softmax. The suite sets its own dtypes (fp32 and fp16): ``--dtype`` does not apply."""
from __future__ import annotations

import torch

import regattn
from regattn import reference
from regattn.bench import counts
from regattn.bench.runner import ours, randn, reference_case, relative_diff, sdpa_cases
from regattn.ops.scan.api import PRECISIONS

NAME = "scan"
PEERS = ("sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "sdpa-math", "reference")
GRIDS = {
    "tiny": [dict(B=1, H=2, T=40, D=16)],
    "default": [dict(B=1, H=16, T=T, D=64) for T in (4096, 16384)],
    "full": [dict(B=1, H=16, T=T, D=64) for T in (1024, 4096, 16384, 32768, 65536)],
}
CHUNK_BYTES = 2 ** 30


def exact(q, k, v):
    """Float64 softmax attention, queries in chunks so no logits block exceeds ~1 GiB."""
    B, T, H, _ = q.shape
    rows = max(1, CHUNK_BYTES // (8 * B * H * k.shape[1]))
    k64, v64 = k.double(), v.double()
    return torch.cat([reference.softmax_attention(c.double(), k64, v64, causal=False)
                      for c in q.split(rows, dim=1)], dim=1)


def with_error(case, truth):
    if case.fn is not None and truth is not None:
        try:
            case.err = relative_diff(case.fn(), truth)
        except Exception:
            case.err = None
    return case


def cases(shape: dict, setup):
    """Shape keys: B, H, T, D (non-causal). Modes: "fp32" and "fp16" (the input dtype)."""
    B, H, T, D = shape["B"], shape["H"], shape["T"], shape["D"]
    for mode, dtype in (("fp32", torch.float32), ("fp16", torch.float16)):
        q, k, v = (randn(setup, B, T, H, D, dtype=dtype) for _ in range(3))
        try:
            truth = exact(q, k, v)
        except Exception:  # out of memory for the float64 check: timings still count
            truth = None
        n = dict(flops=counts.attention_flops(B, T, T, H, D, D, causal=False),
                 bytes=counts.attention_bytes(B, T, T, H, H, D, D, q.element_size()))
        for precision in (PRECISIONS if dtype == torch.float32 else ("ieee",)):
            tag = f"[{precision}]" if dtype == torch.float32 else ""
            call = lambda p=precision: regattn.scan_attention(q, k, v, precision=p, backend=setup.backend)
            yield mode, with_error(ours(regattn.scan_attention, q, setup, call, [], mode=mode, tag=tag, **n), truth)
        for _, case in sdpa_cases(setup, mode, q, k, v, causal=False, **n):
            yield mode, with_error(case, truth)
        for _, case in reference_case(setup, mode, lambda: reference.scan_attention(q, k, v), [], **n):
            yield mode, with_error(case, truth)
        del truth
