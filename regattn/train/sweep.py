"""``regattn sweep TASK --mixers a,b,c --lrs ... [--seeds ...] [--vary KEY=v1,v2,...]`` or ``regattn sweep --preset NAME``.

For every point of the sweep (a value of the varied task setting; for ``mad`` each of the six
tasks, for ``mad_benchmark`` every benchmark setting, for ``mad_hard`` the harder sweep), every
seed, mixer and learning rate, one run. A run's score is its best test metric over the
evaluations (the papers report the best checkpoint); per mixer and point the score is averaged
over seeds and the best learning rate is kept, as the papers report. Writes ``sweep.json`` (every
run and the summary) and plots: the metric against the varied setting, and the training curves
at each mixer's best learning rate.

``--vary a:b=1:10,2:20`` varies two settings together (zipped); repeated ``--vary`` options form a
grid; a key ``cfg.NAME`` varies a training setting instead of a task setting (``--vary cfg.dim=64,128``,
the model widths of gatedfwa Figure 8). A preset (:data:`PRESETS`) writes a paper's protocol as arguments; arguments after it
override it (a ``--vary`` of the same key replaces the preset's).

``--jobs N`` runs N runs at a time, each in its own process (spawned; the small task models leave room for
several on one GPU); ``--streams N`` runs N at a time in this process, each at its own pace on its
own CUDA stream (:mod:`regattn.train.interleave`): the runs of one model shape then share its compilation and
its kernels' tuning, and no process starts. A run that raises is recorded with its ``error`` (and no score) and
is run again by ``--resume``; an interrupt (SIGINT) ends the runs in flight at once, and ``--resume`` runs them
again: from the start, or with ``--checkpoint-every N`` from the last of their checkpoints (every N steps, in
``OUT/checkpoints/``, each removed once its run is recorded). ``--stop-after S`` starts no run after S seconds: the
runs in flight then end, and ``--resume`` does the rest (a sweep longer than a machine's time limit, in parts
that lose no run). Each run's record keeps the wall-clock times it ``started`` and ``ended``; its printed line
gives both in seconds into the sweep, so that a part's time shows where it went. A baseline FLA refuses on the
machine is skipped, its reason under ``skipped`` in the JSON; on CUDA, with other mixers beside them, the
baselines are checked in a process of their own while the other runs go, and their runs start last
(:class:`BaselineCheck`). On CUDA each other mixer also makes its first pass at the runs' sizes in a process of its
own as the sweep starts, so that the runs find its kernels compiled (:func:`warm_up`).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import functools
import itertools
import json
import multiprocessing
import os
import re
import statistics
import sys
import time
from collections.abc import Iterable

from regattn.models.baselines import BASELINES
from regattn.models.mixers import MIXER_NAMES
from regattn.tasks import MAD_TASKS, TASKS, mad_benchmark_settings, mad_hard_settings, make_task, task_input
from regattn.train import checks
from regattn.train.cli import (add_common, base_config, check_common, parse_list, parse_pairs, parse_value, rate,
                               record, refused_mixers, warm_mixer, write_json)
from regattn.train.plots import plot_curves, plot_sweep, x_order
from regattn.train.interleave import interleave
from regattn.train.trainer import TrainConfig, finish, resolve_device, score, training
from regattn.usage import UsageError

SUITES = ("mad", "mad_benchmark", "mad_hard")

# on CUDA each step is compiled and replayed as one CUDA graph (the MAD model: 52 -> 800 steps/s on the H100)
_FAST = "--compile default --cuda-graph"
_ADAMW = f"--optimizer adamw --betas 0.9,0.999 --weight-decay 0.1 --batch-size 256 --schedule constant --seeds 0,1,2 {_FAST}"
_MUON = "--optimizer muon --schedule wsd --warmup 0 --decay-start 0.8 --epochs 60 --batch-size 128 --lrs 5e-3,1e-3,5e-4"
# uncompiled, six runs at a time on CUDA streams: no run waits while another model shape compiles (Table 1a has 36),
# and six in flight keep the device busy (Table 1a's six columns on an H200 in 16.8 and 17.7 minutes, and 14.6
# with FLA's check on the runs' lengths and the other mixers warmed up beside the runs: docs/EXPERIMENTS.md)
_STREAMS = "--compile none --cuda-graph --streams 6 --checkpoint-every 1000"
PRESETS = {
    # lla Appendix F.2 (AdamW (0.9, 0.999), weight decay 0.1, batch 256; the paper names no schedule: constant)
    "lla-icr": f"icr --no-mlp --vary length=64,128,256,512 --vary segments=8,4,2,1 --lrs 5e-5,1e-4,5e-4,1e-3 "
               f"--epochs 100 --set num_train=100000 --set num_test=1000 --mixers softmax,lla {_ADAMW}",
    "lla-mqar": f"mqar --vary length=64,128,256,512 --vary pairs_per_length:num_train=16:20000,8:40000,4:60000 "
                f"--lrs 1e-4,5e-4,1e-3 --epochs 32 --set vocab_size=8192 --set num_test=1000 --set offset_power=0.01 "
                f"--mixers softmax,parallax,lla {_ADAMW}",
    "lla-state": f"state --vary positions=16,24,48,96 --lrs 1e-4,5e-4,1e-3 --epochs 64 --set items=8192 --set queries=8 "
                 f"--set num_train=100000 --set num_test=1000 --mixers softmax,lla {_ADAMW}",
    # gatedfwa Section 4.1 (w = N / 2 is the windowed mixers' default; training settings as lla-mqar)
    "gatedfwa-mqar": f"mqar --vary length=128,256,512 --vary cfg.dim=64,128,256,512 --lrs 1e-4,5e-4,1e-3 --epochs 32 --set num_train=20000 "
                     f"--set num_test=1000 --set offset_power=0.01 --mixers softmax,swa,gatedfwa {_ADAMW}",
    # both papers' MQAR at the lengths they share, trimmed to fit about 15 minutes of one H100: lla's model
    # (d = 128) and middle setting (L/8 pairs, 40000 examples), one seed, lla's two highest rates
    "mqar-trimmed": f"mqar --vary length=128,256,512 --lrs 1e-3,5e-4 --epochs 32 --set pairs_per_length=8 "
                    f"--set num_train=40000 --set vocab_size=8192 --set num_test=1000 --set offset_power=0.01 "
                    f"--mixers softmax,swa,gatedfwa,parallax,lla {_ADAMW} --seeds 0",
    # parallax Appendix E (Muon, WSD without warm-up, last 20% decayed, 60 epochs, three peak rates)
    # Table 1a's Mamba and GDN are flash-linear-attention's layers (the baselines extra), as is GLA, a gated
    # linear layer FLA runs on Hopper with triton < 3.7.1 where it refuses GDN; a baseline FLA refuses on this
    # machine is skipped, with its reason in the sweep's JSON. Mamba's state size is the MAD release's (its
    # Mamba layer's d_state 4; the paper takes the release's settings), in chunks of 16 (the same result, per-chunk
    # products a quarter of 64's)
    "parallax-mad": f"mad --mixers softmax,parallax,gatedfwa,decay,mesanet,mamba2,gdn,gla {_MUON} {_STREAMS} "
                    f"--mixer-opt mamba2.state_size=4 --mixer-opt mamba2.chunk_size=16",
    "parallax-mad-benchmark": f"mad_benchmark --mixers softmax,parallax,gatedfwa,decay {_MUON} {_FAST}",
    "parallax-mad-hard": f"mad_hard --mixers softmax,parallax,gatedfwa,decay {_MUON} {_FAST}",
}


def expand_preset(argv: list[str]) -> list[str]:
    """``--preset NAME rest`` -> the preset's arguments followed by ``rest``."""
    if "--preset" not in argv:
        return argv
    i = argv.index("--preset")
    if i + 1 >= len(argv) or argv[i + 1] not in PRESETS:
        raise UsageError(f"--preset: expected one of {sorted(PRESETS)}, got {argv[i + 1:i + 2]}")
    return PRESETS[argv[i + 1]].split() + argv[:i] + argv[i + 2:]


