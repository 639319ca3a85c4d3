"""FlashLLA kernels (interpreter on CPU) against the float64 reference, forward and backward."""
import pytest
import torch
import triton
import triton.language as tl

import regattn
from regattn import reference
from regattn.ops.lla import tiles
from regattn.ops.lla.forward import lla_forward
from regattn.reference.lla import lla_blocks_uncentred, lla_matrix_free, lla_probe, lla_statistics
from tests.helpers import randn, rel_err, reseed

pytestmark = pytest.mark.usefixtures("interpret")


@pytest.fixture(autouse=True)
def half_kernels(monkeypatch):
    """fp16 inputs run the half-precision kernels here, the interpreter's stand-in for the bf16 ones (whose
    products it cannot run); regattn.lla itself widens fp16 to the fp32 kernels (see WIDEN_FP16)."""
    monkeypatch.setattr("regattn.ops.lla.api.WIDEN_FP16", False)


def make(B, T, S, HQ, H, D, DV, lam_kind, lam_scale=1.0, seed=None):
    q, k, v = randn(B, T, HQ, D, seed=seed), randn(B, S, H, D), randn(B, S, H, DV)
    if lam_kind == "float":
        lam = 0.5 * lam_scale
    elif lam_kind == "query":
        lam = (torch.rand(B, T, HQ, dtype=torch.float64) + 0.2) * lam_scale
    else:
        lam = (torch.rand(B, T, HQ, D, dtype=torch.float64) + 0.2) * lam_scale
    return q, k, v, lam


def grads_of(fn, q, k, v, lam, do):
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
    lam_leaf = lam.detach().clone().requires_grad_(True) if isinstance(lam, torch.Tensor) else lam
    out = fn(*leaves, lam_leaf)
    wrt = leaves + ([lam_leaf] if isinstance(lam, torch.Tensor) else [])
    return out, torch.autograd.grad(out, wrt, do.to(out.dtype))


CASES = [  # B, T, S, HQ, H, D, DV, lam kind, lam scale, window
    (1, 21, 21, 2, 1, 8, 5, "query", 1.0, None),
    (1, 19, 24, 2, 2, 12, 6, "dim", 1.0, 7),
    (2, 17, 17, 1, 1, 8, 8, "float", 200.0, None),
    (1, 18, 18, 2, 1, 8, 4, "query", 0.01, None),
    (1, 20, 12, 2, 1, 8, 20, "query", 1.0, None),   # S < T: the first queries see no key
    (1, 70, 75, 1, 1, 8, 8, "dim", 1.0, 40),        # tiles inside the window, unmasked, beside masked ones
]


def within_float32_rule(got, ref64, ref32, factor=10.0, slack=1e-5):
    """The kernel's error to float64 is at most ``factor`` times that of a float32 exact form.

    ``ref32`` is one float32 result or several (the centred reference and the uncentred eq. 10-11
    form the kernels stream, which cancels where keys sit close to the query); the worst sets the
    bound. Errors of fp32 runs are draws of rounding through the same ill-conditioned solves: their
    ratio reached 4.5 in a dozen draws at lam = 0.01, so the factor leaves room for the tail."""
    refs = ref32 if isinstance(ref32, (list, tuple)) else [ref32]
    return rel_err(got, ref64) <= factor * max(rel_err(r, ref64) for r in refs) + slack


def float32_forms(q, k, v, lam, do, *, window, blocks=None):
    """Outputs and gradients of the centred reference and the uncentred form, both in float32."""
    f32 = [x.float() for x in (q, k, v)]
    lam32 = lam.float() if isinstance(lam, torch.Tensor) else lam
    centred = grads_of(lambda *a: reference.lla(*a[:3], lam=a[3], window=window, blocks=blocks), *f32, lam32, do)
    uncentred = grads_of(lambda *a: lla_blocks_uncentred(*a[:3], lam=a[3], scale=q.shape[-1] ** -0.5,
                                                         window=window, blocks=blocks or 1), *f32, lam32, do)
    return [centred[0], uncentred[0]], list(zip(centred[1], uncentred[1]))


@pytest.mark.parametrize("B,T,S,HQ,H,D,DV,lam_kind,lam_scale,window", CASES)
def test_forward_backward_match_exact_reference(B, T, S, HQ, H, D, DV, lam_kind, lam_scale, window):
    """CG with 2 D iterations in fp32 against the float64 exact solve, bounded by the float32 exact
    solve's own error (tiny ridges are ill-conditioned); early tokens included: the first D queries see
    fewer than D keys, so only the ridge makes Sigma invertible."""
    q, k, v, lam = make(B, T, S, HQ, H, D, DV, lam_kind, lam_scale)
    do = randn(B, T, HQ, DV)

    def exact(*a):
        return reference.lla(*a[:3], lam=a[3], window=window)
    ref, ref_grads = grads_of(exact, q, k, v, lam, do)
    f32 = [x.float() for x in (q, k, v)]
    lam32 = lam.float() if isinstance(lam, torch.Tensor) else lam
    ref32, ref32_grads = float32_forms(q, k, v, lam, do, window=window)
    out, got = grads_of(lambda *a: regattn.lla(*a[:3], lam=a[3], window=window, cg_iters=2 * D, cg_tol=1e-7,
                                               backend="triton"), *f32, lam32, do)
    assert out.dtype == torch.float32
    assert within_float32_rule(out, ref, ref32)
    assert within_float32_rule(out[:, :D], ref[:, :D], [r[:, :D] for r in ref32])
    for name, g, r, r32 in zip(("dq", "dk", "dv", "dlam"), got, ref_grads, ref32_grads):
        assert within_float32_rule(g, r, r32), name


@pytest.mark.parametrize("iters", [1, 3])
def test_truncated_cg_follows_algorithm_2(iters):
    """A few CG iterations (far from converged) give the reference's matrix-free CG, step for step."""
    q, k, v, lam = make(1, 20, 20, 2, 1, 8, 4, "dim", lam_scale=2.0)
    ref = reference.lla(q, k, v, lam=lam, window=13, cg_iters=iters, cg_tol=0.0)
    f32 = dict(lam=lam.float(), window=13, cg_iters=iters, cg_tol=0.0)
    out = regattn.lla(q.float(), k.float(), v.float(), backend="triton", **f32)
    ref32 = reference.lla(q.float(), k.float(), v.float(), **f32)
    # Truncated CG amplifies rounding on some draws: the float32 reference's own error sets the bound.
    assert within_float32_rule(out, ref, ref32, slack=1e-4)
    assert rel_err(out, reference.lla(q, k, v, lam=lam, window=13)) > 1e-3


