"""The fused softmax / sliding-window / gated attention kernel against the float64 reference."""
import pytest
import torch

import regattn
from regattn import reference
from tests.helpers import no_host_reads, randn, rel_err

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# The reference run in fp16/bf16 without upcasting casts the gate u to that dtype and can be far off, so
# the flash-attn rule (2 x its error) is also capped by a fixed bound per dtype.
CAP = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _inputs(B, T, S, HQ, H, D, Dv, dtype, gated, device=DEV, u_rate=0.5):
    q = randn(B, T, HQ, D, dtype=dtype, device=device, requires_grad=True)
    k = randn(B, S, H, D, dtype=dtype, device=device, requires_grad=True)
    v = randn(B, S, H, Dv, dtype=dtype, device=device, requires_grad=True)
    u = None
    if gated:
        alpha = torch.rand(B, T, HQ, dtype=torch.float64) * u_rate
        u = (-torch.cumsum(alpha, 1)).float().to(device).requires_grad_(True)
    return q, k, v, u


def _outputs(fn, q, k, v, u, do):
    """Output and gradients of q, k, v (and u) for ``fn``."""
    leaves = [x for x in (q, k, v, u) if x is not None]
    o = fn(*leaves)
    return [o, *torch.autograd.grad(o, leaves, do)]


def _compare(q, k, v, u, do, bound, **kw):
    """Kernel vs float64 reference, and the reference computed in the inputs' precision (``upcast=False``) for
    the low-precision rule."""
    def run(backend):
        return lambda q, k, v, *u: regattn.softmax_attention(q, k, v, gate=u[0] if u else None, backend=backend,
                                                             **kw)
    got = _outputs(run("triton"), q, k, v, u, do)
    exact = _outputs(run("torch"), *(x.detach().double().requires_grad_(True) if x is not None else None
                                     for x in (q, k, v, u)), do.double())
    plain = lambda q, k, v, *u: reference.softmax_attention(q, k, v, gate=u[0] if u else None, upcast=False, **kw)
    same = _outputs(plain, q, k, v, u, do) if q.dtype != torch.float32 else None
    for i, (a, b) in enumerate(zip(got, exact)):
        limit = bound if same is None else min(2 * rel_err(same[i], b) + bound, CAP[q.dtype])
        assert rel_err(a, b) <= limit, (i, rel_err(a, b), limit)


CASES = [
    # B, T, S, HQ, H, D, Dv, causal, window, gated
    (1, 37, 37, 2, 1, 16, 16, True, None, False),   # full causal, T not a multiple of the tile, GQA
    (2, 45, 45, 4, 2, 32, 24, True, 17, True),      # gated window, GQA, Dv != D, padded head dim
    (1, 40, 40, 2, 2, 16, 16, True, 64, True),      # window >= T equals causal
    (1, 21, 34, 2, 1, 16, 16, False, None, False),  # non-causal, S != T
    (1, 40, 7, 4, 2, 16, 16, False, None, False),   # non-causal with more queries than keys: every row sees all
    (1, 34, 21, 2, 2, 16, 16, True, 5, False),      # causal with more queries than keys: empty rows
]


@pytest.mark.parametrize("case", CASES)
def test_kernel_matches_reference_fp32(case, interpret):
    B, T, S, HQ, H, D, Dv, causal, window, gated = case
    q, k, v, u = _inputs(B, T, S, HQ, H, D, Dv, torch.float32, gated)
    do = randn(B, T, HQ, Dv, device=DEV, dtype=torch.float32)
    _compare(q, k, v, u, do, 2e-5, causal=causal, window=window)


def test_kernel_fp16(interpret):
    q, k, v, u = _inputs(1, 35, 35, 2, 1, 32, 32, torch.float16, True)
    do = randn(1, 35, 2, 32, device=DEV, dtype=torch.float16)
    _compare(q, k, v, u, do, 1e-3, window=9)


