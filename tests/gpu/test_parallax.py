"""Parallax kernels at full size on a GPU (``-m gpu``): prefill forward and backward, and decode,
against the float64 reference (fp16/bf16 by flash-attn's rule, fp32 by a fixed bound)."""
import pytest
import torch

import regattn
from regattn.reference.parallax import parallax as parallax_ref
from tests.gpu.rule import assert_within, leaves, outputs, segments
from tests.helpers import randn, rel_err

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
    pytest.param(2, 1500, 8, 4, 32, BF16, None, None, id="causal-D32-GQA2-bf16"),
    pytest.param(1, 1200, 8, 2, 256, BF16, None, None, id="causal-D256-GQA4-bf16"),
    pytest.param(1, 1000, 4, 4, 256, FP16, 300, None, id="window300-D256-fp16"),
])
def test_prefill(B, T, HQ, H, D, dtype, window, cu_seqlens):
    check_prefill(B, T, HQ, H, D, dtype, window=window, cu_seqlens=cu_seqlens)


@pytest.mark.parametrize("B,T,HQ,H,D,dtype,window", [
    pytest.param(2, 2048, 16, 16, 128, BF16, None, id="causal-D128-MHA-bf16"),
    pytest.param(1, 2000, 16, 4, 64, BF16, 512, id="window512-D64-GQA4-bf16"),
    pytest.param(1, 1500, 8, 2, 128, FP16, None, id="causal-D128-GQA4-fp16"),
])
def test_prefill_through_tensor_descriptors(monkeypatch, B, T, HQ, H, D, dtype, window):
    """The forward and the dQ pass with key and value tiles through tensor descriptors (the TMA tile setting)."""
    from regattn.ops._common import attention_tiles
    from regattn.ops.parallax import tiles

    table = tiles.TILES[tiles.table_head_dim(D)]
    monkeypatch.setitem(tiles.TILES, tiles.table_head_dim(D), dict(table, fwd=dict(table["fwd"], TMA=True),
                                                                   dq=dict(table["dq"], TMA=True)))
    monkeypatch.setattr(attention_tiles, "TMA_WORK", 0)
    check_prefill(B, T, HQ, H, D, dtype, window=window)


@pytest.mark.parametrize("B,Tn,S,HQ,H,D,lens,window", [
    pytest.param(4, 1, 8192, 32, 8, 128, [8192, 1, 5000, 777], None, id="ragged-GQA-32-8"),
    pytest.param(2, 16, 4096, 32, 8, 128, [4096, 100], 1000, id="chunk16-window1000"),
    pytest.param(3, 1, 3000, 16, 4, 32, [3000, 7, 1500], None, id="ragged-D32"),
    pytest.param(2, 1, 3000, 16, 4, 64, [3000, 2999], None, id="ragged-D64"),
    pytest.param(2, 4, 3000, 16, 4, 256, [3000, 1000], None, id="chunk4-D256"),
])
def test_decode(B, Tn, S, HQ, H, D, lens, window):
    check_decode(B, Tn, S, HQ, H, D, lens, window=window)


def test_no_sync_with_max_seqlen():
    """Packed forward+backward and a ragged decode given ``max_seqlen``: no device-to-host sync at all."""
    from tests.helpers import no_host_reads
    x = leaves(inputs(1, 3000, 3000, 16, 4, 128, BF16, "cuda"))
    do = randn(1, 3000, 16, 128, dtype=BF16, device="cuda")
    cu = torch.tensor([0, 1000, 1001, 3000], dtype=torch.int32, device="cuda")
    q, r, k, v = inputs(4, 1, 8192, 32, 8, 128, BF16, "cuda")
    lens = torch.tensor([8192, 1, 5000, 777], dtype=torch.int32, device="cuda")

    def run():
        o = regattn.parallax(*x, cu_seqlens=cu, max_seqlen=1999)
        grads = torch.autograd.grad(o, x, do)
        return [o, *grads], regattn.parallax_decode(q, r, k, v, cache_seqlens=lens, max_seqlen=8192)

    eager = run()  # first calls compile the kernels
    with no_host_reads():
        got = run()
    torch.cuda.synchronize()
    for a, b in zip([*got[0], got[1]], [*eager[0], eager[1]]):
        assert torch.equal(a, b)


def test_decode_in_cuda_graph():
    """Decode captured once in a CUDA graph and replayed on new tokens and lengths: the eager numbers."""
    q, r, k, v = inputs(2, 1, 4096, 32, 8, 128, BF16, "cuda")
    lens = torch.tensor([4096, 1234], dtype=torch.int32, device="cuda")
    regattn.parallax_decode(q, r, k, v, cache_seqlens=lens, max_seqlen=4096)  # warm up: compile, buffers
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o = regattn.parallax_decode(q, r, k, v, cache_seqlens=lens, max_seqlen=4096)
    for step in range(3):
        q.copy_(randn(*q.shape, dtype=BF16, device="cuda"))
        r.copy_(randn(*r.shape, dtype=BF16, device="cuda", scale=0.3))
        lens.copy_(torch.tensor([4096 - step, 1 + 500 * step], dtype=torch.int32))
        graph.replay()
        assert torch.equal(o, regattn.parallax_decode(q, r, k, v, cache_seqlens=lens))


def test_decode_loads_keys_as_its_rule_says(monkeypatch):
    """Eager calls over TMA_EAGER_BYTES of keys and values take tensor descriptors, smaller ones load through
    pointers, captured ones take descriptors at any size: the same numbers each way."""
    from regattn.ops.parallax import decode
    q, r, k, v = inputs(2, 1, 4096, 32, 8, 128, BF16, "cuda")
    loads = []
    run = decode.launch_kernel

    def launch(kernel, grid, *args, **kwargs):
        if kernel is decode._parallax_decode_kernel:
            loads.append(kwargs["TMA"])
        run(kernel, grid, *args, **kwargs)
    monkeypatch.setattr(decode, "launch_kernel", launch)
    pointers = regattn.parallax_decode(q, r, k, v)
    monkeypatch.setattr(decode, "TMA_EAGER_BYTES", 32 * 2 ** 20)  # B 2 x 4k keys x 8 heads x 256 x 2 bytes
    descriptors = regattn.parallax_decode(q, r, k, v)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = regattn.parallax_decode(q, r, k, v)
    graph.replay()
    assert loads == [False, True, True]
    assert torch.equal(pointers, descriptors) and torch.equal(pointers, captured)


def test_layer_compiles_fullgraph_forward_backward():
    """torch.compile(fullgraph=True) of the layer's forward and backward: no graph break, no recompile
    on new inputs of the same shape, the eager numbers."""
    from torch._dynamo.utils import counters

    from regattn.layers import Parallax
    torch._dynamo.reset()
    counters.clear()
    layer = Parallax(512, 8, num_kv_heads=4, probe_gate=True).cuda().to(BF16)
    compiled = torch.compile(layer, fullgraph=True)

    def outputs(fn, x):
        layer.zero_grad()
        y = fn(x)
        y.float().square().mean().backward()
        return [y.detach()] + [p.grad.clone() for p in layer.parameters()]

    for i in range(3):
        x = randn(2, 1024, 512, dtype=BF16, device="cuda")
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            got = outputs(compiled, x)
        for a, b in zip(got, outputs(layer, x)):
            assert rel_err(a, b) < 2e-2
    assert not counters["graph_break"], dict(counters["graph_break"])
    torch._dynamo.reset()
