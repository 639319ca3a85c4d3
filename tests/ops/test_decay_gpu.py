"""Decay kernels at full size on a GPU (``-m gpu``): bf16 and fp32 against the float64 reference,
forward and backward, with and without decay, including the sequence-parallel path."""
import pytest
import torch

import regattn
from regattn import reference
from tests.helpers import TOL, randn, rel_err

pytestmark = pytest.mark.gpu


def run(method, dtype, B, T, H, R, D, gamma):
    b, c, v = (randn(B, T, H, n, seed=i, scale=n ** -0.25 if i < 2 else 1.0, device="cuda")
               for i, n in enumerate((R, R, D)))
    do = randn(B, T, H, D, seed=3, device="cuda")
    g = None if gamma is None else torch.full((H,), gamma, device="cuda", dtype=torch.float64)

    def grads(fn, dt):
        x = [t.detach().to(dt).requires_grad_() for t in (b, c, v)]
        o = fn(*x)
        return [o, *torch.autograd.grad(o, x, do.to(dt))]

    truth = grads(lambda *x: reference.decay_linear_attention(*x, g, method="lightning2"), torch.float64)
    low = None if dtype == torch.float32 else grads(
        lambda *x: reference.decay_linear_attention(*x, None if g is None else g.to(dtype), method="lightning2"), dtype)
    got = grads(lambda *x: regattn.decay_linear_attention(*x, None if g is None else g.float(), method=method,
                                                          backend="triton"), dtype)
    for i, (out, ref) in enumerate(zip(got, truth)):
        bound = TOL[dtype] if low is None else 2 * rel_err(low[i], ref) + 1e-3
        assert rel_err(out, ref) <= bound


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("gamma", [None, 0.99])
@pytest.mark.parametrize("method,B,T", [("lightning2", 2, 4133), ("lightning2", 1, 20000),
                                        ("fleet", 1, 2111), ("causal_dot_product", 1, 2111)])
def test_full_size(method, B, T, dtype, gamma):
    run(method, dtype, B, T, 4, 128, 128, gamma)


def test_rank_differs_from_value_dim():
    run("lightning2", torch.bfloat16, 1, 3001, 4, 64, 96, 0.9)
