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
    kernels = getattr(suites.get(name), "TRITON", True)           # a torch-only op takes no Triton backend
    backend = "triton" if os.environ.get("TRITON_INTERPRET") == "1" and kernels else "auto"
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


@pytest.mark.parametrize("mode", ["fp16", "fp16 fwd+bwd"])
def test_scan_variants_tiny(interpret, mode):
    """time_variants (the forward alone, and time_backward_variants): each form of ours with its error, then
    SDPA flash and cuDNN (on the CPU refused), the kernels' switches back afterwards, packed sequences too (in the
    interpreter this checks the plumbing)."""
    from regattn.bench.suites.scan import BACKWARD_VARIANTS, time_variants
    from regattn.ops.scan import kernels
    variants = BACKWARD_VARIANTS if mode != "fp16" else (("pointers", dict(TENSOR_DESCRIPTORS=False)),)
    before = kernels.FUSED_DQ, kernels.TENSOR_DESCRIPTORS
    shapes = [dict(B=1, H=2, T=40, D=16), dict(B=1, H=2, T=40, D=16, causal=True),
              dict(B=1, H=2, T=40, D=16, causal=True, seqs=2)]  # packed: two sequences of 20
    rows = time_variants(mode, variants, shapes, device="cpu", rep_ms=1, rounds=2)
    assert (kernels.FUSED_DQ, kernels.TENSOR_DESCRIPTORS) == before
    ops = [f"regattn:triton ({label})" for label, _ in variants] + ["sdpa:flash", "sdpa:cudnn"]
    assert [(row["shape"], row["op"]) for row in rows] == [(shape, op) for shape in shapes for op in ops]
    json.dumps(rows)
    ours = [row for row in rows if row["op"].startswith("regattn")]
    assert len(ours) == len(shapes) * len(variants)
    for row in ours:
        assert row["status"] == "ok" and len(row["rounds"][mode]) == 2 and row[f"{mode}_ms"] > 0
        names = {"o", "dq", "dk", "dv"} if mode != "fp16" else {"o"}
        assert set(row["err"]) == names and max(row["err"].values()) < 2e-3, row


def test_scan_fp32_variants_tiny(interpret):
    """time_variants of an fp32 precision's forward, beside SDPA efficient (on the CPU refused), its switch back
    afterwards."""
    from regattn.bench.suites.scan import time_variants
    from regattn.ops.scan import kernels
    variants = (("tuned", {}), ("first tile", dict(AUTOTUNE=False)))
    shapes = [dict(B=1, H=2, T=40, D=16, causal=True)]
    rows = time_variants("fp32", variants, shapes, dtype=torch.float32, precision="ieee", device="cpu", rep_ms=1,
                         rounds=2)
    assert kernels.AUTOTUNE
    assert [row["op"] for row in rows] == ["regattn:triton (tuned)", "regattn:triton (first tile)", "sdpa:efficient"]
    assert rows[2]["status"] != "ok"
    for row in rows[:2]:
        assert row["status"] == "ok" and len(row["rounds"]["fp32"]) == 2 and row["err"]["o"] < 1e-5, row


def test_parallax_decode_variants_tiny(interpret):
    """time_decode_variants: ms, the ratio to SDPA of the same rounds and the error per (shape, variant) (in the
    interpreter this checks the plumbing and the numbers, not the launches' speed)."""
    from regattn.bench.suites.parallax import time_decode_variants
    variants = [{}, {"num_splits": 2}, {"config": {"BLOCK_N": 32}}]
    shape = dict(B=2, HQ=4, H=2, ctx=40, D=16)
    rows = time_decode_variants(variants, shapes=[shape], dtype=torch.float32, device="cpu", rep_ms=1, rounds=2)
    assert [row["variant"] for row in rows] == variants
    json.dumps(rows)
    for row in rows:
        assert row["status"] == "ok" and {k: row[k] for k in shape} == shape, row
        assert len(row["rounds"]["decode"]) == 2 and row["decode_ms"] == min(row["rounds"]["decode"]) > 0
        assert row["ratio"] == row["decode_ms"] / row["sdpa_ms"] > 0
        assert set(row["err"]) == {"o"} and row["err"]["o"] < 1e-5, row
    with pytest.raises(ValueError, match="^variants: "):
        time_decode_variants([{"splits": 2}], device="cpu")


