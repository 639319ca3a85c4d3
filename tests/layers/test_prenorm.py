"""The residual stream's pre-norm (``regattn.layers.norm.PreNorm``): its kernels against the float64 definition,
forward and backward (the weight's gradient too), and its output dtype: the autocast dtype under autocast."""
import pytest
import torch

from regattn.layers.norm import PreNorm
from tests.helpers import TOL, randn, rel_err


def _prenorm(dim, eps=None, backend="triton"):
    norm = PreNorm(dim, eps=eps, backend=backend)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.5 * randn(dim, dtype=torch.float32))
    return norm


def _spec(x, weight, eps):
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape,eps", [((3, 7, 48), None), ((2, 5, 4, 130), 1e-5), ((33, 8), 1e-6)])
def test_kernels_match_definition_forward_and_backward(interpret, shape, eps, dtype):
    norm = _prenorm(shape[-1], eps)
    x = randn(*shape, dtype=dtype, scale=3.0, requires_grad=True)
    y = norm(x)
    assert y.dtype == dtype and y.shape == x.shape
    x64 = x.detach().double().requires_grad_(True)
    w64 = norm.weight.detach().double().requires_grad_(True)
    truth = _spec(x64, w64, eps if eps is not None else torch.finfo(dtype).eps)
    assert rel_err(y, truth) < TOL[dtype]
    dy = randn(*shape, dtype=dtype)
    y.backward(dy)
    truth.backward(dy.double())
    assert rel_err(x.grad, x64.grad) < TOL[dtype]
    assert norm.weight.grad.dtype == torch.float32 and rel_err(norm.weight.grad, w64.grad) < TOL[dtype]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_output_in_the_autocast_dtype_rounded_once(interpret, backend):
    """Under autocast an fp32 stream comes out in the autocast dtype: the fp32 norm rounded once; the gradient
    reaching x is fp32."""
    norm = _prenorm(64, backend=backend)
    x = randn(4, 9, 64, dtype=torch.float32, scale=5.0, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.float16):
        y = norm(x)
    assert y.dtype == torch.float16
    assert torch.equal(y, norm(x).half())                       # the fp32 norm, rounded once
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and torch.isfinite(x.grad).all()


def test_paths_agree_and_take_torchs_norm_elsewhere(interpret):
    norm = _prenorm(32, backend="triton")
    auto = PreNorm(32)
    auto.load_state_dict(norm.state_dict())
    x = randn(2, 6, 32, dtype=torch.float32)
    assert rel_err(norm(x), auto(x)) < 1e-6                     # on the CPU "auto" is torch's norm
    x64 = x.double()
    assert auto(x64).dtype == torch.float64                      # no kernel for float64 under "auto": torch's
    with pytest.raises(ValueError, match="^backend: PreNorm's kernels take"):
        norm(x64)
    with pytest.raises(ValueError, match="^backend: PreNorm's kernels take"):
        _prenorm(31)(randn(2, 31, dtype=torch.float32))


def test_non_finite_rows_stay_in_their_rows(interpret):
    norm = _prenorm(16)
    x = randn(5, 16, dtype=torch.float32)
    x[1, 3] = float("nan")
    x[3, 0] = float("inf")
    bad = ~torch.isfinite(norm(x))
    assert bad[1].all() and bad[3].any() and not bad[[0, 2, 4]].any()
