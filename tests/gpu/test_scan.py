"""The ELSA scan at full size on a GPU (``-m gpu``): forward and backward against the float64 softmax
for every precision (GQA, causal, windows, varlen, Swin partitions, split-KV), the error of the
benchmark shape, and the growth of the error with the sequence length (elsa A.3)."""
import pytest
import torch

import regattn
from regattn.ops._common import attention_tiles
from regattn.ops.scan import kernels
from regattn.ops.scan.verify import UNIT_ROUNDOFF, growth_check, measure
from regattn.reference.softmax import softmax_attention
from tests.gpu.rule import assert_within, leaves, outputs, segments
from tests.helpers import randn

pytestmark = pytest.mark.gpu
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
FP32_BOUND = {"ieee": 1e-5, "tf32x3": 1e-5, "fp16x3": 1e-5, "tf32": 3e-3}


@pytest.fixture(autouse=True)
def fixed_tiles(monkeypatch):
    """The first config of every list, no tuning runs (tuning is the benchmarks' job)."""
    monkeypatch.setattr(kernels, "AUTOTUNE", False)


def reference(q, k, v, *, causal=False, window=None, cu_seqlens=None, partition=None, num_splits=None):
    """The softmax reference computed in the inputs' dtype; Swin partitions through the torch backend."""
    if partition is not None:
        return regattn.scan_attention(q, k, v, partition=partition, backend="torch")
    return softmax_attention(q, k, v, causal=causal, window=window, cu_seqlens=cu_seqlens, upcast=False)


def check_scan(dtype, precision, B, T, HQ, H, D, *, backward=True, cu_seqlens=None, device="cuda", **kw):
    """Output (and the gradients of q, k, v); fp32 within the precision's bound, fp16/bf16 by flash-attn's
    rule; each packed sequence on its own as well."""
    x = [randn(B, T, n, D, dtype=dtype, device=device) for n in (HQ, H, H)]
    do = randn(B, T, HQ, D, dtype=dtype, device=device)
    if cu_seqlens is not None:
        kw["cu_seqlens"] = torch.tensor(cu_seqlens, dtype=torch.int32, device=device)

    def run(fn, dt):
        xs = leaves(x, dt)
        return outputs(fn, xs, do) if backward else [fn(*xs)]
    got = run(lambda *a: regattn.scan_attention(*a, precision=precision, backend="triton", **kw), dtype)
    exact = run(lambda *a: reference(*a, **kw), torch.float64)
    same = None if dtype == FP32 else run(lambda *a: reference(*a, **kw), dtype)
    assert_within(["o", "dq", "dk", "dv"], got, exact, same, fixed=FP32_BOUND.get(precision),
                  parts=segments(cu_seqlens) if cu_seqlens else ())


def check_last_rows(dtype, precision, B, T, H, D, rows, device="cuda"):
    """Non-causal forward at the benchmark shape, judged on its last ``rows`` queries."""
    q, k, v = (randn(B, T, H, D, dtype=dtype, device=device) for _ in range(3))
    o = regattn.scan_attention(q, k, v, precision=precision, backend="triton")[:, -rows:]
    exact = softmax_attention(q[:, -rows:].double(), k.double(), v.double(), causal=False)
    same = None if dtype == FP32 else [softmax_attention(q[:, -rows:], k, v, causal=False, upcast=False)]
    bound = {"ieee": 1e-5, "tf32x3": 1e-5, "fp16x3": 1e-5, "tf32": 1e-3}[precision]
    assert_within(["o"], [o], [exact], same, fixed=bound)


def check_growth(dtype, precision, ns, *, probabilities, heads=2, dim=64, rows=256, device="cuda"):
    """The drift verifier over ``ns``: the output error stays below L(n) u and grows at most like log n."""
    seed = int(torch.randint(2 ** 30, ()))
    results = [measure(n, heads=heads, dim=dim, rows=rows, dtype=dtype, precision=precision, backend="triton",
                       device=device, seed=seed, input_scale=1.0, probabilities=probabilities) for n in ns]
    u = UNIT_ROUNDOFF[precision if dtype == FP32 else str(dtype).split(".")[-1]]
    check = growth_check(results, u)
    assert check["bound_ok"] and check["growth_ok"], (check, [(r["n"], r["rel_dY"]) for r in results])


VARLEN = dict(causal=True, window=700, cu_seqlens=[0, 1, 1000, 1000, 3001, 4096])
PACKED = dict(cu_seqlens=VARLEN["cu_seqlens"])  # non-causal


