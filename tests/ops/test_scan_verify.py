"""The drift verifier: metrics on known inputs, probabilities read through the kernel, the command."""
import json
import math

import torch

from regattn.cli import main as cli_main
from regattn.ops.scan.verify import depth_bound, drift_metrics, growth_check, js_divergence, scan_probabilities
from tests.helpers import randn


def test_metrics_of_a_known_drift():
    p_ref = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.45, 0.45]], dtype=torch.float64)
    p_hat = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.44, 0.46]], dtype=torch.float64)
    y_ref = torch.tensor([[1.0, 2.0]], dtype=torch.float64)
    y_hat = torch.tensor([[1.0, 2.5]], dtype=torch.float64)
    m = drift_metrics(p_hat, p_ref, y_hat, y_ref)
    assert abs(m["max_dP"] - 0.01) < 1e-12
    assert abs(m["rel_dP"] - (2e-4) ** 0.5 / p_ref.norm().item()) < 1e-12
    assert m["argmax"] == 0.5  # row 2 ties in the reference; the scan picks the other key
    assert m["max_dY"] == 0.5 and abs(m["rel_dY"] - 0.5 / 5 ** 0.5) < 1e-12
    assert m["js"] > 0


def test_js_divergence_bounds():
    p = torch.softmax(randn(4, 9), -1)
    assert js_divergence(p, p).abs().max() < 1e-15
    a = torch.tensor([1.0, 0.0], dtype=torch.float64)
    b = torch.tensor([0.0, 1.0], dtype=torch.float64)
    assert abs(js_divergence(a, b).item() - math.log(2.0)) < 1e-12


def test_probabilities_through_the_scan():
    q, k = randn(1, 5, 2, 8), randn(1, 70, 2, 8)
    p = scan_probabilities(q, k, backend="torch", chunk=32)
    ref = torch.softmax(torch.einsum("bthd,bshd->bths", q, k) * 8 ** -0.5, -1)
    assert (p - ref).abs().max() < 1e-14


def test_growth_check():
    rows = [{"n": 1024, "rel_dY": 1e-7}, {"n": 65536, "rel_dY": 1.5e-7}]
    ok = growth_check(rows, 2.0 ** -24)
    assert ok["bound_ok"] and ok["growth_ok"]
    linear = [{"n": 1024, "rel_dY": 1e-8}, {"n": 65536, "rel_dY": 6.4e-7}]
    assert not growth_check(linear, 2.0 ** -24)["growth_ok"]
    assert depth_bound(128) == 8 and depth_bound(1024) == 14


def test_command(tmp_path, capsys):
    out = tmp_path / "drift.json"
    rc = cli_main(["verify", "scan", "--n", "32,128", "--rows", "8", "--heads", "1", "--dim", "16",
                   "--device", "cpu", "--backend", "torch", "--json", str(out)])
    text = capsys.readouterr().out
    assert "rel dY" in text and "PASS" in text
    data = json.loads(out.read_text())
    assert rc == 0 and [r["n"] for r in data["results"]] == [32, 128]
    assert data["machine"]["device"] == "cpu" and data["date"].endswith("UTC")
    assert all(0 < r["rel_dY"] < 1e-5 for r in data["results"])
