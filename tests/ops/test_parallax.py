"""Parallax Triton kernels (forward, backward, decode) against the float64 reference.

Run in the interpreter on CPU (TRITON_INTERPRET=1) at small awkward sizes; the ``gpu`` tests repeat
them at full size on CUDA.
"""
import pytest
import torch

import regattn
from regattn.reference.parallax import parallax as parallax_ref
from tests.helpers import TOL, no_host_reads, randn, rel_err

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(B, T, S, HQ, H, D, Dv, dtype, seed=0, device=DEVICE, logit_scale=1.0):
    q = randn(B, T, HQ, D, dtype=dtype, device=device, seed=seed, scale=logit_scale)
    r = randn(B, T, HQ, D, dtype=dtype, device=device, seed=seed + 1, scale=0.3)
    k = randn(B, S, H, D, dtype=dtype, device=device, seed=seed + 2)
    v = randn(B, S, H, Dv, dtype=dtype, device=device, seed=seed + 3)
    return q, r, k, v


def _bound(dtype, torch_err):
    """fp32: the dtype bound; fp16/bf16: 2x the same-precision reference's error plus slack."""
    return TOL[dtype] if dtype == torch.float32 else 2 * torch_err + 1e-3


def _check(q, r, k, v, *, grad=True, **kw):
    """Kernel forward (and backward) vs float64; low precision judged against the torch reference in it."""
    dtype = q.dtype
    x64 = [t.detach().double().requires_grad_() for t in (q, r, k, v)]
    ref = parallax_ref(*x64, **kw)
    do = randn(*ref.shape, dtype=dtype, device=q.device, seed=7)
    xk = [t.detach().clone().requires_grad_() for t in (q, r, k, v)]
    out = regattn.parallax(*xk, backend="triton", **kw)
    assert out.dtype == dtype and out.shape == ref.shape
    xt = [t.detach().clone().requires_grad_() for t in (q, r, k, v)]
    low = parallax_ref(*xt, **kw)
    assert rel_err(out, ref) <= _bound(dtype, rel_err(low, ref)), rel_err(out, ref)
    if not grad:
        return
    g_ref = torch.autograd.grad(ref, x64, do.double())
    g_out = torch.autograd.grad(out, xk, do)
    g_low = torch.autograd.grad(low, xt, do)
    for name, a, b, c in zip("qrkv", g_out, g_ref, g_low):
        assert rel_err(a, b) <= _bound(dtype, rel_err(c, b)), (name, rel_err(a, b))


CASES = [  # B, T, S, HQ, H, D, Dv, causal, window
    (2, 37, 37, 2, 2, 16, 16, True, None),   # T not a tile multiple
    (1, 1, 6, 1, 1, 16, 16, True, None),     # T = 1 (one query over six keys)
    (1, 29, 29, 4, 2, 24, 20, True, 7),      # window < T, GQA 2, padded head dims
    (1, 21, 21, 4, 1, 32, 32, True, 40),     # window > T, GQA 4
    (1, 19, 19, 3, 1, 16, 16, False, None),  # non-causal, group of 3 padded to 4
    (1, 9, 30, 2, 1, 16, 16, True, None),    # chunked prefill (T < S)
    (1, 20, 12, 2, 2, 16, 16, True, None),   # T > S: the first queries see nothing
]


@pytest.mark.parametrize("B,T,S,HQ,H,D,Dv,causal,window", CASES)
def test_forward_backward_fp32(interpret, B, T, S, HQ, H, D, Dv, causal, window):
    q, r, k, v = _inputs(B, T, S, HQ, H, D, Dv, torch.float32)
    _check(q, r, k, v, causal=causal, window=window)


@pytest.mark.parametrize("B,T,S,HQ,H,D,Dv,causal,window", CASES)
def test_forward_backward_through_tensor_descriptors(interpret, monkeypatch, B, T, S, HQ, H, D, Dv, causal, window):
    """The forward and the dQ pass with their key and value tiles loaded through tensor descriptors (the tile
    setting TMA), at every size: the same answers."""
    from regattn.ops._common import attention_tiles
    from regattn.ops.parallax import backward, forward, tiles

    fwd_default, bwd_default = forward.fwd_config, backward.bwd_config
    monkeypatch.setattr(forward, "fwd_config", lambda *a: dict(fwd_default(*a), TMA=True))
    monkeypatch.setattr(backward, "bwd_config", lambda *a: dict(bwd_default(*a), TMA=a[-1] == "dq"))
    monkeypatch.setattr(attention_tiles, "TMA_WORK", 0)
    q, r, k, v = _inputs(B, T, S, HQ, H, D, Dv, torch.float32)
    assert tiles.prefill_descriptors(k, v, dict(TMA=True, BLOCK_N=16), None, work=1) is not None
    _check(q, r, k, v, causal=causal, window=window)


