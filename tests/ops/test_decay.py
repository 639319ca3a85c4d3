"""Decay kernels (lightning2, fleet, causal_dot_product) against the float64 reference, forward and backward."""
import pytest
import torch

import regattn
from regattn import reference
from regattn.ops.decay.function import log2_gamma
from regattn.ops.decay.lightning2 import lightning2_forward
from tests.helpers import TOL, randn, rel_err

KERNELS = ("lightning2", "fleet", "causal_dot_product")


def case(B, T, H, R, D, dtype, seed, gamma):
    b, c, v = (randn(B, T, H, n, seed=seed + i, scale=n ** -0.25 if i < 2 else 1.0) for i, n in enumerate((R, R, D)))
    do = randn(B, T, H, D, seed=seed + 3)
    g = None if gamma is None else torch.tensor(gamma, dtype=torch.float64)
    return b, c, v, do, g


def forward_backward(fn, b, c, v, do, dtype):
    x = [t.detach().to(dtype).requires_grad_() for t in (b, c, v)]
    o = fn(*x)
    grads = torch.autograd.grad(o, x, do.to(dtype))
    return [o, *grads]


def bound(dtype, low_err):
    """fp32: the dtype bound; fp16: twice the torch reference's own error in fp16 plus slack."""
    return TOL[dtype] if dtype == torch.float32 else 2 * low_err + 1e-3


