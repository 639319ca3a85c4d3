"""convert_to_parallax on tiny Llama / Qwen3 models: same logits at zero W_R, training, save/load, errors."""
import subprocess
import sys
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaModel  # noqa: E402

import regattn  # noqa: E402
import regattn.hf  # noqa: E402
from regattn.hf import ParallaxAttention, ParallaxQwen3ForCausalLM  # noqa: E402
from regattn.layers.parallax import Parallax  # noqa: E402
from tests.helpers import rel_err  # noqa: E402
from tests.hf import tiny  # noqa: E402
from tests.hf.test_attention import packed_check  # noqa: E402

ARCHS = ["llama", "qwen3", "qwen3_sliding", "mistral"]


def _train_step(model, x, lr=1e-2):
    """One AdamW step on the LM loss; returns the loss."""
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    loss = model(x, labels=x).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return model.eval()


def _probe_weights(model):
    return [layer.self_attn.r_proj.weight for layer in model.model.layers]


def _gains(model):
    return [layer.self_attn.r_norm.weight for layer in model.model.layers]


def _set_gains(model, std=1.0):
    """Random nonzero probe gains (what training would move them to), so that rho matters."""
    with torch.no_grad():
        for gain in _gains(model):
            gain.normal_(std=std)
    return model


@pytest.mark.parametrize("arch", ARCHS)
def test_zero_probe_keeps_logits(arch):
    """In float64 (torch backend), the converted model's logits are the original's to rounding."""
    x = tiny.tokens(T=13)
    model = tiny.model(arch).double()
    before = model(x).logits
    converted = regattn.convert_to_parallax(model)
    assert converted is model and type(model).__name__.startswith("Parallax")
    assert all(isinstance(layer.self_attn, ParallaxAttention) for layer in model.model.layers)
    assert all(w.shape == layer.self_attn.q_proj.weight.shape and w.std() > 0.05
               for w, layer in zip(_probe_weights(model), model.model.layers))   # W_R normal (std 0.1)
    assert all(not gain.any() for gain in _gains(model))
    assert rel_err(model(x).logits, before) < 1e-12


def _probe_gradients(model, x):
    """Per layer, the gradient norms of (W_Q, W_R, gain) of the LM loss on ``x``."""
    model.zero_grad()
    model.train()
    model(x, labels=x).loss.backward()
    model.eval()
    return [(a.q_proj.weight.grad.norm(), a.r_proj.weight.grad.norm(), a.r_norm.weight.grad.norm())
            for a in (layer.self_attn for layer in model.model.layers)]


def test_probe_gradients_at_init_are_order_one():
    """At init the gain's and W_R's gradients are finite and at most 10x W_Q's gradient.

    The attention input is RMS-normalised (unit scale), and the probe reaches the output as the
    query does (a linear map of that input, here through a norm with a unit-scale result), so an
    O(1) probe gradient is one of the order of W_Q's; 10x leaves room for the heads' spread. The
    gain's gradient is nonzero (it trains); W_R's is exactly zero until the gain moves. The bound
    fails for the old start (W_R = 0 under the RMSNorm, unit gain): there W_R's gradient is over
    100x W_Q's (the norm divides by ``sqrt(eps)``).
    """
    x = tiny.tokens(T=13)
    model = regattn.convert_to_parallax(tiny.model("qwen3"))
    for g_q, g_r, g_gain in _probe_gradients(model, x):
        assert torch.isfinite(torch.stack([g_q, g_r, g_gain])).all()
        assert g_r <= 10 * g_q and 0 < g_gain <= 10 * g_q
    with torch.no_grad():
        for w, gain in zip(_probe_weights(model), _gains(model)):
            w.zero_()
            gain.fill_(1.0)
    assert all(g_r > 100 * g_q for g_q, g_r, _ in _probe_gradients(model, x))


def _change(model, x, params, direction, step):
    """Logits after ``params += step * direction`` minus the logits before (parameters restored)."""
    with torch.no_grad():
        before = model(x).logits
        for p, d in zip(params, direction):
            p.add_(step * d)
        after = model(x).logits
        for p, d in zip(params, direction):
            p.sub_(step * d)
    return after - before