@pytest.mark.parametrize("B,T,S,HQ,H,D,Dv,causal,window", [CASES[0], CASES[2], CASES[3], CASES[5]])
def test_backward_key_tiles_of_gpu_shape(interpret, monkeypatch, B, T, S, HQ, H, D, Dv, causal, window):
    """The dK/dV pass with more streamed rows than the interpreter's default: its partially masked tiles
    then take half as many rows as the others (the GPU tiles' layout)."""
    from regattn.ops.parallax import backward

    default = backward.bwd_config

    def config(D, Dv, groups, dtype, kind):
        return dict(default(D, Dv, groups, dtype, kind), **(dict(BLOCK_M=32, BLOCK_N=32) if kind == "dk" else {}))

    monkeypatch.setattr(backward, "bwd_config", config)
    q, r, k, v = _inputs(B, T, S, HQ, H, D, Dv, torch.float32)
    _check(q, r, k, v, causal=causal, window=window)


@pytest.mark.parametrize("D,Dv,window", [(32, 32, None), (64, 48, 9), (128, 128, None), (256, 256, 6)])
def test_head_dims(interpret, D, Dv, window):
    """Every head dim of the tile table, GQA and T not a tile multiple, forward and backward."""
    q, r, k, v = _inputs(1, 19, 19, 4, 2, D, Dv, torch.float32)
    _check(q, r, k, v, window=window)


def test_forward_backward_fp16(interpret):
    q, r, k, v = _inputs(1, 33, 33, 4, 2, 16, 16, torch.float16)
    _check(q, r, k, v, window=12)


def test_varlen(interpret):
    cu = torch.tensor([0, 5, 5, 6, 29, 40], dtype=torch.int32, device=DEVICE)  # an empty and a length-1 sequence
    q, r, k, v = _inputs(1, 40, 40, 4, 2, 16, 16, torch.float32)
    _check(q, r, k, v, window=6, cu_seqlens=cu)


def test_large_logits_and_zero_probe(interpret):
    """|scale q.k| up to ~1e4 and r = 0 (softmax attention): finite and exact."""
    q, r, k, v = _inputs(1, 24, 24, 2, 1, 16, 16, torch.float32, logit_scale=2000.0)
    o = regattn.parallax(q, r, k, v, backend="triton")
    max_logit = (q[0, :, 0] @ k[0, :, 0].T).abs().max().item() * 16 ** -0.5
    assert max_logit > 5e3
    assert rel_err(o, parallax_ref(q.double(), r.double(), k.double(), v.double())) < 1e-5
    zero = torch.zeros_like(r)
    _check(q, zero, k, v, window=5, grad=False)
    # The softmax saturates: dQ and dR are ~0 and the fp32 logits (~1e4) carry ~1e-3 absolute rounding,
    # so gradients are judged at fp32 precision of their natural scale ||dO|| ||q|| scale, not relatively.
    for probe in (r, zero):
        x = [t.clone().requires_grad_() for t in (q, probe, k, v)]
        x64 = [t.detach().double().requires_grad_() for t in (q, probe, k, v)]
        do = randn(*o.shape, device=DEVICE, seed=9, dtype=torch.float32)
        g = torch.autograd.grad(regattn.parallax(*x, backend="triton"), x, do)
        g_ref = torch.autograd.grad(parallax_ref(*x64), x64, do.double())
        natural = do.norm() * q.norm() * 16 ** -0.5
        for a, b in zip(g, g_ref):
            assert torch.isfinite(a).all() and (a.double() - b).norm() <= 1e-6 * natural + 1e-5 * b.norm()
        # dV = P^T dO with P recomputed from the saved log-sum-exp: the recomputed logit carries the
        # fp32 rounding of its size, so P's relative error is about eps * max|logit|.
        assert rel_err(g[3], g_ref[3]) < 2 ** -23 * max_logit
    o0 = regattn.parallax(q, zero, k, v, backend="triton")
    assert rel_err(o0, regattn.softmax_attention(q.double(), k.double(), v.double(), backend="torch")) < 1e-5