@pytest.mark.parametrize("window", [None, 300])
def test_preconditioned_cg_follows_the_reference(window):
    """Over more than one preconditioner block (128 positions), with queries after a prefix (tiles across two
    blocks), GQA and a window that leaves each query block one key block: the kernel's preconditioned CG is
    the reference's step for step, and without the preconditioner it is plain CG."""
    q, k, v, lam = make(1, 150, 400, 2, 1, 16, 8, "query")
    runs = {}
    for precondition in (True, False):
        args = dict(window=window, cg_iters=3, cg_tol=0.0, cg_precondition=precondition)
        ref = reference.lla(q, k, v, lam=lam, **args)
        out = regattn.lla(q.float(), k.float(), v.float(), lam=lam.float(), backend="triton", **args)
        assert within_float32_rule(out, ref, reference.lla(q.float(), k.float(), v.float(), lam=lam.float(), **args),
                                   slack=1e-4)
        runs[precondition] = out
    assert rel_err(runs[True], runs[False]) > 1e-3


@triton.jit
def _rows_times_matrix_kernel(R, M, Z, D, BM: tl.constexpr, BD: tl.constexpr, dtype: tl.constexpr):
    offs = tl.arange(0, BM)[:, None] * BD + tl.arange(0, BD)[None, :]
    tl.store(Z + offs, tiles.rows_times_matrix(tl.load(R + offs), M, D, dtype, "tf32"))


@pytest.mark.parametrize("D", [16, 64, 100])
@pytest.mark.parametrize("dtype", [tl.float16, tl.float32])
def test_preconditioner_product_keeps_fp32_accuracy(D, dtype):
    """The kernel's preconditioner product ``r @ M`` (fp32 ``r``, fp32 ``M`` of size D, the tile padded to a power
    of two) with half-precision operands, as the key loop takes them: the matrix and the vector each in a high
    and a low part (fp16 here, standing in for bf16), in two halves of the rows from 32 columns on. Within 1e-5
    of float64 (the high parts alone leave about 5e-4)."""
    BM, BD = 16, max(16, 1 << (D - 1).bit_length())
    r = torch.zeros(BM, BD)
    r[:, :D] = randn(BM, D, dtype=torch.float32)
    m = randn(D, D, dtype=torch.float32)
    z = torch.empty(BM, BD)
    _rows_times_matrix_kernel[(1,)](r, m, z, D, BM=BM, BD=BD, dtype=dtype)
    want = r[:, :D].double() @ m.double()
    assert rel_err(z[:, :D], want) < 1e-5 and (z[:, D:] == 0).all()


