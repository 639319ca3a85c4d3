"""LLA reference against the papers' identities (lla eq. 7-16, parallax eq. 4, 7, 13, Prop. 3.1)."""
import pytest
import torch

from regattn.reference import lla, softmax_attention
from regattn.reference.lla import (
    PRECONDITIONER_BLOCK, PRECONDITIONER_RIDGE, key_preconditioner, lla_blocks_uncentred, lla_decomposition,
    lla_matrix_free, lla_probe, lla_statistics,
)
from regattn.reference.regression import affine_mesanet
from tests.helpers import randn, rel_err

B, T, H, D, DV = 2, 13, 2, 4, 3


def inputs(HQ=H, S=T, Tq=T, dv=DV):
    return randn(B, Tq, HQ, D), randn(B, S, H, D), randn(B, S, H, dv)


def test_large_ridge_gives_softmax():
    q, k, v = inputs()
    assert rel_err(lla(q, k, v, lam=1e10), softmax_attention(q, k, v)) < 1e-8
    assert rel_err(lla(q, k, v, lam=0.1), softmax_attention(q, k, v)) > 1e-3


def test_uniform_weights_give_affine_mesanet_with_ridge_over_count():
    """scale = 0 makes every visible weight 1: LLA's unnormalised ridge lam is lam / n_i on eq. 9's moments."""
    q, k, v = inputs()
    n = torch.arange(1, T + 1, dtype=torch.float64)
    lam_affine = (0.3 / n)[None, :, None].expand(B, T, H)
    ref = affine_mesanet(q, k, v, lam=lam_affine)
    assert rel_err(lla(q, k, v, lam=0.3, scale=0.0), ref) < 1e-10
    errs = [rel_err(lla(q, k, v, lam=0.3, scale=h), ref) for h in (1e-1, 1e-2, 1e-3)]
    assert errs[0] > errs[1] > errs[2] and errs[2] < 1e-2


def test_reformulation_and_boundary_amplification():
    """parallax eq. 7: o = o_SA - (1 + eta) Sigma_KV rho*, with tbar in [0, 1), eta >= 0 (Prop. 3.1)."""
    q, k, v = inputs()
    lam = randn(B, T, H).abs() + 0.05
    o_sa, sigma_kv, rho, t_bar, eta = lla_decomposition(q, k, v, lam=lam)
    o = o_sa - (1 + eta)[..., None] * (sigma_kv @ rho[..., None])[..., 0]
    assert rel_err(o.transpose(1, 2), lla(q, k, v, lam=lam)) < 1e-10
    assert rel_err(o_sa.transpose(1, 2), softmax_attention(q, k, v)) < 1e-12
    assert bool((t_bar >= -1e-12).all()) and bool((t_bar < 1).all()) and bool((eta >= -1e-12).all())


@pytest.mark.parametrize("blocks", [None, 2])
def test_cg_with_d_iterations_equals_exact_solve(blocks):
    q, k, v = inputs()
    lam = randn(B, T, H, D).abs() + 0.1
    exact = lla(q, k, v, lam=lam, blocks=blocks)
    assert rel_err(lla(q, k, v, lam=lam, blocks=blocks, cg_iters=D, cg_tol=0.0), exact) < 1e-8
    assert rel_err(lla(q, k, v, lam=lam, blocks=blocks, cg_iters=1, cg_tol=0.0), exact) > 1e-4