@pytest.mark.parametrize("dtype,precision,shape,kw", [
    pytest.param(FP32, "ieee", (2, 4096, 8, 4, 64), {}, id="ieee-gqa-d64"),
    pytest.param(FP32, "ieee", (1, 4096, 4, 2, 128), VARLEN, id="ieee-d128-causal-window-varlen"),
    pytest.param(FP32, "ieee", (16, 49 * 16, 4, 4, 32), dict(partition=49), id="ieee-swin-partition49"),
    pytest.param(FP32, "ieee", (1, 2048, 4, 4, 64), dict(num_splits=8, backward=False), id="ieee-split-kv8"),
    pytest.param(FP32, "tf32x3", (2, 4096, 8, 4, 64), {}, id="tf32x3-gqa-d64"),
    pytest.param(FP32, "tf32x3", (1, 4096, 4, 4, 128), dict(causal=True), id="tf32x3-d128-causal"),
    pytest.param(FP32, "fp16x3", (2, 4096, 8, 4, 64), {}, id="fp16x3-gqa-d64"),
    pytest.param(FP32, "fp16x3", (1, 4096, 4, 2, 128), VARLEN, id="fp16x3-d128-causal-window-varlen"),
    pytest.param(FP32, "fp16x3", (1, 2048, 4, 4, 64), dict(num_splits=8, backward=False), id="fp16x3-split-kv8"),
    pytest.param(FP32, "tf32", (2, 4096, 8, 4, 64), {}, id="tf32-gqa-d64"),
    pytest.param(FP16, "ieee", (2, 4096, 8, 4, 64), {}, id="fp16-gqa-d64"),
    pytest.param(FP16, "ieee", (1, 4096, 4, 2, 128), VARLEN, id="fp16-d128-causal-window-varlen"),
    pytest.param(FP16, "ieee", (1, 4096, 4, 2, 128), dict(causal=True), id="fp16-d128-causal"),
    pytest.param(FP16, "ieee", (1, 4096, 4, 2, 64), VARLEN, id="fp16-d64-causal-window-varlen"),
    pytest.param(FP16, "ieee", (1, 4096, 4, 2, 128), dict(causal=True, num_splits=1), id="fp16-d128-causal-nosplit"),
    pytest.param(FP32, "ieee", (1, 4096, 4, 2, 128), dict(causal=True), id="ieee-d128-causal"),
    pytest.param(BF16, "ieee", (1, 4096, 4, 2, 128), dict(causal=True), id="bf16-d128-causal"),
    pytest.param(BF16, "ieee", (2, 4096, 8, 4, 64), {}, id="bf16-gqa-d64"),
])
def test_forward_backward(dtype, precision, shape, kw):
    check_scan(dtype, precision, *shape, **kw)


@pytest.mark.parametrize("dtype,precision", [(FP32, "ieee"), (FP32, "tf32x3"), (FP32, "fp16x3"), (FP16, "ieee"),
                                             (BF16, "ieee")], ids=["ieee", "tf32x3", "fp16x3", "fp16", "bf16"])
def test_running_max_rising_and_falling_across_tiles(dtype, precision):
    """Blocks of 512 keys whose scores rise past the running max by a little, then by far, then fall far below
    it (as ``tests/ops/test_scan.py`` at the interpreter's tiles), causal."""
    levels = torch.tensor([0.0, 3.0, 7.5, 20.0, -30.0, 5.0, 28.0, 1.0], device="cuda").repeat_interleave(512)
    q, k, v = (randn(1, levels.numel(), 4, 64, dtype=dtype, device="cuda") for _ in range(3))
    q[..., 0] = 1.0
    k[..., 0] = (levels / attention_tiles.LOG2E)[None, :, None] + 0.1 * k[..., 0].float()
    do = randn(*v.shape, dtype=dtype, device="cuda")
    kw = dict(causal=True, scale=1.0)
    got = outputs(lambda *a: regattn.scan_attention(*a, precision=precision, backend="triton", **kw),
                  leaves([q, k, v]), do)
    exact = outputs(lambda *a: softmax_attention(*a, **kw), leaves([q, k, v], torch.float64), do)
    same = None if dtype == FP32 else outputs(lambda *a: softmax_attention(*a, upcast=False, **kw),
                                              leaves([q, k, v]), do)
    assert_within(["o", "dq", "dk", "dv"], got, exact, same, fixed=FP32_BOUND.get(precision))


