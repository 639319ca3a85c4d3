"""Decay kernels at full size on a GPU (``-m gpu``) with a different decay per head (including 1 and
1e-4), against the float64 reference; uniform decays are in tests/ops/test_decay_gpu.py."""
import pytest
import torch

import regattn
from regattn import reference
from tests.gpu.rule import assert_within, leaves, outputs
from tests.helpers import randn

pytestmark = pytest.mark.gpu
BF16, FP32 = torch.bfloat16, torch.float32
MIX = [0.99, 1.0, 0.9, 1e-4]


def truth(b, c, v, gamma):
    return reference.decay_linear_attention(b, c, v, gamma, method="lightning2")


def check_decay(method, B, T, H, R, D, gammas, dtype, *, backward=True, device="cuda"):
    """Output (and the gradients of b, c, v) against float64; gammas: one per head, or None for no decay."""
    x = [randn(B, T, H, n, device=device, scale=s) for n, s in ((R, R ** -0.25), (R, R ** -0.25), (D, 1.0))]
    do = randn(B, T, H, D, device=device)
    g = None if gammas is None else torch.tensor(gammas, dtype=torch.float64, device=device)

    def run(fn, dt, gamma):
        xs = leaves(x, dt)
        return outputs(lambda *a: fn(*a, gamma), xs, do) if backward else [fn(*xs, gamma)]
    got = run(lambda *a: regattn.decay_linear_attention(*a, method=method, backend="triton"), dtype,
              None if g is None else g.float())
    exact = run(truth, torch.float64, g)
    same = None if dtype == FP32 else run(truth, dtype, None if g is None else g.to(dtype))
    assert_within(["o", "db", "dc", "dv"], got, exact, same, fixed=1e-5)


def check_large_offsets(B, T, H, R, D, dtype=BF16, device="cuda"):
    """More than 2^31 elements per tensor: the last (batch, head) slice of every kernel (lightning2 also
    backward) against the float64 reference of that slice, within 2e-2."""
    b, c, v, do = (torch.randn(B, T, H, n, device=device, dtype=dtype) * s
                   for n, s in ((R, R ** -0.25), (R, R ** -0.25), (D, 1.0), (D, 1.0)))
    gamma = torch.full((H,), 0.99, device=device)

    def last(t):
        return t[-1:, :, -1:].double()
    exact = outputs(lambda *a: truth(*a, gamma[-1:].double()), leaves([last(t) for t in (b, c, v)]), last(do))
    for method in ("lightning2", "fleet", "causal_dot_product"):
        backward = method == "lightning2"
        xs = [t.requires_grad_(backward) for t in (b, c, v)]
        o = regattn.decay_linear_attention(*xs, gamma, method=method, backend="triton")
        got = [o.detach(), *torch.autograd.grad(o, xs, do)] if backward else [o]
        names = ["o", "db", "dc", "dv"][:len(got)]
        assert_within([f"{method} {n}" for n in names], [last(t) for t in got], exact, fixed=2e-2)
        del o, got
        for t in (b, c, v):
            t.requires_grad_(False)


@pytest.mark.parametrize("dtype", [BF16, FP32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("method,B,T,H,R,D,gammas", [
    pytest.param("lightning2", 2, 4133, 4, 128, 128, MIX, id="lightning2-B2-T4133"),
    pytest.param("lightning2", 1, 3001, 4, 64, 96, MIX, id="lightning2-R64-D96"),
    pytest.param("lightning2", 1, 20000, 2, 128, 128, [0.999, 1.0], id="lightning2-T20000-sequence-parallel"),
    pytest.param("lightning2", 2, 1, 4, 128, 128, MIX, id="lightning2-T1"),
    pytest.param("fleet", 1, 2111, 4, 128, 128, MIX, id="fleet"),
    pytest.param("causal_dot_product", 1, 2111, 4, 128, 128, MIX, id="causal_dot_product"),
])
def test_decay_per_head(method, B, T, H, R, D, gammas, dtype):
    check_decay(method, B, T, H, R, D, gammas, dtype)


@pytest.mark.parametrize("method", ["lightning2", "fleet", "causal_dot_product"])
def test_long_without_decay(method):
    """T = 100000 with gamma = 1: the sums grow with T and stay accurate (lightning2 also backward)."""
    check_decay(method, 1, 100000, 2, 128, 128, [1.0, 1.0], BF16, backward=method == "lightning2")


def test_offsets_past_int32():
    check_large_offsets(6, 100000, 32, 128, 128)