def parse_vary(items: list[str]) -> list[tuple[str, list]]:
    """``["a=1,2", "b:c=1:10,2:20"]`` -> ``[("a", [1, 2]), ("b:c", [(1, 10), (2, 20)])]``; a later entry of
    the same key replaces the values of an earlier one, in its place."""
    out: dict = {}
    for item in items:
        if "=" not in item:
            raise UsageError(f"--vary: expected KEY=V1,V2,..., got {item!r}")
        key, values = item.split("=", 1)
        width = len(key.split(":"))
        parsed = []
        for value in values.split(","):
            parts = [parse_value(v) for v in value.split(":")]
            if len(parts) != width:
                raise UsageError(f"--vary: {key!r} needs {width} values per point, got {value!r}")
            parsed.append(tuple(parts) if width > 1 else parts[0])
        out[key] = parsed                       # a repeated key keeps its place
    return list(out.items())


def label(setting: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in setting.items()) or "baseline"


def sweep_points(task: str, vary: list[tuple[str, list]] | None) -> list[tuple[str, dict, object]]:
    """``(task name, task settings, x)`` for each point. ``vary``: :func:`parse_vary` entries whose product
    is swept; x is the value when one setting varies, else the settings' label."""
    if task == "mad":
        return [(f"mad_{name}", {}, name) for name in MAD_TASKS]
    if task == "mad_benchmark":
        return [(f"mad_{name}", s, f"{name}:{label(s)}") for name, s in mad_benchmark_settings()]
    if task == "mad_hard":
        return [(f"mad_{name}", s, f"{name}:{label(s)}") for name, s in mad_hard_settings()]
    if not vary:
        return [(task, {}, "default")]
    axes = [[dict(zip(key.split(":"), v if isinstance(v, tuple) else (v,))) for v in values] for key, values in vary]
    grid = [{k: v for part in parts for k, v in part.items()} for parts in itertools.product(*axes)]
    single = len(vary) == 1 and ":" not in vary[0][0]
    return [(task, g, g[vary[0][0]] if single else label(g)) for g in grid]


