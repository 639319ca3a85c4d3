"""FlashLLA at full size on a GPU (``-m gpu``): B=1, HQ=4, H=2, T=1024, D=128 and a ridge per query in
[0.5, 1.5]. CG run to convergence against the exact solve in float64 (forward and backward), and the
16 iterations of lla Table 2 in fp32 against Algorithm 2 run in float64."""
import pytest
import torch

import regattn
from regattn.reference.lla import lla as lla_ref
from regattn.reference.lla import key_preconditioner, lla_blocks_uncentred
from tests.gpu.rule import assert_within, leaves, outputs
from tests.helpers import randn, rel_err

pytestmark = pytest.mark.gpu
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
# The torch reference on fp16/bf16 inputs solves in fp32, so its error is the inputs' rounding alone; the
# kernels' tl.dot operands are in the input dtype too, and the solve amplifies those roundings as much.
# In the interpreter (fp16, D = 32 and 64) the kernel's error reached 13x the reference's.
LOW_FACTOR = 16.0


def inputs(B, T, HQ, H, D, device):
    """float64 q, k, v, the ridge ``lam [B, T, HQ]`` and an upstream gradient."""
    q, k, v = (randn(B, T, n, D, device=device) for n in (HQ, H, H))
    lam = (torch.rand(B, T, HQ, dtype=torch.float64) + 0.5).to(device)
    return q, k, v, lam, randn(B, T, HQ, D, device=device)


def check_converged(dtype, *, window=None, backward=True, blocks=None, shift=0.0, B=1, T=1024, HQ=4, H=2, D=128,
                    device="cuda"):
    """2 D CG iterations, or BD-LLA's direct solves with ``blocks``: the output (and the gradients of q, k, v
    and lam) against the exact solve in float64; fp32 within 10x the float32 exact solve's error (the solve
    amplifies rounding), fp16/bf16 within LOW_FACTOR x the error of the reference run on the same
    low-precision inputs. ``shift`` moves every query and key by that much along every feature."""
    q, k, v, lam, do = inputs(B, T, HQ, H, D, device)
    q, k = q + shift, k + shift

    def exact_form(q, k, v, lam):
        return lla_blocks_uncentred(q, k, v, lam=lam, scale=D ** -0.5, window=window, blocks=blocks or 1)

    def kernel(q, k, v, lam):
        solve = dict(blocks=blocks) if blocks else dict(cg_iters=2 * D, cg_tol=1e-7)
        return regattn.lla(q, k, v, lam=lam, window=window, backend="triton", **solve)

    def run(fn, xs):
        return outputs(fn, xs, do) if backward else [fn(*xs)]
    got = run(kernel, leaves([q, k, v], dtype) + leaves([lam], FP32))
    exact = run(exact_form, leaves([q, k, v, lam]))
    same = run(exact_form, leaves([x.to(dtype).float() for x in (q, k, v)] + [lam.float()]))
    kw = dict(factor=10.0, slack=1e-5) if dtype == FP32 else dict(factor=LOW_FACTOR)
    assert_within(["o", "dq", "dk", "dv", "dlam"], got, exact, same, **kw)


def check_truncated_cg(iters, precondition, *, B=1, T=1024, HQ=4, H=2, D=128, device="cuda"):
    """fp32, ``iters`` CG iterations (preconditioned or not): Algorithm 2 step for step, within 10x the error of
    its float32 run plus 1e-4 (truncated CG amplifies rounding)."""
    q, k, v, lam, _ = inputs(B, T, HQ, H, D, device)
    cg = dict(cg_iters=iters, cg_tol=1e-6, cg_precondition=precondition)
    x32 = [t.float() for t in (q, k, v, lam)]
    out = regattn.lla(*x32[:3], lam=x32[3], backend="triton", **cg)
    assert_within(["o"], [out], [lla_ref(q, k, v, lam=lam, **cg)], [lla_ref(*x32[:3], lam=x32[3], **cg)],
                  factor=10.0, slack=1e-4)


@pytest.mark.parametrize("dtype,window,backward", [
    pytest.param(BF16, None, True, id="bf16"),
    pytest.param(FP32, None, True, id="fp32"),
    pytest.param(FP16, None, False, id="fp16-forward"),
    pytest.param(BF16, 256, False, id="sw-lla-w256-bf16-forward"),
])
def test_converged(dtype, window, backward):
    check_converged(dtype, window=window, backward=backward)


@pytest.mark.parametrize("blocks,shift", [(128, 0.0), (64, 0.0), (128, 4.0), (64, 4.0)],
                         ids=["1x1", "2x2", "1x1-shifted", "2x2-shifted"])
def test_block_diagonal_direct_solves_bf16(blocks, shift):
    """BD-LLA's direct solves, forward and backward: every moment from the weights rounded to bf16 once
    (``tiles.direct_moments``), the backward's cross terms centred on a tile's mean key or query in one tf32
    product (``cross_precision``), where uncentred they would lose the cancellations of keys far from the origin.
    Shifted, every key and query sits 4 per feature off the origin, so ``Sigma_dd`` (about 2 a feature) is an
    eighth of the second moment it is taken from."""
    check_converged(BF16, blocks=blocks, shift=shift)