@pytest.mark.parametrize("window", [None, 400, 200])
def test_key_preconditioner_inverts_the_scaled_covariance_of_the_keys_each_block_sees(window):
    """``M_b`` from its definition: the covariance of the whole key blocks before query block ``b`` that every
    query of the block sees (``window // P - 1`` of them with a window: none at 200), scaled to unit mean
    variance, plus the ridge, inverted; queries after a prefix, two key heads."""
    S, T, Dk, P = 700, 300, 8, PRECONDITIONER_BLOCK
    k = randn(2, S, 2, Dk)
    M = key_preconditioner(k, T, window)
    first = (S - T) // P
    assert M.shape == (2, 2, (S - 1) // P - first + 1, Dk, Dk)
    eye = torch.eye(Dk, dtype=k.dtype)
    for i in range(M.shape[2]):
        lo = 0 if window is None else max(0, (first + i + 1 - window // P) * P)
        for b in range(2):
            for h in range(2):
                keys = k[b, lo:(first + i) * P, h]
                want = eye / PRECONDITIONER_RIDGE
                if len(keys):
                    c = torch.cov(keys.T, correction=0)
                    want = torch.linalg.inv(c / (c.trace() / Dk) + PRECONDITIONER_RIDGE * eye)
                assert rel_err(M[b, h, i], want) < 1e-12


def test_preconditioned_cg_is_exact_after_d_iterations_and_closer_before():
    """Preconditioned CG solves exactly after D iterations, as plain CG does, and comes nearer
    before: at 6 iterations under 0.7 times plain CG's error on the rows of the third block (0.40 to 0.49
    over six draws)."""
    q, k, v = (randn(1, 384, 2, 32) for _ in range(3))
    exact = lla(q, k, v, lam=1.0)[:, 256:]
    errors = {}
    for precondition in (True, False):
        def run(iters):
            return lla(q, k, v, lam=1.0, cg_iters=iters, cg_tol=0.0, cg_precondition=precondition)[:, 256:]
        assert rel_err(run(32), exact) < 1e-8
        errors[precondition] = rel_err(run(6), exact)
    assert errors[True] < 0.7 * errors[False]


def test_cg_active_mask_freezes_converged_rows():
    """Many more iterations than D: converged systems stay put, no NaN."""
    q, k, v = inputs()
    out = lla(q, k, v, lam=0.5, cg_iters=4 * D, cg_tol=1e-9)
    assert torch.isfinite(out).all()
    assert rel_err(out, lla(q, k, v, lam=0.5)) < 1e-8


def test_one_block_is_lla_and_diagonal_blocks_solve_per_feature():
    q, k, v = inputs()
    assert rel_err(lla(q, k, v, lam=0.2, blocks=1), lla(q, k, v, lam=0.2)) == 0.0
    stats = lla_statistics(q, k, lam=0.2, scale=D ** -0.5, blocks=D)
    diag = torch.diagonal(stats.Sigma, dim1=-2, dim2=-1)
    assert torch.allclose(stats.Sigma, torch.diag_embed(diag))
    assert rel_err(lla_probe(stats), stats.mu / diag) < 1e-12


@pytest.mark.parametrize("blocks", [1, 2, D])
def test_block_uncentred_form_matches_definition(blocks):
    q, k, v = inputs(HQ=4, S=17, Tq=9)
    lam = randn(B, 9, 4, D).abs() + 0.1
    ref = lla(q, k, v, lam=lam, blocks=blocks, window=6)
    assert rel_err(lla_blocks_uncentred(q, k, v, lam=lam, scale=0.6, window=6, blocks=blocks),
                   lla(q, k, v, lam=lam, blocks=blocks, window=6, scale=0.6)) < 1e-10
    assert ref.shape == (B, 9, 4, DV)


def test_matrix_free_statistics_match_definition():
    """Eq. 10-11 (uncentred) against eq. 7 (centred) through the implicit product of eq. 13."""
    from regattn.reference.lla import heads_first, lla_weights, ridge, sigma_matvec
    q, k, _ = inputs()
    stats = lla_statistics(q, k, lam=0.4, scale=0.7)
    w, _ = lla_weights(q, k, scale=0.7)
    qh, kh = q.transpose(1, 2), heads_first(k, H)
    p = randn(B, H, T, D)
    lam = ridge(0.4, (B, H, T, D), dtype=q.dtype, device=q.device)
    implicit = sigma_matvec(p, qh, kh, w, w.sum(-1), w @ kh, lam, None)
    assert rel_err(implicit, (stats.Sigma @ p[..., None])[..., 0]) < 1e-12


@pytest.mark.parametrize("blocks", [None, 2])
def test_centred_scatter_and_sherman_morrison(blocks):
    """CG's matrix ``A = Sigma - mu mu^T / omega`` (per block for BD-LLA) and the probe recovered from
    ``A^-1 mu`` against the materialised eq. 7."""
    from regattn.reference.lla import centred_matvec, heads_first, lla_weights, probe_from_centred, ridge
    q, k, _ = inputs()
    stats = lla_statistics(q, k, lam=0.4, scale=0.7, blocks=blocks)
    w, _ = lla_weights(q, k, scale=0.7)
    kh = heads_first(k, H)
    lam = ridge(0.4, (B, H, T, D), dtype=q.dtype, device=q.device)
    mask = torch.block_diag(*[torch.ones(D // (blocks or 1), D // (blocks or 1), dtype=q.dtype)] * (blocks or 1))
    A = stats.Sigma - stats.mu[..., :, None] * stats.mu[..., None, :] / stats.omega[..., None, None] * mask
    p = randn(B, H, T, D)
    assert rel_err(centred_matvec(p, kh, w, w.sum(-1), w @ kh, lam, blocks), (A @ p[..., None])[..., 0]) < 1e-12
    y = torch.linalg.solve(A, stats.mu[..., None])[..., 0]
    assert rel_err(probe_from_centred(y, stats.mu, stats.omega, blocks), lla_probe(stats)) < 1e-10


def test_truncated_cg_in_float32_follows_float64():
    """A few CG iterations on the centred scatter are as stable in fp32 as in float64: 4 iterations at T = 96,
    D = 32 agree to 1e-4 (CG on eq. 7's Sigma, whose eigenvalue omega |kbar - q|^2 stands far above the rest,
    put fp32 2e-2 to 6e-2 away from float64 at this size over four draws, 0.2 to 0.65 at T = 192, D = 64)."""
    q, k, v = (randn(1, 96, 2, 32) for _ in range(3))
    o64 = lla(q, k, v, lam=1.0, cg_iters=4)
    o32 = lla(q.float(), k.float(), v.float(), lam=1.0, cg_iters=4)
    assert rel_err(o32.double(), o64) < 1e-4


def test_window_gqa_and_queries_aligned_to_the_end():
    HQ, S, Tq = 4, 17, 6
    q, k, v = inputs(HQ=HQ, S=S, Tq=Tq)
    lam = randn(B, Tq, HQ).abs() + 0.1
    out = lla(q, k, v, lam=lam, window=5)
    k_rep, v_rep = k.repeat_interleave(2, dim=2), v.repeat_interleave(2, dim=2)
    for i in (0, Tq - 1):
        pos = S - Tq + i
        keys = slice(pos - 4, pos + 1)
        alone = lla(q[:, i:i + 1], k_rep[:, keys], v_rep[:, keys], lam=lam[:, i:i + 1], window=None)
        assert rel_err(out[:, i:i + 1], alone) < 1e-10
    assert rel_err(lla(q, k, v, lam=lam, window=5, cg_iters=D, cg_tol=0.0), out) < 1e-8


def test_low_precision_returns_input_dtype():
    q, k, v = inputs()
    ref = lla(q, k, v, lam=0.5)
    out = lla(q.bfloat16(), k.bfloat16(), v.bfloat16(), lam=0.5)
    assert out.dtype == torch.bfloat16 and rel_err(out, ref) < 5e-2


def test_gradcheck_exact_and_cg():
    q, k, v = (randn(1, 5, 2, 3, requires_grad=True), randn(1, 5, 1, 3, requires_grad=True),
               randn(1, 5, 1, 2, requires_grad=True))
    lam = (randn(1, 5, 2, 3).abs() + 0.2).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda *a: lla(*a[:3], lam=a[3], window=4), (q, k, v, lam))
    assert torch.autograd.gradcheck(lambda *a: lla(*a[:3], lam=a[3], blocks=3), (q, k, v, lam))
    assert torch.autograd.gradcheck(lambda *a: lla_matrix_free(*a[:3], lam=a[3], scale=0.5, cg_iters=2, cg_tol=0.0,
                                                               cg_gradient="unrolled"), (q, k, v, lam))
    with pytest.raises(ValueError, match="cg_gradient"):
        lla_matrix_free(q, k, v, lam=lam, scale=0.5, cg_iters=2, cg_gradient="exact")
    # the implicit gradient is the derivative once CG is exact (D = 3 iterations)
    assert torch.autograd.gradcheck(lambda *a: lla_matrix_free(*a[:3], lam=a[3], scale=0.5, cg_iters=3, cg_tol=0.0),
                                    (q, k, v, lam))


def test_block_diagonal_cg_runs_one_cg_per_block():
    """BD-LLA with blocks of 4 at D = 8: one CG per block is exact after 4 iterations (float64),
    where a single CG over the whole block-diagonal system is not."""
    q, k, v = randn(1, 15, 2, 8), randn(1, 15, 1, 8), randn(1, 15, 1, 3)
    exact = lla(q, k, v, lam=0.3, blocks=2)
    assert rel_err(lla(q, k, v, lam=0.3, blocks=2, cg_iters=4, cg_tol=0.0), exact) < 1e-10
    assert rel_err(lla(q, k, v, lam=0.3, blocks=2, cg_iters=3, cg_tol=0.0), exact) > 1e-6
