"""``regattn train TASK --mixer NAME [--lr ...] [--seeds ...] [--steps ...]``: train one mixer on one task.

Each seed is a separate run (data and initialisation); the JSON written under ``--out`` holds every
run's history and final / best test metric and their mean over seeds, and a plot of the curves.
Task settings go through ``--set key=value`` (e.g. ``--set length=128 --set pairs=16``), mixer
options through ``--mixer-opt key=value`` (e.g. ``--mixer-opt lam=0.1``), or ``MIXER.key=value`` for one
mixer of a sweep (``--mixer-opt mamba2.state_size=4``).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics

from regattn.models.baselines import refusals
from regattn.models.mixers import MIXER_NAMES, options_for
from regattn.models.stack import first_passes
from regattn.tasks import TASKS, task_input
from regattn.train import checks
from regattn.train.optim import OPTIMIZERS
from regattn.train.schedules import SCHEDULES
from regattn.train.step import COMPILE_MODES
from regattn.train.trainer import TrainConfig, resolve_device, train
from regattn.usage import UsageError


def parse_value(text: str):
    """``"3" -> 3``, ``"0.1" -> 0.1``, ``"true" -> True``, ``"none" -> None``, else the text."""
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low == "none":
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_pairs(items: list[str] | None, flag: str) -> dict:
    """``["a=1", "b=x"] -> {"a": 1, "b": "x"}``."""
    out = {}
    for item in items or []:
        if "=" not in item:
            raise UsageError(f"{flag}: expected key=value, got {item!r}")
        key, value = item.split("=", 1)
        out[key.strip()] = parse_value(value.strip())
    return out


def parse_list(text: str, kind=float, flag: str = "list") -> list:
    """``"1e-3,5e-4" -> [1e-3, 5e-4]``; at least one value."""
    try:
        values = [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"{flag}: expected comma-separated {kind.__name__} values, got {text!r}") from None
    if not values:
        raise UsageError(f"{flag}: expected at least one value, got {text!r}")
    return values


def add_common(p: argparse.ArgumentParser) -> None:
    """The options shared by ``train`` and ``sweep``."""
    p.add_argument("task", nargs="?", help=f"one of {', '.join(sorted(TASKS))}")
    p.add_argument("--seeds", default="0", help="comma-separated seeds (default 0)")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--epochs", type=float, default=None, help="train for this many epochs instead of --steps")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--betas", default="0.9,0.999", help="AdamW betas (default 0.9,0.999)")
    p.add_argument("--schedule", choices=SCHEDULES, default="wsd")
    p.add_argument("--warmup", type=float, default=None, help="warm-up fraction (schedule default)")
    p.add_argument("--decay-start", type=float, default=None, help="decay start fraction (schedule default)")
    p.add_argument("--wda-gamma", type=float, default=0.0, help="weight-decay annealing exponent (eq. 42)")
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--no-mlp", action="store_true", help="mixer-only blocks (lla's in-context regression)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="a task setting")
    p.add_argument("--mixer-opt", action="append", metavar="KEY=VALUE",
                   help="a mixer option; MIXER.KEY=VALUE for that mixer alone")
    p.add_argument("--eval-every", type=int, default=0, help="evaluate every N steps (and at the end)")
    p.add_argument("--eval-batch-size", type=int, default=256)
    p.add_argument("--device", default="auto")
    p.add_argument("--no-amp", action="store_true", help="no bf16 autocast on CUDA")
    p.add_argument("--out", default="out/train", help="folder for JSON results and plots")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--log-every", type=int, default=100,
                   help="read the training loss and accuracy back every N steps (default 100)")
    p.add_argument("--compile", choices=COMPILE_MODES, default="none",
                   help="torch.compile the model and the loss with this mode (default none)")
    p.add_argument("--cuda-graph", action="store_true",
                   help="on CUDA, replay each step as one CUDA graph (with --compile none or default)")


def check_common(args, tasks: list[str], mixers: list[str]) -> None:
    """The shared options' values (``--set`` gives settings of each of ``tasks``)."""
    if args.epochs is None:
        checks.at_least("--steps", args.steps, 1)
    else:
        checks.positive("--epochs", args.epochs)
    for flag in ("batch_size", "eval_batch_size", "dim", "layers", "heads"):
        checks.at_least("--" + flag.replace("_", "-"), getattr(args, flag), 1)
    checks.at_least("--eval-every", args.eval_every, 0)
    checks.at_least("--log-every", args.log_every, 1)
    for flag in ("weight_decay", "wda_gamma", "clip"):
        checks.non_negative("--" + flag.replace("_", "-"), getattr(args, flag))
    if args.cuda_graph and args.compile == "reduce-overhead":
        raise UsageError("--cuda-graph: captures the whole step itself; expected --compile none or default, "
                         "got reduce-overhead")
    if args.cuda_graph and args.wda_gamma:
        raise UsageError(f"--wda-gamma: a CUDA graph holds the weight decay it was captured with; expected 0 "
                         f"with --cuda-graph, got {args.wda_gamma}")
    checks.fraction("--warmup", args.warmup)
    checks.fraction("--decay-start", args.decay_start)
    betas = parse_list(args.betas, flag="--betas")
    if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
        raise UsageError(f"--betas: expected two values in [0, 1), got {args.betas!r}")
    for seed in parse_list(args.seeds, int, "--seeds"):
        checks.at_least("--seeds", seed, 0)
    checks.device("--device", args.device)
    for task in tasks:
        checks.task_settings(task, parse_pairs(args.set, "--set"))
    options = parse_pairs(args.mixer_opt, "--mixer-opt")
    for mixer in mixers:
        checks.mixer_options(mixer, options, dim=args.dim, heads=args.heads)


