"""Parallax kernels at full size on a GPU (``-m gpu``): prefill forward and backward, and decode,
against the float64 reference (fp16/bf16 by flash-attn's rule, fp32 by a fixed bound)."""
import pytest
import torch

import regattn
from regattn.reference.parallax import parallax as parallax_ref
from tests.gpu.rule import assert_within, leaves, outputs, segments
from tests.helpers import randn

pytestmark = pytest.mark.gpu
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def inputs(B, T, S, HQ, H, D, dtype, device):
    return (randn(B, T, HQ, D, dtype=dtype, device=device), randn(B, T, HQ, D, dtype=dtype, device=device, scale=0.3),
            randn(B, S, H, D, dtype=dtype, device=device), randn(B, S, H, D, dtype=dtype, device=device))


def check_prefill(B, T, HQ, H, D, dtype, *, window=None, cu_seqlens=None, device="cuda"):
    """Output and the gradients of q, r, k, v; each packed sequence on its own as well."""
    x = inputs(B, T, T, HQ, H, D, dtype, device)
    do = randn(B, T, HQ, D, dtype=dtype, device=device)
    cu = None if cu_seqlens is None else torch.tensor(cu_seqlens, dtype=torch.int32, device=device)
    kw = dict(window=window, cu_seqlens=cu)
    got = outputs(lambda *a: regattn.parallax(*a, backend="triton", **kw), leaves(x), do)
    exact = outputs(lambda *a: parallax_ref(*a, **kw), leaves(x, torch.float64), do)
    same = None if dtype == FP32 else outputs(lambda *a: parallax_ref(*a, **kw), leaves(x), do)
    assert_within(["o", "dq", "dr", "dk", "dv"], got, exact, same, fixed=2e-5,
                  parts=segments(cu_seqlens) if cu_seqlens else ())


def check_decode(B, Tn, S, HQ, H, D, lens, *, window=None, dtype=BF16, device="cuda"):
    """Ragged caches: each batch row against the reference over its own ``lens[b]`` keys."""
    q, r, k, v = inputs(B, Tn, S, HQ, H, D, dtype, device)
    cache_seqlens = torch.tensor(lens, dtype=torch.int32, device=device)
    o = regattn.parallax_decode(q, r, k, v, cache_seqlens=cache_seqlens, window=window, backend="triton")
    for b, n in enumerate(lens):
        x = [q[b:b + 1], r[b:b + 1], k[b:b + 1, :n], v[b:b + 1, :n]]
        exact = parallax_ref(*(t.double() for t in x), window=window)
        same = None if dtype == FP32 else [parallax_ref(*x, window=window)]
        assert_within([f"o[{b}]"], [o[b:b + 1]], [exact], same, fixed=2e-5)


@pytest.mark.parametrize("B,T,HQ,H,D,dtype,window,cu_seqlens", [
    pytest.param(2, 2048, 16, 16, 128, BF16, None, None, id="causal-D128-MHA-bf16"),
    pytest.param(1, 2000, 16, 4, 64, BF16, 512, None, id="window512-D64-GQA4-bf16"),
    pytest.param(1, 1500, 8, 2, 128, FP16, None, None, id="causal-D128-GQA4-fp16"),
    pytest.param(1, 1024, 8, 8, 64, FP32, None, None, id="causal-D64-fp32"),
    pytest.param(1, 3000, 8, 2, 128, BF16, None, [0, 1000, 1001, 1001, 3000], id="varlen-D128-GQA4-bf16"),
])
def test_prefill(B, T, HQ, H, D, dtype, window, cu_seqlens):
    check_prefill(B, T, HQ, H, D, dtype, window=window, cu_seqlens=cu_seqlens)


@pytest.mark.parametrize("B,Tn,S,HQ,H,D,lens,window", [
    pytest.param(4, 1, 8192, 32, 8, 128, [8192, 1, 5000, 777], None, id="ragged-GQA-32-8"),
    pytest.param(2, 16, 4096, 32, 8, 128, [4096, 100], 1000, id="chunk16-window1000"),
])
def test_decode(B, Tn, S, HQ, H, D, lens, window):
    check_decode(B, Tn, S, HQ, H, D, lens, window=window)
