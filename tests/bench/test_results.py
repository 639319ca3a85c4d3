"""Machine info, result files, the report and its plots."""
import json

import pytest

from regattn.bench import report, results


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
    rows = [
        {"shape": "B=4 T=2048", "mode": "fwd", "op": "regattn:triton", "ours": True, "status": "ok", "ms": 0.5,
         "ratio": 0.8},
        {"shape": "B=4 T=2048", "mode": "fwd", "op": "sdpa:flash", "ours": False, "status": "ok", "ms": 0.625,
         "ratio": 1.0},
        {"shape": "B=4 T=2048", "mode": "fwd", "op": "sdpa:math", "ours": False, "status": "OOM", "ms": None,
         "ratio": None},
    ]
    return results.make_result(suite, machine, {"dtype": "bf16", "cpu_smoke": False}, rows)


def test_write_and_read_result_round_trip(tmp_path):
    result = gpu_result()
    path = results.write_result(tmp_path / "a" / "softmax.json", result)
    assert results.read_result(path) == json.loads(json.dumps(result))
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(ValueError, match="suite"):
        results.read_result(bad)


def test_report_tables_ratios_and_plots_from_result_files(tmp_path):
    results.write_result(results.default_path("softmax", gpu_result()["machine"], tmp_path), gpu_result())
    smoke = results.make_result("scan", {"device": "cpu", "name": "x86_64"}, {"cpu_smoke": True}, [])
    results.write_result(tmp_path / "benchmarks" / "results" / "cpu" / "scan.json", smoke)
    (tmp_path / "benchmarks" / "results" / "h100" / "softmax_check.json").write_text('{"suite": "other"}')
    doc = report.write_report(tmp_path)
    text = doc.read_text()
    assert doc == tmp_path / "docs" / "PERFORMANCE.md"
    assert "## softmax on h100" in text and "scan" not in text
    assert "| B=4 T=2048 | fwd | 0.5 ms (0.80x) | 0.625 ms (1.00x) | OOM |" in text
    assert "2.11" in text and "132 SMs" in text
    png = tmp_path / "docs" / "perf" / "h100-softmax.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


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
