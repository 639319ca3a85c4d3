"""The Parallax layer's zero_init_probe start: softmax attention that moves smoothly, with O(1) gradients."""
import torch

from regattn.layers import Parallax
from tests.helpers import randn, rel_err


def _layers():
    """The zero-gain start and the old start (W_R = 0 under the RMSNorm, unit gain), same other weights."""
    torch.manual_seed(0)
    new = Parallax(32, 4, num_kv_heads=2, head_dim=16, zero_init_probe=True).double()
    old = Parallax(32, 4, num_kv_heads=2, head_dim=16).double()
    old.load_state_dict(new.state_dict())
    with torch.no_grad():
        old.r_proj.weight.zero_()
        old.r_norm.weight.fill_(1.0)
    return new, old


def test_zero_gain_start_is_softmax_with_normal_probe_weights():
    new, old = _layers()
    x = randn(2, 9, 32)
    assert not new.r_norm.weight.any() and new.r_proj.weight.std() > 0.05
    assert rel_err(new(x), old(x)) < 1e-12                # both starts are softmax attention


def _gradients(layer, x, cotangent):
    layer.zero_grad()
    (layer(x) * cotangent).sum().backward()
    return layer.q_proj.weight.grad.norm(), layer.r_proj.weight.grad.norm(), layer.r_norm.weight.grad.norm()


def test_gradients_at_init_are_order_one():
    """Unit-scale input and output cotangent: the gain's and W_R's gradients are finite and at most 10x
    W_Q's (the probe reaches the output as the query does, so O(1) means W_Q's order; 10x leaves room
    for the heads' spread). The gain's is nonzero; W_R's is zero until the gain moves. The old start
    breaks the bound: W_R's gradient is over 100x W_Q's (the RMSNorm divides by sqrt(eps))."""
    new, old = _layers()
    x, cotangent = randn(2, 9, 32), randn(2, 9, 32)
    g_q, g_r, g_gain = _gradients(new, x, cotangent)
    assert torch.isfinite(torch.stack([g_q, g_r, g_gain])).all()
    assert g_r <= 10 * g_q and 0 < g_gain <= 10 * g_q
    g_q, g_r, _ = _gradients(old, x, cotangent)
    assert g_r > 100 * g_q


def _change(layer, x, param, direction, step):
    with torch.no_grad():
        before = layer(x)
        param.add_(step * direction)
        after = layer(x)
        param.sub_(step * direction)
    return (after - before).norm()


def test_gain_moves_output_smoothly():
    """Halving a step on the gain halves the output change (within 10 %); halving a step on W_R from
    the old start leaves the change as it was (rho jumps to unit scale)."""
    new, old = _layers()
    x = randn(2, 9, 32)
    direction = randn(16)
    big, half = (_change(new, x, new.r_norm.weight, direction, step) for step in (1e-2, 5e-3))
    assert big > 0 and abs(big / half - 2) < 0.2
    direction = randn(*old.r_proj.weight.shape)
    big, half = (_change(old, x, old.r_proj.weight, direction, step) for step in (1e-2, 5e-3))
    assert abs(big / half - 2) > 0.5