def tile_id(c) -> str:
    return "m{BLOCK_M}-n{BLOCK_N}".format(**c.kwargs) + f"-w{c.num_warps}-s{c.num_stages}"


TMA_TILES = [c for c in kernels.FWD_CONFIGS["half"] if c.kwargs["TMA"]]


@pytest.mark.parametrize("config", TMA_TILES, ids=tile_id)
@pytest.mark.parametrize("dtype,shape,kw", [
    pytest.param(FP16, (2, 4096, 8, 4, 64), {}, id="fp16-gqa-d64"),
    pytest.param(BF16, (1, 4000, 4, 2, 128), dict(causal=True, window=700), id="bf16-d128-causal-window-ragged"),
    pytest.param(FP16, (1, 2048, 4, 4, 64), dict(num_splits=8, backward=False), id="fp16-split-kv8"),
    pytest.param(FP16, (1, 4096, 4, 2, 64), VARLEN, id="fp16-d64-causal-window-varlen"),
    pytest.param(BF16, (1, 4096, 4, 2, 128), PACKED, id="bf16-d128-varlen"),
])
def test_tma_tiles(monkeypatch, config, dtype, shape, kw):
    """Each forward tile that loads keys and values through tensor descriptors (Hopper's TMA)."""
    monkeypatch.setitem(kernels.FWD_CONFIGS, "half", [config])
    monkeypatch.setattr(attention_tiles, "TMA_WORK", 0)  # the split case is below it
    check_scan(dtype, "ieee", *shape, **kw)


@pytest.mark.parametrize("config", kernels.FUSED_CONFIGS,
                         ids=lambda c: tile_id(c) + ("-tma" if c.kwargs["TMA"] else ""))
@pytest.mark.parametrize("dtype,shape,kw", [
    pytest.param(FP16, (2, 4096, 8, 4, 64), {}, id="fp16-gqa-d64"),
    pytest.param(BF16, (1, 4000, 4, 2, 128), dict(causal=True, window=700), id="bf16-d128-causal-window-ragged"),
    pytest.param(FP16, (1, 4096, 4, 2, 64), VARLEN, id="fp16-d64-causal-window-varlen"),
    pytest.param(BF16, (1, 4096, 4, 2, 128), PACKED, id="bf16-d128-varlen"),
])
def test_fused_backward_tiles(monkeypatch, config, dtype, shape, kw):
    """Each tile of the backward that adds dq in its dK/dV pass: through atomics, or the tensor-memory reduction
    (TMA; with cu_seqlens its tiles reach into the next sequence, where they add zeros)."""
    if kernels._smem_bytes(config, shape[-1], shape[-1], 2, streamed="fused") > kernels.SMEM_BUDGET:
        pytest.skip("the autotuner's pruner drops this tile at this head dim (shared memory)")
    monkeypatch.setattr(kernels, "FUSED_CONFIGS", [config])
    monkeypatch.setattr(attention_tiles, "TMA_WORK", 0)
    check_scan(dtype, "ieee", *shape, **kw)


@pytest.mark.parametrize("config", kernels.FWD_CONFIGS["split"], ids=tile_id)
def test_fp16x3_tiles(monkeypatch, config):
    """Each forward tile of fp32 as fp16 parts, causal with a window over a ragged length."""
    monkeypatch.setitem(kernels.FWD_CONFIGS, "split", [config])
    check_scan(FP32, "fp16x3", 1, 4000, 4, 2, 64, causal=True, window=700, backward=False)


@pytest.mark.parametrize("dtype,precision", [(FP32, "ieee"), (FP32, "tf32x3"), (FP32, "fp16x3"), (FP32, "tf32"),
                                             (FP16, "ieee"), (BF16, "ieee")],
                         ids=["ieee", "tf32x3", "fp16x3", "tf32", "fp16", "bf16"])
def test_benchmark_shape(dtype, precision):
    check_last_rows(dtype, precision, 1, 16384, 16, 64, 512)


@pytest.mark.parametrize("dtype,precision,probabilities", [(FP32, "ieee", True), (FP32, "tf32x3", False),
                                                           (FP32, "fp16x3", False), (FP16, "ieee", False)],
                         ids=["ieee", "tf32x3", "fp16x3", "fp16"])
def test_error_growth(dtype, precision, probabilities):
    check_growth(dtype, precision, [1024, 2048, 4096, 8192, 16384, 32768, 65536], probabilities=probabilities)
