"""The scaling harness (``python -m regattn.train scaling``): each mixer's lm run on 1 and 2 processes
(gloo), the JSON, table and curves; rows of other mixers kept; a failed run recorded; usage errors."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from regattn.cli import main as regattn_main
from regattn.train import scaling

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def env() -> dict:
    """The children's environment; a rank that aborts prints every thread's Python stack (the fault handler)."""
    return dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1",
                PYTHONFAULTHANDLER="1")


def test_command_runs_a_mixer_on_one_and_two_processes(tmp_path):
    """End to end on gloo (one mixer: the rows of several are kept by the bookkeeping tested below), the
    2-process run stopped at step 2 of 4 and resumed on 2 processes, its checkpoint also on 1."""
    out = tmp_path / "results" / "scaling.json"
    cmd = [sys.executable, "-m", "regattn.train", "scaling", "--tiny", "--mixers", "parallax", "--nproc", "2",
           "--resume-check", "--device", "cpu", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env(), cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["suite"] == "scaling" and result["machine"]["device"] == "cpu"
    assert result["config"]["nproc"] == 2 and result["config"]["lm"]["activation_checkpointing"]
    assert [(r["mixer"], r["world_size"]) for r in result["rows"]] == [("parallax", 1), ("parallax", 2)]
    for r in result["rows"]:
        assert r["batch_size_per_rank"] == 2 and r["peak_memory_mib"] is None and r["steps"] == 4
        assert r["tokens_per_second"] > 0 and r["speedup"] > 0
        assert math.isclose(r["efficiency"], r["speedup"] / r["world_size"])
        assert [row["step"] for row in r["history"]["train"]] == [1, 2, 3, 4]
        assert all(math.isfinite(row["loss"]) for row in r["history"]["train"])
        assert r["final_loss"] == r["history"]["train"][-1]["loss"] and math.isfinite(r["final"]["ppl"])
    assert all(r["speedup"] == 1.0 for r in result["rows"] if r["world_size"] == 1)
    single, several = result["rows"]
    assert "resume" not in single and [e["step"] for e in several["history"]["eval"]] == [2, 4]
    check = several["resume"]
    assert check["step"] == 2 and check["saved_nll"] == several["history"]["eval"][0]["nll"]
    assert [(run["world_size"], run["to_step"]) for run in check["runs"]] == [(2, 3), (1, 3)]
    for run in check["runs"]:
        assert math.isclose(run["loaded_nll"], check["saved_nll"], rel_tol=1e-6) and math.isfinite(run["loss"])
    assert check["runs"][0]["loss"] == several["history"]["train"][2]["loss"]
    table = (tmp_path / "results" / "scaling.md").read_text()
    assert table.count("| parallax |") == 2 and "parallax: the checkpoint of 2 processes at step 2" in table
    assert (tmp_path / "results" / "scaling-curves.png").stat().st_size > 0


def fake_result(world: int, rate: float) -> dict:
    """What ``lm`` writes, for the rows' bookkeeping."""
    history = {"train": [{"step": s, "loss": 5.0 - s / 10, "lr": 0.02, "tokens_per_second": rate} for s in (1, 2)],
               "eval": [{"step": 2, "nll": 4.0, "ppl": math.exp(4.0), "bits_per_byte": 4.0 / math.log(2)}]}
    return {"world_size": world, "batch_size_per_rank": 2, "tokens_per_second": rate, "peak_memory_mib": None,
            "history": history, "final": history["eval"][-1], "parameters": 1000, "steps": 2, "device": "cpu"}