def test_compile_no_graph_break(interpret):
    q, r, k, v = [t.requires_grad_() for t in _inputs(1, 17, 17, 2, 1, 16, 16, torch.float32)]
    f = torch.compile(lambda *a: regattn.parallax(*a, backend="triton", window=5), backend="aot_eager",
                      fullgraph=True)
    out = f(q, r, k, v)
    out.square().sum().backward()
    assert rel_err(out, parallax_ref(q.double(), r.double(), k.double(), v.double(), window=5)) < 1e-5
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, r, k, v))


DECODE_CASES = [  # B, Tn, S, HQ, H, D, window, cache_seqlens, num_splits
    (2, 1, 45, 4, 1, 16, None, None, None),
    (3, 1, 70, 8, 2, 32, None, [70, 1, 33], 4),
    (2, 6, 50, 4, 2, 16, 9, [50, 20], 2),      # chunk of new tokens, window
    (1, 1, 70, 8, 2, 32, None, None, 16),      # more splits than key tiles: most splits see no key
]


@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
@pytest.mark.parametrize("B,Tn,S,HQ,H,D,window,lens,splits", DECODE_CASES)
def test_decode(interpret, B, Tn, S, HQ, H, D, window, lens, splits, tma):
    """The op, and the kernel with a given split count, key and value tiles loaded through pointers or through
    tensor descriptors (TMA)."""
    from regattn.ops.parallax.decode import parallax_decode_fwd
    q, r, k, v = _inputs(B, Tn, S, HQ, H, D, D, torch.float32)
    cache_seqlens = None if lens is None else torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    o = regattn.parallax_decode(q, r, k, v, cache_seqlens=cache_seqlens, window=window, backend="triton")
    o_split = parallax_decode_fwd(q, r, k, v, cache_seqlens=cache_seqlens, window=window, scale=D ** -0.5,
                                  num_splits=splits or 1, config=dict(TMA=tma))
    for b in range(B):
        n = S if lens is None else lens[b]
        ref = parallax_ref(q[b:b + 1].double(), r[b:b + 1].double(), k[b:b + 1, :n].double(),
                           v[b:b + 1, :n].double(), window=window)
        assert rel_err(o[b:b + 1], ref) < 1e-5
        assert rel_err(o_split[b:b + 1], ref) < 1e-5
    torch_o = regattn.parallax_decode(q, r, k, v, cache_seqlens=cache_seqlens, window=window, backend="torch")
    assert rel_err(torch_o, o) < 1e-5


@pytest.mark.parametrize("B,Tn,S,HQ,H,D,window,lens,splits", [case for case in DECODE_CASES if case[-1]])
def test_decode_merges_splits_in_its_own_launch_when_eager(interpret, monkeypatch, B, Tn, S, HQ, H, D, window, lens,
                                                           splits):
    """Eager calls merge the splits in the decode launch (the last split of a row tile to finish merges them,
    counted in kept counters that it sets back to zero); where no counters may be kept (CUDA graphs, compiled
    code) a second launch merges them. The same numbers, called again and again."""
    from regattn.ops._common.workspace import stream_zeros
    from regattn.ops.parallax import decode
    q, r, k, v = _inputs(B, Tn, S, HQ, H, D, D, torch.float32)
    cache_seqlens = None if lens is None else torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    kw = dict(cache_seqlens=cache_seqlens, window=window, scale=D ** -0.5, num_splits=splits)
    launches = []
    run = decode.launch_kernel

    def launch(kernel, *args, **kwargs):
        launches.append(kernel)
        run(kernel, *args, **kwargs)
    monkeypatch.setattr(decode, "launch_kernel", launch)
    one = [decode.parallax_decode_fwd(q, r, k, v, **kw) for _ in range(3)]
    assert launches == [decode._parallax_decode_kernel] * 3
    assert (stream_zeros(1, q.device) == 0).all()
    monkeypatch.setattr(decode, "stream_zeros", lambda *a: None)
    launches.clear()
    two = decode.parallax_decode_fwd(q, r, k, v, **kw)
    assert launches == [decode._parallax_decode_kernel, decode._merge_splits_kernel]
    for b in range(B):
        n = S if lens is None else lens[b]
        ref = parallax_ref(q[b:b + 1].double(), r[b:b + 1].double(), k[b:b + 1, :n].double(),
                           v[b:b + 1, :n].double(), window=window)
        assert rel_err(two[b:b + 1], ref) < 1e-5
    for o in one:
        assert rel_err(o, two) < 1e-6


