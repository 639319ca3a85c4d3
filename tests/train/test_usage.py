"""The ``regattn`` command's usage errors: one line on stderr naming the argument, exit status 2, no traceback;
how its process ends."""
import os
import subprocess
import sys
import tomllib

import pytest
import torch

import regattn
from regattn.cli import main

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAIN = ["train", "mqar", "--mixer", "softmax", "--quiet"]
SWEEP = ["sweep", "mqar", "--mixers", "softmax", "--quiet"]
LM = ["lm", "--quiet"]

BAD = [
    (TRAIN + ["--steps", "0"], "--steps"),
    (TRAIN + ["--batch-size", "0"], "--batch-size"),
    (TRAIN + ["--set", "lenght=16"], "--set"),
    (TRAIN + ["--mixer-opt", "windw=4"], "--mixer-opt"),
    (TRAIN + ["--device", "cuda"], "--device"),
    (TRAIN + ["--lr", "-0.001"], "--lr"),
    (TRAIN + ["--mixer", "nope"], "--mixer"),
    (TRAIN + ["--set", "length"], "--set"),
    (SWEEP + ["--steps", "0"], "--steps"),
    (SWEEP + ["--lrs", "1e-3,-1e-3"], "--lrs"),
    (SWEEP + ["--vary", "lenght=16,32"], "--vary"),
    (SWEEP + ["--mixer-opt", "windw=4"], "--mixer-opt"),
    (TRAIN + ["--compile", "max"], "--compile"),
    (TRAIN + ["--log-every", "0"], "--log-every"),
    (SWEEP + ["--compile", "fast"], "--compile"),
    (SWEEP + ["--log-every", "-1"], "--log-every"),
    (SWEEP + ["--jobs", "0"], "--jobs"),
    (SWEEP + ["--checkpoint-every", "-1"], "--checkpoint-every"),
    (TRAIN + ["--cuda-graph", "--compile", "reduce-overhead"], "--cuda-graph"),
    (SWEEP + ["--cuda-graph", "--wda-gamma", "1"], "--wda-gamma"),
    (SWEEP + ["--jobs", "two"], "--jobs"),
    (SWEEP + ["--streams", "0"], "--streams"),
    (SWEEP + ["--jobs", "2", "--streams", "2"], "--streams"),
    (SWEEP + ["--stop-after", "0"], "--stop-after"),
    (SWEEP + ["--stop-after", "inf"], "--stop-after"),
    (LM + ["--steps", "0"], "--steps"),
    (LM + ["--batch-size", "0"], "--batch-size"),
    (LM + ["--lr", "-0.02"], "--lr"),
    (LM + ["--device", "cuda"], "--device"),
    (LM + ["--mixer-options", '{"softmax": {"windw": 4}}'], "--mixer-options"),
    (LM + ["--wda-gamma", "-1"], "--wda-gamma"),
    (LM + ["--compare", "softmax,nope"], "--compare"),
    (["analyze", "no/such/checkpoint.pt"], "checkpoint"),
    (["analyze", "."], "checkpoint"),
    (["analyze", "no/such/checkpoint.pt", "--examples", "0"], "--examples"),
    (["demo", "--length", "0"], "--length"),
    (["verify", "--dim", "x"], "--dim"),
    (["tune", "decay", "--H", "x"], "--H"),
    (["verify", "--device", "cuda"], "--device"),
    (["tune", "decay"], "CUDA device"),
    (["bench", "scan", "--device", "cuda"], "--device"),
]


@pytest.mark.parametrize("argv,flag", BAD, ids=[" ".join(a[1:]) for a, _ in BAD])
def test_bad_argument_is_one_line_and_status_2(argv, flag, capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"regattn {argv[0]}: error: ") and flag in err, err
    assert not any(tmp_path.iterdir())                 # nothing ran


def test_no_command_prints_help_and_status_2(capsys):
    assert main([]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: regattn") and all(name in err for name in ("train", "lm", "analyze"))


def test_version(capsys):
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        version = tomllib.load(f)["project"]["version"]
    assert regattn.__version__ == version
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"regattn {version}"


def test_python_m_regattn_runs_the_command():
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "regattn", "--version"], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == f"regattn {regattn.__version__}", proc.stderr


@pytest.mark.parametrize("world", [None, "2"])
def test_a_rank_exits_without_finalizing_python(world):
    """exit_process: under torchrun (WORLD_SIZE > 1) the process ends with its status and its output flushed
    but no finalization (where gloo's worker threads can abort it); a lone process finalizes as usual."""
    code = ("import atexit; from regattn.usage import exit_process; "
            "atexit.register(print, ' finalized'); print('done', end=''); exit_process(3)")
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for name in ("WORLD_SIZE", "PYTHONUNBUFFERED"):         # the output buffered, as printed by a rank
        env.pop(name, None)
    env.update({} if world is None else {"WORLD_SIZE": world})
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout == ("done finalized\n" if world is None else "done")


def test_a_failure_after_the_checks_keeps_its_traceback(monkeypatch, tmp_path):
    import regattn.train.cli

    def broken(config):
        raise ValueError("a bug inside the run")
    monkeypatch.setattr(regattn.train.cli, "train", broken)
    with pytest.raises(ValueError, match="a bug inside the run"):
        main(TRAIN + ["--steps", "2", "--out", str(tmp_path)])
