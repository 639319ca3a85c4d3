"""The Retention layer: parallel form, prefill + step decoding, kernels in the interpreter."""
import pytest
import torch
import torch.nn.functional as F

from regattn import reference
from regattn.layers import Retention
from regattn.layers.retention import retnet_gammas
from tests.helpers import randn, rel_err


def layer(dtype=torch.float64, **kw):
    torch.manual_seed(0)
    m = Retention(32, 2, key_dim=8, head_dim=12, **kw)
    with torch.no_grad():
        m.norm_weight.uniform_(0.5, 1.5)
    return m.to(dtype)


def by_hand(m, x):
    """Projections, the float64 reference, per-head RMSNorm, silu gate, output projection."""
    B, T, _ = x.shape
    b = m.q_proj(x).view(B, T, 2, 8) * 8 ** -0.5
    c = m.k_proj(x).view(B, T, 2, 8)
    v = m.v_proj(x).view(B, T, 2, 12)
    g = m.g_proj(x).view(B, T, 2, 12)
    o = reference.decay_linear_attention(b, c, v, m.gammas.double())
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + m.eps) * m.norm_weight
    return m.o_proj((o * F.silu(g)).flatten(-2))


def test_forward_matches_definition():
    m = layer(backend="torch")
    x = randn(2, 19, 32, seed=1)
    y = m(x)
    assert y.shape == x.shape
    assert rel_err(y, by_hand(m, x)) < 1e-12


def test_generation_state_matches_parallel_form():
    m = layer(backend="torch")
    x = randn(2, 15, 32, seed=2)
    full = m(x)
    y, state = m(x[:, :9], return_state=True)
    outs = [y]
    for t in range(9, 12):
        y_t, state = m.step(x[:, t], state)
        outs.append(y_t[:, None])
    y, state = m(x[:, 12:], state=state)
    outs.append(y)
    assert state.shape == (2, 2, 8, 12)
    assert rel_err(torch.cat(outs, 1), full) < 1e-12


def test_kernel_backend_forward_and_backward(interpret):
    m32 = layer(torch.float32, backend="triton", method="lightning2")
    m64 = layer(torch.float64, backend="torch")
    x = randn(1, 40, 32, seed=3)
    y32 = m32(x.float().requires_grad_())
    y64 = m64(x)
    assert rel_err(y32, y64) < 1e-4
    y32.square().sum().backward()
    y64.square().sum().backward()
    assert rel_err(m32.q_proj.weight.grad, m64.q_proj.weight.grad) < 1e-4
    assert rel_err(m32.v_proj.weight.grad, m64.v_proj.weight.grad) < 1e-4


def test_gammas():
    g = retnet_gammas(4)
    assert bool(((g > 0) & (g <= 1)).all()) and bool((g[1:] > g[:-1]).all())
    with pytest.raises(ValueError, match="gammas"):
        Retention(16, 2, gammas=torch.tensor([0.5, 1.5]))
    with pytest.raises(ValueError, match="gammas"):
        Retention(16, 2, gammas=torch.tensor([0.5, 0.5, 0.5]))
