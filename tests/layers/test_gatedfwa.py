"""The GatedFWA layer: shapes, init, generation cache, kernel path vs torch path, varlen, bad input."""
import pytest
import torch

from regattn import reference
from regattn.layers import GatedFWA, GatedFWANSA
from tests.helpers import decode_one_by_one, randn, rel_err

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# beta_proj's init spread in the tests: beta = 1 + elu(x W) data-dependent but above about 0.1. With 0.3, one draw
# in ten reached beta ~ 1e-3, where d alpha / d beta ~ 1 / beta^2 turns the fp32 rounding of the kernel path's gate
# gradient into up to 0.25% error in beta_proj's (the torch path's stayed under 5e-5; see regattn.ops.softmax.kernels)
BETA_STD = 0.1


def _layer(dtype=torch.float64, seed=0, **kw):
    torch.manual_seed(seed)
    args = dict(d_model=32, num_heads=4, window=5, num_kv_heads=2)
    args.update(kw)
    layer = GatedFWA(**args)
    with torch.no_grad():  # leave the init: make beta data-dependent so its gradient path is exercised
        layer.beta_proj.weight.normal_(0, BETA_STD)
    return layer.to(dtype)


def test_init_beta_is_one_and_shapes():
    torch.manual_seed(0)
    layer = GatedFWA(32, 4, window=8)
    x = randn(2, 11, 32, dtype=torch.float32)
    h, beta = layer.gate_inputs(x)
    assert torch.equal(beta, torch.ones_like(beta))
    assert h.shape == (2, 11, 4)
    assert layer(x).shape == (2, 11, 32)


def test_every_parameter_gets_a_gradient():
    layer = _layer()
    layer(randn(2, 9, 32)).square().sum().backward()
    for name, p in layer.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("window,rope,output_gate", [(5, False, True), (None, True, True), (5, True, False)])
def test_step_by_step_generation_equals_forward(window, rope, output_gate):
    layer = _layer(window=window, rope=rope, output_gate=output_gate)
    x = randn(2, 13, 32)
    full = layer(x)
    y, cache = layer.prefill(x[:, :4])
    outs = [y]
    for t in range(4, 13):
        y, cache = layer.step(x[:, t:t + 1], cache)
        outs.append(y)
        if window is not None:
            assert cache.k.shape[1] <= window
    assert rel_err(torch.cat(outs, 1), full) < 1e-12
    y0, _ = layer.step(x[:, :1], None)
    assert rel_err(y0, full[:, :1]) < 1e-12


def test_output_gate_off_joins_the_heads_and_the_decay_range_sets_the_gate_bias():
    from regattn.ops.gatedfwa.api import gate_dispatch, gatedfwa

    layer = _layer(window=5, output_gate=False, decay_low=1e-4, decay_high=1e-2)
    assert not hasattr(layer, "out_gate") and not hasattr(layer, "o_norm")
    rates = torch.nn.functional.softplus(layer.g_proj.bias)
    assert torch.allclose(rates, torch.logspace(-4, -2, 4, dtype=torch.float64), rtol=1e-6)
    x = randn(2, 9, 32)
    q, k, v = layer._qkv(x)
    u = gate_dispatch(*layer.gate_inputs(x), eps=layer.eps, backend="torch")
    o = gatedfwa(q, k, v, u, window=5, backend="torch")
    assert rel_err(layer(x), layer.o_proj(o.flatten(2))) < 1e-12


def test_varlen_equals_separate_sequences():
    layer = _layer()
    x = randn(1, 15, 32)
    cu = torch.tensor([0, 6, 15])
    packed = layer(x, cu_seqlens=cu)
    assert rel_err(packed[:, :6], layer(x[:, :6])) < 1e-12
    assert rel_err(packed[:, 6:], layer(x[:, 6:])) < 1e-12


def test_kernel_path_matches_torch_path(interpret):
    """Output and gradients of every weight (through q, k, v, h and beta) agree with the float64 layer."""
    fast = _layer(torch.float32, backend="triton", d_model=32, num_heads=2, num_kv_heads=1, window=7).to(DEV)
    exact = _layer(torch.float64, backend="torch", d_model=32, num_heads=2, num_kv_heads=1, window=7).to(DEV)
    x = randn(1, 37, 32, device=DEV)
    dy = randn(1, 37, 32, device=DEV)
    fast(x.float()).backward(dy.float())
    y = exact(x)
    y.backward(dy)
    assert rel_err(fast(x.float()), y) < 2e-5
    for (name, a), (_, b) in zip(fast.named_parameters(), exact.named_parameters()):
        # The gate weights' gradients sum reverse cumulative sums over time that partly cancel: in 60 draws the
        # kernel path reached 4.8e-5 there (the fp32 torch path 8.4e-6), 3e-5 elsewhere.
        bound = 5e-4 if name.startswith(("g_proj", "beta_proj")) else 1e-4
        assert rel_err(a.grad, b.grad) < bound, name


