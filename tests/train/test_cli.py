import concurrent.futures
import dataclasses
import json
import pathlib
import re

import matplotlib.axes
import pytest
import torch

from regattn.cli import COMMANDS
from regattn.train import cli, plots, sweep
from regattn.usage import UsageError

BASE = ["--set", "vocab_size=32", "--set", "num_train=16", "--set", "num_test=4", "--dim", "16", "--steps", "2",
        "--batch-size", "4", "--quiet"]
TINY = ["--set", "length=16", "--set", "pairs=2"] + BASE


def test_registered():
    assert COMMANDS["train"][0] == "regattn.train.cli" and COMMANDS["sweep"][0] == "regattn.train.sweep"


def test_parse_values_and_lists():
    assert cli.parse_pairs(["a=1", "b=0.5", "c=true", "d=none", "e=x"], "--set") == \
        dict(a=1, b=0.5, c=True, d=None, e="x")
    assert cli.parse_list("1e-3,5e-4") == [1e-3, 5e-4]


def test_train_writes_json_and_plot(tmp_path, capsys):
    out = tmp_path / "t"
    assert cli.main(["mqar", "--mixer", "parallax", "--seeds", "0,1", "--analyze-every", "2", "--out", str(out)]
                    + TINY) == 0
    payload = json.loads((out / "mqar-parallax.json").read_text())
    assert len(payload["runs"]) == 2 and payload["summary"]["metric"] == "accuracy"
    assert payload["summary"]["best_mean"] == sum(r["best"]["accuracy"] for r in payload["runs"]) / 2
    assert (out / "mqar-parallax-curves.png").stat().st_size > 0
    assert (out / "mqar-parallax-diagnostics-seed1.png").stat().st_size > 0


def test_sweep_picks_best_lr_and_averages_seeds(tmp_path):
    out = tmp_path / "s"
    args = ["mqar", "--mixers", "softmax", "--lrs", "1e-3,1e-2", "--seeds", "0,1", "--vary", "length=16",
            "--out", str(out)] + TINY
    assert sweep.main(args) == 0
    payload = json.loads((out / "sweep-mqar.json").read_text())
    assert len(payload["runs"]) == 2 * 2
    for mixer in ("softmax",):
        for x in ("16",):
            cell = payload["summary"][mixer][x]
            runs = [r for r in payload["runs"] if r["mixer"] == mixer and str(r["x"]) == x]
            means = {lr: sum(r["best"]["accuracy"] for r in runs if r["lr"] == lr) / 2 for lr in (1e-3, 1e-2)}
            assert cell["mean"] == max(means.values()) and means[cell["best_lr"]] == cell["mean"]
    assert (out / "sweep-mqar.png").exists() and (out / "sweep-mqar-curves-0.png").exists()


def test_sweep_points_for_suites():
    assert [x for _, _, x in sweep.sweep_points("mad", None)][0] == "recall"
    assert len(sweep.sweep_points("mad_benchmark", None)) == 66
    assert sweep.sweep_points("icr", [("segment", [4, 8])])[1] == ("icr", {"segment": 8}, 8)
    grid = sweep.sweep_points("mqar", [("length", [16, 32]), ("pairs_per_length", [8, 4])])
    assert [x for _, _, x in grid] == ["length=16,pairs_per_length=8", "length=16,pairs_per_length=4",
                                      "length=32,pairs_per_length=8", "length=32,pairs_per_length=4"]
    summary = {"m": {"recall:a": {"mean": 0.5}, "recall:b": {"mean": 1.0}, "copy:a": {"mean": 0.25}}}
    assert sweep.suite_average(summary)["m"] == dict(tasks={"recall": 0.75, "copy": 0.25}, average=0.5)
    partial = sweep.suite_average({**summary, "n": {"recall:a": {"mean": 1.0}}})
    assert partial["m"]["average"] == 0.5
    assert partial["n"] == dict(tasks={"recall": 1.0}, average=None, missing=["copy"])