def test_decode_merges_in_its_launch_up_to_16_splits_and_128_mib():
    """Eager calls merge in the decode launch up to 16 splits over 128 MiB of keys and values, with the merge
    launch's column slices; past either a merge launch runs (the merging split's tail shows once the kernel
    outlasts the host); one split has nothing to merge."""
    from regattn.ops.parallax.decode import plan_decode

    def plan(B, S, splits):
        return plan_decode(B, 1, 32, 8, 128, 128, S, torch.bfloat16, 132, num_splits=splits)
    short = plan(1, 4096, 16)
    assert short.merge_in_launch == dict(MERGE=True, BLOCK_C=short.merge_meta["BLOCK_C"])
    assert plan(8, 4096, 4).merge_in_launch is not None  # 128 MiB
    assert plan(8, 8192, 4).merge_in_launch is None  # 256 MiB
    assert plan(1, 8192, 32).merge_in_launch is None
    assert plan(64, 4096, 1).merge_in_launch is None


@pytest.mark.parametrize("splits", [1, 4])
def test_decode_tma_ignores_entries_past_the_cache_lengths(interpret, splits):
    """Tensor descriptors read whole key tiles, past a cache length too: NaN and inf there change nothing."""
    from regattn.ops.parallax.decode import parallax_decode_fwd
    B, Tn, S, HQ, H, D = 2, 2, 45, 4, 2, 16
    q, r, k, v = _inputs(B, Tn, S, HQ, H, D, D, torch.float32)
    lens = torch.tensor([19, 33], dtype=torch.int32, device=DEVICE)
    bad_k, bad_v = k.clone(), v.clone()
    for b, n in enumerate(lens.tolist()):
        bad_k[b, n:], bad_v[b, n:] = float("nan"), float("inf")
    kw = dict(cache_seqlens=lens, window=7, scale=D ** -0.5, num_splits=splits)
    got = parallax_decode_fwd(q, r, bad_k, bad_v, config=dict(TMA=True), **kw)
    assert torch.equal(got, parallax_decode_fwd(q, r, k, v, config=dict(TMA=True), **kw))
    assert rel_err(got, parallax_decode_fwd(q, r, k, v, **kw)) < 1e-6


@pytest.mark.parametrize("splits", [1, 4])
def test_decode_strided_inputs(interpret, splits):
    """q and r as views into wider tensors, caches as slices of longer ones (one with a strided head dim)."""
    from regattn.ops.parallax.decode import parallax_decode_fwd
    B, Tn, S, HQ, H, D = 2, 3, 37, 4, 2, 16
    qr = randn(B, Tn, HQ, 3 * D, dtype=torch.float32, device=DEVICE, seed=1)
    q, r = qr[..., :D], qr[..., D:2 * D]
    k = randn(B, S + 9, H, D, dtype=torch.float32, device=DEVICE, seed=2)[:, 4:S + 4]
    v = randn(B, S, 2 * D, H, dtype=torch.float32, device=DEVICE, seed=3).transpose(2, 3)[..., ::2]
    assert not (q.is_contiguous() or r.is_contiguous() or k.is_contiguous()) and v.stride(-1) != 1
    lens = torch.tensor([S, 20], dtype=torch.int32, device=DEVICE)
    o = parallax_decode_fwd(q, r, k, v, cache_seqlens=lens, window=11, scale=D ** -0.5, num_splits=splits)
    for b, n in enumerate(lens.tolist()):
        ref = parallax_ref(q[b:b + 1].double(), r[b:b + 1].double(), k[b:b + 1, :n].double(),
                           v[b:b + 1, :n].double(), window=11)
        assert rel_err(o[b:b + 1], ref) < 1e-5
    assert rel_err(regattn.parallax_decode(q, r, k, v, cache_seqlens=lens, window=11, backend="triton"), o) < 1e-5