def test_bad_input():
    with pytest.raises(ValueError, match="window"):
        GatedFWA(32, 4, window=0)
    with pytest.raises(ValueError, match="num_kv_heads"):
        GatedFWA(32, 4, window=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="decay_low"):
        GatedFWA(32, 4, window=4, decay_low=0.0)
    with pytest.raises(ValueError, match="decay_high"):
        GatedFWA(32, 4, window=4, decay_low=1e-2, decay_high=1e-3)
    with pytest.raises(TypeError, match="output_gate"):
        GatedFWA(32, 4, window=4, output_gate=1)
    layer = GatedFWA(32, 4, window=4)
    with pytest.raises(ValueError, match="x"):
        layer(randn(2, 3, 4, 32, dtype=torch.float32))
    with pytest.raises(ValueError, match="x"):
        layer.step(randn(1, 2, 32, dtype=torch.float32), None)


def _nsa(**kw):
    torch.manual_seed(0)
    args = dict(d_model=32, num_heads=4, window=4, num_kv_heads=2, block_cmp=4, stride_cmp=2, block_slc=4, topk=2)
    args.update(kw)
    return GatedFWANSA(**args).double()


def test_nsa_selection_of_every_block_is_causal_attention():
    layer = _nsa(topk=100)
    x = randn(2, 19, 32)
    _, o_slc, _ = layer.branches(x)
    q, k, v = layer._qkv(x)
    assert rel_err(o_slc, reference.softmax_attention(q, k, v, causal=True)) < 1e-12


def test_nsa_local_branch_is_gatedfwa_and_compression_matches_loop():
    layer = _nsa()
    x = randn(1, 15, 32)
    o_cmp, o_slc, o_loc = layer.branches(x)
    q, k, v = layer._qkv(x)
    h, beta = layer.gate_inputs(x)
    assert rel_err(o_loc, reference.gatedfwa(q, k, v, reference.gatedfwa_gate(h, beta), window=4)) < 1e-12
    # Query t = 9 sees compressed blocks ending at or before 9: starts 0, 2, 4, 6 (block 4, stride 2).
    t, head, kv = 9, 3, 1
    kc = [layer.phi_k((k[0, s:s + 4, kv] + layer.cmp_pos).flatten()) for s in (0, 2, 4, 6)]
    vc = [layer.phi_v((v[0, s:s + 4, kv] + layer.cmp_pos).flatten()) for s in (0, 2, 4, 6)]
    w = torch.softmax(torch.stack([q[0, t, head] @ c for c in kc]) * 8 ** -0.5, 0)
    assert rel_err(o_cmp[0, t, head], sum(wi * vi for wi, vi in zip(w, vc))) < 1e-12


def test_nsa_is_causal_and_trains():
    layer = _nsa()
    x = randn(2, 21, 32)
    y = layer(x)
    x2 = x.clone()
    x2[:, 12:] = randn(2, 9, 32)
    assert rel_err(layer(x2)[:, :12], y[:, :12]) < 1e-12
    y.square().sum().backward()
    for name, p in layer.named_parameters():
        if name != "beta_proj.weight":  # zero at init: its gradient is data-dependent but may vanish
            assert p.grad is not None and torch.isfinite(p.grad).all(), name
    assert layer.phi_k[0].weight.grad.abs().sum() > 0 and layer.branch_gate.weight.grad.abs().sum() > 0


def test_nsa_bad_input():
    with pytest.raises(ValueError, match="stride_cmp"):
        GatedFWANSA(32, 4, window=4, block_cmp=4, stride_cmp=8)
    with pytest.raises(ValueError, match="topk"):
        GatedFWANSA(32, 4, window=4, topk=0)


@pytest.mark.parametrize("prompt", [0, 1, 6, 13])
def test_nsa_prefill_then_steps_equal_the_full_forward(prompt):
    """Compressed blocks completing during decoding (block 4, stride 2), the window of 4 and the selection
    blocks passed; ``prompt = 0`` starts from ``step(x, None)``."""
    layer = _nsa(rope=True)
    x = randn(2, 19, 32)
    full = layer(x)
    decoded, cache = decode_one_by_one(layer, x, prompt)
    assert rel_err(decoded, full) < 1e-12
    assert cache.k.shape[1] == 19 and cache.kc.shape[1] == (19 - 4) // 2 + 1 and cache.local.k.shape[1] == 4


def test_nsa_refuses_left_padding():
    with pytest.raises(ValueError, match="start"):
        _nsa().prefill(randn(2, 5, 32), start=torch.tensor([0, 2]))