def by_first_key(summary: dict, runs: list[dict], key: str) -> dict:
    """The summary averaged over every varied setting but ``key``: ``{mixer: {value: {x, mean, std}}}``."""
    setting_of = {str(r["x"]): r["setting"] for r in runs}
    out = {}
    for mixer, cells in summary.items():
        groups: dict = {}
        for x, cell in cells.items():
            groups.setdefault(setting_of[x][key], []).append(cell["mean"])
        out[mixer] = {str(v): dict(x=v, mean=statistics.fmean(m), std=statistics.pstdev(m) if len(m) > 1 else 0.0)
                      for v, m in groups.items()}
    return out


CONFIG_PREFIX = "cfg."


def split_setting(setting: dict) -> tuple[dict, dict]:
    """A point's settings as ``(task settings, TrainConfig fields)``: those named ``cfg.`` are the fields."""
    fields = {k[len(CONFIG_PREFIX):]: v for k, v in setting.items() if k.startswith(CONFIG_PREFIX)}
    return {k: v for k, v in setting.items() if not k.startswith(CONFIG_PREFIX)}, fields


def task_inputs(points: list[tuple[str, dict, object]], task_options: dict) -> list[tuple[str, int]]:
    """The kinds and lengths of the points' tasks' inputs (:func:`regattn.tasks.task_input`), each with
    ``task_options`` under its own settings, in the order the points first take them."""
    inputs = (task_input(task, **{**task_options, **split_setting(setting)[0]}) for task, setting, _ in points)
    return list(dict.fromkeys(inputs))


def run_key(mixer: str, x, lr: float, seed: int) -> tuple:
    return (mixer, str(x), float(lr), int(seed))


def checkpoint_name(task: str, key: tuple) -> str:
    """The file name of a run's checkpoint: its task and :func:`run_key`, in characters safe in any path."""
    mixer, x, lr, seed = key
    return re.sub(r"[^A-Za-z0-9_.=-]+", "_", f"{task}-{x}-{mixer}-lr{lr:g}-seed{seed}") + ".pt"


