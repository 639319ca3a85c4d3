import pytest
import torch

from regattn.layers.norm import RMSNorm
from regattn.models.mixers import MIXERS, build_mixer, options_for
from regattn.models.stack import MixerStack, build_model, first_pass
from regattn.tasks import mad_task, mqar, in_context_regression


@pytest.mark.parametrize("name", sorted(MIXERS))
def test_forward_backward(name):
    torch.manual_seed(0)
    mixer = build_mixer(name, 16, 2, seq_len=12)
    x = torch.randn(2, 12, 16, requires_grad=True)
    y = mixer(x)
    assert y.shape == x.shape and torch.isfinite(y).all()
    (y * torch.randn_like(y)).sum().backward()
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
    grads = [p.grad for p in mixer.parameters() if p.requires_grad]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("name", ["softmax", "parallax", "decay"])
def test_causal(name):
    torch.manual_seed(0)
    mixer = build_mixer(name, 16, 2, seq_len=10)
    x = torch.randn(1, 10, 16)
    y = mixer(x)
    x2 = x.clone()
    x2[:, 6:] = torch.randn(1, 4, 16)
    assert torch.allclose(mixer(x2)[:, :6], y[:, :6], atol=1e-5)


def test_window_default_and_bad_name():
    assert build_mixer("swa", 16, 2, seq_len=20).window == 10
    assert build_mixer("swa", 16, 2, seq_len=20, window=3).window == 3
    with pytest.raises(ValueError, match="mixer"):
        build_mixer("mamba", 16, 2, seq_len=8)
    with pytest.raises(ValueError, match="heads"):
        build_mixer("softmax", 16, 3)


def test_first_pass_runs_the_mixer_forward_and_backward_in_a_model_at_the_runs_sizes():
    model = first_pass("swa", 16, 2, "cpu", batch=3, length=20, **options_for("swa", {"parallax.window": 4}))
    layer = model.blocks[0].mixer
    assert layer.window == 10 and layer.training                     # the window from the length, as in the runs
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in layer.parameters())
    assert model.blocks[0].mixer_norm.weight.grad is not None        # its input came through the block's norm
    for kind in ("regression", "autoencode"):                        # the other kinds of task inputs
        model = first_pass("decay", 16, 2, "cpu", batch=3, length=20, kind=kind, eval_batch=5)
        assert model.kind == kind and not model.training             # then evaluated
        assert all(p.grad is not None for p in model.blocks[0].mixer.parameters())


def test_options_named_for_one_mixer_reach_it_alone():
    options = {"window": 4, "swa.window": 6, "lla.cg_iters": 3}
    assert options_for("swa", options) == {"window": 6}
    assert options_for("gatedfwa", options) == {"window": 4}
    assert options_for("lla", options) == {"window": 4, "cg_iters": 3}
    assert build_mixer("swa", 16, 2, seq_len=20, **options).window == 6
    assert build_mixer("lla", 16, 2, seq_len=20, **{"lla.cg_iters": 3, "swa.window": 6}).cg_iters == 3
    assert build_mixer("softmax", 16, 2, **{"lla.cg_iters": 3}).window is None
    with pytest.raises(ValueError, match="'lal.cg_iters'.*names no mixer"):
        build_mixer("lla", 16, 2, seq_len=20, **{"lal.cg_iters": 3})