def test_rows_of_other_mixers_are_kept_and_a_failed_run_is_recorded(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.chdir(tmp_path)
    rates = {("softmax", 1): 100.0, ("softmax", 2): 170.0, ("parallax", 1): 80.0}

    def launch(plan, mixer, nproc, folder):
        if (mixer, nproc) not in rates:
            return {"error": f"lm on {nproc} processes exited with status 1"}
        return fake_result(nproc, rates[mixer, nproc])
    monkeypatch.setattr(scaling, "launch", launch)

    assert regattn_main(["scaling", "--tiny", "--mixers", "softmax"]) == 0
    path = tmp_path / "benchmarks" / "results" / "cpux2" / "scaling.json"
    rows = json.loads(path.read_text())["rows"]
    assert [(r["mixer"], r["world_size"], r["speedup"]) for r in rows] == [("softmax", 1, 1.0), ("softmax", 2, 1.7)]
    assert rows[1]["efficiency"] == pytest.approx(0.85)

    assert regattn_main(["scaling", "--tiny", "--mixers", "parallax"]) == 1
    rows = json.loads(path.read_text())["rows"]
    assert [(r["mixer"], r["world_size"]) for r in rows] == [("softmax", 1), ("softmax", 2), ("parallax", 1),
                                                             ("parallax", 2)]
    assert rows[1]["speedup"] == pytest.approx(1.7)
    assert "error" in rows[3] and rows[3]["speedup"] is None and rows[3]["efficiency"] is None
    assert "| parallax | 2 | failed: lm on 2 processes exited with status 1 |" in path.with_suffix(".md").read_text()

    capsys.readouterr()
    assert regattn_main(["scaling", "--tiny", "--mixers", "parallax", "--steps", "5"]) == 2    # another configuration
    err = capsys.readouterr().err
    assert err.startswith("regattn scaling: error: --out") and err.count("\n") == 1, err


def test_runs_are_launched_by_torchrun_with_nvlink_multicast_off(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    plan = scaling.parse_args(["--tiny", "--mixers", "softmax", "--nproc", "3", "--lr", "0.01",
                               "--out", str(tmp_path / "s.json")])
    calls = []

    def run(cmd, env):
        calls.append((cmd, env))
        return subprocess.CompletedProcess(cmd, 3)
    monkeypatch.setattr(scaling.subprocess, "run", run)
    assert scaling.launch(plan, "softmax", 3, str(tmp_path)) == {"error": "lm on 3 processes exited with status 3"}
    cmd, child_env = calls[0]
    assert cmd[1:7] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3", "-m"]
    assert cmd[7:9] == ["regattn.train", "lm"] and cmd[-5:] == ["--mixer", "softmax", "--quiet", "--out", str(tmp_path)]
    assert cmd[9:-5] == scaling.TINY + ["--lr", "0.01"] and plan.config.lr == 0.01
    assert child_env["NCCL_NVLS_ENABLE"] == "0" and child_env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
    assert child_env["NVSHMEM_DISABLE_NVLS"] == "1"


def test_default_configuration(tmp_path):
    plan = scaling.parse_args(["--out", str(tmp_path / "scaling.json")])
    c = plan.config
    assert (c.dim, c.layers, c.seq_len, c.steps, c.optimizer) == (1024, 16, 4096, scaling.STEPS, "muon")
    assert (c.heads, c.window, c.batch_size) == (8, 512, 8)
    assert c.activation_checkpointing and c.amp and plan.mixers == ["parallax", "gatedfwa", "softmax"]
    assert plan.nproc == 2


BAD = [
    (["--nproc", "1"], "--nproc"),
    (["--nproc", "two"], "--nproc"),
    (["--mixers", "softmax,nope"], "--mixers"),
    (["--mixers", "softmax,softmax"], "--mixers"),
    (["--mixer", "softmax"], "--mixer"),
    (["--compare", "softmax,swa"], "--compare"),
    (["--checkpoint", "ck"], "--checkpoint"),
    (["--resume-check", "--steps", "1"], "--steps"),
    (["--steps", "0"], "--steps"),
    (["--device", "cuda"], "--device"),
    (["--tiny", "--eval-tokens", "16"], "--eval-tokens"),
    (["--no-such-flag"], "--no-such-flag"),
]


@pytest.mark.parametrize("argv,flag", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_argument_is_one_line_and_status_2(argv, flag, capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.chdir(tmp_path)
    assert regattn_main(["scaling", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("regattn scaling: error: ") and flag in err, err
    assert not any(tmp_path.iterdir())                 # nothing ran


def test_python_m_regattn_train_scaling_bad_argument(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "regattn.train", "scaling", "--nproc", "1"], capture_output=True,
                          text=True, env=env(), cwd=tmp_path, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("python -m regattn.train scaling: error: --nproc") and proc.stderr.count("\n") == 1