def run_sweep(base: TrainConfig, *, mixers: list[str], lrs: list[float], seeds: list[int],
              points: list[tuple[str, dict, object]], done: list[dict] | None = None, on_run=None,
              jobs: int = 1, streams: int = 1, checkpoints: str | None = None,
              stop_after: float | None = None, check: BaselineCheck | None = None) -> list[dict]:
    """Every run of the grid; each record carries ``mixer, x, setting, lr, seed``, in the grid's order.

    done: records of an earlier, interrupted sweep; their runs are kept, not repeated (a failed one, with an
    ``error``, is run again). on_run: called with the list of records after each run (to save partial
    results). jobs: runs at a time, each in its own process; with 1, in this process, the task data built
    once per point and seed, ``streams`` runs at a time side by side (:mod:`regattn.train.interleave`).
    checkpoints: a folder where each run checkpoints (every ``base.checkpoint_every`` steps) and resumes from;
    a run's file is removed once ``on_run`` has its record. stop_after: seconds after which no run starts (the
    runs in flight end; the records hold the runs that ran). check: the baselines still being checked; their
    runs start last, those of a baseline it refuses not at all.
    """
    runs = [r for r in done or [] if not r.get("error")]
    finished = {run_key(r["mixer"], r["x"], r["lr"], r["seed"]) for r in runs}
    grid, pending = [], []
    for task, setting, x in points:
        task_setting, model = split_setting(setting)
        options = {**base.task_options, **task_setting}
        for seed in seeds:
            for mixer, lr in itertools.product(mixers, lrs):
                key = run_key(mixer, x, lr, seed)
                grid.append(key)
                if key not in finished:
                    path = checkpoints and os.path.join(checkpoints, checkpoint_name(task, key))
                    config = dataclasses.replace(base, task=task, task_options=options, mixer=mixer, lr=lr, seed=seed,
                                                 checkpoint=path, **model)
                    pending.append((config, dict(mixer=mixer, x=x, setting=setting, lr=lr, seed=seed)))
    order = {key: i for i, key in enumerate(grid)}
    began = time.time()
    deadline = None if stop_after is None else began + stop_after
    ran = 0
    # closed on an interrupt in this loop too, not only inside it: the runs in flight end before the exit waits
    with contextlib.closing(execute(starts(pending, deadline, check), jobs, streams, base.device)) as finished:
        for run in finished:
            ran += 1
            run.update(pending[run.pop("index")][1])
            runs.append(run)
            runs.sort(key=lambda r: order.get(run_key(r["mixer"], r["x"], r["lr"], r["seed"]), len(order)))
            print_run(run, began)
            if on_run is not None:
                on_run(runs)
            if checkpoints and not run.get("error") and os.path.exists(run["config"]["checkpoint"]):
                os.remove(run["config"]["checkpoint"])
    refused = sum(1 for _, meta in pending if check is not None and meta["mixer"] in check.answered())
    if ran + refused < len(pending):
        print(f"--stop-after: {len(pending) - ran - refused} of {len(pending)} runs not started (--resume runs them)")
    return runs


def starts(pending: list[tuple[TrainConfig, dict]], deadline: float | None = None,
           check: BaselineCheck | None = None):
    """``(index, config)`` of each run of ``pending`` to start, in its order but the runs of the mixers ``check``
    is still checking, which come last, once it has answered, without those it refuses. None starts after
    ``deadline`` (``time.time()``)."""
    waiting = set() if check is None else check.mixers
    for i in sorted(range(len(pending)), key=lambda i: pending[i][1]["mixer"] in waiting):
        if deadline is not None and time.time() >= deadline:
            return
        config, meta = pending[i]
        if meta["mixer"] not in waiting or meta["mixer"] not in check.refused():
            yield i, config


class BaselineCheck:
    """Which baselines FLA refuses on this machine (:func:`regattn.train.cli.refused_mixers`), asked in a spawned
    process of its own while the sweep's other runs go; the baselines' runs start last, the first once it has
    answered (:func:`starts`). The check runs each baseline at the runs' batch size and ``inputs`` (kinds and
    lengths), so FLA compiles its kernels there (over 150 s for Mamba2 on a cold H200) into Triton's cache on disk,
    for this process to find as it tunes them for its first baseline run (Triton compiles a kernel apart for each
    divisibility of its integer arguments and each dtype: after a check on 128 tokens, a run on MAD recall's 127
    compiled 135 of them again). FLA keeps none of the check's tuning (``FLA_CACHE_RESULTS=0``): those timings ran
    beside the other runs. ``refused()`` waits for the answer."""

    def __init__(self, args, mixers: list[str], inputs: list[tuple[str, int]]):
        self.mixers = set(mixers)
        self.began = time.time()
        self._answer = None
        pool = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                                                      initializer=keep_no_tuning)
        self._future = pool.submit(timed, refused_mixers, args, mixers, inputs)
        pool.shutdown(wait=False)

    @staticmethod
    def of(args, mixers: list[str], inputs: list[tuple[str, int]]) -> BaselineCheck | None:
        """The check of the baselines among ``mixers``, started, where it goes beside the other runs: on CUDA, with
        both among ``mixers``; else None (off CUDA the check is quick: FLA's kernels need CUDA)."""
        baselines = [m for m in mixers if m in BASELINES]
        beside = resolve_device(args.device).type == "cuda" and 0 < len(baselines) < len(mixers)
        return BaselineCheck(args, baselines, inputs) if beside else None

    def refused(self) -> dict[str, str]:
        """``{mixer: reason}`` (waits for the check the first time; says how long it took, and when it was asked)."""
        if self._answer is None:
            self._answer, seconds = self._future.result()
            print(f"checked {sorted(self.mixers)} in a process of its own in {seconds:.0f} s "
                  f"(asked for at {time.time() - self.began:.0f} s)")
            for mixer, reason in self._answer.items():
                print(f"skipping {mixer}: {reason}")
        return self._answer

    def answered(self) -> dict[str, str]:
        """:meth:`refused` once it has answered, else ``{}`` (does not wait)."""
        return self._answer or {}