def test_varlen_matches_per_sequence(interpret):
    q, k, v, u = _inputs(1, 50, 50, 4, 2, 16, 16, torch.float32, True)
    do = randn(1, 50, 4, 16, device=DEV, dtype=torch.float32)
    cu = torch.tensor([0, 3, 3, 21, 50], device=DEV, dtype=torch.int32)
    _compare(q, k, v, u, do, 2e-5, window=7, cu_seqlens=cu)


def test_window_one_returns_v_with_zero_grads_of_q_k_u(interpret):
    q, k, v, u = _inputs(1, 33, 33, 2, 1, 16, 16, torch.float32, True)
    do = randn(1, 33, 2, 16, device=DEV, dtype=torch.float32)
    o, dq, dk, dv, du = _outputs(lambda q, k, v, u: regattn.gatedfwa(q, k, v, u, window=1, backend="triton"),
                                 q, k, v, u, do)
    assert rel_err(o, v.repeat_interleave(2, 2)) < 1e-6
    assert rel_err(dv, do.view(1, 33, 1, 2, 16).sum(3)) < 1e-6
    for g in (dq, dk, du):
        assert torch.isfinite(g).all() and g.abs().max() < 1e-5


def test_gate_far_from_zero_keeps_fp32_precision(interpret):
    """Late in a long sequence ``u`` is large (``|u| ~ 1e5``, an fp32 step of 0.008) while the differences the
    window sees are small: the kernel forms the differences first, so fp32 stays within 2e-5 of float64,
    forward and every gradient (adding ``u_i`` and ``u_j`` to the logits one at a time errs by about 1e-2)."""
    q, k, v, u = _inputs(1, 45, 45, 2, 1, 16, 16, torch.float32, True)
    u = (u.detach() - 1.0e5).requires_grad_(True)
    do = randn(1, 45, 2, 16, device=DEV, dtype=torch.float32)
    _compare(q, k, v, u, do, 2e-5, window=13)


def test_non_finite_gate_stays_in_the_rows_that_read_it(interpret):
    """A NaN gate at position 16 (in the interpreter the first row of a tile, whose gate the kernel subtracts
    from the others) makes NaN the rows that read it, 16 to 19 with a window of 4, and leaves every other row
    as the spec's."""
    q, k, v, u = _inputs(1, 40, 40, 2, 2, 16, 16, torch.float32, True)
    u = u.detach().clone()
    u[0, 16, 1] = float("nan")
    o = regattn.gatedfwa(q, k, v, u, window=4, backend="triton")
    want = reference.gatedfwa(q.double(), k.double(), v.double(), u.double(), window=4)
    reads = torch.zeros(40, 2, dtype=torch.bool)
    reads[16:20, 1] = True
    assert torch.isnan(o[0][reads]).all()
    assert rel_err(o[0][~reads], want[0][~reads]) < 2e-5


def test_strong_gates_no_nan_and_first_token_attends_to_itself(interpret):
    q, k, v, _ = _inputs(1, 40, 40, 2, 2, 16, 16, torch.float32, False)
    u = (-torch.cumsum(torch.full((1, 40, 2), 300.0), 1)).to(DEV).requires_grad_(True)
    do = randn(1, 40, 2, 16, device=DEV, dtype=torch.float32)
    outs = _outputs(lambda q, k, v, u: regattn.gatedfwa(q, k, v, u, window=8, backend="triton"), q, k, v, u, do)
    assert all(torch.isfinite(x).all() for x in outs)
    assert rel_err(outs[0], v) < 1e-5
    assert rel_err(outs[0][:, 0], v[:, 0]) < 1e-6


def test_triton_refuses_float64_and_bad_gate(interpret):
    q, k, v, u = _inputs(1, 8, 8, 2, 1, 16, 16, torch.float64, True)
    with pytest.raises(TypeError, match="q"):
        regattn.gatedfwa(q, k, v, u.double(), window=2, backend="triton")
    q32 = q.detach().float()
    with pytest.raises(ValueError, match="^u: "):
        regattn.gatedfwa(q32, q32, q32, u[:, :4].detach(), window=2, backend="triton")
    with pytest.raises(ValueError, match="window"):
        regattn.gatedfwa(q32, q32, q32, u.detach().float(), window=0, backend="triton")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("D", [64, 128])
