"""Every suite at its tiny CPU grid through the command, our kernels in the interpreter: JSON, table, plot,
and every row of our ops and of the peers computing our function checked against float64."""
import json
import math
import os

import pytest
import torch

from regattn.bench import suites
from regattn.cli import main

# fp32 arithmetic against float64; CG iterations amplify rounding (lla); fp16 inputs and tf32 products in
# the scan suite; the CG table measures truncation against the exact solve (any finite value).
BOUND = {"lla": 5e-3}
MODE_BOUND = {"fp16": 5e-3, "fp16 fwd+bwd": 5e-3, "cg": math.inf}


def bound(suite: str, row: dict) -> float:
    return 2e-3 if row["op"].endswith("[tf32]") else MODE_BOUND.get(row["mode"], BOUND.get(suite, 1e-4))


@pytest.mark.parametrize("name", suites.NAMES)
def test_suite_runs_tiny_on_cpu(name, tmp_path, capsys, interpret):
    out, plot = tmp_path / f"{name}.json", tmp_path / f"{name}.png"
    backend = "triton" if os.environ.get("TRITON_INTERPRET") == "1" else "auto"
    assert main(["bench", name, "--device", "cpu", "--rep-ms", "1", "--backend", backend, "--peers",
                 "sdpa,flex,fla,reference,copy", "--out", str(out), "--plot", str(plot)]) == 0
    table = capsys.readouterr().out
    assert "ratio" in table and "ms" in table
    result = json.loads(out.read_text())
    assert result["suite"] == name and result["machine"]["torch"] and result["config"]["cpu_smoke"]
    rows = result["rows"]
    assert {r["shape"] for r in rows} == {" ".join(f"{k}={v}" for k, v in s.items() if v is not None)
                                           for s in suites.get(name).GRIDS["tiny"]}
    for r in rows:
        assert set(r) >= {"params", "mode", "op", "ours", "status", "ms", "ratio", "err", "peak_mb", "graph",
                          "wall_s"}
        assert r["status"] == "ok" or r["status"] in ("OOM", "unsupported", "not installed") \
            or r["status"].startswith("error"), r
        if r["ours"]:
            assert r["status"] == "ok" and r["ms"] > 0 and (r["tflops"] or r["gbps"]) > 0, r
        if r["err"] is not None:
            assert "status" not in r["err"], r
            assert all(math.isfinite(e) and e <= bound(name, r) for e in r["err"].values()), r
    checked = [r for r in rows if r["ours"] and r["err"] is not None]
    assert checked and (backend == "auto" or any(r["op"].startswith("regattn:triton") for r in checked))
    backward = [r for r in checked if r["mode"].endswith("fwd+bwd")]
    assert all(len(r["err"]) > 1 for r in backward)  # the output and every gradient
    assert any(r["op"] == "reference" and r["status"] == "ok" for r in rows)
    assert plot.read_bytes()[:4] == b"\x89PNG"


def test_parallax_tile_variants_tiny(interpret):
    """time_tile_variants: ms and errors per variant, the table restored afterwards (in the interpreter
    the kernels take their small tiles, so this checks the plumbing, not the tiles)."""
    from regattn.bench.suites.parallax import time_tile_variants
    from regattn.ops.parallax.tiles import TILES
    before = {key: {kind: dict(cfg) for kind, cfg in row.items()} for key, row in TILES.items()}
    variants = [{}, {"dk": {"BLOCK_N": 32, "num_warps": 8}}]
    rows = time_tile_variants(variants, shape=dict(B=1, H=2, T=40, D=16), dtype=torch.float32, device="cpu",
                              rep_ms=1, rounds=2)
    assert TILES == before
    assert [row["tiles"]["dk"] for row in rows] == [before[32]["dk"], dict(before[32]["dk"], BLOCK_N=32, num_warps=8)]
    for row in rows:
        assert row["status"] == "ok" and row["fwd_ms"] > 0 and row["fwd+bwd_ms"] > 0
        assert all(len(times) == 2 and row[f"{mode}_ms"] == min(times) for mode, times in row["rounds"].items())
        assert set(row["err"]) == {"o", "dq", "dr", "dk", "dv"} and max(row["err"].values()) < 1e-4
    with pytest.raises(ValueError, match="^variants: "):
        time_tile_variants([{"bwd": {}}], device="cpu")


def test_parallax_tile_variants_are_table_entries():
    """Every listed variant overrides fwd, dq or dk with launch settings a kernel takes."""
    from regattn.bench.suites.parallax import TILE_VARIANTS
    from regattn.ops.parallax.tiles import TILES
    for head_dim, variants in TILE_VARIANTS.items():
        assert head_dim in TILES and variants[0] == {}
        for variant in variants[1:]:
            assert variant and set(variant) <= {"fwd", "dq", "dk"}
            for cfg in variant.values():
                assert set(cfg) == {"BLOCK_M", "BLOCK_N", "num_warps", "num_stages"}
                assert all(cfg[b] >= 16 and cfg[b] & (cfg[b] - 1) == 0 for b in ("BLOCK_M", "BLOCK_N"))


def test_chunked_gate_tiles_tiny(interpret):
    """time_chunked_tiles: ms, fraction of copy bandwidth and errors per (shape, tile), the head block cut to
    the heads (in the interpreter this checks the plumbing and the numbers, not the speed)."""
    from regattn.bench.suites.gatedfwa import time_chunked_tiles
    rows = time_chunked_tiles([(64, 4), (16, 16)], shapes=[(2, 45, 3)], device="cpu", rep_ms=1)
    assert [(r["BLOCK_T"], r["BLOCK_H"]) for r in rows] == [(16, 4), (4, 4)]
    for r in rows:
        assert r["fwd_ms"] > 0 and r["bwd_ms"] > 0 and r["fwd_of_copy"] > 0 and r["bwd_of_copy"] > 0
        assert set(r["err"]) == {"u", "dh", "dbeta"} and max(r["err"].values()) < 1e-5, r


def test_lla_latency_shape_with_cg_times_that_count_and_the_direct_solve(tmp_path, capsys, interpret):
    out = tmp_path / "lla.json"
    assert main(["bench", "lla", "--device", "cpu", "--rep-ms", "1", "--backend", "triton", "--peers", "none",
                 "--shapes", "B=1,H=2,T=24,D=8,cg=4", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["op"] for r in rows] == ["regattn:triton[cg=4]", "regattn:triton[BD g=D]"]
    assert all(r["status"] == "ok" and max(r["err"].values()) <= BOUND["lla"] for r in rows), rows


def test_scan_shape_with_a_causal_value_that_is_not_a_bool_is_refused_before_any_input(tmp_path):
    out = tmp_path / "scan.json"
    assert main(["bench", "scan", "--device", "cpu", "--rep-ms", "1", "--peers", "none",
                 "--shapes", "B=1,H=2,T=8,D=16,causal=yes", "--out", str(out)]) == 0
    [row] = json.loads(out.read_text())["rows"]
    assert row["op"] == "inputs" and "causal: expected true or false, got 'yes'" in row["status"], row