def test_gain_moves_logits_smoothly():
    """From the converted start, a step on the gain changes the logits in proportion to the step
    (halving the step halves the change, within 10 %); a step on W_R from zero under the old start
    does not (rho jumps to unit scale however small the step)."""
    x = tiny.tokens(T=13)
    model = regattn.convert_to_parallax(tiny.model("llama"))
    gains = _gains(model)
    direction = [torch.randn_like(g) for g in gains]
    big, half = (_change(model, x, gains, direction, step).norm() for step in (1e-2, 5e-3))
    assert big > 0 and abs(big / half - 2) < 0.2
    with torch.no_grad():
        for w, gain in zip(_probe_weights(model), gains):
            w.zero_()
            gain.fill_(1.0)
    weights = _probe_weights(model)
    direction = [torch.randn_like(w) for w in weights]
    big, half = (_change(model, x, weights, direction, step).norm() for step in (1e-2, 5e-3))
    assert abs(big / half - 2) > 0.5


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_training_moves_probe_and_logits(arch):
    x = tiny.tokens(T=13)
    model = regattn.convert_to_parallax(tiny.model(arch))
    before = model(x).logits.detach()
    model.train()
    model(x, labels=x).loss.backward()
    assert all(g.grad is not None and g.grad.abs().sum() > 0 for g in _gains(model))
    model.zero_grad()
    _train_step(model, x)
    assert all(g.abs().sum() > 0 for g in _gains(model))
    model.train()
    model(x, labels=x).loss.backward()                 # once the gain moved, W_R trains too
    assert all(w.grad.abs().sum() > 0 for w in _probe_weights(model))
    model.zero_grad()
    after = model(x).logits
    assert torch.isfinite(after).all() and rel_err(after, before) > 1e-3


def test_layer_equals_regattn_parallax_layer():
    """A converted Qwen3 attention layer with a trained W_R is regattn's Parallax layer (RMSNorm + RoPE on rho)."""
    model = regattn.convert_to_parallax(tiny.model("qwen3"))
    attn = model.model.layers[0].self_attn
    torch.nn.init.normal_(attn.r_proj.weight, std=0.2)
    torch.nn.init.normal_(attn.r_norm.weight, mean=1.0, std=0.1)
    cfg = model.config
    rope_base = cfg.rope_parameters["rope_theta"] if getattr(cfg, "rope_parameters", None) else cfg.rope_theta
    layer = Parallax(cfg.hidden_size, cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads,
                     head_dim=cfg.head_dim, rope_base=rope_base, norm_eps=cfg.rms_norm_eps)
    for name in ("q_proj", "k_proj", "v_proj", "o_proj", "r_proj", "q_norm", "k_norm", "r_norm"):
        getattr(layer, name).load_state_dict(getattr(attn, name).state_dict())
    x = torch.randn(2, 9, cfg.hidden_size)
    positions = torch.arange(9)[None].expand(2, -1)
    ours = attn(x, model.model.rotary_emb(x, positions))[0]
    assert rel_err(ours, layer(x)) < 1e-5


def test_rope_on_probe_matters():
    """rope_probe=False gives a different model once W_R is nonzero (same weights)."""
    x = tiny.tokens(T=13)
    a, b = (regattn.convert_to_parallax(tiny.model("llama"), rope_probe=flag) for flag in (True, False))
    _set_gains(a)
    for pa, pb in zip(_probe_weights(a) + _gains(a), _probe_weights(b) + _gains(b)):
        with torch.no_grad():
            pb.copy_(pa)
    assert rel_err(a(x).logits, b(x).logits) > 1e-4


@pytest.mark.parametrize("arch,rope_probe", [("llama", True), ("qwen3_sliding", False), ("mistral", True)])
def test_save_load_round_trip(tmp_path, arch, rope_probe):
    x = tiny.tokens(T=13)
    model = _train_step(regattn.convert_to_parallax(tiny.model(arch), rope_probe=rope_probe), x)
    expected = model(x).logits
    model.save_pretrained(tmp_path)
    loaded, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert type(loaded) is type(model)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert loaded.config.parallax_rope_probe is rope_probe
    assert all(layer.self_attn.rope_probe is rope_probe for layer in loaded.model.layers)
    assert rel_err(loaded.eval()(x).logits, expected) < 1e-6


def test_cached_decoding_matches_full_forward():
    """After training, logits through the KV cache (prefill, a 2-token chunk, single steps past the window)
    equal one forward over the whole sequence; greedy generation with and without the cache agrees."""
    x = tiny.tokens(B=2, T=11)
    model = _train_step(regattn.convert_to_parallax(tiny.model("qwen3_sliding")), tiny.tokens(T=13))
    with torch.no_grad():
        full = model(x).logits
        out = model(x[:, :4], use_cache=True)
        steps = [out.logits]
        for a, b in [(4, 6), *((t, t + 1) for t in range(6, 11))]:
            out = model(x[:, a:b], past_key_values=out.past_key_values, use_cache=True)
            steps.append(out.logits)
    assert rel_err(torch.cat(steps, 1), full) < 1e-5
    prompt = x[:, :5]
    kwargs = dict(max_new_tokens=6, do_sample=False, attention_mask=torch.ones_like(prompt))
    assert torch.equal(model.generate(prompt, **kwargs), model.generate(prompt, use_cache=False, **kwargs))