def test_task_inputs_are_those_the_runs_take():
    # MAD recall's inputs drop the sequence's last token; a point's own setting wins over --set's; cfg. is no task's
    assert sweep.task_inputs(sweep.sweep_points("mad", None), {}) == [                  # as the runs go
        ("tokens", 127), ("tokens", 128), ("tokens", 256), ("autoencode", 32), ("tokens", 32)]
    points = sweep.sweep_points("mqar", [("length", [24, 48]), ("cfg.batch_size", [2])])
    assert sweep.task_inputs(points, {"length": 16, "pairs": 2}) == [("tokens", 24), ("tokens", 48)]
    assert sweep.task_inputs(sweep.sweep_points("mqar", None), {"length": 40, "pairs": 2}) == [("tokens", 40)]
    assert sweep.task_inputs(sweep.sweep_points("icr", None), {"length": 12}) == [("regression", 28)]  # and 16 queries


def test_sweep_resume_keeps_done_runs(tmp_path):
    out = tmp_path / "r"
    args = ["mqar", "--mixers", "softmax", "--lrs", "1e-3", "--out", str(out)] + TINY
    assert sweep.main(args + ["--seeds", "0"]) == 0
    first = json.loads((out / "sweep-mqar.json").read_text())["runs"]
    assert sweep.main(args + ["--seeds", "0,1", "--resume"]) == 0
    runs = json.loads((out / "sweep-mqar.json").read_text())["runs"]
    assert [r["seed"] for r in runs] == [0, 1] and runs[0] == first[0]
    assert sweep.main(args[:3] + ["--lrs", "2e-3", "--seeds", "1"] + args[5:] + ["--resume"]) == 0
    payload = json.loads((out / "sweep-mqar.json").read_text())
    assert sorted((r["lr"], r["seed"]) for r in payload["runs"]) == [(1e-3, 0), (1e-3, 1), (2e-3, 1)]
    assert payload["lrs"] == [1e-3, 2e-3] and payload["seeds"] == [0, 1]     # every run's, not only this call's


def test_sweep_resume_with_other_mixers_keeps_the_earlier_ones_and_their_skips(tmp_path):
    out = tmp_path / "r"
    args = ["mqar", "--lrs", "1e-3", "--out", str(out)] + TINY
    assert sweep.main(args + ["--mixers", "softmax"]) == 0
    path = out / "sweep-mqar.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "skipped": {"gdn": "refused here"}}))
    assert sweep.main(args + ["--mixers", "parallax", "--resume"]) == 0
    assert sweep.main(args + ["--mixers", "parallax", "--resume"]) == 0      # the order stays the first run's
    payload = json.loads(path.read_text())
    assert payload["mixers"] == ["softmax", "parallax"] and set(payload["summary"]) == {"softmax", "parallax"}
    assert payload["skipped"] == {"gdn": "refused here"}


def test_summary_ranks_failed_runs_last():
    def run(lr, seed, value, metric="accuracy"):
        return dict(mixer="m", x=1, lr=lr, seed=seed, metric=metric, best=None if value is None else {metric: value})
    summary = sweep.summarize_sweep([run(1e-3, 0, 0.5), run(1e-3, 1, 0.7), run(1e-2, 0, 0.9), run(1e-2, 1, None)])
    cell = summary["m"]["1"]
    assert cell["best_lr"] == 1e-3 and abs(cell["mean"] - 0.6) < 1e-12
    mse = sweep.summarize_sweep([run(1e-3, 0, 0.2, "mse"), run(1e-2, 0, 0.1, "mse"), run(1e-1, 0, float("nan"), "mse")])
    assert mse["m"]["1"]["best_lr"] == 1e-2