@pytest.mark.parametrize("method,B,T,H,R,D,gamma", [
    ("lightning2", 2, 37, 2, 16, 24, [0.9, 0.6]),
    ("lightning2", 1, 1, 2, 5, 7, [0.9, 0.6]),
    ("lightning2", 1, 50, 1, 20, 16, None),
    ("lightning2", 1, 45, 2, 8, 8, [1e-6, 1.0]),
    ("fleet", 2, 37, 2, 12, 20, [0.9, 0.6]),
    ("fleet", 1, 21, 2, 8, 8, [1e-6, 1.0]),
    ("causal_dot_product", 1, 23, 2, 12, 20, [0.9, 1e-6]),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_matches_reference(interpret, method, B, T, H, R, D, gamma, dtype):
    b, c, v, do, g = case(B, T, H, R, D, dtype, seed=T + R, gamma=gamma)
    truth = forward_backward(lambda *x: reference.decay_linear_attention(*x, g), b, c, v, do, torch.float64)
    low = forward_backward(lambda *x: reference.decay_linear_attention(*x, None if g is None else g.to(dtype)),
                           b, c, v, do, dtype) if dtype != torch.float32 else None
    gk = None if g is None else g.float()
    got = forward_backward(lambda *x: regattn.decay_linear_attention(*x, gk, method=method, backend="triton"),
                           b, c, v, do, dtype)
    for name, out, ref, i in zip(("o", "db", "dc", "dv"), got, truth, range(4)):
        assert out.dtype == dtype and out.shape == ref.shape
        err = rel_err(out, ref)
        tol = bound(dtype, rel_err(low[i], ref)) if low else TOL[dtype]
        assert err <= tol, f"{method} {name}: {err:.2e} > {tol:.2e}"


@pytest.mark.parametrize("reverse", [False, True])
def test_lightning2_segments(interpret, reverse):
    """The sequence-parallel path (segment states chained between two launches) equals the reference."""
    b, c, v, _, g = case(2, 70, 2, 16, 16, torch.float32, seed=3, gamma=[0.95, 0.7])
    x = [t.float() for t in (b, c, v)]
    if reverse:
        x = [t.flip(1) for t in x]
    out = lightning2_forward(*x, log2_gamma(g.float(), 2, "cpu"), reverse=reverse, segment=16)
    out = out.flip(1) if reverse else out
    assert rel_err(out, reference.decay_linear_attention(b, c, v, g)) <= TOL[torch.float32]


def test_prefill_and_step_through_kernels(interpret):
    b, c, v, _, g = case(1, 33, 2, 8, 16, torch.float32, seed=4, gamma=[0.9, 0.99])
    x = [t.float() for t in (b, c, v)]
    ref_o, ref_s = reference.decay_linear_prefill(b[:, :32], c[:, :32], v[:, :32], g)
    o, s = regattn.decay_linear_prefill(*(t[:, :32] for t in x), g.float(), method="lightning2", backend="triton")
    assert rel_err(o, ref_o) <= TOL[torch.float32] and rel_err(s, ref_s) <= TOL[torch.float32]
    o1, s1 = regattn.decay_linear_step(s, *(t[:, 32] for t in x), g.float())
    full = reference.decay_linear_attention(b, c, v, g)
    assert rel_err(o1, full[:, 32]) <= TOL[torch.float32]
    o2, s2 = regattn.decay_linear_prefill(*(t[:, 32:] for t in x), g.float(), initial_state=s, method="fleet",
                                          backend="triton")
    assert rel_err(o2, full[:, 32:]) <= TOL[torch.float32] and rel_err(s2, s1) <= TOL[torch.float32]


def small():
    return [randn(1, 6, 2, n, dtype=torch.float32, seed=i) for i, n in enumerate((4, 4, 3))]


@pytest.mark.parametrize("gamma", [1.5, 0.0, -0.1, float("nan"), torch.tensor([0.5, 1.01])])
def test_gamma_outside_range(gamma):
    b, c, v = small()
    with pytest.raises(ValueError, match="gamma"):
        regattn.decay_linear_attention(b, c, v, gamma)
    with pytest.raises(ValueError, match="gamma"):
        regattn.decay_linear_step(None, b[:, 0], c[:, 0], v[:, 0], gamma)


def test_different_rank():
    b, c, v = small()
    with pytest.raises(ValueError, match="c: expected shape"):
        regattn.decay_linear_attention(b, c[..., :3], v)
    with pytest.raises(ValueError, match="c_t"):
        regattn.decay_linear_step(None, b[:, 0], c[:, 0, :, :3], v[:, 0])
    with pytest.raises(ValueError, match="v_t: expected leading dims"):
        regattn.decay_linear_step(None, b[:, 0], c[:, 0], v[:, 0, :1])
    with pytest.raises(ValueError, match="b_t: expected a rank-3"):
        regattn.decay_linear_step(None, b, c[:, 0], v[:, 0])


def test_unknown_method():
    b, c, v = small()
    with pytest.raises(ValueError, match="method: expected one of"):
        regattn.decay_linear_attention(b, c, v, method="lightning3")


def test_bad_states():
    b, c, v = small()
    with pytest.raises(ValueError, match="initial_state"):
        regattn.decay_linear_prefill(b, c, v, initial_state=torch.zeros(1, 2, 3, 3))
    with pytest.raises(ValueError, match="state"):
        regattn.decay_linear_step(torch.zeros(1, 2, 4), b[:, 0], c[:, 0], v[:, 0])


def test_gamma_with_grad_on_kernels(interpret):
    b, c, v = small()
    g = torch.tensor([0.9, 0.8], requires_grad=True)
    with pytest.raises(ValueError, match="gamma"):
        regattn.decay_linear_attention(b, c, v, g, method="lightning2", backend="triton")
    o = regattn.decay_linear_attention(b.double(), c.double(), v.double(), g.double(), method="fleet", backend="torch")
    assert torch.autograd.grad(o.sum(), g)[0].shape == (2,)


def test_gamma_written_in_place_is_checked_again(interpret):
    """Validation and log2 gamma are remembered per tensor only until it is written to."""
    b, c, v = small()
    g = torch.tensor([0.9, 0.8])
    first = regattn.decay_linear_attention(b, c, v, g, method="lightning2", backend="triton")
    assert rel_err(first, reference.decay_linear_attention(b, c, v, g)) <= TOL[torch.float32]
    g.copy_(torch.tensor([0.5, 0.3]))
    again = regattn.decay_linear_attention(b, c, v, g, method="lightning2", backend="triton")
    assert rel_err(again, reference.decay_linear_attention(b, c, v, g)) <= TOL[torch.float32]
    g.fill_(1.5)
    with pytest.raises(ValueError, match="gamma"):
        regattn.decay_linear_attention(b, c, v, g, method="lightning2", backend="triton")
