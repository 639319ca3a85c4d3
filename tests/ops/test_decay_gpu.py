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


@pytest.mark.parametrize("T,cu", [(20000, None), (9000, [0, 1000, 1000, 7000, 9000])])
def test_full_size_from_a_state(T, cu):
    """lightning2 from an initial state with the final state (sequence-parallel, or packed), and the
    gradients of both, against the float64 reference."""
    H, R, D = 4, 64, 64
    cu = None if cu is None else torch.tensor(cu, device="cuda", dtype=torch.int32)
    N = 1 if cu is None else cu.numel() - 1
    b, c, v = (randn(1, T, H, n, seed=i, scale=n ** -0.25 if i < 2 else 1.0, device="cuda")
               for i, n in enumerate((R, R, D)))
    s0, ds, do = randn(N, H, R, D, seed=4, device="cuda"), randn(N, H, R, D, seed=5, device="cuda"), \
        randn(1, T, H, D, seed=6, device="cuda")
    g = torch.full((H,), 0.999, device="cuda", dtype=torch.float64)

    def grads(fn, dt):
        x = [t.detach().to(dt).requires_grad_() for t in (b, c, v)]
        s = s0.detach().to(torch.float64 if dt == torch.float64 else torch.float32).requires_grad_()
        o, final = fn(*x, s)
        loss = (o.double() * do).sum() + (final.double() * ds).sum()
        return [o, final, *torch.autograd.grad(loss, [*x, s])]

    truth = grads(lambda *x: reference.decay_linear_attention(*x[:3], g, method="lightning2", initial_state=x[3],
                                                              output_final_state=True, cu_seqlens=cu), torch.float64)
    got = grads(lambda *x: regattn.decay_linear_attention(*x[:3], g.float(), initial_state=x[3],
                                                          output_final_state=True, cu_seqlens=cu, backend="triton"),
                torch.float32)
    for out, ref in zip(got, truth):
        assert rel_err(out, ref) <= TOL[torch.float32]