def test_sweep_grid_plot_averages_the_other_keys(tmp_path):
    out = tmp_path / "g"
    args = ["mqar", "--mixers", "softmax", "--lrs", "1e-3", "--vary", "length=16,32", "--vary",
            "pairs_per_length=8,4", "--out", str(out)] + BASE
    assert sweep.main(args) == 0
    payload = json.loads((out / "sweep-mqar.json").read_text())
    assert len(payload["runs"]) == 4 and payload["vary"] == ["length", "pairs_per_length"]
    shown = sweep.by_first_key(payload["summary"], payload["runs"], "length")
    cells = payload["summary"]["softmax"]
    expect = (cells["length=16,pairs_per_length=8"]["mean"] + cells["length=16,pairs_per_length=4"]["mean"]) / 2
    assert abs(shown["softmax"]["16"]["mean"] - expect) < 1e-12
    assert (out / "sweep-mqar.png").exists()


def test_presets_parse_into_valid_sweeps():
    from regattn.models.mixers import MIXER_NAMES
    from regattn.tasks import TASKS
    for name in sweep.PRESETS:
        args = sweep.build_parser().parse_args(sweep.expand_preset(["--preset", name, "--seeds", "0"]))
        assert args.task in TASKS or args.task in sweep.SUITES, name
        assert all(m in MIXER_NAMES for m in args.mixers.split(",")) and args.seeds == "0"
        assert sweep.sweep_points(args.task, sweep.parse_vary(args.vary or [])), name
    args = sweep.build_parser().parse_args(sweep.expand_preset(["--preset", "lla-mqar", "--vary", "length=64"]))
    vary = sweep.parse_vary(args.vary)
    assert [k for k, _ in vary] == ["length", "pairs_per_length:num_train"]
    points = sweep.sweep_points(args.task, vary)
    assert [s for _, s, _ in points] == [dict(length=64, pairs_per_length=16, num_train=20000),
                                         dict(length=64, pairs_per_length=8, num_train=40000),
                                         dict(length=64, pairs_per_length=4, num_train=60000)]
    assert args.epochs == 32 and args.batch_size == 256 and args.optimizer == "adamw"
    args = sweep.build_parser().parse_args(sweep.expand_preset(["--preset", "parallax-mad"]))
    assert (args.compile, args.cuda_graph, args.jobs, args.streams, args.checkpoint_every) == ("none", True, 1, 6, 1000)


def test_sweep_refuses_an_option_for_no_mixer(tmp_path):
    with pytest.raises(UsageError, match="--mixer-opt: .*'sw.window'.*names no mixer"):
        sweep.main(["mqar", "--mixers", "softmax,swa", "--mixer-opt", "sw.window=3", "--out", str(tmp_path)] + TINY)


def test_sweep_varies_a_training_setting(tmp_path):
    out = tmp_path / "d"
    assert sweep.main(["mqar", "--mixers", "softmax", "--vary", "cfg.dim=8,16", "--out", str(out)] + TINY) == 0
    runs = json.loads((out / "sweep-mqar.json").read_text())["runs"]
    assert [r["config"]["dim"] for r in runs] == [8, 16] and [r["x"] for r in runs] == [8, 16]
    assert runs[0]["parameters"] < runs[1]["parameters"]


def test_compile_graph_and_log_every_flags_reach_the_config():
    parser = sweep.build_parser()
    for mode in ("none", "default", "reduce-overhead"):
        parsed = parser.parse_args(["mqar", "--mixers", "softmax", "--compile", mode, "--log-every", "7"])
        config = cli.base_config(parsed)
        assert config.compile == mode and config.log_every == 7
    assert cli.base_config(parser.parse_args(["mqar", "--mixers", "softmax", "--cuda-graph"])).cuda_graph
    defaults = cli.base_config(parser.parse_args(["mqar", "--mixers", "softmax"]))
    assert defaults.compile == "none" and defaults.log_every == 100 and not defaults.cuda_graph


