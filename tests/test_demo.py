"""``regattn demo``: the protocol's alignment, the scoring, and a tiny end-to-end run."""
import json

import pytest
import torch

from regattn import demo, reference
from regattn.tasks.regression import piecewise_linear_regression


def tiny(tmp_path, *extra):
    return ["-L", "24", "--dims", "4", "--segments", "6,24", "-n", "3", "--out", str(tmp_path / "mse.png"),
            "--quiet", *extra]


def nadaraya_watson(q, k, v, scale):
    """Softmax attention of one query over the given pairs, written out."""
    w = torch.softmax(scale * (k @ q), dim=0)
    return w @ v


@pytest.mark.parametrize("include_self", [True, False])
def test_context_alignment_reads_the_documented_pairs(include_self):
    data = piecewise_linear_regression(1, 10, 3, 5, seed=0)
    K, V = data.keys[0], data.values[0]
    q, k, v = demo.split_context(data.keys, data.values, include_self)
    cfg = demo.Config(include_self=include_self, chunk=4)
    out = demo.predict("softmax", q, k, v, cfg=cfg, dim=3)[0, :, 0]
    for t in range(out.shape[0]):
        i = t if include_self else t + 1                       # the position this query predicts
        last = i + 1 if include_self else i                    # pairs j <= i, or j < i
        expected = nadaraya_watson(K[i], K[:last], V[:last], 3 ** -0.5)
        torch.testing.assert_close(out[t], expected, rtol=1e-10, atol=1e-12)


def test_query_chunks_give_the_unchunked_result():
    data = piecewise_linear_regression(2, 13, 4, 13, seed=1)
    q, k, v = demo.split_context(data.keys, data.values, False)
    whole = reference.lla(q, k, v, lam=0.5)
    parts = demo.by_query_chunks(lambda q, k, v: reference.lla(q, k, v, lam=0.5), q, k, v, 5)
    torch.testing.assert_close(parts, whole, rtol=1e-10, atol=1e-12)


def result(before, after):
    r = demo.Result(dim=4, segment=8, mse={}, seconds=0.0)
    r.before, r.after = before, after
    return r


def test_claims_are_judged_from_the_totals_not_assumed():
    held = result({"LLA": 2.0, "softmax": 3.0, "linear": 9.0, "MesaNet": 1.0, "random": 5.0},
                  {"LLA": 1.0, "softmax": 2.0, "linear": 9.0, "MesaNet": 3.0, "random": 5.0})
    failed = result({"LLA": 1.0, "softmax": 3.0, "linear": 9.0, "MesaNet": 2.0, "random": 5.0},
                    {"LLA": 2.0, "softmax": 1.0, "linear": 9.0, "MesaNet": 3.0, "random": 5.0})
    no_shift = result({"LLA": 2.0, "softmax": 3.0, "linear": 9.0, "MesaNet": 1.0, "random": 5.0}, None)
    verdicts = demo.claims([held, failed, no_shift])
    assert [h for _, _, h, _ in verdicts["MesaNet best before the first shift"]] == [True, False, True]
    assert [w for _, _, _, w in verdicts["LLA best after the first shift"]] == ["LLA", "softmax"]
    text = demo.format_claims(verdicts)
    assert "HELD PARTLY in 2/3" in text and "HELD PARTLY in 1/2" in text and "softmax was best" in text


def test_paper_flag_sets_the_sweep_and_explicit_flags_win():
    cfg = demo.parse_config(["--paper", "-n", "10"])
    assert (cfg.length, cfg.dims, cfg.sequences) == (1024, (8, 16, 32, 64, 128), 10)
    assert cfg.segments == (8, 16, 32, 64, 128, 256, 512, 1024)
    default = demo.parse_config([])
    assert default.include_self and default.lam == 1.0 and default.length < 1024


@pytest.mark.parametrize("argv", [["--lam", "0"], ["--segments", "1"], ["-n", "0"], ["--noise", "-1"]])
def test_bad_flags_exit_with_a_message(argv, capsys):
    with pytest.raises(SystemExit):
        demo.parse_config(argv)
    assert argv[0] in capsys.readouterr().err


def test_tiny_run_writes_the_figure_and_returns_the_table(tmp_path, capsys):
    assert demo.main(tiny(tmp_path, "--json", str(tmp_path / "r.json"))) == 0
    printed = capsys.readouterr().out
    assert "MSE ratio to LLA" in printed and "MesaNet best before the first shift" in printed
    assert (tmp_path / "mse.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    payload = json.loads((tmp_path / "r.json").read_text())
    assert [(r["d"], r["S"]) for r in payload["results"]] == [(4, 6), (4, 24)]

    results, verdicts = demo.run(demo.parse_config(tiny(tmp_path)), log=lambda *a, **k: None)
    for r in results:
        assert r.ratio["LLA"] == 1.0
        assert all(0 < r.ratio[m] < float("inf") for m in demo.MODELS)
        assert all(e.shape == (24,) and torch.isfinite(e).all() for e in r.mse.values())
    assert results[1].after is None                            # S = L: no shift to judge
    assert len(verdicts["LLA best after the first shift"]) == 1


def test_excluding_self_leaves_position_one_unscored(tmp_path):
    results, _ = demo.run(demo.parse_config(tiny(tmp_path, "--exclude-self", "--segments", "6")),
                          log=lambda *a, **k: None)
    mse = results[0].mse["LLA"]
    assert torch.isnan(mse[0]) and torch.isfinite(mse[1:]).all()