def test_parallax_decode_variants_switch_the_module(interpret):
    """A variant's ``switches`` hold while it runs, and only then; ``eager`` times the same calls."""
    from regattn.bench.suites.parallax import time_decode_variants
    from regattn.ops.parallax import decode
    kernel, seen = decode._parallax_decode_kernel, []

    class Counted:
        def __getitem__(self, grid):
            seen.append(grid)
            return kernel[grid]

    shape = dict(B=1, HQ=2, H=1, ctx=20, D=16)
    rows = time_decode_variants([{"switches": {"_parallax_decode_kernel": Counted()}}, {}], shapes=[shape],
                                dtype=torch.float32, device="cpu", rep_ms=1, rounds=1, eager=True)
    assert seen and decode._parallax_decode_kernel is kernel
    calls = len(seen)
    for row in rows:
        assert row["status"] == "ok" and row["err"]["o"] < 1e-5, row
    time_decode_variants([{}], shapes=[shape], dtype=torch.float32, device="cpu", rep_ms=1, rounds=1)
    assert len(seen) == calls


def test_parallax_decode_variants_take_the_kernels_settings():
    """Every listed decode variant names launch settings the decode kernel takes, the launch in use first."""
    from regattn.bench.suites.parallax import DECODE_VARIANTS
    assert DECODE_VARIANTS[0] == {}
    for variant in DECODE_VARIANTS[1:]:
        assert variant and set(variant) <= {"config", "num_splits"}
        assert set(variant.get("config", {})) <= {"BLOCK_N", "num_warps", "num_stages", "TMA"}
        assert variant.get("num_splits", 1) in (1, 2, 4, 8, 16, 32)


def test_parallax_tile_variants_are_table_entries():
    """Every listed variant overrides fwd, dq or dk with launch settings a kernel takes (a ``TMA`` variant: the
    loads the table's entry does not take)."""
    from regattn.bench.suites.parallax import TILE_VARIANTS
    from regattn.ops.parallax.tiles import TILES
    for head_dim, variants in TILE_VARIANTS.items():
        assert head_dim in TILES and variants[0] == {}
        for variant in variants[1:]:
            assert variant and set(variant) <= {"fwd", "dq", "dk"}
            for kind, cfg in variant.items():
                other_loads = {"TMA": not TILES[head_dim][kind].get("TMA", False)}
                assert cfg == other_loads or set(cfg) == {"BLOCK_M", "BLOCK_N", "num_warps", "num_stages"}
                assert all(cfg[b] >= 16 and cfg[b] & (cfg[b] - 1) == 0 for b in ("BLOCK_M", "BLOCK_N") if b in cfg)


def test_gatedfwa_tile_variants_tiny(interpret):
    """time_tile_variants: Flex's row first, then per variant ms, ratios to Flex and to the ungated window and
    errors; the tile overrides before come back afterwards (in the interpreter this checks the plumbing)."""
    from regattn.bench.suites.gatedfwa import TILE_KINDS, time_tile_variants
    from regattn.ops._common.attention_tiles import BLOCK_OVERRIDES, attention_blocks
    before = dict(BLOCK_OVERRIDES)
    variants = [{}, {"bwd_kv": {"BLOCK_N": 32, "num_warps": 2}}]
    flex, *rows = time_tile_variants(variants, shape=dict(B=1, H=2, T=40, D=16, w=16), dtype=torch.float32,
                                     device="cpu", rep_ms=1, rounds=2)
    assert BLOCK_OVERRIDES == before
    table = {kind: attention_blocks(16, torch.float32, kind, gated=True) for kind in TILE_KINDS}
    assert [row["tiles"] for row in rows] == [table, dict(table, bwd_kv=dict(table["bwd_kv"], BLOCK_N=32, num_warps=2))]
    assert flex["op"] == "flex" and flex["tiles"] is None and flex["fwd_ms"] > 0  # CPU: no Flex backward
    for row in rows:
        assert row["op"] == "regattn:triton" and row["status"] == "ok"
        assert set(row["rounds"]) == {"fwd", "fwd+bwd", "window fwd", "window fwd+bwd"}
        assert all(len(times) == 2 and row[f"{label}_ms"] == min(times) for label, times in row["rounds"].items())
        assert row["of_flex"]["fwd"] > 0 and min(row["gate_cost"].values()) > 0
        assert set(row["err"]) == {"o", "dq", "dk", "dv", "du"} and max(row["err"].values()) < 1e-4
    with pytest.raises(ValueError, match="^variants: "):
        time_tile_variants([{"dq": {}}], device="cpu")


def test_gatedfwa_tile_variants_are_table_entries():
    """The table first, then at most 12 variants, each overriding kinds of attention_blocks with settings a
    kernel takes."""
    from regattn.bench.suites.gatedfwa import TILE_KINDS, TILE_VARIANTS
    assert TILE_VARIANTS[0] == {} and len(TILE_VARIANTS) <= 12
    for variant in TILE_VARIANTS[1:]:
        assert variant and set(variant) <= set(TILE_KINDS)
        for cfg in variant.values():
            assert set(cfg) == {"BLOCK_M", "BLOCK_N", "num_warps", "num_stages"}
            assert all(cfg[b] >= 16 and cfg[b] & (cfg[b] - 1) == 0 for b in ("BLOCK_M", "BLOCK_N"))