def test_sweep_jobs_and_streams_run_like_one_at_a_time(tmp_path, capsys):
    # a tiny version of a preset: the six MAD tasks, in two processes, and three at a time in this one
    tiny = ["--preset", "parallax-mad", "--mixers", "softmax", "--lrs", "1e-2", "--epochs", "1",
            "--batch-size", "8", "--set", "num_train=16", "--set", "num_test=8", "--dim", "16", "--quiet"]
    assert sweep.main(tiny + ["--out", str(tmp_path / "one"), "--streams", "1"]) == 0
    assert sweep.main(tiny + ["--out", str(tmp_path / "two"), "--jobs", "2", "--streams", "1"]) == 0
    assert sweep.main(tiny + ["--out", str(tmp_path / "three"), "--streams", "3"]) == 0
    out = capsys.readouterr().out
    assert "6 runs" in out and "(3 at a time)" in out
    one, two, three = (json.loads((tmp_path / d / "sweep-mad.json").read_text())["runs"]
                       for d in ("one", "two", "three"))
    key = (lambda r: (r["x"], r["lr"]))
    assert [key(r) for r in two] == [key(r) for r in three] == [key(r) for r in one] and len(two) == 6  # grid order
    assert re.findall(r"\d+-\d+ s into the sweep\)", out) and len(re.findall("into the sweep", out)) == 18
    for a, b in zip(one + one, two + three):
        assert not b.get("error") and b["steps"] == a["steps"] == 2 and b["started"] <= b["ended"]
        assert abs(a["best"]["accuracy"] - b["best"]["accuracy"]) < 1e-3
        assert abs(a["history"]["train"][-1]["loss"] - b["history"]["train"][-1]["loss"]) < 1e-3


@pytest.mark.parametrize("jobs, streams", [(1, 2), (2, 1)], ids=["streams", "processes"])
def test_a_sweep_runs_what_its_starts_give_and_no_more(jobs, streams):
    base = cli.base_config(sweep.build_parser().parse_args(["mqar", "--mixers", "softmax"] + TINY))
    configs = [dataclasses.replace(base, lr=lr) for lr in (1e-3, 2e-3, 3e-3, 4e-3)]
    runs = list(sweep.execute([(3, configs[3]), (1, configs[1])], jobs, streams, base.device))
    assert sorted(r["index"] for r in runs) == [1, 3] and not any(r.get("error") for r in runs)
    assert sorted(r["config"]["lr"] for r in runs) == [2e-3, 4e-3]


class Check:
    """A baseline check that has answered: ``mixers`` checked, ``reasons`` those refused."""
    def __init__(self, mixers, reasons):
        self.mixers, self.reasons, self.asked = set(mixers), reasons, 0

    def refused(self):
        self.asked += 1
        return self.reasons


def test_runs_of_baselines_being_checked_start_last_and_a_refused_ones_not_at_all():
    pending = [(f"config{i}", dict(mixer=m)) for i, m in enumerate(["a", "b", "c", "a", "b", "c"])]
    assert [i for i, _ in sweep.starts(pending)] == [0, 1, 2, 3, 4, 5]
    check = Check(["b", "c"], {"c": "refused"})
    started = sweep.starts(pending, check=check)
    assert [next(started)[0] for _ in range(2)] == [0, 3] and check.asked == 0    # no wait before b's turn
    assert [i for i, _ in started] == [1, 4] and [c for _, c in sweep.starts(pending, check=check)][-1] == "config4"
    assert list(sweep.starts(pending, deadline=0.0)) == []                        # past the deadline: none starts


def refuse_decay(args, mixers, inputs):
    """A baseline check for the spawned process (importable there): decay refused, with a setting of ``args``
    and the runs' input lengths."""
    return {m: f"RuntimeError: not at dim {args.dim} on {[length for _, length in inputs]}" for m in mixers
            if m == "decay"}


