"""The flash-linear-attention baselines on the CPU: the error without the extra, the sweep's skip, and
(where FLA is importable) the layers built at the model's sizes. Their kernels run in tests/gpu/test_baselines.py."""
import importlib
import json
import re
import sys

import pytest

from regattn.cli import main as regattn_command
from regattn.models import DecoderLM, LMConfig
from regattn.models.baselines import BASELINES, Baseline, refusals
from regattn.models.mixers import build_mixer
from regattn.models.stack import MixerStack
from regattn.train import cli, sweep
from regattn.usage import UsageError
from tests.train.test_cli import TINY

EXTRA = r"pip install 'regattn\[baselines\]'"


@pytest.fixture
def no_fla(monkeypatch):
    for name in ("fla", "fla.layers"):
        monkeypatch.setitem(sys.modules, name, None)


@pytest.mark.parametrize("name", BASELINES)
def test_without_the_extra_naming_a_baseline_names_it(no_fla, name):
    with pytest.raises(ImportError, match=EXTRA):
        build_mixer(name, 16, 2)
    with pytest.raises(ImportError, match=EXTRA):
        DecoderLM(LMConfig(mixer=["softmax", name], layers=2, dim=16, heads=2))


@pytest.mark.parametrize("argv", [["train", "mqar", "--mixer", "mamba2"], ["sweep", "--preset", "parallax-mad"],
                                  ["lm", "--mixer", "gla"]], ids=["train", "sweep", "lm"])
def test_without_the_extra_the_commands_say_how_to_install_it(no_fla, argv, tmp_path, capsys):
    assert regattn_command(argv + ["--out", str(tmp_path), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and re.search(EXTRA, err), err
    assert not any(tmp_path.iterdir())                 # nothing ran


def test_baselines_are_refused_off_cuda():
    reasons = refusals(["softmax", "gdn", "mamba2"], dim=16, heads=2, device="cpu", options={})
    assert sorted(reasons) == ["gdn", "mamba2"] and "CUDA device" in reasons["gdn"]


def test_sweep_skips_a_refused_mixer_and_records_why(tmp_path, monkeypatch, capsys):
    asked = []

    def refuse_decay(mixers, **sizes):
        asked.append((sizes["batch"], sizes["inputs"], sizes["eval_batch"]))
        return {m: "RuntimeError: not on this machine" for m in mixers if m == "decay"}
    monkeypatch.setattr(cli, "refusals", refuse_decay)
    out = tmp_path / "s"
    assert sweep.main(["mqar", "--mixers", "softmax,decay", "--out", str(out)] + TINY) == 0
    assert asked == [(4, [("tokens", 16)], 256)]          # checked at the runs' batch sizes and inputs (TINY's)
    payload = json.loads((out / "sweep-mqar.json").read_text())
    assert payload["skipped"] == {"decay": "RuntimeError: not on this machine"}
    assert payload["mixers"] == ["softmax"] and {r["mixer"] for r in payload["runs"]} == {"softmax"}
    assert "skipping decay: RuntimeError: not on this machine" in capsys.readouterr().out
    with pytest.raises(UsageError, match="none runs"):
        sweep.main(["mqar", "--mixers", "decay", "--out", str(out)] + TINY)
    with pytest.raises(UsageError, match="--mixer decay: RuntimeError"):
        cli.main(["mqar", "--mixer", "decay", "--out", str(out)] + TINY)


# ------------------------------------------------------------------------------------------- with FLA
def heads_and_widths(layer) -> tuple:
    """``(heads, key width, value width)`` of an FLA layer (Mamba2: its head width for both)."""
    if hasattr(layer, "head_k_dim"):
        return layer.num_heads, layer.head_k_dim, layer.head_v_dim
    return layer.num_heads, layer.head_dim, layer.head_dim


@pytest.mark.parametrize("name, widths", [("mamba2", (2, 64, 64)), ("gdn", (2, 32, 32)), ("gla", (2, 32, 32)),
                                          ("deltanet", (2, 32, 32))])
def test_layers_take_the_model_sizes(name, widths):
    pytest.importorskip("fla.layers")
    mixer = build_mixer(name, 64, 2, seq_len=8)
    assert isinstance(mixer, Baseline) and mixer.layer.hidden_size == 64
    assert heads_and_widths(mixer.layer) == widths
    lm = DecoderLM(LMConfig(mixer=["softmax", name], layers=2, dim=64, heads=4, head_dim=8))
    assert heads_and_widths(lm.blocks[1].mixer.layer.layer) == (4, 8, 8)           # head_dim given
    model = MixerStack(name, kind="tokens", seq_len=8, vocab_size=10, dim=32, heads=2)
    assert heads_and_widths(model.blocks[0].mixer.layer)[0] == 2


def test_options_reach_fla_and_sizes_are_checked():
    pytest.importorskip("fla.layers")
    assert build_mixer("gdn", 64, 2, expand_v=2.0).layer.head_v_dim == 64
    assert build_mixer("mamba2", 64, 2, state_size=16).layer.ssm_state_size == 16
    with pytest.raises(ValueError, match="heads"):
        build_mixer("gla", 64, 3)
    with pytest.raises(ValueError, match="kv_heads"):
        DecoderLM(LMConfig(mixer="deltanet", layers=1, dim=64, heads=4, kv_heads=2))


def test_sweep_on_the_cpu_skips_the_baselines(tmp_path):
    pytest.importorskip("fla.layers")
    out = tmp_path / "s"
    assert sweep.main(["mqar", "--mixers", "softmax,mamba2", "--out", str(out)] + TINY) == 0
    payload = json.loads((out / "sweep-mqar.json").read_text())
    assert list(payload["skipped"]) == ["mamba2"] and payload["mixers"] == ["softmax"]


@pytest.mark.parametrize("fast, conv, call", [(True, False, {"use_cache": True}), (True, True, {}), (False, False, {})],
                         ids=["mamba_ssm", "mamba_ssm-causal_conv1d", "neither"])
def test_mamba2_trains_unfused_where_causal_conv1d_is_missing(monkeypatch, fast, conv, call):
    pytest.importorskip("fla.layers")
    module = importlib.import_module("fla.layers.mamba2")
    monkeypatch.setattr(module, "is_fast_path_available", fast)
    monkeypatch.setattr(module, "causal_conv1d_fn", (lambda *a, **k: None) if conv else None)
    assert build_mixer("mamba2", 64, 2, seq_len=8).call == call
