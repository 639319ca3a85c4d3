import math

import pytest
import torch

import regattn
from regattn.analysis import analyze, layer_diagnostics, stable_rank
from regattn.analysis.cli import main as analyze_main
from regattn.analysis.diagnostics import (attention_inputs, covariance_terms, heads_first, lla_scores,
                                          softmax_weights)
from regattn.models.mixers import MIXERS, build_mixer
from regattn.models.stack import build_model
from regattn.tasks import mqar
from regattn.train.trainer import TrainConfig, train


def test_stable_rank():
    assert stable_rank(torch.eye(5)) == pytest.approx(5.0)
    u, v = torch.randn(6, 1), torch.randn(1, 4)
    assert stable_rank(u @ v) == pytest.approx(1.0)
    assert stable_rank(torch.diag(torch.tensor([2.0, 1.0]))) == pytest.approx(1.25)


def mixer_and_input(name, T=12):
    torch.manual_seed(0)
    mixer = build_mixer(name, 16, 2, seq_len=T).double()
    return mixer, torch.randn(2, T, 16, dtype=torch.float64)


def test_parallax_scores_reproduce_the_op_and_cor():
    mixer, x = mixer_and_input("parallax")
    inp = attention_inputs(mixer, x)
    q, k, v, r = (heads_first(inp[n], 2) for n in ("q", "k", "v", "r"))
    p = softmax_weights(q, k, scale=8 ** -0.5, window=None)
    t = r @ k.transpose(-1, -2)
    s = p * (1 - t + (p * t).sum(-1, keepdim=True))
    o = regattn.parallax(inp["q"], inp["r"], inp["k"], inp["v"]).transpose(1, 2)
    assert torch.allclose(s @ v, o, atol=1e-10)
    assert torch.allclose(s.sum(-1), torch.ones_like(s[..., 0]))
    o_sa = p @ v
    cor = ((o_sa - o).norm(dim=-1) / o_sa.norm(dim=-1)).mean().item()   # ||Sigma_KV rho|| = ||o_SA - o_PLX||
    assert covariance_terms(p, k, v, r)["cor"] == pytest.approx(cor, rel=1e-9)


def test_zero_probe_is_softmax():
    mixer, x = mixer_and_input("parallax")
    with torch.no_grad():
        mixer.r_proj.weight.zero_()
    d = layer_diagnostics(mixer, x)
    soft, _ = mixer_and_input("softmax")
    soft.load_state_dict({k: v for k, v in mixer.state_dict().items() if not k.startswith("r_")})
    ds = layer_diagnostics(soft, x)
    assert d["cor"] == 0 and d["probe_norm"] == 0
    for key in ("score_range", "score_min", "sink_base", "sink_scores", "entropy", "density", "corr_f"):
        assert d[key] == pytest.approx(ds[key], rel=1e-9), key


def test_lla_scores_reproduce_the_op():
    mixer, x = mixer_and_input("lla")
    inp = attention_inputs(mixer, x)
    s = lla_scores(inp["q"], inp["k"], lam=inp["lam"], scale=8 ** -0.5, window=None, blocks=None)
    o = regattn.lla(inp["q"], inp["k"], inp["v"], lam=inp["lam"]).transpose(1, 2)
    assert torch.allclose(s @ heads_first(inp["v"], 2), o, atol=1e-8)
    assert s.min() < 0                                   # signed scores


def test_corr_of_a_linear_map_is_orthogonal():
    torch.manual_seed(1)
    B, H, T, D = 1, 1, 40, 4
    k = torch.randn(B, H, T, D, dtype=torch.float64)
    v = k @ torch.randn(D, D, dtype=torch.float64).T
    p = torch.full((B, H, T, T), 1.0 / T, dtype=torch.float64)
    assert covariance_terms(p, k, v)["corr_f"] == pytest.approx(math.sqrt(D), rel=1e-6)


def test_analyze_every_mixer_and_the_command(tmp_path, capsys):
    t = mqar(length=16, pairs=2, vocab_size=32, num_train=4, num_test=2)
    for name in MIXERS:
        torch.manual_seed(0)
        rows = analyze(build_model(t, name, dim=16, heads=2), t.test.inputs)
        assert len(rows) == 2 and all(math.isfinite(v) for r in rows for v in r.values()), name
        assert "W_QK" in rows[0]
        if name in ("softmax", "swa", "gatedfwa", "parallax", "lla", "bd_lla"):
            assert 0 <= rows[0]["sink_base"] <= 1 and rows[0]["entropy"] >= 0, name
    path = str(tmp_path / "m.pt")
    train(TrainConfig(task="mqar", task_options=dict(length=16, pairs=2, vocab_size=32, num_train=8, num_test=4),
                      mixer="parallax", dim=16, steps=1, batch_size=4, progress=False, checkpoint=path))
    assert analyze_main([path, "--examples", "2", "--json", str(tmp_path / "a.json")]) == 0
    out = capsys.readouterr().out
    assert "cor" in out and "W_RK" in out and (tmp_path / "a.json").exists()


def test_probe_gate_and_table_mean():
    from regattn.analysis.cli import table
    torch.manual_seed(0)
    mixer = build_mixer("parallax", 16, 2, seq_len=8, probe_gate=True).double()
    d = layer_diagnostics(mixer, torch.randn(1, 8, 16, dtype=torch.float64))
    assert 0 < d["probe_gate"] < 1
    text = table([dict(layer=0, cor=1.0), dict(layer=1, cor=3.0)])
    assert text.splitlines()[1].split() == ["cor", "1", "3", "2"]


def test_gatedfwa_weights_reproduce_the_op():
    from regattn.ops.gatedfwa.api import gate_dispatch
    mixer, x = mixer_and_input("gatedfwa")
    with torch.no_grad():
        mixer.beta_proj.weight.normal_()                       # a non-trivial amplitude
    inp = attention_inputs(mixer, x)
    q, k, v = (heads_first(inp[n], 2) for n in ("q", "k", "v"))
    p = softmax_weights(q, k, scale=8 ** -0.5, window=inp["window"], bias=inp["bias"])
    h, beta = mixer.gate_inputs(x)
    u = gate_dispatch(h, beta, eps=mixer.eps, backend="torch")
    o = regattn.gatedfwa(inp["q"], inp["k"], inp["v"], u, window=inp["window"]).transpose(1, 2)
    assert torch.allclose(p @ v, o, atol=1e-10)
