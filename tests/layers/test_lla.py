"""The LLA layer: shapes, eq. 27 ridges, gradients, and generation equal to the full forward."""
import pytest
import torch

from regattn.layers import LLA
from tests.helpers import randn, rel_err


@pytest.mark.parametrize("lam,window,blocks", [("head", None, None), ("dim", 5, 2)])
def test_generation_matches_full_forward(lam, window, blocks):
    """Prefill then steps give the full forward's output up to float64 rounding, which BD-LLA's solve amplifies
    where its denominator ``omega - mu.rho`` nears zero: over 300 draws the largest error was 7.6e-12, and one
    draw gave 1.0e-10 at a single row, which a 1e-15 relative change of the inputs moves by 9e-10 in the full
    forward itself. A cache that loses or repeats a token is wrong by order one."""
    torch.manual_seed(0)
    layer = LLA(16, 4, num_kv_heads=2, lam=lam, window=window, blocks=blocks, cg_iters=None, rope=True,
                backend="torch").double()
    x = randn(2, 11, 16)
    full = layer(x)
    y, cache = layer.prefill(x[:, :6])
    outs = [y]
    for t in range(6, 11, 2):
        y, cache = layer.step(x[:, t:t + 2], cache)
        outs.append(y)
    assert rel_err(torch.cat(outs, 1), full) < 1e-8
    if window is not None:
        assert cache.k.shape[1] == window


def test_ridge_shapes_range_and_gradients():
    layer = LLA(16, 2, lam="dim", cg_iters=4, backend="torch").double()
    x = randn(1, 7, 16)
    lam = layer.ridge(x)
    assert lam.shape == (1, 7, 2, 8) and bool(((lam > 0) & (lam < 1)).all())
    layer(x).square().sum().backward()
    for p in (layer.lam_proj.weight, layer.q_proj.weight, layer.k_proj.weight, layer.v_proj.weight):
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0


def test_cg_gradient_reaches_the_op():
    """``cg_gradient`` picks the gradient of the truncated solve: the same output, other gradients at 2
    iterations (far from converged)."""
    x = randn(1, 9, 16)
    grads, outs = [], []
    for mode in ("implicit", "unrolled"):
        torch.manual_seed(0)
        layer = LLA(16, 2, cg_iters=2, cg_tol=0.0, cg_gradient=mode, backend="torch").double()
        y = layer(x)
        y.square().sum().backward()
        outs.append(y)
        grads.append(layer.q_proj.weight.grad)
    assert rel_err(outs[1], outs[0]) < 1e-12
    assert rel_err(grads[1], grads[0]) > 1e-3


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_non_finite_input_flows_through(backend, interpret):
    """A NaN in the input at position 3 (a training step gone bad) raises nothing and makes row 3 NaN: the
    layer's ridge is in range by construction, so the layer does not read its values on the host per call
    (the op checks a caller's ridge). The torch form leaves rows 0-2 as they were; the kernels do not yet
    contain a hidden NaN in partly masked tiles (tests/ops/test_nan_containment.py says why)."""
    layer = LLA(16, 2, cg_iters=4, backend=backend)
    x = randn(1, 8, 16, dtype=torch.float32)
    clean = layer(x)
    x[0, 3, 0] = float("nan")
    y = layer(x)
    assert torch.isnan(y[:, 3]).all()
    if backend == "torch":
        assert torch.equal(y[:, :3], clean[:, :3])


def test_saturated_ridge_keeps_its_floor_and_stays_finite():
    """A ridge gate driven far negative: eq. 27's sigmoid underflows to 0, the floor holds lam_min,
    and the fp32 layer's output and gradients stay finite."""
    layer = LLA(16, 2, cg_iters=None, backend="torch")
    with torch.no_grad():
        layer.lam_proj.bias.fill_(-1e4)
    x = randn(1, 9, 16, dtype=torch.float32)
    assert torch.equal(layer.ridge(x), torch.full((1, 9, 2), 1e-2))
    y = layer(x)
    y.square().sum().backward()
    assert torch.isfinite(y).all() and all(torch.isfinite(p.grad).all() for p in layer.parameters())


def test_bad_arguments():
    with pytest.raises(ValueError, match="lam"):
        LLA(16, 2, lam="token")
    for lam_min in (0.0, 1.0, float("nan")):
        with pytest.raises(ValueError, match="lam_min"):
            LLA(16, 2, lam_min=lam_min)
    with pytest.raises(ValueError, match="num_kv_heads"):
        LLA(16, 4, num_kv_heads=3)
    with pytest.raises(ValueError, match="blocks"):
        LLA(16, 2, blocks=3)
    with pytest.raises(ValueError, match="cg_gradient"):
        LLA(16, 2, cg_iters=4, cg_gradient="exact")
    with pytest.raises(ValueError, match="cg_gradient"):
        LLA(16, 2, cg_iters=4, cg_gradient="unrolled", backend="triton")