def test_baselines_checked_in_a_process_of_their_own(tmp_path, monkeypatch, capsys):
    # as on CUDA, with decay and parallax standing for baselines (FLA's need CUDA), and the check above
    monkeypatch.setattr(sweep, "BASELINES", ("decay", "parallax"))
    monkeypatch.setattr(sweep, "refused_mixers", refuse_decay)
    args = sweep.build_parser().parse_args(["mqar", "--mixers", "decay,softmax"])
    assert sweep.BaselineCheck.of(args, ["decay", "softmax"], [("tokens", 64)]) is None  # the CPU: checked first
    with monkeypatch.context() as m:
        m.setattr(sweep, "resolve_device", lambda device: torch.device("cuda"))
        assert sweep.BaselineCheck.of(args, ["decay", "parallax"], [("tokens", 64)]) is None  # nothing to go beside
        real = sweep.BaselineCheck.of(args, ["decay", "softmax"], [("tokens", 64)])
    assert real.mixers == {"decay"} and real.refused() == {"decay": "RuntimeError: not at dim 128 on [64]"}
    capsys.readouterr()
    monkeypatch.setattr(sweep.BaselineCheck, "of",
                        lambda args, mixers, inputs: sweep.BaselineCheck(args, ["decay", "parallax"], inputs))
    out = tmp_path / "c"
    assert sweep.main(["mqar", "--mixers", "decay,softmax,parallax", "--out", str(out)] + TINY) == 0
    payload = json.loads((out / "sweep-mqar.json").read_text())
    assert payload["mixers"] == ["softmax", "parallax"]
    assert [r["mixer"] for r in payload["runs"]] == ["softmax", "parallax"]
    assert payload["skipped"] == {"decay": "RuntimeError: not at dim 16 on [16]"}     # TINY's length
    printed = capsys.readouterr().out
    assert "checked ['decay', 'parallax'] in a process of its own" in printed
    assert "skipping decay: RuntimeError: not at dim 16 on [16]" in printed and "not started" not in printed
    assert printed.index("softmax") < printed.index("checked") < printed.index("parallax")   # softmax did not wait


def warm_into_file(args, mixer, inputs):
    """A warm-up for the spawned process (importable there): it writes what it was asked into ``--out``."""
    (pathlib.Path(args.out) / f"{mixer}.warm").write_text(json.dumps([args.batch_size, inputs]))


def test_mixers_warm_up_in_processes_of_their_own_on_cuda(tmp_path, monkeypatch):
    args = sweep.build_parser().parse_args(["mqar", "--mixers", "softmax,decay", "--out", str(tmp_path)] + TINY)
    assert sweep.warm_up(args, ["softmax", "decay"], [("tokens", 16)]) == []  # the CPU: Triton compiles nothing
    monkeypatch.setattr(sweep, "warm_mixer", warm_into_file)
    monkeypatch.setattr(sweep, "resolve_device", lambda device: torch.device("cuda"))
    futures = sweep.warm_up(args, ["softmax", "decay"], [("tokens", 16), ("autoencode", 8)])
    assert all(seconds >= 0 for _, seconds in (f.result(timeout=120) for f in futures))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["decay.warm", "softmax.warm"]
    assert json.loads((tmp_path / "decay.warm").read_text()) == [4, [["tokens", 16], ["autoencode", 8]]]  # TINY's batch


def test_a_warm_up_says_how_long_it_took_or_why_it_failed(capsys):
    done, failed = concurrent.futures.Future(), concurrent.futures.Future()
    done.set_result((None, 41.6))
    failed.set_exception(RuntimeError("no kernel"))
    sweep.say_warmed("mesanet", done)
    sweep.say_warmed("decay", failed)
    assert capsys.readouterr().out.splitlines() == ["warmed up mesanet's kernels in a process of its own in 42 s",
                                                    "warming up decay's kernels failed: RuntimeError: no kernel"]


def test_stop_after_leaves_the_rest_to_resume(tmp_path, capsys):
    out = tmp_path / "s"
    args = ["mqar", "--mixers", "softmax", "--lrs", "1e-3,1e-2", "--out", str(out)] + TINY
    assert sweep.main(args + ["--stop-after", "1e-9"]) == 1                # no run starts; none done
    assert "2 of 2 runs not started (--resume runs them)" in capsys.readouterr().out
    assert sweep.main(args + ["--resume", "--stop-after", "600"]) == 0
    runs = json.loads((out / "sweep-mqar.json").read_text())["runs"]
    assert [r["lr"] for r in runs] == [1e-3, 1e-2] and "not started" not in capsys.readouterr().out