def test_chunked_gate_tiles_tiny(interpret):
    """time_chunked_tiles: ms eager and in a graph, fraction of copy bandwidth and errors per (shape, tile), the
    default tiles first, the head block cut to the heads and tiles alike there timed once (in the interpreter
    this checks the plumbing and the numbers, not the speed)."""
    from regattn.bench.suites.gatedfwa import CHUNK_TIMINGS, time_chunked_tiles
    rows = time_chunked_tiles([(64, 4, 8), (16, 16, 4), (16, 8, 4), (64, 16, 4)], shapes=[(2, 45, 3)], device="cpu",
                              rep_ms=1, rounds=2)
    assert [(r["BLOCK_T"], r["BLOCK_H"], r["num_warps"], r["default"]) for r in rows] == [
        (16, 4, 4, ["fwd", "bwd"]), (16, 4, 8, []), (4, 4, 4, [])]
    json.dumps(rows)
    for r in rows:
        assert r["status"] == "ok" and set(r["copy_ms"]) == set(CHUNK_TIMINGS), r
        for name in CHUNK_TIMINGS:
            assert len(r["rounds"][name]) == 2 and r[f"{name}_ms"] == min(r["rounds"][name]) > 0
            assert r[f"{name}_of_copy"] == r["copy_ms"][name] / r[f"{name}_ms"] > 0
        assert set(r["err"]) == {"u", "dh", "dbeta"} and max(r["err"].values()) < 1e-5, r


def test_chunked_gate_tiles_are_distinct_and_few():
    """The sweep's tiles: distinct, num_warps of 4, 8 or 16, power-of-two blocks, at most 30 a shape."""
    from regattn.bench.suites.gatedfwa import CHUNK_TILES, chunk_blocks
    assert len(set(CHUNK_TILES)) == len(CHUNK_TILES) <= 30
    for H in (16, 64, 128):
        for block_t, block_h, num_warps in chunk_blocks(H):
            assert num_warps in (4, 8, 16) and block_h <= H and block_t & (block_t - 1) == 0, (H, block_t)


def test_lla_latency_shape_with_cg_times_that_count_and_the_direct_solve(tmp_path, capsys, interpret):
    out = tmp_path / "lla.json"
    assert main(["bench", "lla", "--device", "cpu", "--rep-ms", "1", "--backend", "triton", "--peers", "none",
                 "--shapes", "B=1,H=2,T=24,D=8,cg=4", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["mode"], r["op"]) for r in rows] == [(mode, op) for mode in ("fwd", "fwd+bwd")
                                                    for op in ("regattn:triton[cg=4]", "regattn:triton[BD g=D]")]
    assert all(r["status"] == "ok" and max(r["err"].values()) <= BOUND["lla"] for r in rows), rows
    assert all(set(r["err"]) == {"o", "dq", "dk", "dv"} for r in rows if r["mode"] == "fwd+bwd"), rows


@pytest.mark.parametrize("shape, message", [
    ("B=1,H=2,T=8,D=16,causal=yes", "causal: expected true or false, got 'yes'"),
    ("B=1,H=2,T=10,D=16,causal=True,seqs=3", "seqs: expected B == 1 and T divisible by seqs"),
    ("B=1,H=2,T=8,D=16,precision=fp64", "precision: expected one of ieee, tf32x3, fp16x3, tf32, got 'fp64'"),
], ids=["causal-not-a-bool", "seqs-not-dividing-T", "unknown-precision"])
def test_scan_shape_with_a_bad_key_is_refused_before_any_input(tmp_path, shape, message):
    out = tmp_path / "scan.json"
    assert main(["bench", "scan", "--device", "cpu", "--rep-ms", "1", "--peers", "none",
                 "--shapes", shape, "--out", str(out)]) == 0
    [row] = json.loads(out.read_text())["rows"]
    assert row["op"] == "inputs" and message in row["status"], row


def test_scan_shape_with_a_precision_times_that_precision_alone(tmp_path, interpret):
    out = tmp_path / "scan.json"
    assert main(["bench", "scan", "--device", "cpu", "--rep-ms", "1", "--backend", "triton", "--peers", "none",
                 "--shapes", "B=1,H=2,T=24,D=16,causal=true,precision=fp16x3", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["mode"], r["op"]) for r in rows] == [("fp32", "regattn:triton[fp16x3]")], rows
    assert rows[0]["status"] == "ok" and rows[0]["err"]["o"] < 1e-5, rows