def warm_up(args, mixers: list[str], inputs: list[tuple[str, int]]) -> list[concurrent.futures.Future]:
    """On CUDA, the first pass of each of ``mixers`` in a model at the runs' batch size and ``inputs`` (kinds and
    lengths; :func:`regattn.train.cli.warm_mixer`), in spawned processes of their own while the runs go: Triton compiles
    their kernels into its cache on disk, where a run finds them, instead of compiling them at its start while this
    process issues no step of the runs beside it. Each says how long it took. The futures of ``timed``; none off
    CUDA (Triton compiles nothing there)."""
    if resolve_device(args.device).type != "cuda" or not mixers:
        return []
    workers = max(1, min(len(mixers), (os.cpu_count() or 2) // 2))
    pool = concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
    futures = [pool.submit(timed, warm_mixer, args, mixer, inputs) for mixer in mixers]
    for mixer, future in zip(mixers, futures):
        future.add_done_callback(functools.partial(say_warmed, mixer))
    pool.shutdown(wait=False)
    return futures


def say_warmed(mixer: str, future: concurrent.futures.Future) -> None:
    error = future.exception()
    print(f"warmed up {mixer}'s kernels in a process of its own in {future.result()[1]:.0f} s" if error is None
          else f"warming up {mixer}'s kernels failed: {type(error).__name__}: {error}")


def timed(function, *args) -> tuple[object, float]:
    """``(function(*args), the seconds it took)``."""
    began = time.time()
    return function(*args), time.time() - began


def keep_no_tuning() -> None:
    """The baseline check's process keeps none of FLA's tuning choices on disk."""
    os.environ["FLA_CACHE_RESULTS"] = "0"


def execute(starts: Iterable[tuple[int, TrainConfig]], jobs: int, streams: int = 1, device: str = "cpu"):
    """The record of each run (:func:`run_config`, with its ``index``) as it finishes, the runs started as
    ``starts`` yields ``(index, config)``: ``jobs`` processes, or with ``jobs`` 1 in this process, ``streams`` runs
    side by side on ``device`` (:mod:`regattn.train.interleave`)."""
    starts = iter(starts)
    if jobs == 1:
        steps = ((i, functools.partial(run_steps, config)) for i, config in starts)
        for i, run in interleave(steps, streams, resolve_device(device)):
            yield dict(run, index=i)
        return
    context = multiprocessing.get_context("spawn")           # CUDA does not survive a fork
    pool = concurrent.futures.ProcessPoolExecutor(jobs, mp_context=context, initializer=share_cores, initargs=(jobs,))
    running = {}
    try:
        while True:
            while len(running) < jobs and (start := next(starts, None)) is not None:
                running[pool.submit(run_config, start[1])] = start
            if not running:
                break
            finished, _ = concurrent.futures.wait(running, return_when=concurrent.futures.FIRST_COMPLETED)
            for future in finished:
                i, config = running.pop(future)
                try:
                    run = future.result()
                except Exception as e:                       # noqa: BLE001 (a worker that died: recorded as failed)
                    run = failed(config, e, 0.0)
                yield dict(run, index=i)
    except BaseException:                                    # interrupted: stop the runs in flight, not wait for them
        stop_workers(pool)
        raise
    pool.shutdown()


def stop_workers(pool: concurrent.futures.ProcessPoolExecutor) -> None:
    """Cancel the queued runs and end the running ones (``--resume`` runs them again): every child process, also a
    worker the pool had started but not yet listed when the interrupt came, which would run on and keep the
    interpreter's exit waiting for it (``multiprocessing`` joins its children at exit)."""
    listed = (getattr(pool, "_processes", None) or {}).values()             # shutdown forgets them
    processes = {*listed, *multiprocessing.active_children()}
    pool.shutdown(wait=False, cancel_futures=True)
    for process in processes:
        process.terminate()


def share_cores(jobs: int) -> None:
    """A worker's share of the CPU threads."""
    import torch
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // jobs))


_DATA: dict = {}


def task_data(config: TrainConfig):
    """The task data of ``config``, built once per task, settings and seed in this process (the last one kept)."""
    key = (config.task, config.seed, json.dumps(config.task_options, sort_keys=True))
    if key not in _DATA:
        _DATA.clear()
        _DATA[key] = make_task(config.task, seed=config.seed, **config.task_options)
    return _DATA[key]


def run_config(config: TrainConfig) -> dict:
    """One run's record (:func:`regattn.train.cli.record`); a run that raises gives ``{config, error}``."""
    return finish(run_steps(config))


def run_steps(config: TrainConfig):
    """:func:`run_config` as a generator of the run's steps (:func:`regattn.train.trainer.training`); the record
    carries the wall-clock times (``time.time()``) at which the run ``started`` (before its data and model are
    built) and ``ended``."""
    started = time.time()
    try:
        run = record((yield from training(config, data=task_data(config))))
    except Exception as e:                                   # noqa: BLE001 (recorded, and retried on --resume)
        run = failed(config, e, time.time() - started)
    return dict(run, started=started, ended=time.time())


def failed(config: TrainConfig, error: BaseException, seconds: float) -> dict:
    """The record of a run that raised ``error``."""
    return dict(config=dataclasses.asdict(config), error=f"{type(error).__name__}: {error}", best=None,
                seconds=seconds)


def print_run(run: dict, began: float) -> None:
    """One line for a finished run: its score, its own time and rate, and when it started and ended, in seconds
    since the sweep (or this part of it) ``began``."""
    head = f"{run['config']['task']} {label(run['setting'])} {run['mixer']} lr {run['lr']:g} seed {run['seed']}"
    span = f"{run['started'] - began:.0f}-{run['ended'] - began:.0f} s into the sweep" if "started" in run else ""
    if run.get("error"):
        print(f"{head}: failed{f' ({span})' if span else ''}: {run['error']}")
        return
    best = run["best"][run["metric"]] if run["best"] else float("nan")
    print(f"{head}: best {run['metric']} {best:.4f}{' (diverged)' if run['diverged'] else ''} "
          f"({run['seconds']:.0f} s, {rate(run)}{f'; {span}' if span else ''})")


def summarize_sweep(runs: list[dict]) -> dict:
    """``{mixer: {str(x): {x, best_lr, mean, std, per_lr: {lr: mean}}}}`` over the seeds' best scores
    (a diverged run scores the worst; a mean with one is NaN and never the best; a run that raised is left out)."""
    out: dict = {}
    for r in runs:
        if r.get("error"):
            continue
        cell = out.setdefault(r["mixer"], {}).setdefault(str(r["x"]), {"x": r["x"], "scores": {}, "metric": r["metric"]})
        value = r["best"][r["metric"]] if r["best"] else float("nan")
        cell["scores"].setdefault(r["lr"], []).append(value)
    for points in out.values():
        for cell in points.values():
            scores, metric = cell.pop("scores"), cell.pop("metric")
            per_lr = {lr: statistics.fmean(v) for lr, v in scores.items()}
            best = max(per_lr, key=lambda lr: score(metric, per_lr[lr]))
            cell.update(best_lr=best, mean=per_lr[best],
                        std=statistics.pstdev(scores[best]) if len(scores[best]) > 1 else 0.0,
                        per_lr={str(lr): m for lr, m in per_lr.items()})
    return out


def suite_average(summary: dict) -> dict:
    """Per mixer: the mean over MAD tasks of each task's mean over its settings (Table 1a's Avg). A mixer without
    a score on every task some mixer has gets ``average`` None and its ``missing`` tasks: a partial mean is not
    comparable."""
    per_mixer = {}
    for mixer, points in summary.items():
        per_task: dict = {}
        for key, cell in points.items():
            per_task.setdefault(str(key).split(":")[0], []).append(cell["mean"])
        per_mixer[mixer] = {t: statistics.fmean(v) for t, v in per_task.items()}
    every = list(dict.fromkeys(t for tasks in per_mixer.values() for t in tasks))
    out = {}
    for mixer, tasks in per_mixer.items():
        missing = [t for t in every if t not in tasks]
        out[mixer] = dict(tasks=tasks, average=None if missing else statistics.fmean(tasks.values()))
        if missing:
            out[mixer]["missing"] = missing
    return out


def check_points(points: list[tuple[str, dict, object]]) -> None:
    """Every varied key is a setting of its task, or ``cfg.`` and a :class:`TrainConfig` field."""
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    for task, setting, _ in points:
        unknown = [k for k in setting if k.startswith(CONFIG_PREFIX) and k[len(CONFIG_PREFIX):] not in fields]
        if unknown:
            raise UsageError(f"--vary: {', '.join(unknown)} is not a training setting; expected cfg. and one of "
                             f"{sorted(fields)}")
        checks.task_settings(task, split_setting(setting)[0], "--vary")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="regattn sweep", description=__doc__.split("\n")[0])
    add_common(p)
    p.add_argument("--mixers", required=True, help=f"comma-separated, from {', '.join(MIXER_NAMES)}")
    p.add_argument("--lrs", default="1e-3", help="comma-separated learning rates")
    p.add_argument("--vary", action="append", metavar="KEY=V1,V2,...",
                   help="a task setting to sweep; repeat for a grid (the first is the plot's x-axis, "
                        "the others are averaged in the plot)")
    p.add_argument("--resume", action="store_true",
                   help="keep the runs already in the output JSON (written after every run) and do the rest")
    p.add_argument("--preset", choices=sorted(PRESETS), help="a paper's protocol (see PRESETS); give no TASK")
    p.add_argument("--jobs", type=int, default=1, help="runs at a time, each in its own process (default 1)")
    p.add_argument("--streams", type=int, default=1,
                   help="with --jobs 1: runs at a time in this process, each at its own pace on its own "
                        "CUDA stream (default 1)")
    p.add_argument("--checkpoint-every", type=int, default=0, metavar="N",
                   help="each run checkpoints every N steps into OUT/checkpoints, and --resume continues an "
                        "interrupted run from there (default 0: it starts again)")
    p.add_argument("--stop-after", type=float, default=None, metavar="SECONDS",
                   help="start no run after this many seconds; the runs in flight end, and --resume does the rest")
    return p


def resumed(path: str | None, mixers: list[str], skipped: dict) -> tuple[list[dict], list[str], dict]:
    """``(runs, mixers, skipped)`` of a sweep continued from its JSON at ``path`` (None or missing: a new one).

    The earlier runs are kept; the mixers shown are the earlier ones with runs, in their order, then this
    call's; a mixer skipped earlier and not named now keeps its reason."""
    previous = {}
    if path is not None and os.path.exists(path):
        with open(path) as f:
            previous = json.load(f)
    done = previous.get("runs", [])
    ran = {r["mixer"] for r in done if not r.get("error")}
    shown = [m for m in dict.fromkeys(previous.get("mixers", []) + mixers) if m in mixers or m in ran]
    kept = {m: why for m, why in previous.get("skipped", {}).items() if m not in mixers}
    return done, shown, {**kept, **skipped}


def plot_results(stem: str, payload: dict) -> None:
    """The sweep's plot (best rate per point and mixer) and the curves of each point's best runs, from its JSON
    ``payload``, beside ``stem``: every point the runs hold, so a resumed sweep redraws the earlier ones too; the
    mixers in the sweep's order, whichever ran first."""
    vary, order = payload["vary"], list(dict.fromkeys(payload["mixers"] + list(payload["summary"])))
    summary = {m: payload["summary"][m] for m in order if m in payload["summary"]}
    runs = [r for r in payload["runs"] if not r.get("error")]
    first = vary[0].split(":")[0] if vary else None
    single = len(vary) == 1 and ":" not in vary[0]
    shown = summary if single or not vary else by_first_key(summary, runs, first)
    others = [k for key in vary for k in key.split(":") if k != first]
    xlabel = "task" if not vary else first + (f" (mean over {', '.join(others)})" if others else "")
    plot_sweep(shown, stem + ".png", xlabel=xlabel, metric=runs[0]["metric"], title=payload["task"])
    for i, x in enumerate(x_order([r["x"] for r in runs])):
        best = {m: [r for r in runs if r["mixer"] == m and str(r["x"]) == x and r["lr"] == summary[m][x]["best_lr"]]
                for m in payload["mixers"] if x in summary.get(m, {})}
        plot_curves(best, f"{stem}-curves-{i}.png", title=f"{payload['task']} {x}")


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(expand_preset(list(sys.argv[1:] if argv is None else argv)))
    if args.task not in TASKS and args.task not in SUITES:
        p.error(f"task: expected one of {sorted(TASKS) + list(SUITES)}, got {args.task!r}")
    mixers = [m for m in args.mixers.split(",") if m]
    unknown = [m for m in mixers if m not in MIXER_NAMES]
    if unknown:
        p.error(f"--mixers: unknown {unknown}; expected from {list(MIXER_NAMES)}")
    vary = parse_vary(args.vary or [])
    points = sweep_points(args.task, vary)
    for lr in parse_list(args.lrs, flag="--lrs"):
        checks.positive("--lrs", lr)
    check_common(args, sorted({task for task, _, _ in points}), mixers)
    checks.at_least("--jobs", args.jobs, 1)
    checks.at_least("--streams", args.streams, 1)
    if args.jobs > 1 and args.streams > 1:
        raise UsageError(f"--streams: runs go side by side in one process; expected --jobs 1 with it, "
                         f"got --jobs {args.jobs} (give --streams 1 with --jobs, also after a preset that sets it)")
    checks.at_least("--checkpoint-every", args.checkpoint_every, 0)
    if args.stop_after is not None:
        checks.positive("--stop-after", args.stop_after)
    check_points(points)
    inputs = task_inputs(points, parse_pairs(args.set, "--set"))
    warm_up(args, [m for m in mixers if m not in BASELINES], inputs)
    check = BaselineCheck.of(args, mixers, inputs)
    skipped = {} if check else refused_mixers(args, mixers, inputs)
    for mixer, reason in skipped.items():
        print(f"skipping {mixer}: {reason}")
    mixers = [m for m in mixers if m not in skipped]
    if not mixers:
        raise UsageError(f"--mixers: none runs on this machine: {skipped}")
    base = base_config(args, task=args.task if args.task in TASKS else "mad_recall",
                       checkpoint_every=args.checkpoint_every)
    stem = os.path.join(args.out, f"sweep-{args.task}")
    done, shown_mixers, skipped = resumed(stem + ".json" if args.resume else None, mixers, skipped)
    lrs, seeds = parse_list(args.lrs), parse_list(args.seeds, int)
    head = dict(task=args.task, mixers=shown_mixers, lrs=list(dict.fromkeys([r["lr"] for r in done] + lrs)),
                seeds=list(dict.fromkeys([r["seed"] for r in done] + seeds)), vary=[k for k, _ in vary],
                skipped=skipped)  # the rates and seeds of every run kept, then this call's

    def save(runs):
        later = check.answered() if check else {}         # the baselines refused by the check beside the runs
        shown = [m for m in head["mixers"] if m not in later or any(r["mixer"] == m for r in runs)]
        payload = dict(head, mixers=shown, skipped={**head["skipped"], **later}, summary=summarize_sweep(runs),
                       runs=runs)
        if args.task in SUITES:
            payload["average"] = suite_average(payload["summary"])
        write_json(stem + ".json", payload)
        return payload

    started = time.time()
    runs = run_sweep(base, mixers=mixers, lrs=lrs, seeds=seeds, points=points, done=done,
                     on_run=save, jobs=args.jobs, streams=args.streams, stop_after=args.stop_after, check=check,
                     checkpoints=os.path.join(args.out, "checkpoints") if args.checkpoint_every else None)
    wall = time.time() - started
    payload = save(runs)
    summary = payload["summary"]
    done_runs = [r for r in runs if not r.get("error")]
    failed = len(runs) - len(done_runs)
    earlier = {id(r) for r in done}
    fresh = [r for r in done_runs if id(r) not in earlier]
    steps = sum(r["steps"] - r.get("resumed_from", 0) for r in fresh)
    print(f"{len(fresh)} runs, {steps} steps in {wall:.0f} s: {steps / max(wall, 1e-9):.0f} steps/s over all runs "
          f"({args.jobs * args.streams} at a time){f'; {failed} failed (run again with --resume)' if failed else ''}")
    if not done_runs:
        return 1
    plot_results(stem, payload)
    print(json.dumps({m: {k: round(c["mean"], 4) for k, c in pts.items()} for m, pts in summary.items()}))
    if "average" in payload:
        averages = payload["average"].items()
        print(json.dumps({m: None if a["average"] is None else round(a["average"], 4) for m, a in averages}))
    print(f"wrote {stem}.json and plots")
    return 0