def refused_mixers(args, mixers: list[str], inputs: list[tuple[str, int]]) -> dict[str, str]:
    """``{mixer: reason}`` for the baselines among ``mixers`` that FLA will not run on ``--device`` at these
    sizes, the batch sizes and the runs' ``inputs``, ``(kind, length)`` pairs
    (:func:`regattn.models.baselines.refusal`)."""
    options = parse_pairs(args.mixer_opt, "--mixer-opt")
    return refusals(mixers, dim=args.dim, heads=args.heads, device=resolve_device(args.device),
                    options={m: options_for(m, options) for m in mixers}, batch=args.batch_size, inputs=inputs,
                    eval_batch=args.eval_batch_size)


def warm_mixer(args, mixer: str, inputs: list[tuple[str, int]]) -> None:
    """The first pass of ``mixer`` in a model (:func:`regattn.models.stack.first_passes`) on ``--device`` at these
    sizes, the batch sizes and each ``(kind, length)`` of the runs' ``inputs``."""
    options = options_for(mixer, parse_pairs(args.mixer_opt, "--mixer-opt"))
    first_passes(mixer, args.dim, args.heads, resolve_device(args.device), batch=args.batch_size, inputs=inputs,
                 eval_batch=args.eval_batch_size, **options)


def base_config(args, **overrides) -> TrainConfig:
    """A :class:`TrainConfig` from the shared options."""
    fields = dict(task=args.task, task_options=parse_pairs(args.set, "--set"),
                  mixer_options=parse_pairs(args.mixer_opt, "--mixer-opt"), dim=args.dim, layers=args.layers,
                  heads=args.heads, mlp=not args.no_mlp, optimizer=args.optimizer, weight_decay=args.weight_decay,
                  betas=tuple(parse_list(args.betas)),
                  clip=args.clip, schedule=args.schedule, warmup=args.warmup, decay_start=args.decay_start,
                  wda_gamma=args.wda_gamma, steps=args.steps, epochs=args.epochs, batch_size=args.batch_size, eval_every=args.eval_every,
                  eval_batch_size=args.eval_batch_size, device=args.device, amp=not args.no_amp,
                  progress=not args.quiet, log_every=args.log_every, compile=args.compile,
                  cuda_graph=args.cuda_graph)
    fields.update(overrides)
    return TrainConfig(**fields)


def record(result: dict, max_points: int = 500) -> dict:
    """A run's result without the model, its per-step training history thinned to ``max_points`` rows."""
    out = {k: v for k, v in result.items() if k != "model"}
    rows = out["history"]["train"]
    stride = -(-len(rows) // max_points) if rows else 1
    out["history"] = dict(out["history"], train=rows[stride - 1::stride])
    return out


def rate(result: dict) -> str:
    """``"N steps/s"`` of a run's result (its ``steps_per_second``), or ``"- steps/s"`` when not measured."""
    sps = result.get("steps_per_second")
    return f"{sps:.0f} steps/s" if sps is not None else "- steps/s"


def seed_mean(results: list[dict], which: str) -> float | None:
    values = [r[which][r["metric"]] for r in results if r[which] is not None]
    return statistics.fmean(values) if values else None


def write_json(path: str, payload) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="regattn train", description=__doc__.split("\n")[0])
    add_common(p)
    p.add_argument("--mixer", required=True, choices=MIXER_NAMES)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--checkpoint", default=None,
                   help="checkpoint path (one per seed: '{seed}' in the path is replaced); resumed when present")
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.add_argument("--analyze-every", type=int, default=0,
                   help="record the per-layer diagnostics (COR, ranks, scores) every N steps")
    args = p.parse_args(argv)
    if args.task not in TASKS:
        p.error(f"task: expected one of {sorted(TASKS)}, got {args.task!r}")
    checks.positive("--lr", args.lr)
    checks.at_least("--checkpoint-every", args.checkpoint_every, 0)
    checks.at_least("--analyze-every", args.analyze_every, 0)
    check_common(args, [args.task], [args.mixer])
    refused = refused_mixers(args, [args.mixer], [task_input(args.task, **parse_pairs(args.set, "--set"))])
    if refused:
        raise UsageError(f"--mixer {args.mixer}: {refused[args.mixer]}")
    runs = []
    for seed in parse_list(args.seeds, int):
        ckpt = None if args.checkpoint is None else args.checkpoint.replace("{seed}", str(seed))
        config = base_config(args, mixer=args.mixer, lr=args.lr, seed=seed, checkpoint=ckpt,
                             checkpoint_every=args.checkpoint_every, analyze_every=args.analyze_every)
        runs.append(record(train(config)))
        r = runs[-1]
        final, best = (float("nan") if e is None else e[r["metric"]] for e in (r["final"], r["best"]))
        print(f"{args.task} {args.mixer} seed {seed}: final {r['metric']} {final:.4f}, best {best:.4f}"
              f"{' (diverged)' if r['diverged'] else ''} ({r['seconds']:.0f} s, {rate(r)})")
    summary = dict(task=args.task, mixer=args.mixer, lr=args.lr, metric=runs[0]["metric"],
                   final_mean=seed_mean(runs, "final"), best_mean=seed_mean(runs, "best"))
    stem = os.path.join(args.out, f"{args.task}-{args.mixer}")
    write_json(stem + ".json", dict(summary=summary, runs=runs))
    from regattn.train.plots import plot_curves, plot_diagnostics
    plot_curves({args.mixer: runs}, stem + "-curves.png", title=f"{args.task}")
    for r in runs:
        plot_diagnostics(r, f"{stem}-diagnostics-seed{r['config']['seed']}.png", title=f"{args.task} {args.mixer}")
    print(json.dumps(summary))
    print(f"wrote {stem}.json and {stem}-curves.png")
    return 0