@triton.jit
def _moments_kernel(W, K, OMEGA, MT, Z2, ZX, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr):
    rows = tl.arange(0, BM)[:, None]
    w = tl.load(W + rows * BN + tl.arange(0, BN)[None, :])
    k = tl.load(K + tl.arange(0, BN)[:, None] * BD + tl.arange(0, BD)[None, :])
    omega, mt, kk, kx = tiles.direct_moments(w, k, tl.zeros((BM, BD), tl.float32), 2, "parts", "ieee")
    tl.store(OMEGA + tl.arange(0, BM), omega)
    tl.store(MT + rows * BD + tl.arange(0, BD)[None, :], mt)
    tl.store(Z2 + rows * BD + tl.arange(0, BD)[None, :], kk)
    tl.store(ZX + rows * (BD // 2) + tl.arange(0, BD // 2)[None, :], kx)


def test_direct_moments_in_parts_share_the_rounded_weights(BM=16, BN=32, BD=16):
    """The direct solves' moments for bf16 inputs (``moment_precision``: "parts"; fp16 here, standing in for bf16,
    with keys whose squares split into two fp16 parts): ``omega``, ``mu~``, ``sum_j w_ij k_jd^2`` and the pair
    moments all of the weights rounded to the input dtype, to fp32 accumulation, so that the differences
    ``mu`` and ``Sigma`` take of them cancel alike (``omega`` of the fp32 weights is off by about 1e-4)."""
    w = torch.rand(BM, BN)
    k = ((torch.rand(BN, BD) * 4 + 0.5) * torch.randint(0, 2, (BN, BD)).mul(2).sub(1)).half()
    omega, mt, z2, zx = torch.empty(BM), torch.empty(BM, BD), torch.empty(BM, BD), torch.empty(BM, BD // 2)
    _moments_kernel[(1,)](w, k, omega, mt, z2, zx, BM=BM, BN=BN, BD=BD)
    rounded, k64 = w.half().double(), k.double()
    assert rel_err(omega, rounded.sum(1)) < 1e-6
    assert rel_err(mt, rounded @ k64) < 1e-6
    assert rel_err(z2, rounded @ k64 ** 2) < 1e-6
    assert rel_err(zx, rounded @ (k64[:, 0::2] * k64[:, 1::2])) < 1e-6


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("window, bad, unseen", [(None, 380, slice(256, 320)), (300, 3, slice(384, 400))])
def test_preconditioner_keeps_a_non_finite_key_from_rows_that_cannot_see_it(backend, window, bad, unseen):
    """A NaN key enters only the preconditioners of blocks whose every query sees it. Causal: the block of rows
    256 to 383 takes the keys before 256 only, so its rows before the key are untouched; windowed: the block
    of rows 384 to 399 takes keys 256 to 383 (the sums are direct, not differences of running sums). The rows
    checked share no key tile of up to 64 with the NaN (the kernel contains hidden keys only per tile)."""
    q, k, v = (randn(1, 400, 1, 8, dtype=torch.float32) for _ in range(3))
    poisoned = k.clone()
    poisoned[0, bad, 0, 0] = float("nan")
    args = dict(lam=0.5, window=window, cg_iters=4, cg_precondition=True, backend=backend)
    got, want = regattn.lla(q, poisoned, v, **args)[:, unseen], regattn.lla(q, k, v, **args)[:, unseen]
    assert torch.isfinite(got).all() and rel_err(got, want) < 1e-6


def test_early_convergence_keeps_rows_finite():
    """Three times D iterations: rows reach the tolerance at different steps and stop there, no NaN."""
    q, k, v, lam = make(1, 20, 20, 1, 1, 8, 4, "float")
    do = randn(1, 20, 1, 4)
    ref, ref_grads = grads_of(lambda *a: reference.lla(*a[:3], lam=a[3]), q, k, v, lam, do)
    out, got = grads_of(lambda *a: regattn.lla(*a[:3], lam=a[3], cg_iters=24, cg_tol=1e-5, backend="triton"),
                        q.float(), k.float(), v.float(), lam, do)
    assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in got)
    assert rel_err(out, ref) < 1e-3
    assert all(rel_err(g, r) < 1e-2 for g, r in zip(got, ref_grads))


@pytest.mark.parametrize("blocks", [8, 4, 2])
def test_block_diagonal(blocks, monkeypatch):
    """BD-LLA: g = D (1 x 1) and g = D / 2 (2 x 2) by direct solves with the fused backward; g = 2 by CG,
    whose backward recomputes the block-exact form in chunks of 8 queries (chunks, windows, key offsets)."""
    monkeypatch.setattr("regattn.ops.lla.api.BLOCK_BACKWARD_CHUNK", 8)
    B, T, HQ, H, D = 1, 20, 2, 1, 8
    q, k, v, lam = make(B, T, T, HQ, H, D, 6, "dim")
    do = randn(B, T, HQ, 6)
    ref, ref_grads = grads_of(lambda *a: reference.lla(*a[:3], lam=a[3], blocks=blocks, window=11), q, k, v, lam, do)
    cg = 2 * D if blocks == 2 else None
    out, got = grads_of(lambda *a: regattn.lla(*a[:3], lam=a[3], blocks=blocks, window=11, cg_iters=cg,
                                               cg_tol=1e-7, backend="triton"),
                        q.float(), k.float(), v.float(), lam.float(), do)
    ref32, ref32_grads = float32_forms(q, k, v, lam, do, window=11, blocks=blocks)
    assert within_float32_rule(out, ref, ref32)
    assert all(within_float32_rule(g, r, r32) for g, r, r32 in zip(got, ref_grads, ref32_grads))


def test_block_diagonal_cg_solves_each_block_on_its_own():
    """BD-LLA with blocks of 4 at D = 8 by the kernel's CG: one CG per block, so D / g = 4 iterations reach
    the exact block solve ``rho = Sigma^-1 mu`` up to fp32 rounding. Over 1900 draws the kernel's probe
    stayed within 3.1e-3 of float64's, while a single CG over the whole block-diagonal system (its step
    sizes shared by the blocks) stays 3.2e-2 to 0.15 off in float64. The probe is compared, not the output:
    BD-LLA's denominator ``omega - mu.rho`` can pass near zero, which amplifies any rounding in the output."""
    q, k, v, lam = make(1, 20, 20, 2, 1, 8, 4, "dim")
    stats = lla_statistics(q, k, lam=lam, scale=8 ** -0.5, blocks=2)
    _, rho, *_ = lla_forward(q.float(), k.float(), v.float(), lam.float(), scale=8 ** -0.5, window=None,
                             blocks=2, cg_iters=4, cg_tol=0.0)
    assert rel_err(rho.transpose(1, 2), lla_probe(stats)) < 1e-2


@pytest.mark.parametrize("D,T,window", [(32, 37, None), (64, 100, 23), (24, 37, 9)])
@pytest.mark.parametrize("size", [1, 2, 8])
def test_block_diagonal_at_awkward_sizes(D, T, window, size, monkeypatch):
    """BD-LLA with blocks of 1 and 2 features (direct solves, fused backward) and of 8 (one CG per block,
    batched over the blocks; D = 24 gives 3 blocks, laid out as 4 in the kernel) in fp32 against float64,
    forward and backward. CG runs twice as many iterations as a block has features: with exactly 8 fp32
    rounding leaves ~1e-4 (the torch backend's CG too), with 12 it is exact to rounding."""
    monkeypatch.setattr("regattn.ops.lla.api.BLOCK_BACKWARD_CHUNK", 32)
    blocks = D // size
    q, k, v, lam = make(1, T, T, 2, 1, D, 6, "dim")
    do = randn(1, T, 2, 6)
    ref, ref_grads = grads_of(lambda *a: reference.lla(*a[:3], lam=a[3], blocks=blocks, window=window),
                              q, k, v, lam, do)
    out, got = grads_of(lambda *a: regattn.lla(*a[:3], lam=a[3], blocks=blocks, window=window,
                                               cg_iters=2 * size if size > 2 else None, cg_tol=0.0,
                                               backend="triton"),
                        q.float(), k.float(), v.float(), lam.float(), do)
    ref32, ref32_grads = float32_forms(q, k, v, lam, do, window=window, blocks=blocks)
    assert within_float32_rule(out, ref, ref32)
    for name, g, r, r32 in zip(("dq", "dk", "dv", "dlam"), got, ref_grads, ref32_grads):
        assert within_float32_rule(g, r, r32), name


@pytest.mark.parametrize("size", [1, 2])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_block_diagonal_backward_keeps_a_non_finite_query_to_its_row(size, bad):
    """The direct solves' backward centres its cross terms on the query tile's mean: a non-finite query leaves the
    centre to the tile's other rows, whose dq stay those of the clean inputs (the centre moves, the result only by
    rounding)."""
    B, T, HQ, D = 1, 20, 2, 8
    q, k, v, lam = make(B, T, T, HQ, 1, D, 5, "dim")
    do = randn(B, T, HQ, 5)
    poisoned = q.clone()
    poisoned[0, 6, 0, 3] = bad

    def dq_of(q):
        return grads_of(lambda *a: regattn.lla(*a[:3], lam=a[3], blocks=D // size, backend="triton"),
                        q.float(), k.float(), v.float(), lam.float(), do)[1][0]
    clean, got = dq_of(q), dq_of(poisoned)
    others = torch.ones(T, HQ, dtype=torch.bool)
    others[6, 0] = False
    assert torch.isfinite(got[0][others]).all()
    torch.testing.assert_close(got[0][others], clean[0][others], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("size", [1, 2, 8])
def test_block_diagonal_half_precision_forward(size):
    """fp16 BD-LLA (direct solves with their second moments in three tf32 products on a GPU; CG per block):
    error to float64 within 2x the reference run on fp16 inputs plus slack, as for full LLA."""
    D, T = 32, 37
    q, k, v, lam = make(1, T, T, 2, 1, D, 8, "query")
    ref = reference.lla(q, k, v, lam=lam, blocks=D // size, window=19)
    half = [x.half() for x in (q, k, v)]
    low = reference.lla(*half, lam=lam.half(), blocks=D // size, window=19)
    out = regattn.lla(*half, lam=lam.half(), blocks=D // size, window=19, cg_iters=2 * size if size > 2 else None,
                      cg_tol=0.0, backend="triton")
    assert out.dtype == torch.float16
    assert rel_err(out, ref) <= 2 * rel_err(low, ref) + 5e-3


@pytest.mark.parametrize("size", [1, 2])
def test_direct_solves_keep_fp32_precision_with_half_inputs(size):
    """fp16 inputs, keys off-centre (``Sigma_dd`` cancels ``2 q mu~`` against the second moments): the direct
    solves' ``rho`` stays within fp32 rounding of float64 on the same inputs. ``mu~`` from fp16-rounded
    weights gave 8e-5 (centred) and 6e-4 (here)."""
    B, T, HQ, D = 1, 64, 2, 32
    q, k, v, lam = make(B, T, T, HQ, 1, D, 8, "query", seed=5)
    q, k, v, lam = (q + 3.0).half(), (k + 3.0).half(), v.half(), lam.half()
    _, rho, *_ = lla_forward(q, k, v, lam, scale=D ** -0.5, window=None, blocks=D // size, cg_iters=1, cg_tol=0.0)
    qd, kd = q.double().transpose(1, 2), k.double().transpose(1, 2).expand(-1, HQ, -1, -1)  # [B, HQ, T, D]
    s = (qd @ kd.transpose(-1, -2) * D ** -0.5).masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    w = torch.exp(s - s.amax(-1, keepdim=True))
    z = kd[:, :, None] - qd[:, :, :, None]  # [B, HQ, T, S, D]
    block = torch.block_diag(*[torch.ones(size, size, dtype=torch.float64)] * (D // size))
    sigma = torch.einsum("bhts,bhtsd,bhtse->bhtde", w, z, z) * block
    sigma = sigma + torch.diag_embed(lam.double().transpose(1, 2)[..., None].expand(-1, -1, -1, D))
    exact = torch.linalg.solve(sigma, torch.einsum("bhts,bhtsd->bhtd", w, z)).transpose(1, 2)
    assert rel_err(rho, exact) < 1e-5


@pytest.mark.parametrize("lam_kind,blocks", [("query", None), ("dim", None), ("dim", 2)])
def test_truncated_cg_gradient_is_the_same_on_both_backends(lam_kind, blocks, monkeypatch):
    """With cg_iters = 2 (far from converged, for full LLA and BD-LLA with blocks of 4) both backends give
    the implicit gradient at the CG result (the adjoint system solved by the same CG): in fp32 both give
    dq, dk and dlam of the float64 torch backend, which differ from differentiating through the two
    iterations (dv, which does not go through the solve, is the same either way)."""
    monkeypatch.setattr("regattn.ops.lla.api.BLOCK_BACKWARD_CHUNK", 8)
    q, k, v, lam = make(1, 21, 21, 2, 1, 8, 5, lam_kind)
    do = randn(1, 21, 2, 5)
    f32 = [x.float() for x in (q, k, v, lam)]
    kw = dict(window=13, blocks=blocks, cg_iters=2, cg_tol=0.0)
    _, implicit = grads_of(lambda *a: regattn.lla(*a[:3], lam=a[3], backend="torch", **kw), q, k, v, lam,
                           do.double())
    _, unrolled = grads_of(lambda *a: lla_matrix_free(*a[:3], lam=a[3], scale=8 ** -0.5, cg_gradient="unrolled",
                                                      **kw), q, k, v, lam, do.double())
    for backend in ("torch", "triton"):
        _, grads = grads_of(lambda *a: regattn.lla(*a[:3], lam=a[3], backend=backend, **kw), *f32, do)
        for name, g, want, other in zip(("dq", "dk", "dlam"), grads[:2] + grads[3:], implicit[:2] + implicit[3:],
                                        unrolled[:2] + unrolled[3:]):  # dv does not go through the solve
            apart = rel_err(other, want)
            assert apart > 1e-2, (name, apart)
            # fp32 rounding through two CG iterations (a step skipped or not near the curvature floor) can
            # reach 1e-2; the other definition is farther still
            assert rel_err(g.double(), want) < max(0.2 * apart, 1e-3), (backend, name)
    # cg_gradient="unrolled" is the other definition, on the torch backend whatever the backend asked
    _, grads = grads_of(lambda *a: regattn.lla(*a[:3], lam=a[3], cg_gradient="unrolled", **kw), *f32, do)
    for name, g, want, other in zip(("dq", "dk", "dlam"), grads[:2] + grads[3:], unrolled[:2] + unrolled[3:],
                                    implicit[:2] + implicit[3:]):
        assert rel_err(g.double(), want) < max(0.2 * rel_err(other, want), 1e-3), name


def test_exact_solve_on_the_triton_backend_uses_the_uncentred_form():
    q, k, v, lam = make(1, 14, 16, 2, 1, 8, 4, "query")
    do = randn(1, 14, 2, 4)
    ref, ref_grads = grads_of(lambda *a: reference.lla(*a[:3], lam=a[3], window=6), q, k, v, lam, do)
    out, got = grads_of(lambda *a: regattn.lla(*a[:3], lam=a[3], window=6, backend="triton"),
                        q.float(), k.float(), v.float(), lam.float(), do)
    ref32, ref32_grads = float32_forms(q, k, v, lam, do, window=6)
    assert out.dtype == torch.float32 and rel_err(out, ref32[1]) < 1e-6
    assert within_float32_rule(out, ref, ref32)
    assert all(within_float32_rule(g, r, r32) for g, r, r32 in zip(got, ref_grads, ref32_grads))


def test_half_precision_forward():
    """fp16: error to float64 within 2x the reference run on fp16 inputs plus slack (the reference
    solves in fp32, so its error is the input rounding; the kernel's CG products are in fp16)."""
    q, k, v, lam = make(1, 20, 20, 2, 1, 16, 8, "query")
    ref = reference.lla(q, k, v, lam=lam)
    half = [x.half() for x in (q, k, v)]
    low = reference.lla(*half, lam=lam.half())
    out = regattn.lla(*half, lam=lam.half(), cg_iters=32, cg_tol=1e-6, backend="triton")
    assert out.dtype == torch.float16
    assert rel_err(out, ref) <= 2 * rel_err(low, ref) + 5e-3


def test_half_precision_backward_keeps_the_error_of_rounded_inputs():
    """fp16 inputs, CG to convergence: the output and every gradient within 4x the error (to float64) of the
    exact solve on the same rounded inputs (in float64; the kernel measured up to 1.8x over six draws). dk once
    summed its z-path term by term (w dmu, f rho, w a u), which cancel as a = z.rho nears 1: 10x. Ridges of
    0.8 to 4.8: with smaller ones, rows with a small delta can take adjoint vectors beyond fp16's range."""
    B, T, HQ, H, D = 1, 96, 2, 1, 32
    q, k, v, lam = make(B, T, T, HQ, H, D, D, "query", lam_scale=4.0)
    do = randn(B, T, HQ, D)
    exact = grads_of(lambda *a: reference.lla(*a[:3], lam=a[3]), q, k, v, lam, do)
    rounded = grads_of(lambda *a: reference.lla(*a[:3], lam=a[3]), *(x.half().double() for x in (q, k, v)), lam, do)
    got = grads_of(lambda *a: regattn.lla(*a[:3], lam=a[3], cg_iters=2 * D, cg_tol=1e-7, backend="triton"),
                   q.half(), k.half(), v.half(), lam.float(), do)
    for name, g, r, low in zip(("o", "dq", "dk", "dv", "dlam"), [got[0], *got[1]], [exact[0], *exact[1]],
                               [rounded[0], *rounded[1]], strict=True):
        assert rel_err(g, r) <= 4 * rel_err(low, r), name


@pytest.mark.parametrize("size", [1, 2])
def test_direct_solves_half_precision_backward_keeps_the_error_of_rounded_inputs(size):
    """fp16 inputs (the half-precision kernels, the interpreter's stand-in for bf16), BD-LLA's direct solves: the
    output and the gradients of q, k, v and the ridge within 4x the error (to float64) of the exact solve on the
    same rounded inputs (the backward takes the centre ``kbar.rho`` the forward saved: with one half-precision part
    of rho and w (k.rho - c) in the output pass, c plus their weighted mean plus ``kbar.(rho - rho_hi)``; without
    the last, the ridge's gradient reached 4.2x at one seed). On a row that sees one key the ridge's
    gradient is 0, the difference of the adjoint's right-hand side ``sum_j c_j z_j`` and ``beta mu``: with ``c`` in
    one half-precision part it came out about 1e-3, up to 7x the rounded inputs' error."""
    B, T, HQ, H, D = 1, 96, 2, 1, 32
    q, k, v, lam = make(B, T, T, HQ, H, D, D, "query", lam_scale=4.0)
    do = randn(B, T, HQ, D)
    exact = grads_of(lambda *a: reference.lla(*a[:3], lam=a[3], blocks=D // size), q, k, v, lam, do)
    rounded = grads_of(lambda *a: reference.lla(*a[:3], lam=a[3], blocks=D // size),
                       *(x.half().double() for x in (q, k, v)), lam, do)
    got = grads_of(lambda *a: regattn.lla(*a[:3], lam=a[3], blocks=D // size, backend="triton"),
                   q.half(), k.half(), v.half(), lam.float(), do)
    for name, g, r, low in zip(("o", "dq", "dk", "dv", "dlam"), [got[0], *got[1]], [exact[0], *exact[1]],
                               [rounded[0], *rounded[1]], strict=True):
        assert rel_err(g, r) <= 4 * rel_err(low, r), name


def test_half_precision_cg_keeps_its_krylov_vectors_in_fp32():
    """fp16 inputs, CG run to convergence: the kernel's products split the fp32 CG vectors (and the weights
    of mu~) into two fp16 parts, so the solve's error stays near the output's own fp16 rounding (about
    3e-4 here), not the 5x larger error of vectors rounded to fp16 in every product (1.5e-3 to 1.8e-3)."""
    q, k, v = (randn(1, 100, 2, 32).half() for _ in range(3))
    exact = reference.lla(q.double(), k.double(), v.double(), lam=1.0)
    out = regattn.lla(q, k, v, lam=1.0, cg_iters=64, cg_tol=1e-7, backend="triton")
    assert rel_err(out, exact) <= 1e-3


def fp16_small_ridge(D: int, backward: bool) -> tuple[list, list, list]:
    """``(got, fp32, exact)``: regattn.lla at lam = 0.01 on fp16 inputs, on the same values in fp32 (both the
    Triton kernels) and in float64 (the reference): the output, then with ``backward`` dq, dk and dv."""
    q, k, v = (x.half() for x in (randn(1, 24, 2, D), randn(1, 24, 2, D), randn(1, 24, 2, 8)))
    do = randn(1, 24, 2, 8).half()

    def run(fn, *xs):
        if not backward:
            return [fn(*xs, 0.01)]
        out, grads = grads_of(fn, *xs, 0.01, do)
        return [out, *grads]
    exact = run(lambda *a: reference.lla(*a[:3], lam=a[3]), *(x.double() for x in (q, k, v)))
    kernel = lambda *a: regattn.lla(*a[:3], lam=a[3], cg_iters=2 * D, cg_tol=1e-7, backend="triton")
    return run(kernel, q, k, v), run(kernel, q.float(), k.float(), v.float()), exact


@pytest.mark.parametrize("D,backward", [(16, True), (128, False)])
def test_fp16_inputs_keep_small_ridges_in_range(D, backward, monkeypatch):
    """fp16 inputs at lam = 0.01 (the LLA layer's floor): the half-precision kernels left the output 18 to 23 times
    its norm from float64 at D 128 and the gradients 80 to 1500 times at D 16 (the solve's quantities grow as
    1 / lam past fp16's range). regattn.lla runs them on the fp32 kernels: the output and the gradients are the
    fp32 kernels' on the same values, rounded to fp16, the output and dv as close to float64 as those (the fp32 solve's
    own error at this ridge, about 1e-3 at D 128, is 3 to 5 times what rounding the inputs to fp16 costs); dq and dk
    see test_fp32_gradients_near_a_rank_deficient_row."""
    monkeypatch.setattr("regattn.ops.lla.api.WIDEN_FP16", True)
    got, fp32, exact = fp16_small_ridge(D, backward)
    for name, g, g32, r in zip(("o", "dq", "dk", "dv"), got, fp32, exact):
        assert g.dtype == torch.float16 and rel_err(g, g32) <= 2.0 ** -11, name
        if name in ("o", "dv"):
            assert rel_err(g32, r) <= 5e-3, name


def test_fp32_gradients_near_a_rank_deficient_row(monkeypatch):
    """Regression: dq and dk of the fp32 kernels within 1e-3 of float64 at lam = 0.01, D 16, T 24, cg_iters = 2 D,
    on a draw whose row 16 (17 keys in 16 dimensions, Sigma's condition number 4e3) needs about 36 adjoint CG
    iterations in fp32 (float64: 21). Cut at the forward's 32, the adjoint left dq 3.9e-2 and dk 8.8e-3 from float64;
    with the budget doubled past D (backward.adjoint_iterations) they are 2.3e-4 and 4.9e-5, as on other draws."""
    monkeypatch.setattr("regattn.ops.lla.api.WIDEN_FP16", True)
    reseed(3457357712)
    _, fp32, exact = fp16_small_ridge(16, backward=True)
    assert rel_err(fp32[1], exact[1]) <= 1e-3 and rel_err(fp32[2], exact[2]) <= 1e-3


def test_decode_matches_last_rows():
    q, k, v, lam = make(1, 20, 20, 2, 1, 8, 5, "query")
    full = reference.lla(q, k, v, lam=lam, window=9)
    for n in (1, 3):
        out = regattn.lla_decode(q[:, -n:].float(), k.float(), v.float(), lam=lam[:, -n:].float(), window=9,
                                 cg_iters=16, cg_tol=1e-7, backend="triton")
        assert out.shape == (1, n, 2, 5) and rel_err(out, full[:, -n:]) < 1e-4
    with pytest.raises(ValueError, match="q"):
        regattn.lla_decode(q, k[:, :3], v[:, :3], lam=0.5)


def test_decode_takes_the_preconditioner_of_its_block():
    """Decode past several preconditioner blocks gives the prefill's rows at a few CG iterations (far from the
    exact solve, where any other preconditioner would differ): the new queries' blocks by their positions."""
    q, k, v, lam = make(1, 300, 300, 2, 1, 8, 5, "query")
    q, k, v, lam = q.float(), k.float(), v.float(), lam.float()
    args = dict(cg_iters=3, cg_tol=0.0, cg_precondition=True, backend="triton")
    full = regattn.lla(q, k, v, lam=lam, **args)
    for n in (1, 45):  # the last row alone; rows 255 to 299, across the blocks at 256
        out = regattn.lla_decode(q[:, -n:], k, v, lam=lam[:, -n:], **args)
        assert rel_err(out, full[:, -n:]) < 1e-5


@pytest.mark.parametrize("cg_iters", [None, 8])
def test_torch_forms_ignore_an_enclosing_autocast(cg_iters):
    """Under a bf16 autocast (a training loop's) the torch forms still compute in fp32: with their products
    rounded to bf16 the CG output was 0.11 away from float64 where fp32 is 0.0035 (D 32, lam 0.5), and an
    MQAR model trained on them learned nothing."""
    q, k, v = (randn(2, 40, 2, 32, dtype=torch.float32) for _ in range(3))
    want = regattn.lla(q, k, v, lam=0.5, cg_iters=cg_iters, backend="torch")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = regattn.lla(q, k, v, lam=0.5, cg_iters=cg_iters, backend="torch")
    assert got.dtype == torch.float32 and rel_err(got, want) < 1e-6


def test_bad_input():
    q, k, v, _ = make(1, 8, 8, 2, 1, 8, 4, "float")
    q, k, v = q.float(), k.float(), v.float()
    for lam in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="lam"):
            regattn.lla(q, k, v, lam=lam, cg_iters=2, backend="triton")
    with pytest.raises(ValueError, match="lam"):
        regattn.lla(q, k, v, lam=torch.zeros(1, 8, 2), cg_iters=2, backend="triton")
    with pytest.raises(ValueError, match="lam"):
        regattn.lla(q, k, v, lam=torch.ones(1, 8, 3), cg_iters=2, backend="triton")
    with pytest.raises(ValueError, match="blocks"):
        regattn.lla(q, k, v, lam=0.5, blocks=3, backend="triton")
    with pytest.raises(ValueError, match="cg_iters"):
        regattn.lla(q, k, v, lam=0.5, cg_iters=0, backend="triton")
    with pytest.raises(TypeError, match="cg_iters"):
        regattn.lla(q, k, v, lam=0.5, cg_iters=2.0, backend="triton")
    with pytest.raises(TypeError, match="q"):
        regattn.lla(q.double(), k.double(), v.double(), lam=0.5, cg_iters=2, backend="triton")
    with pytest.raises(ValueError, match="cg_gradient"):
        regattn.lla(q, k, v, lam=0.5, cg_iters=2, cg_gradient="exact")
    with pytest.raises(ValueError, match="cg_gradient"):
        regattn.lla(q, k, v, lam=0.5, cg_iters=2, cg_gradient="unrolled", backend="triton")
    with pytest.raises(TypeError, match="cg_precondition"):
        regattn.lla(q, k, v, lam=0.5, cg_iters=2, cg_precondition="yes", backend="triton")


SOLVERS = [("torch", None), ("torch", 16), ("triton", None), ("triton", 16)]


@pytest.mark.parametrize("backend,cg_iters", SOLVERS)
@pytest.mark.parametrize("case", ["q_times_1e4", "lam_1e-8"])
def test_extreme_inputs_stay_finite_in_float32(case, backend, cg_iters):
    """Finite inputs give finite outputs and gradients in fp32 however small ``lam`` (the denominator
    ``omega - mu.rho`` cancels: it is kept above its exact lower bound) and however large ``scale q.k``
    (nearly one-hot weights). A row whose weights are one-hot (its two largest logits more than 30 apart)
    returns the top key's value whatever the rounding of ``1 - z.rho``: those rows follow float64.
    (Rows with two close logits at q x 1e4, and every row at ``lam = 1e-8`` against ``|z|^2 ~ 10``, have
    no correct digit in fp32, so only finiteness is asserted there; dq and dk of one-hot rows are
    rounding-sized in float64, so no relative bound applies to them.)"""
    q, k, v, lam = make(1, 24, 24, 2, 1, 8, 4, "query", seed=3)
    if case == "q_times_1e4":
        q = q * 1e4
    else:
        lam = torch.full_like(lam, 1e-8)
    do = randn(1, 24, 2, 4)
    ref, ref_grads = grads_of(lambda *a: reference.lla(*a[:3], lam=a[3]), q, k, v, lam, do)
    out, got = grads_of(lambda *a: regattn.lla(*a[:3], lam=a[3], cg_iters=cg_iters, backend=backend),
                        q.float(), k.float(), v.float(), lam.float(), do)
    assert torch.isfinite(ref).all() and all(torch.isfinite(g).all() for g in ref_grads)
    assert torch.isfinite(out).all()
    for name, g in zip(("dq", "dk", "dv", "dlam"), got):
        assert torch.isfinite(g).all(), name
    if case == "q_times_1e4":
        logits = torch.einsum("bthd,bshd->bths", q, k.expand(-1, -1, 2, -1)) * 8 ** -0.5
        logits = logits.masked_fill(~torch.ones(24, 24, dtype=torch.bool).tril()[:, None], float("-inf"))
        top2 = logits.topk(2, dim=-1).values
        one_hot = (top2[..., 0] - top2[..., 1] > 30) | (top2[..., 1] == float("-inf"))
        assert one_hot.sum() > 24
        assert rel_err(out[one_hot], ref[one_hot]) < 1e-5


@pytest.mark.parametrize("dtype,S,HQ,window,lam_kind,precondition,tol,iters", [
    (torch.float32, 41, 2, None, "dim", False, 0.0, 7),
    # S > T, grouped heads, a window across tiles; fp16 to convergence, where ill-conditioned rows amplify any
    # difference between the two forms' search vectors (while the launches kept it in two fp16 parts, one row of one
    # seed ended 0.82 from float64 where the one launch was within 5e-4)
    (torch.float16, 46, 4, 13, "query", False, 0.0, 48),
    (torch.float32, 41, 2, None, "query", True, 0.0, 7),    # preconditioned
    (torch.float32, 41, 2, None, "float", False, 0.05, 7),  # tiles whose systems converge skip their key pass
])
def test_cg_launches_match_the_one_launch(dtype, S, HQ, window, lam_kind, precondition, tol, iters, monkeypatch):
    """From CG_LAUNCH_ROWS query rows full LLA's CG runs in iters + 2 launches with each row's state in memory:
    at awkward sizes (41 rows past 16-row tiles, D 24 padded to 32) the output and every saved statistic are the
    one launch's to rounding (the state's search vector in fp32, as the one launch holds it), and a non-finite key
    at the last position reaches no row outside its tile."""
    from regattn.ops.lla import forward
    T, D = 41, 24
    q, k, v, lam = make(1, T, S, HQ, 2, D, 8, lam_kind)
    q, k, v = (x.to(dtype) for x in (q, k, v))
    lam = lam if isinstance(lam, float) else lam.float()
    k[:, -1, 0, 3] = float("nan")
    args = dict(scale=D ** -0.5, window=window, blocks=None, cg_iters=iters, cg_tol=tol, cg_precondition=precondition)
    one = lla_forward(q, k, v, lam, **args)
    monkeypatch.setattr(forward, "CG_LAUNCH_ROWS", T)
    monkeypatch.setattr(forward, "CG_KERNELS", {n: counted(kernel) for n, kernel in forward.CG_KERNELS.items()})
    split = lla_forward(q, k, v, lam, **args)
    assert [kernel.calls for kernel in forward.CG_KERNELS.values()] == [1, iters, 1]
    # the interpreter's 16 x 16 tiles: query tiles that end before the key tile of S - 1 do not load it (a NaN
    # hidden in a tile's products reaches the query tile that loads it, as in the one launch)
    n_clean = ((S - 1) // 16 * 16 - (S - T)) // 16 * 16
    clean = (slice(None), slice(0, n_clean))
    assert torch.equal(torch.isfinite(split[0]), torch.isfinite(one[0])) and torch.isfinite(split[0][clean]).all()
    # both forms take their products from the same fp16 parts of the same fp32 search vectors; on a GPU the half
    # kernels take bf16 (regattn.lla widens fp16 to the fp32 kernels)
    assert rel_err(split[0][clean].float(), one[0][clean].float()) < (1e-5 if dtype == torch.float32 else 1e-2)
    for a, b in zip(one[1:], split[1:], strict=True):  # rho, delta, m2, argmax, omega, centre
        rows = clean if a.shape[1] == T else (slice(None), slice(None), slice(0, n_clean))
        assert rel_err(b[rows].double(), a[rows].double()) < (1e-5 if dtype == torch.float32 else 1e-2)


class counted:
    """A kernel whose launches (``kernel[grid](...)``) are counted."""

    def __init__(self, kernel):
        self.kernel, self.calls = kernel, 0

    def __getitem__(self, grid):
        self.calls += 1
        return self.kernel[grid]


@pytest.mark.parametrize("dtype,blocks", [(torch.float32, None), (torch.float16, None), (torch.float16, 2)])
def test_autotuned_launch_matches_the_fixed_tile(dtype, blocks, monkeypatch):
    """Beyond SHORT query rows a GPU launches the autotuned kernel (tiles by meta-parameters, grid by tile
    rows): with one interpreter-sized tile per list it gives the fixed launch's outputs bit for bit."""
    from regattn.ops.lla import forward
    T, D = forward.SHORT + 9, 8
    q, k, v = (randn(2, T, 2, D, dtype=dtype) for _ in range(3))
    args = dict(scale=D ** -0.5, window=13, blocks=blocks, cg_iters=6, cg_tol=0.0)
    fixed = lla_forward(q, k, v, 0.3, **args)
    monkeypatch.setattr(forward, "interpreting", lambda: False)
    one_tile = {family: [(16, 16, 1, 1)] for family in forward.FORWARD_TILES}
    monkeypatch.setattr(forward, "TUNED", forward.tuned_kernels(one_tile))
    tuned = lla_forward(q, k, v, 0.3, **args)
    for a, b in zip(fixed, tuned, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("blocks,bd", [(None, 0), (36, 2)], ids=["cg", "pairs"])
def test_autotuned_backward_matches_the_fixed_tile(blocks, bd, monkeypatch):
    """fp16/bf16 beyond D = 64 a GPU launches the autotuned backward kernels (tiles by meta-parameters, grids
    by tile rows): with one interpreter-sized tile per list they give the fixed launch's gradients exactly."""
    from regattn.ops.lla import backward
    T, D = 20, 72
    q, k, v, do = (randn(1, T, 2, D, dtype=torch.float16) for _ in range(4))
    args = dict(scale=D ** -0.5, window=9, cg_iters=4, cg_tol=0.0)
    saved = lla_forward(q, k, v, 0.3, blocks=blocks, **args)[1:]
    fixed = backward.lla_backward(do, q, k, v, 0.3, *saved, lam_grad=False, bd=bd, **args)
    monkeypatch.setattr(backward, "interpreting", lambda: False)
    one_tile = [(16, 16, 1, 1)]
    tiles = {solver: one_tile for solver in (0, 1, 2)}
    monkeypatch.setattr(backward, "TUNED", backward.tuned_kernels(tiles, one_tile, {1: one_tile, 2: one_tile}))
    tuned = backward.lla_backward(do, q, k, v, 0.3, *saved, lam_grad=False, bd=bd, **args)
    for a, b in zip(fixed[:3], tuned[:3], strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("blocks,bd", [(20, 1), (10, 2)], ids=["1x1", "2x2"])
def test_block_diagonal_dq_by_atomics_matches_its_deterministic_pass(blocks, bd, monkeypatch):
    """The block-diagonal dk/dv kernel adds dq's key sum and dm by atomics; under deterministic algorithms the q
    kernel forms them in a pass of its own instead: the same dq and dk (through dm) within rounding, the same dv,
    and only there the second q launch."""
    from regattn.ops.lla import backward
    T, D = 37, 20
    q, k, v, do = (randn(1, T, 4, D, dtype=torch.float16) for _ in range(4))
    k, v = k[:, :, :2], v[:, :, :2]
    args = dict(scale=D ** -0.5, window=None, cg_iters=4, cg_tol=0.0)
    saved = lla_forward(q, k, v, 0.3, blocks=blocks, **args)[1:]
    launched = []
    launch = backward.launch_any
    monkeypatch.setattr(backward, "launch_any", lambda kernel, *a, **kw: (
        launched.append((kernel.__name__, kw.get("PART"))), launch(kernel, *a, **kw)))
    fused = backward.lla_backward(do, q, k, v, 0.3, *saved, lam_grad=False, bd=bd, **args)
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    own_pass = backward.lla_backward(do, q, k, v, 0.3, *saved, lam_grad=False, bd=bd, **args)
    q_kernel = [name for name, _ in launched if name == "lla_bwd_q_kernel"]
    assert q_kernel == ["lla_bwd_q_kernel"] * 3, launched
    assert rel_err(fused[0], own_pass[0]) < 1e-4 and rel_err(fused[1], own_pass[1]) < 1e-4
    assert torch.equal(fused[2], own_pass[2])


def test_block_diagonal_dk_tiles_must_share_their_key_tile():
    """The block-diagonal dk kernel's two parts read the squares of one key tiling: an autotune list that mixes key
    tiles is refused."""
    from regattn.ops.lla import backward
    with pytest.raises(ValueError, match="kv_tiles"):
        backward.tuned_kernels(backward.BACKWARD_TILES, [(16, 64, 8, 1), (16, 128, 8, 1)], backward.PASS_B_TILES)


@pytest.mark.parametrize("bd", [1, 2])
def test_centred_key_tiles_are_each_tiles_keys_less_their_mean(bd, BN=16, B=2, S=37, H=3, D=10):
    """The block-diagonal dk kernel's operands: per tile of BN keys (the last one partial), the tile's mean key, the
    squares of the keys less it and, with 2 x 2 blocks, the product of each pair's two features."""
    from regattn.ops.lla.backward import centred_key_tiles, pairs_block
    k = randn(B, S, H, D, dtype=torch.float16)
    ksq, pairs, mean = centred_key_tiles(k, bd, BN, pairs_block(D))
    for start in range(0, S, BN):
        keys = k[:, start:start + BN].double()
        centre = keys.mean(1)                                             # [B, H, D]
        kc = keys - centre[:, None]
        got_mean = mean.view(B, H, -1, mean.shape[-1])[:, :, start // BN, :D]
        torch.testing.assert_close(got_mean.double(), centre, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(ksq[:, start:start + BN].double(), kc * kc, rtol=1e-5, atol=1e-6)
        if bd == 2:
            got = pairs[:, start:start + BN, :, :D // 2].double()
            torch.testing.assert_close(got, kc[..., 0::2] * kc[..., 1::2], rtol=1e-5, atol=1e-6)
            assert not pairs[:, start:start + BN, :, D // 2:].any()
