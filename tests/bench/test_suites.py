"""Every suite at its tiny CPU grid through the command: JSON, table, plot; peers agree with our op."""
import json

import pytest

from regattn.bench import suites
from regattn.cli import main

# Peers computing the same function as our op (not a floor such as plain attention for Parallax).
SAME = ("sdpa:flash", "sdpa:math", "flex", "reference")


@pytest.mark.parametrize("name", suites.NAMES)
def test_suite_runs_tiny_on_cpu(name, tmp_path, capsys):
    out, plot = tmp_path / f"{name}.json", tmp_path / f"{name}.png"
    assert main(["bench", name, "--device", "cpu", "--rep-ms", "1", "--out", str(out), "--plot", str(plot)]) == 0
    table = capsys.readouterr().out
    assert "ratio" in table and "ms" in table
    result = json.loads(out.read_text())
    assert result["suite"] == name and result["machine"]["torch"] and result["config"]["cpu_smoke"]
    rows = result["rows"]
    assert {r["shape"] for r in rows} == {" ".join(f"{k}={v}" for k, v in s.items() if v is not None)
                                           for s in suites.get(name).GRIDS["tiny"]}
    for r in rows:
        assert r["status"] == "ok" or r["status"] in ("OOM", "unsupported", "not installed") \
            or r["status"].startswith("error")
        if r["ours"]:
            assert r["status"] == "ok" and r["ms"] > 0 and r["tflops"] > 0, r
        if r["op"] in SAME and r.get("diff") is not None:
            assert r["diff"] < (5e-3 if r["mode"] == "fp16" else 1e-4), r
    assert any(r["op"] == "reference" and r["status"] == "ok" for r in rows)
    assert plot.read_bytes()[:4] == b"\x89PNG"