def test_decode_bad_input(interpret):
    q, r, k, v = _inputs(2, 1, 10, 4, 2, 16, 16, torch.float32)
    dec = regattn.parallax_decode
    with pytest.raises(ValueError, match="cache_seqlens"):
        dec(q, r, k, v, cache_seqlens=torch.tensor([10, 11], dtype=torch.int32, device=DEVICE), backend="triton")
    with pytest.raises(ValueError, match="cache_seqlens"):
        dec(q, r, k, v, cache_seqlens=torch.tensor([0, 3], device=DEVICE), backend="triton")
    with pytest.raises(ValueError, match="cache_seqlens"):
        dec(q, r, k, v, cache_seqlens=torch.tensor([3], device=DEVICE), backend="triton")
    with pytest.raises(TypeError, match="cache_seqlens"):
        dec(q, r, k, v, cache_seqlens=torch.tensor([3.0, 4.0], device=DEVICE), backend="triton")
    with pytest.raises(ValueError, match="k_cache"):
        dec(q, r, k[:, :, :, :8], v, backend="triton")
    with pytest.raises(ValueError, match="v_cache"):
        dec(q, r, k, v[:1], backend="triton")
    with pytest.raises(ValueError, match="q"):
        dec(q[:, :, :3], r[:, :, :3], k, v, backend="triton")
    with pytest.raises(ValueError, match="r"):
        dec(q, r[:, :, :2], k, v, backend="triton")


def test_bad_input(interpret):
    q, r, k, v = _inputs(1, 10, 10, 4, 2, 16, 16, torch.float32)
    with pytest.raises(ValueError, match="cu_seqlens"):
        regattn.parallax(q, r, k, v, cu_seqlens=torch.tensor([0, 6, 4, 10]), backend="triton")
    with pytest.raises(ValueError, match="cu_seqlens"):
        regattn.parallax(q, r, k, v, cu_seqlens=torch.tensor([0, 6, 9]), backend="triton")
    with pytest.raises(ValueError, match="q"):
        regattn.parallax(q[:, :, :3], r[:, :, :3], k, v, backend="triton")
    with pytest.raises(TypeError, match="q"):
        regattn.parallax(q.double(), r.double(), k.double(), v.double(), backend="triton")
    with pytest.raises(ValueError, match="window"):
        regattn.parallax(q, r, k, v, window=0, backend="triton")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("D,window,groups", [(64, None, 1), (128, 500, 4), (128, None, 2)])
