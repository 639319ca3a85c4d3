"""Uniform-weight rows of the family (parallax eq. 9-13, lla eq. 2) against their identities."""
import torch

from regattn.reference import (
    affine_linear_attention, affine_mesanet, linear_attention, mesanet, value_averaging,
)
from regattn.reference.regression import affine_mesanet_probe
from tests.helpers import randn, rel_err

B, T, H, D, DV = 2, 11, 2, 4, 3


def inputs(HQ=H):
    return randn(B, T, HQ, D), randn(B, T, H, D), randn(B, T, H, DV)


def loop(fn, q, k, v):
    """Query by query from the definitions, float64."""
    return torch.stack([fn(q[:, i], k[:, :i + 1], v[:, :i + 1]) for i in range(q.shape[1])], dim=1)


def test_linear_attention_and_mesanet_match_per_query_definitions():
    q, k, v = inputs()
    la = loop(lambda qi, ki, vi: torch.einsum("bjhe,bjhd,bhd->bhe", vi, ki, qi), q, k, v)
    assert rel_err(linear_attention(q, k, v), la) < 1e-12

    def mesa(qi, ki, vi):
        Hm = torch.einsum("bjhd,bjhe->bhde", ki, ki) + 0.7 * torch.eye(D, dtype=qi.dtype)
        Sm = torch.einsum("bjhe,bjhd->bhed", vi, ki)
        return (Sm @ torch.linalg.solve(Hm, qi[..., None]))[..., 0]
    assert rel_err(mesanet(q, k, v, lam=0.7), loop(mesa, q, k, v)) < 1e-10


def test_mesanet_large_ridge_is_scaled_linear_attention():
    q, k, v = inputs()
    assert rel_err(1e8 * mesanet(q, k, v, lam=1e8), linear_attention(q, k, v)) < 1e-6


def test_affine_forms_share_the_template():
    q, k, v = inputs()
    va = value_averaging(v)
    assert rel_err(va, loop(lambda qi, ki, vi: vi.mean(1), q, k, v)) < 1e-12
    assert rel_err(affine_linear_attention(torch.zeros_like(q), k, v), va) < 1e-12
    rho = affine_mesanet_probe(q, k, lam=0.2)
    assert rel_err(affine_mesanet(q, k, v, lam=0.2), affine_linear_attention(rho, k, v)) < 1e-12
    assert rel_err(affine_mesanet(q, k, v, lam=1e10), va) < 1e-8


def test_affine_mesanet_is_ols_with_intercept_at_the_query():
    """eq. 13 equals the ridge-regression prediction b + W (q - k_bar) from the centred normal equations."""
    q, k, v = inputs()

    def ols(qi, ki, vi):
        n = ki.shape[1]
        kc, vc = ki - ki.mean(1, keepdim=True), vi - vi.mean(1, keepdim=True)
        Hm = torch.einsum("bjhd,bjhe->bhde", kc, kc) / n + 0.3 * torch.eye(D, dtype=qi.dtype)
        Sm = torch.einsum("bjhe,bjhd->bhed", vc, kc) / n
        W = Sm @ torch.linalg.inv(Hm)
        return vi.mean(1) + (W @ (qi - ki.mean(1))[..., None])[..., 0]
    assert rel_err(affine_mesanet(q, k, v, lam=0.3), loop(ols, q, k, v)) < 1e-10


def test_gqa_matches_repeated_heads():
    q, k, v = inputs(HQ=4)
    k2, v2 = k.repeat_interleave(2, 2), v.repeat_interleave(2, 2)
    assert rel_err(mesanet(q, k, v, lam=0.5), mesanet(q, k2, v2, lam=0.5)) < 1e-14
    assert rel_err(affine_mesanet(q, k, v, lam=0.5), affine_mesanet(q, k2, v2, lam=0.5)) < 1e-14


def test_gradcheck():
    q, k, v = (randn(1, 4, 2, 3, requires_grad=True), randn(1, 4, 1, 3, requires_grad=True),
               randn(1, 4, 1, 2, requires_grad=True))
    lam = (randn(1, 4, 2).abs() + 0.3).requires_grad_(True)
    assert torch.autograd.gradcheck(linear_attention, (q, k, v))
    assert torch.autograd.gradcheck(lambda *a: mesanet(*a[:3], lam=a[3]), (q, k, v, lam))
    assert torch.autograd.gradcheck(value_averaging, (v,))
    assert torch.autograd.gradcheck(affine_linear_attention, (q, k, v))
    assert torch.autograd.gradcheck(lambda *a: affine_mesanet(*a[:3], lam=a[3]), (q, k, v, lam))