def test_stack_kinds():
    tok = mqar(length=16, pairs=2, vocab_size=30, num_train=2, num_test=1)
    model = build_model(tok, "softmax", dim=16, heads=2)
    assert model(tok.train.inputs).shape == (2, 16, 30)
    assert len(model.features(tok.train.inputs)) == 3

    reg = in_context_regression(length=8, dim_x=4, dim_y=3, queries=2, num_train=2, num_test=1)
    model = build_model(reg, "parallax", dim=16, heads=2, mlp=False)
    assert model(reg.train.inputs).shape == (2, 10, 3)
    assert all(block.mlp is None for block in model.blocks)

    comp = mad_task("compression", num_train=2, num_test=1, seq_len=12)
    model = build_model(comp, "softmax", dim=16, heads=2, layers=1)
    out = model(comp.train.inputs)
    assert out.shape == (2, 12, comp.vocab_size)
    # the reconstruction reads only the last position's state: changing earlier tokens changes every output
    x = comp.train.inputs.clone()
    x[:, 0] = (x[:, 0] + 1) % (comp.vocab_size - 1)
    assert not torch.allclose(model(x), out)

    with pytest.raises(ValueError, match="kind"):
        MixerStack("softmax", kind="images", seq_len=4, vocab_size=4)


def test_bf16_autocast():
    x = torch.randn(2, 12, 16)
    for name in sorted(MIXERS):
        torch.manual_seed(0)
        mixer = build_mixer(name, 16, 2, seq_len=12)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = mixer(x)
        assert y.dtype == torch.bfloat16 and torch.isfinite(y.float()).all(), name


def test_mixer_norms_keep_the_input_dtype(monkeypatch):
    # CUDA autocast runs rms_norm in fp32; the mixers' norms return the input's dtype to the ops
    for name in sorted(MIXERS):
        mixer = build_mixer(name, 16, 2, seq_len=12)
        norms = [m for m in mixer.modules() if isinstance(m, torch.nn.RMSNorm)]
        assert all(isinstance(m, RMSNorm) for m in norms), name
    monkeypatch.setattr(torch.nn.RMSNorm, "forward", lambda self, x: x.float())
    x = torch.randn(3, 4, dtype=torch.bfloat16)
    assert RMSNorm(4)(x).dtype == torch.bfloat16


@pytest.mark.parametrize("task", ["mqar", "compression"])
def test_select_positions(task):
    t = mqar(length=16, pairs=2, vocab_size=30, num_train=2, num_test=1) if task == "mqar" else \
        mad_task("compression", vocab_size=12, seq_len=8, num_train=2, num_test=1)
    model = build_model(t, "softmax", dim=16, heads=2)
    T = t.train.inputs.shape[1]
    select = torch.stack([torch.randperm(T)[:5] for _ in range(2)])           # any positions, in any order
    full = model(t.train.inputs)
    picked = model(t.train.inputs, select=select)
    assert picked.shape == (2, 5, full.shape[-1])
    assert torch.allclose(picked, full.gather(1, select[..., None].expand(-1, -1, full.shape[-1])), atol=1e-6)


def test_lla_mixer_solves_to_convergence():
    import regattn
    from regattn.analysis.diagnostics import attention_inputs
    torch.manual_seed(0)
    mixer = build_mixer("lla", 32, 2, seq_len=24)
    assert mixer.cg_iters == 16
    x = torch.randn(2, 24, 32)
    inp = attention_inputs(mixer, x)
    exact = regattn.lla(inp["q"], inp["k"], inp["v"], lam=inp["lam"])
    ours = regattn.lla(inp["q"], inp["k"], inp["v"], lam=inp["lam"], cg_iters=mixer.cg_iters)
    assert ((ours - exact).norm() / exact.norm()).item() < 1e-2           # fp32 CG; 4 iterations give ~0.5


def test_mesanet_chunk_changes_the_cost_not_the_numbers():
    torch.manual_seed(0)
    mixer = build_mixer("mesanet", 16, 2, chunk=64)
    x = torch.randn(2, 40, 16, dtype=torch.float64)
    mixer.double()
    want = mixer(x)
    mixer.chunk = 8
    assert torch.allclose(mixer(x), want, rtol=0, atol=1e-10)
    assert build_mixer("mesanet", 16, 2, **{"mesanet.chunk": 16}).chunk == 16
    with pytest.raises(ValueError, match="chunk"):
        build_mixer("mesanet", 16, 2, chunk=0)(x.float())
