"""Machine info, result files, the report and its plots."""
import json
import shutil
from pathlib import Path

import pytest

from regattn.bench import report, results

REPO = Path(__file__).resolve().parents[2]


def test_device_slug():
    assert results.device_slug("NVIDIA H100 80GB HBM3") == "h100"
    assert results.device_slug("NVIDIA H200") == "h200"
    assert results.device_slug("NVIDIA A100-SXM4-80GB") == "a100"
    assert results.device_slug("Some Accelerator") == "some-accelerator"


def test_machine_info_names_versions():
    info = results.machine_info("cpu")
    for key in ("device", "name", "sm_count", "torch", "triton", "cuda"):
        assert key in info
    assert info["device"] == "cpu" and info["torch"]


def gpu_result(suite="softmax"):
    machine = {"device": "h100", "name": "NVIDIA H100 80GB HBM3", "sm_count": 132, "torch": "2.11", "triton": "3.6",
               "cuda": "13.0", "cudnn": 91000}

    def row(op, ours, status, ms, ratio, err=None, **params):
        return {"shape": "B=4 T=2048", "params": dict(B=4, T=2048, **params), "mode": "fwd", "op": op, "ours": ours,
                "status": status, "ms": ms, "ratio": ratio, "tflops": None if ms is None else 10.0, "gbps": None,
                "peak_mb": None if ms is None else 12.0, "graph": False, "err": err}
    rows = [row("regattn:triton", True, "ok", 0.5, 0.8, {"o": 1e-3, "dk": 2.5e-3}),
            row("sdpa:cudnn", False, "ok", 0.625, 1.0, {"o": 2e-3}),
            row("sdpa:math", False, "OOM", None, None)]
    return results.make_result(suite, machine, {"dtype": "bf16", "cpu_smoke": False, "grid": "goal", "seconds": 12.5},
                               rows)


def test_write_and_read_result_round_trip(tmp_path):
    result = gpu_result()
    path = results.write_result(tmp_path / "a" / "softmax.json", result)
    assert results.read_result(path) == json.loads(json.dumps(result))
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(ValueError, match="suite"):
        results.read_result(bad)


def test_report_tables_ratios_errors_and_plots_from_result_files(tmp_path):
    results.write_result(results.default_path("softmax", gpu_result()["machine"], tmp_path), gpu_result())
    smoke = results.make_result("scan", {"device": "cpu", "name": "x86_64"}, {"cpu_smoke": True}, [])
    results.write_result(tmp_path / "benchmarks" / "results" / "cpu" / "scan.json", smoke)
    (tmp_path / "benchmarks" / "results" / "h100" / "demo_regression.json").write_text('{"suite": "other"}')
    doc = report.write_report(tmp_path)
    text = doc.read_text()
    assert doc == tmp_path / "docs" / "PERFORMANCE.md"
    assert "## softmax on h100" in text and "scan on" not in text and "demo_regression" not in text
    assert "| B=4 T=2048 | fwd | regattn:triton | 0.5 | 0.80x | 10 | – | 12 | dk 2.50e-03 |" in text
    assert "|  |  | sdpa:cudnn | 0.625 | 1.00x | 10 | – | 12 | o 2.00e-03 |" in text
    assert "|  |  | sdpa:math | OOM | – | – | – | – | – |" in text
    assert "2.11" in text and "132 SMs" in text and "the run took 12.5 s" in text
    png = tmp_path / "docs" / "perf" / "h100-softmax.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_plots_latency_and_memory_against_length_where_a_suite_asks(tmp_path):
    result = gpu_result("lla")
    for r, T in zip(result["rows"], (1024, 2048, 4096)):
        r["params"].update(part="fig7", T=T)
    results.write_result(results.default_path("lla", result["machine"], tmp_path), result)
    text = report.write_report(tmp_path).read_text()
    assert "![h100-lla-fig7](perf/h100-lla-fig7.png)" in text
    assert (tmp_path / "docs" / "perf" / "h100-lla-fig7.png").read_bytes()[:4] == b"\x89PNG"


def test_report_renders_part_files_and_the_scan_drift_after_the_devices_scan_tables(tmp_path):
    from regattn.ops.scan import verify

    folder = tmp_path / results.RESULTS_DIR / "h100"
    for name in ("scan-varlen", "scan", "softmax"):
        results.write_result(folder / f"{name}.json", gpu_result(name.split("-")[0]))
    (folder / "verify").mkdir()
    drift = folder / "verify" / "scan-ieee.json"
    assert verify.main(["scan", "--n", "32,64", "--heads", "1", "--dim", "16", "--rows", "8", "--device", "cpu",
                        "--backend", "torch", "--json", str(drift)]) == 0
    text = report.write_report(tmp_path).read_text()
    heads = [line for line in text.splitlines() if line.startswith("## ")]
    assert heads == ["## scan on h100", "## scan-varlen on h100", "## scan drift on h100", "## softmax on h100"]
    assert "![h100-scan-varlen](perf/h100-scan-varlen.png)" in text
    run = json.loads(drift.read_text())
    assert f"{report.versions(run['machine'])}; measured {run['date']}" in text
    assert verify.summary(run) in text and "Theorem 1 bound rel dY" in text


def test_report_names_the_later_run_that_measured_a_row_of_ours_again(tmp_path):
    folder = tmp_path / results.RESULTS_DIR / "h100"
    old, new = gpu_result("scan"), gpu_result("scan")
    new["date"] = "9999-01-01 00:00 UTC"
    for r in new["rows"]:
        r["params"]["precision"] = "ieee"  # named in the shape, as in the op's name
    other = gpu_result("scan")
    other["rows"][0]["params"]["causal"] = True  # another shape: not the same measurement
    other["date"] = new["date"]
    for name, result in (("scan", old), ("scan-again", new), ("scan-causal", other)):
        results.write_result(folder / f"{name}.json", result)
    text = report.write_report(tmp_path).read_text()
    assert text.count("| regattn:triton (measured again: `scan-again`) | 0.5 |") == 1
    assert text.count("| regattn:triton | 0.5 |") == 2  # the later run's row and the other shape's
    assert "sdpa:cudnn (measured again" not in text  # peers are measured with each run


def test_committed_performance_doc_is_the_generated_one(tmp_path):
    shutil.copytree(REPO / results.RESULTS_DIR, tmp_path / results.RESULTS_DIR)
    assert report.write_report(tmp_path).read_text() == (REPO / report.DOC).read_text()


def test_report_without_results_says_so(tmp_path):
    assert "No GPU result files" in report.write_report(tmp_path).read_text()


def test_machine_info_on_a_gpu_names_it_and_its_sm_count(monkeypatch):
    import types

    import torch

    props = types.SimpleNamespace(name="NVIDIA H100 80GB HBM3", multi_processor_count=132, total_memory=80 * 2**30,
                                  major=9, minor=0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    info = results.machine_info("cuda")
    assert (info["device"], info["name"], info["sm_count"], info["capability"]) == ("h100", props.name, 132, "9.0")
    assert results.default_path("softmax", info).as_posix() == "benchmarks/results/h100/softmax.json"