@pytest.mark.parametrize("blocks", [128, 64], ids=["1x1", "2x2"])
def test_block_diagonal_direct_solves_repeat_bit_for_bit_at_every_tile(blocks, monkeypatch, B=4, T=8192, H=16, D=128):
    """Each forward tile the autotuner times, three bf16 runs bitwise equal at the shape where ``mu~``'s product
    once still read its key tile while the next one loaded into the same buffer (``tiles.direct_moments``): runs
    then differed by up to 0.13 at three of the six tiles."""
    from regattn.ops.lla import forward
    q, k, v = (torch.randn(B, T, H, D, device="cuda", dtype=BF16) for _ in range(3))
    monkeypatch.setattr(forward, "AUTOTUNE", False)
    for tile in forward.forward_tiles(BF16, *forward.solver_for(blocks, D)):
        monkeypatch.setattr(forward, "forward_blocks", lambda *a, t=tile: dict(t))
        runs = [regattn.lla(q, k, v, lam=1.0, blocks=blocks, backend="triton") for _ in range(3)]
        assert all(torch.equal(runs[0], r) for r in runs[1:]), tile


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomics", "deterministic"])
@pytest.mark.parametrize("blocks", [128, 64], ids=["1x1", "2x2"])
def test_block_diagonal_backward_at_every_query_tile(blocks, deterministic, monkeypatch, D=128):
    """The block-diagonal backward with each tile of its q kernel's autotune lists: the first part's with dq added
    by the dk/dv kernel's atomics, the second part's (deterministic) with dq from that part, on the shifted inputs
    of :func:`test_block_diagonal_direct_solves_bf16` and within its bound."""
    from regattn.ops.lla import backward, forward
    bd = forward.direct_solver(blocks, D)
    kv_tile = backward.backward_blocks(D, BF16, bd)[1]
    monkeypatch.setattr(backward, "AUTOTUNE", False)
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: deterministic)
    for m, n, warps, stages in (backward.PASS_B_TILES if deterministic else backward.BACKWARD_TILES)[bd]:
        tile = dict(BLOCK_M=m, BLOCK_N=n, num_warps=warps, num_stages=stages)
        monkeypatch.setattr(backward, "backward_blocks", lambda *a, t=tile: (dict(t), dict(kv_tile)))
        check_converged(BF16, blocks=blocks, shift=4.0, D=D)


@pytest.mark.parametrize("precondition", [True, False])
def test_truncated_cg_fp32(precondition):
    check_truncated_cg(16, precondition)


@pytest.mark.parametrize("dtype", [BF16, FP32])
def test_converged_through_cg_launches(dtype, monkeypatch):
    """Full LLA's CG in iters + 2 launches (``forward.CG_LAUNCH_ROWS``, from 4096 query rows in use), here from
    T 1024: converged forward and backward, and 16 truncated iterations with and without the preconditioner."""
    from regattn.ops.lla import forward
    monkeypatch.setattr(forward, "CG_LAUNCH_ROWS", 1024)
    check_converged(dtype)
    if dtype == FP32:
        for precondition in (False, True):
            check_truncated_cg(16, precondition)


def test_preconditioned_cg_reaches_table_2_targets(B=1, T=512, H=4, D=128):
    """bf16 at T 512, where queries see the fewest keys (the hard end of lla Table 2): on the last 256 rows the
    preconditioned CG comes within 0.05 of the float64 exact solve after 8 iterations and within 0.02 after 16
    (plain CG: 0.084 and 0.0069 on the H100)."""
    q, k, v = (randn(B, T, H, D, device="cuda") for _ in range(3))
    exact = lla_ref(q, k, v, lam=1.0)[:, -256:]
    x16 = [t.to(BF16) for t in (q, k, v)]
    for iters, bound in ((8, 0.05), (16, 0.02)):
        out = regattn.lla(*x16, lam=1.0, cg_iters=iters, cg_precondition=True, backend="triton")[:, -256:]
        assert rel_err(out, exact) < bound, iters


@pytest.mark.parametrize("window", [None, 1024])
def test_preconditioner_build_stays_near_its_own_size(window, B=2, T=8192, H=8, D=128):
    """The build's memory beyond its inputs: the matrices and the temporaries of a slice of blocks at a time (on the
    CPU 2.0x the matrices' size causal and 2.5x windowed; 4.5x when it formed a whole fp32 copy of k, the block
    sums and the factors of 32 blocks at once)."""
    k = torch.randn(B, T, H, D, device="cuda", dtype=BF16)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    M = key_preconditioner(k, T, window)
    extra = torch.cuda.max_memory_allocated() - before
    assert extra <= 3 * M.numel() * M.element_size(), extra / (M.numel() * M.element_size())


def test_unrolled_gradient_under_autocast(B=1, T=256, HQ=4, H=2, D=128):
    """``cg_gradient="unrolled"`` on bf16 inputs inside a bf16 autocast (a training step's): the torch form
    still solves in fp32, so the output and the gradients through 4 CG iterations stay within 2x the error of
    the same form run on the rounded inputs in fp32, plus the bf16 rounding of the results (on the CPU at D 32,
    products rounded by the autocast left the output 0.11 from float64 against 0.0035)."""
    q, k, v, lam, do = inputs(B, T, HQ, H, D, "cuda")
    cg = dict(cg_iters=4, cg_tol=0.0, cg_gradient="unrolled")

    def op(q, k, v, lam):
        with torch.autocast("cuda", dtype=BF16):
            return regattn.lla(q, k, v, lam=lam, **cg)

    def form(q, k, v, lam):
        return lla_ref(q, k, v, lam=lam, **cg)
    got = outputs(op, leaves([q, k, v], BF16) + leaves([lam], FP32), do)
    exact = outputs(form, leaves([q, k, v, lam]), do)
    same = outputs(form, leaves([x.to(BF16).float() for x in (q, k, v)] + [lam.float()]), do)
    assert_within(["o", "dq", "dk", "dv", "dlam"], got, exact, same, factor=2.0, slack=4e-3)
