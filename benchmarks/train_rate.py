"""Optimizer steps per second of the task trainer on parallax's MAD configuration: mad_recall (length 128,
12800 examples), the 2-layer d=128 model, batch 128, Muon, WSD without warm-up.

    PYTHONPATH=. python benchmarks/train_rate.py --mixer softmax --epochs 5 [--compile default] [--cuda-graph] \
        [--runs N] [--profile K] [--mixer-opt MIXER.KEY=VALUE]

Prints one JSON line: ``run_steps_per_second``, the run's steps over the trainer's own ``seconds`` (its loop:
the first steps, any compilation and the final evaluation included; every version of the trainer reports
it, so it compares versions), and ``steps_per_second`` where the trainer measures it (from the first log
point to the end, evaluations left out). ``--runs N`` trains N runs (seeds 0 to N-1) at once in this process,
each at its own pace on its own CUDA stream (:mod:`regattn.train.interleave`), and reports the sums
over the runs, and the wall time from the first run's start to the last one's end; ``--mixer a,b,...`` gives run i
the list's entry i modulo its length (runs of different mixers in flight together). ``--profile K`` instead
profiles the N runs in flight (after 50 steps each, over 40 more; CUDA) and prints the kernels a step, their
summed time a step, the share of the window in which some kernel ran, the window a step, and the K kernels that
took the most time (time and calls a step).
"""
import argparse
import dataclasses
import functools
import json
import time

import torch

from regattn.train.cli import parse_pairs
from regattn.train.interleave import Slot, interleave
from regattn.train.trainer import TrainConfig, training


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mixer", default="softmax", help="a mixer, or a list: run i takes the i-th modulo its length")
    p.add_argument("--mixer-opt", action="append", metavar="KEY=VALUE", help="a mixer option (MIXER.KEY: one mixer's)")
    p.add_argument("--epochs", type=float, default=5)
    p.add_argument("--num-train", type=int, default=12_800)
    p.add_argument("--compile", default=None, help="none, default or reduce-overhead (trainers that have it)")
    p.add_argument("--cuda-graph", action="store_true", help="replay each step as one CUDA graph (trainers that have it)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--runs", type=int, default=1, help="runs trained at once, each on its own stream")
    p.add_argument("--profile", type=int, default=None, metavar="K", help="profile the runs in flight; show K kernels")
    args = p.parse_args()
    extra = {} if args.compile is None else {"compile": args.compile}
    if args.cuda_graph:
        extra["cuda_graph"] = True
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    for name in extra:
        if name not in known:
            p.error(f"--{name.replace('_', '-')}: this trainer has no {name} option")
    mixers = args.mixer.split(",")
    config = TrainConfig(task="mad_recall", task_options=dict(num_train=args.num_train), mixer=mixers[0],
                         mixer_options=parse_pairs(args.mixer_opt, "--mixer-opt"), optimizer="muon", schedule="wsd",
                         warmup=0.0, decay_start=0.8, epochs=args.epochs, batch_size=128, device=args.device,
                         progress=False, **extra)
    if args.runs < 1:
        p.error(f"--runs: expected a value >= 1, got {args.runs}")
    configs = [dataclasses.replace(config, seed=seed, mixer=mixers[seed % len(mixers)]) for seed in range(args.runs)]
    if args.profile is not None:
        profile(configs, args.profile)
        return
    began = time.perf_counter()
    ended = {}
    for seed, outcome in interleave([(seed, functools.partial(training, c)) for seed, c in enumerate(configs)],
                                    args.runs, torch.device(args.device)):
        if isinstance(outcome, BaseException):
            raise outcome
        ended[seed] = outcome
    wall = time.perf_counter() - began
    results = [ended[seed] for seed in range(args.runs)]
    rates = [r.get("steps_per_second") for r in results]
    steps = sum(r["steps"] for r in results)
    device = torch.cuda.get_device_name() if config.device.startswith("cuda") else config.device
    print(json.dumps(dict(mixer=args.mixer, compile=args.compile or "none", cuda_graph=args.cuda_graph, runs=args.runs,
                          steps=steps, seconds=round(max(r["seconds"] for r in results), 2),
                          wall_seconds=round(wall, 2), wall_steps_per_second=round(steps / wall, 1),
                          run_steps_per_second=round(sum(r["steps"] / r["seconds"] for r in results), 1),
                          steps_per_second=None if None in rates else round(sum(rates), 1),
                          run_rates=[r.get("steps_per_second") and round(r["steps_per_second"], 1) for r in results],
                          test_accuracy=[round(r["final"]["accuracy"], 4) for r in results], device=device)))


def profile(configs: list[TrainConfig], shown: int, warm: int = 50, rounds: int = 40) -> None:
    """Profile the runs of ``configs`` in flight, each on its own stream, over ``rounds`` steps each after
    ``warm``."""
    slots = [Slot(seed, training(config), torch.cuda.Stream()) for seed, config in enumerate(configs)]
    runs = len(configs)

    def turns(count: int) -> None:
        """``count`` steps of every run, in turns, and the device's end of them."""
        for _ in range(count):
            for slot in slots:
                slot.advance()
        torch.cuda.synchronize()

    turns(warm)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        turns(rounds)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    spans = sorted((e.time_range.start, e.time_range.end) for e in kernels)
    busy, (start, end) = 0, spans[0]
    for a, b in spans[1:]:                       # the union of the kernels' intervals
        if a > end:
            busy, start = busy + end - start, a
        end = max(end, b)
    busy += end - start
    steps = rounds * runs
    window = max(b for _, b in spans) - spans[0][0]
    print(json.dumps(dict(mixer=",".join(c.mixer for c in configs), compile=configs[0].compile, runs=runs,
                          kernels_per_step=round(len(kernels) / steps),
                          kernel_us_per_step=round(sum(b - a for a, b in spans) / steps, 1),
                          busy_share=round(busy / window, 3), window_us_per_step=round(window / steps, 1),
                          device=torch.cuda.get_device_name())))
    totals: dict = {}
    for e in kernels:
        us, calls = totals.get(e.name, (0, 0))
        totals[e.name] = (us + e.time_range.elapsed_us(), calls + 1)
    for name, (us, calls) in sorted(totals.items(), key=lambda item: -item[1][0])[:shown]:
        print(f"{us / steps:9.1f} us a step {calls / steps:6.1f} calls  {name[:100]}")


if __name__ == "__main__":
    main()