@pytest.mark.parametrize("arch", ["llama", "qwen3_sliding", "mistral"])
def test_left_padding(arch):
    """Left padding (as transformers pads for generation) is accepted, with a trained-like probe; the
    windowed layers (qwen3_sliding, mistral: 5 tokens) see rows longer and shorter than the window."""
    tiny.check_left_padding(_set_gains(regattn.convert_to_parallax(tiny.model(arch))))


def test_left_padding_is_differentiable():
    """Without a cache a left-padded batch runs the differentiable op: its loss's gradient at the real
    tokens equals the sum of the rows' own gradients."""
    model = _set_gains(regattn.convert_to_parallax(tiny.model("qwen3_sliding"))).train()
    lengths, T = (9, 5), 9
    x, mask = tiny.left_padded(lengths, T)
    logits = model(x, attention_mask=mask).logits
    loss = sum(logits[b, T - n:].square().mean() for b, n in enumerate(lengths))
    padded = torch.autograd.grad(loss, _gains(model))
    loss = sum(model(x[b:b + 1, T - n:]).logits.square().mean() for b, n in enumerate(lengths))
    alone = torch.autograd.grad(loss, _gains(model))
    assert rel_err(torch.cat(padded), torch.cat(alone)) < 1e-5


def test_packed_sequences():
    model = _train_step(regattn.convert_to_parallax(tiny.model("qwen3_sliding")), tiny.tokens(T=13))
    packed_check(model)


def test_converted_model_runs_on_regattn_attention_config():
    """A model built for regattn_softmax converts too (its mask is checked the same way)."""
    x = tiny.tokens(T=13)
    model = tiny.model("llama", "regattn_softmax")
    before = model(x).logits
    assert rel_err(regattn.convert_to_parallax(model)(x).logits, before) < 1e-5


def test_bad_inputs():
    with pytest.raises(TypeError, match="model"):
        regattn.convert_to_parallax(LlamaModel(tiny.config("llama")))
    with pytest.raises(TypeError, match="model"):
        regattn.convert_to_parallax(torch.nn.Linear(2, 2))
    converted = regattn.convert_to_parallax(tiny.model("qwen3"))
    assert isinstance(converted, ParallaxQwen3ForCausalLM)
    with pytest.raises(TypeError, match="model"):
        regattn.convert_to_parallax(converted)
    with pytest.raises(TypeError, match="rope_probe"):
        regattn.convert_to_parallax(tiny.model("llama"), rope_probe="yes")
    with pytest.raises(ValueError, match="attention_dropout"):
        regattn.convert_to_parallax(tiny.model("llama", attention_dropout=0.1))
    x = tiny.tokens(B=2, T=7)
    mask = torch.ones_like(x)
    mask[1, 2:4] = 0                                   # a hole, not left padding
    with pytest.raises(ValueError, match="attention_mask"):
        converted(x, attention_mask=mask)
    with pytest.raises(ValueError, match="static cache"):
        converted.generate(x[:1], max_new_tokens=2, do_sample=False, cache_implementation="static")


def test_import_regattn_needs_no_transformers():
    code = ("import sys; sys.modules['transformers'] = None\n"
            "import regattn\n"
            "try:\n    regattn.convert_to_parallax\n"
            "except ImportError as e:\n    print('hf extra' if 'regattn[hf]' in str(e) else e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.stdout.strip() == "hf extra"


def test_triton_kernel_in_converted_model(interpret):
    """The fused Parallax kernels (interpreter on CPU) inside a converted model after a training step,
    on a plain and on a left-padded batch (rolled prefill, decode with ragged cache lengths)."""
    x = tiny.tokens(B=1, T=9)
    model = _train_step(regattn.convert_to_parallax(tiny.model("qwen3_sliding")), x)
    expected = model(x).logits
    model.config.regattn_backend = "triton"
    assert rel_err(model(x).logits, expected) < 1e-5
    prompt = x[:, :4]
    kwargs = dict(max_new_tokens=4, do_sample=False, attention_mask=torch.ones_like(prompt))
    assert torch.equal(model.generate(prompt, **kwargs), model.generate(prompt, use_cache=False, **kwargs))
    padded, mask = tiny.left_padded((5, 2), 5)
    kwargs = dict(max_new_tokens=3, do_sample=False, attention_mask=mask)
    triton = model.generate(padded, **kwargs)
    model.config.regattn_backend = "torch"
    assert torch.equal(triton, model.generate(padded, **kwargs))