def test_failed_run_is_recorded_and_retried_on_resume(tmp_path, monkeypatch):
    out = tmp_path / "f"
    args = ["mqar", "--mixers", "softmax", "--lrs", "1e-3,1e-2", "--out", str(out)] + TINY
    training = sweep.training

    def fails_at_high_lr(config, **kw):
        if config.lr == 1e-2:
            raise RuntimeError("out of memory")
        return (yield from training(config, **kw))

    monkeypatch.setattr(sweep, "training", fails_at_high_lr)
    assert sweep.main(args) == 0
    payload = json.loads((out / "sweep-mqar.json").read_text())
    failed = [r for r in payload["runs"] if r.get("error")]
    assert len(failed) == 1 and failed[0]["lr"] == 1e-2 and "RuntimeError: out of memory" in failed[0]["error"]
    assert payload["summary"]["softmax"]["default"]["per_lr"] == {"0.001": payload["runs"][0]["best"]["accuracy"]}
    monkeypatch.setattr(sweep, "training", training)
    assert sweep.main(args + ["--resume"]) == 0
    runs = json.loads((out / "sweep-mqar.json").read_text())["runs"]
    assert [r["lr"] for r in runs] == [1e-3, 1e-2] and not any(r.get("error") for r in runs)
    assert runs[0] == payload["runs"][0]                                     # the finished run is kept


def test_interrupted_sweep_stops_its_runs_in_flight(tmp_path):
    """SIGINT ends a ``--jobs`` sweep and its workers at once (runs of a million steps would never finish);
    the runs done before are saved for ``--resume``."""
    import signal
    import subprocess
    import sys
    import time
    out = tmp_path / "s"
    args = [sys.executable, "-m", "regattn", "sweep", "mqar", "--mixers", "softmax", "--lrs", "1e-3,1e-2",
            "--epochs", "1000000", "--batch-size", "4", "--set", "num_train=8", "--set", "num_test=4", "--dim", "8",
            "--jobs", "2", "--quiet", "--out", str(out)]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    workers = []
    while len(workers) < 2 and proc.poll() is None:               # both runs have started
        time.sleep(0.5)
        children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        workers = [pid for pid in children if "spawn_main" in _command_line(pid)]
    assert len(workers) == 2, f"the sweep ended before its runs started: {proc.communicate()[0][-2000:]}"
    proc.send_signal(signal.SIGINT)
    try:
        proc.communicate(timeout=300)                              # a hang guard: waiting would take days
    finally:
        proc.kill()
        for pid in workers:
            subprocess.run(["kill", "-9", pid], capture_output=True)
    assert proc.returncode not in (None, 0)
    for pid in workers:
        assert not _alive(int(pid)), f"worker {pid} still runs after the sweep was interrupted"


def test_stopping_the_workers_ends_a_worker_the_pool_has_not_listed():
    """An interrupt can come after the pool started a worker and before it listed it: ``stop_workers`` ends that
    one too (a worker left running kept the interrupted sweep's exit waiting for it, as ``multiprocessing`` joins
    its children at exit)."""
    import multiprocessing
    import time
    context = multiprocessing.get_context("spawn")
    pool = concurrent.futures.ProcessPoolExecutor(1, mp_context=context)
    unlisted = context.Process(target=time.sleep, args=(600,))
    unlisted.start()
    try:
        sweep.stop_workers(pool)
        unlisted.join(timeout=60)
        assert not unlisted.is_alive()
    finally:
        unlisted.kill()