def test_kernel_full_size_gpu(dtype, D):
    q, k, v, u = _inputs(2, 1000, 1000, 8, 2, D, D, dtype, True, device="cuda", u_rate=0.05)
    do = randn(2, 1000, 8, D, device="cuda", dtype=dtype)
    _compare(q, k, v, u, do, 1e-3 if dtype == torch.float32 else 2e-3, window=256)


def test_varlen_max_seqlen_reads_nothing_on_the_host(interpret):
    """GatedFWA on packed sequences given ``max_seqlen``: no offset read on the host, the same numbers."""
    q, k, v, u = _inputs(1, 30, 30, 2, 1, 16, 16, torch.float32, True)
    do = randn(1, 30, 2, 16, device=DEV, dtype=torch.float32)
    cu = torch.tensor([0, 11, 11, 30], device=DEV, dtype=torch.int32)
    with no_host_reads():
        got = _outputs(lambda *x: regattn.gatedfwa(*x, window=5, cu_seqlens=cu, max_seqlen=19, backend="triton"),
                       q, k, v, u, do)
    want = _outputs(lambda *x: regattn.gatedfwa(*x, window=5, cu_seqlens=cu, backend="triton"), q, k, v, u, do)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_unchecked_offsets_past_t_are_clamped(interpret):
    q, k, v, _ = _inputs(1, 20, 20, 2, 1, 16, 16, torch.float32, False)
    bad = torch.tensor([0, 7, 45], device=DEV, dtype=torch.int32)
    good = torch.tensor([0, 7, 20], device=DEV, dtype=torch.int32)
    o = regattn.softmax_attention(q, k, v, cu_seqlens=bad, max_seqlen=20, backend="triton")
    assert torch.equal(o, regattn.softmax_attention(q, k, v, cu_seqlens=good, backend="triton"))


def test_tile_overrides_and_gated_entries(monkeypatch):
    """attention_blocks: the gated kernels take GATED_BLOCKS' entry where it has one; overridden_blocks sets
    kinds for both within a block and puts the overrides before back on leaving."""
    from regattn.ops._common import attention_tiles as tiles
    monkeypatch.setattr(tiles, "interpreting", lambda: False)
    gated = dict(BLOCK_M=32, BLOCK_N=64, num_warps=4, num_stages=3)
    kept = dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=2)
    monkeypatch.setattr(tiles, "GATED_BLOCKS", {"bwd_kv": gated})
    monkeypatch.setattr(tiles, "BLOCK_OVERRIDES", {"bwd_q": kept})

    def blocks(kind, **kw):
        return tiles.attention_blocks(128, torch.bfloat16, kind, **kw)
    assert blocks("bwd_kv", gated=True) == gated != blocks("bwd_kv")
    assert blocks("fwd", gated=True) == blocks("fwd")
    fwd = dict(BLOCK_M=128, BLOCK_N=32, num_warps=8, num_stages=3)
    with tiles.overridden_blocks({"fwd": fwd, "bwd_kv": fwd}):
        assert blocks("fwd") == blocks("bwd_kv", gated=True) == blocks("bwd_kv") == fwd
        assert blocks("bwd_q") == kept
    assert tiles.BLOCK_OVERRIDES == {"bwd_q": kept} and blocks("bwd_kv", gated=True) == gated


def test_size_class_separates_small_launches_and_caps_large_ones():
    from regattn.ops._common.attention_tiles import SIZE_CLASS_CAP, size_class

    assert size_class(0) == size_class(1) == 1
    assert size_class(4 * 1024) < size_class(16 * 8192) == 18
    assert size_class(2 ** SIZE_CLASS_CAP - 1) == SIZE_CLASS_CAP
    assert size_class(16 * 65536) == size_class(2 ** 40) == SIZE_CLASS_CAP