def test_full_size_gpu(dtype, D, window, groups):
    q, r, k, v = _inputs(2, 1000, 1000, 8, 8 // groups, D, D, dtype, device="cuda")
    _check(q, r, k, v, window=window)


@pytest.mark.gpu
@pytest.mark.parametrize("config", [None, dict(TMA=True), dict(TMA=True, BLOCK_N=64)], ids=["table", "tma", "tma-64"])
@pytest.mark.parametrize("splits", [None, 1, 8])
def test_decode_gpu(config, splits):
    from regattn.ops.parallax.decode import parallax_decode_fwd
    q, r, k, v = _inputs(3, 1, 5000, 32, 8, 128, 128, torch.bfloat16, device="cuda")
    lens = torch.tensor([5000, 1, 2345], dtype=torch.int32, device="cuda")
    if config is None and splits is None:
        o = regattn.parallax_decode(q, r, k, v, cache_seqlens=lens)
    else:
        o = parallax_decode_fwd(q, r, k, v, cache_seqlens=lens, scale=128 ** -0.5, config=config, num_splits=splits)
    for b, n in enumerate(lens.tolist()):
        ref = parallax_ref(q[b:b + 1].double(), r[b:b + 1].double(), k[b:b + 1, :n].double(), v[b:b + 1, :n].double())
        low = parallax_ref(q[b:b + 1], r[b:b + 1], k[b:b + 1, :n], v[b:b + 1, :n])
        assert rel_err(o[b:b + 1], ref) <= 2 * rel_err(low, ref) + 1e-3


def test_max_seqlen_reads_nothing_on_the_host(interpret):
    """With ``max_seqlen`` the packed forward and backward read no offset on the host; the same numbers."""
    cu = torch.tensor([0, 9, 9, 10, 31], dtype=torch.int32, device=DEVICE)
    q, r, k, v = [t.requires_grad_() for t in _inputs(1, 31, 31, 4, 2, 16, 16, torch.float32)]
    do = randn(1, 31, 4, 16, device=DEVICE, dtype=torch.float32)
    with no_host_reads():
        o = regattn.parallax(q, r, k, v, window=6, cu_seqlens=cu, max_seqlen=21, backend="triton")
        grads = torch.autograd.grad(o, (q, r, k, v), do)
    x64 = [t.detach().double().requires_grad_() for t in (q, r, k, v)]
    ref = parallax_ref(*x64, window=6, cu_seqlens=cu)
    assert rel_err(o, ref) < 1e-5
    for a, b in zip(grads, torch.autograd.grad(ref, x64, do.double())):
        assert rel_err(a, b) < 1e-5
    with pytest.raises(AssertionError, match="host"), no_host_reads():  # without it the offsets are read
        regattn.parallax(q, r, k, v, cu_seqlens=cu, backend="triton")


def test_bad_offsets_under_max_seqlen_stay_in_bounds(interpret):
    """Unchecked offsets past T are clamped to it: the last sequence ends at T."""
    q, r, k, v = _inputs(1, 20, 20, 2, 1, 16, 16, torch.float32)
    bad = torch.tensor([0, 8, 50], dtype=torch.int32, device=DEVICE)
    o = regattn.parallax(q, r, k, v, cu_seqlens=bad, max_seqlen=20, backend="triton")
    good = torch.tensor([0, 8, 20], dtype=torch.int32, device=DEVICE)
    assert rel_err(o, parallax_ref(q.double(), r.double(), k.double(), v.double(), cu_seqlens=good)) < 1e-5


def test_bad_max_seqlen(interpret):
    q, r, k, v = _inputs(1, 10, 10, 2, 1, 16, 16, torch.float32)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    for bad, error in ((0, ValueError), (11, ValueError), (4.0, TypeError), (True, TypeError)):
        with pytest.raises(error, match="^max_seqlen: "):
            regattn.parallax(q, r, k, v, cu_seqlens=cu, max_seqlen=bad, backend="triton")
    with pytest.raises(ValueError, match="^max_seqlen: "):
        regattn.parallax(q, r, k, v, max_seqlen=10, backend="triton")
    lens = torch.tensor([10], dtype=torch.int32)
    for bad, error in ((0, ValueError), (11, ValueError), (3.0, TypeError)):
        with pytest.raises(error, match="^max_seqlen: "):
            regattn.parallax_decode(q[:, :1], r[:, :1], k, v, cache_seqlens=lens, max_seqlen=bad, backend="triton")
    with pytest.raises(ValueError, match="^max_seqlen: "):
        regattn.parallax_decode(q[:, :1], r[:, :1], k, v, max_seqlen=10, backend="triton")


def test_decode_max_seqlen_reads_nothing_and_clamps(interpret):
    """With ``max_seqlen`` the lengths are not read on the host; a length past the cache is clamped to it."""
    from regattn.ops.parallax.decode import decode_launch
    q, r, k, v = _inputs(3, 2, 40, 4, 2, 16, 16, torch.float32)
    lens = torch.tensor([40, 2, 57], dtype=torch.int32, device=DEVICE)  # 57 > S: clamped to 40
    regattn.parallax_decode(q, r, k, v, cache_seqlens=lens, max_seqlen=40, window=9, backend="triton")
    hits = decode_launch.cache_info().hits
    with no_host_reads():
        o = regattn.parallax_decode(q, r, k, v, cache_seqlens=lens, max_seqlen=40, window=9, backend="triton")
    assert decode_launch.cache_info().hits == hits + 1  # the launch settings of a shape are computed once
    for b, n in enumerate((40, 2, 40)):
        ref = parallax_ref(q[b:b + 1].double(), r[b:b + 1].double(), k[b:b + 1, :n].double(),
                           v[b:b + 1, :n].double(), window=9)
        assert rel_err(o[b:b + 1], ref) < 1e-5
    with pytest.raises(AssertionError, match="host"), no_host_reads():  # without it the lengths are checked
        regattn.parallax_decode(q, r, k, v, cache_seqlens=lens.clamp(max=40), backend="triton")