def _command_line(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline") as f:
            return f.read()
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_sweep_plots_every_point_its_runs_hold(tmp_path):
    """A resumed sweep at another length redraws the earlier length's curves too, at the same index."""
    out = tmp_path / "r"
    args = ["mqar", "--mixers", "softmax", "--lrs", "1e-3", "--set", "pairs=2", "--out", str(out)] + BASE
    assert sweep.main(args + ["--vary", "length=24"]) == 0
    assert sweep.main(args + ["--vary", "length=16", "--resume"]) == 0
    assert (out / "sweep-mqar-curves-0.png").exists() and (out / "sweep-mqar-curves-1.png").exists()
    assert plots.x_order([512, 128, "256"]) == ["128", "256", "512"]
    assert plots.x_order(["recall", "copy", "recall"]) == ["recall", "copy"]


def test_sweep_plot_keeps_each_point_in_its_place_when_a_mixer_lacks_some(tmp_path, monkeypatch):
    drawn = {}
    original = matplotlib.axes.Axes.errorbar

    def record(ax, x, y, *args, label=None, **kwargs):
        drawn[label] = (list(x), list(y))
        return original(ax, x, y, *args, label=label, **kwargs)
    monkeypatch.setattr(matplotlib.axes.Axes, "errorbar", record)
    cell = {"recall": 0.9, "copy": 0.5, "memo": 0.7}
    summary = {"partial": {k: dict(x=k, mean=cell[k], std=0.0) for k in ("copy", "memo")},
               "whole": {k: dict(x=k, mean=cell[k], std=0.0) for k in ("recall", "copy", "memo")}}
    plots.plot_sweep(summary, str(tmp_path / "s.png"), xlabel="task", metric="accuracy")
    assert drawn == {"partial": ([1, 2], [0.5, 0.7]), "whole": ([0, 1, 2], [0.9, 0.5, 0.7])}


def test_sweep_plots_draw_the_mixers_in_the_sweeps_order(monkeypatch):
    """A mixer whose runs came first in the JSON (a resumed sweep's) still takes its place in the legend."""
    drawn = []
    monkeypatch.setattr(sweep, "plot_sweep", lambda summary, *a, **k: drawn.append(list(summary)))
    monkeypatch.setattr(sweep, "plot_curves", lambda best, *a, **k: drawn.append(list(best)))
    cell = {"recall": dict(x="recall", best_lr=1e-3, mean=0.5, std=0.0)}
    runs = [dict(mixer=m, x="recall", lr=1e-3, metric="accuracy") for m in ("late", "first")]
    payload = dict(task="mad", vary=[], mixers=["first", "late"], runs=runs,
                   summary={"late": cell, "first": cell})
    sweep.plot_results("unused", payload)
    assert drawn == [["first", "late"], ["first", "late"]]


def test_sweep_resumes_an_interrupted_run_from_its_checkpoint(tmp_path, monkeypatch):
    """A run stopped after 3 of its 6 steps continues from its checkpoint on --resume and ends as the same
    run uninterrupted does; its checkpoint is removed once the run is recorded."""
    args = ["mqar", "--mixers", "softmax", "--lrs", "1e-3"] + TINY + ["--steps", "6", "--log-every", "1"]
    assert sweep.main(args + ["--out", str(tmp_path / "whole")]) == 0

    def stopped(config, data=None):
        yield from sweep_training(config, data=data, stop_at=3)
        raise RuntimeError("stopped")
    sweep_training, out = sweep.training, tmp_path / "resumed"
    monkeypatch.setattr(sweep, "training", stopped)
    assert sweep.main(args + ["--out", str(out), "--checkpoint-every", "2"]) == 1
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["mqar-default-softmax-lr0.001-seed0.pt"]
    monkeypatch.setattr(sweep, "training", sweep_training)
    assert sweep.main(args + ["--out", str(out), "--checkpoint-every", "2", "--resume"]) == 0
    assert list((out / "checkpoints").iterdir()) == []
    whole, resumed = (json.loads((d / "sweep-mqar.json").read_text())["runs"][0] for d in (tmp_path / "whole", out))
    assert resumed["resumed_from"] == 3 and whole["resumed_from"] == 0
    assert resumed["history"]["train"] == whole["history"]["train"] and resumed["best"] == whole["best"]
