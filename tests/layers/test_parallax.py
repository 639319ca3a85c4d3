"""The Parallax layer: zero-init equals softmax attention, generation equals the full forward, varlen, GQA."""
import pytest
import torch

import regattn
from regattn.layers import Parallax
from tests.helpers import no_host_reads, randn, rel_err


def _layer(**kw):
    torch.manual_seed(0)
    return Parallax(32, 4, head_dim=16, **kw).double()


def test_zero_init_is_softmax_attention():
    layer = _layer(num_kv_heads=2, zero_init_probe=True)
    x = randn(2, 9, 32, seed=1)
    q, rho, k, v = layer.projections(x)
    assert rho.abs().max() == 0
    o = regattn.softmax_attention(q, k, v, backend="torch")
    assert rel_err(layer(x), layer.o_proj(o.reshape(2, 9, 64))) < 1e-12


def test_probe_changes_output_and_trains():
    layer = _layer(probe_gate=True)
    base = _layer(probe_gate=True, zero_init_probe=True)
    x = randn(1, 7, 32, seed=2)
    assert rel_err(layer(x), base(x)) > 1e-3
    layer(x).square().sum().backward()
    assert layer.r_proj.weight.grad.abs().sum() > 0 and layer.gate_proj.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("window,rope_probe", [(None, True), (4, False)])
def test_generation_matches_forward(window, rope_probe):
    layer = _layer(num_kv_heads=2, window=window, rope_probe=rope_probe, probe_gate=True)
    x = randn(2, 11, 32, seed=3)
    full = layer(x)
    y, cache = layer.prefill(x[:, :5])
    outs = [y]
    for t in range(5, 8):
        y, cache = layer.step(x[:, t:t + 1], cache)
        outs.append(y)
    y, cache = layer.step(x[:, 8:], cache)  # a chunk of three new tokens
    outs.append(y)
    assert cache.pos == 11
    assert rel_err(torch.cat(outs, 1), full) < 1e-12


def test_varlen_equals_per_sequence():
    layer = _layer(num_kv_heads=1, window=3)
    x = randn(1, 12, 32, seed=4)
    cu = torch.tensor([0, 5, 6, 12])
    y = layer(x, cu_seqlens=cu)
    ref = torch.cat([layer(x[:, a:b]) for a, b in ((0, 5), (5, 6), (6, 12))], 1)
    assert rel_err(y, ref) < 1e-12


def test_kernel_backend_matches_reference(interpret):
    torch.manual_seed(0)
    layer = Parallax(32, 4, num_kv_heads=2, head_dim=16, probe_gate=True, backend="triton")
    x = torch.randn(1, 20, 32)
    y = layer(x)
    layer.backend = "torch"
    assert rel_err(y, layer.double()(x.double())) < 1e-5
    layer.float().backend = "triton"
    _, cache = layer.prefill(x[:, :19])
    y_step, _ = layer.step(x[:, 19:], cache)
    assert rel_err(y_step, y[:, 19:]) < 1e-5


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_kv_heads"):
        Parallax(32, 4, num_kv_heads=3)
    with pytest.raises(ValueError, match="window"):
        Parallax(32, 4, window=0)
    with pytest.raises(ValueError, match="x"):
        _layer()(randn(2, 32, seed=5))


def test_step_and_packed_forward_read_nothing_on_the_host(interpret):
    """A decode step of a left-padded batch and a packed forward given ``max_seqlen``: no host read."""
    torch.manual_seed(0)
    layer = Parallax(32, 4, num_kv_heads=2, head_dim=16, backend="triton")
    x = torch.randn(2, 7, 32)
    start = torch.tensor([0, 3])
    _, cache = layer.prefill(x[:, :6], start)
    with no_host_reads():
        y, _ = layer.step(x[:, 6:], cache)
    layer.backend = "torch"
    _, ref_cache = layer.prefill(x[:, :6], start)
    assert rel_err(y, layer.step(x[:, 6:], ref_cache)[0]) < 1e-5
    layer.backend = "triton"
    cu = torch.tensor([0, 5, 14], dtype=torch.int32)
    packed = x.reshape(1, 14, 32)
    with no_host_reads():
        y = layer(packed, cu_seqlens=cu, max_seqlen=9)
    layer.backend = "torch"
    assert rel_err(y, layer(packed, cu_seqlens=cu)) < 1e-5


@pytest.mark.parametrize("rope_probe", [True, False])
def test_projections_under_autocast(rope_probe):
    """Under bf16 autocast q, rho, k, v reach the op in one dtype, the projections', rounded once from the
    fp32 norm and rotation."""
    torch.manual_seed(0)
    layer = Parallax(32, 4, num_kv_heads=2, head_dim=16, probe_gate=True, rope_probe=rope_probe)
    x = torch.randn(2, 9, 32)
    exact = layer.double().projections(x.double(), 3)
    layer.float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = layer.projections(x, 3)
        y = layer(x)
    assert all(t.dtype == torch.bfloat16 for t in got) and y.dtype == torch.bfloat16
    for a, b in zip(got, exact):
        assert rel_err(a, b) < 2e-2
