"""``regattn bench SUITE | all | report``: run suites, print their tables, write JSON and plots.

On a GPU every suite runs its goal shapes (``--quick``: a subset) unless ``--shapes`` names
others, and writes ``benchmarks/results/<device>/<suite>.json``; on the CPU the tiny shapes run
as a smoke test and nothing is written unless ``--out`` is given.
"""
from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

import torch

from regattn.bench import peers as peer_names, report, results, suites
from regattn.bench.runner import Setup, format_table, run_suite
from regattn import usage
from regattn.usage import UsageError, run_command

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}


def parse_value(text: str):
    """``none``, ``true`` / ``false``, an int, a float, or the text itself."""
    word = {"none": None, "true": True, "false": False}
    if text.lower() in word:
        return word[text.lower()]
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            return text


def parse_shapes(specs: list[str] | None, suite, cuda: bool, quick: bool = False) -> list[dict]:
    """Grid names (``tiny``, ``goal``, ``quick``, ``full``) or ``KEY=V[/V...],...`` specs, each expanded
    to the product of its alternatives: ``B=4,H=16,T=2048/8192,D=128,window=none/1024``."""
    if not specs:
        return list(suite.GRIDS[("quick" if quick else "goal") if cuda else "tiny"])
    shapes = []
    for spec in specs:
        if spec in suite.GRIDS:
            shapes += suite.GRIDS[spec]
            continue
        if len(spec.split()) > 1:
            raise UsageError(f"--shapes: {spec!r} holds several specs: pass each as an argument of its own")
        keys, choices = [], []
        for item in spec.split(","):
            key, sep, values = item.partition("=")
            key = key.strip()
            if not sep or not key or not values.strip():
                raise UsageError(f"--shapes: expected KEY=VALUE[/VALUE...] items or one of {sorted(suite.GRIDS)}, "
                                 f"got {item!r}")
            if key in keys:
                raise UsageError(f"--shapes: {key!r} given twice in {spec!r}")
            keys.append(key)
            choices.append([parse_value(v.strip()) for v in values.split("/")])
        shapes += [dict(zip(keys, combo)) for combo in itertools.product(*choices)]
    return shapes


def parse_peers(text: str | None, suite, quick: bool = False) -> tuple:
    """``--peers``: comma-separated names from :data:`regattn.bench.peers.PEERS` (``sdpa`` for every
    SDPA backend), ``none``, or the suite's own list when not given (with ``--quick`` its short list:
    the main peers that need no autotuning of their own)."""
    if text is None:
        return tuple(suite.QUICK_PEERS if quick else suite.PEERS)
    names = tuple(p.strip() for p in text.split(",") if p.strip() and p.strip() != "none")
    unknown = [p for p in names if p not in peer_names.PEERS and p != "sdpa"]
    if unknown:
        raise UsageError(f"--peers: expected names from {', '.join(peer_names.PEERS)}, sdpa or none, "
                         f"got {', '.join(map(repr, unknown))}")
    return names


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="regattn bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("suite", help=f"one of {', '.join(suites.NAMES)}; 'all' for every suite; 'report' to "
                                 "write docs/PERFORMANCE.md from benchmarks/results")
    p.add_argument("--shapes", nargs="+", help="grid names (tiny, goal, quick, full) or KEY=V[/V...],... specs")
    p.add_argument("--quick", action="store_true",
                   help="the quick subset of the goal shapes, against the suite's short list of peers")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="input dtype (default bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--peers", help=f"comma-separated peers ({', '.join(peer_names.PEERS)}, sdpa) or 'none'; "
                                   "default: the suite's own list")
    p.add_argument("--backend", default="auto", choices=("auto", "torch", "triton"), help="backend of our ops")
    p.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    p.add_argument("--rep-ms", type=int, default=100, help="timing window of do_bench, in ms")
    p.add_argument("--out", help="result JSON, or with 'all' a folder (default benchmarks/results/<device>/ on a "
                                 "GPU; none written on CPU unless given)")
    p.add_argument("--plot", help="PNG of the results (with 'all': a folder)")
    p.add_argument("--root", default=".", help="for 'report': the folder holding benchmarks/ and docs/")
    return p


def output_path(arg: str | None, name: str, every: bool, machine: dict, cuda: bool, suffix: str) -> Path | None:
    """Where one suite's file goes: ``arg`` itself, ``arg/<suite><suffix>`` for ``all``, or the default."""
    if arg:
        return Path(arg) / f"{name}{suffix}" if every else Path(arg)
    return results.default_path(name, machine) if cuda and suffix == ".json" else None


def grid_name(specs: list[str] | None, suite, quick: bool, cuda: bool) -> str:
    """The shapes a run took, by name: the one grid ``--shapes`` named, else ``custom``; without ``--shapes`` the
    default grid (``goal`` or ``quick`` on a GPU, ``tiny`` on the CPU)."""
    if specs:
        return specs[0] if len(specs) == 1 and specs[0] in suite.GRIDS else "custom"
    return ("quick" if quick else "goal") if cuda else "tiny"


def run_one(name: str, args, device: str) -> dict:
    suite = suites.get(name)
    cuda = device.startswith("cuda")
    dtype = args.dtype or ("bf16" if cuda else "fp32")
    peers = parse_peers(args.peers, suite, args.quick)
    setup = Setup(dtype=DTYPES[dtype], device=device, backend=args.backend, peers=peers, rep_ms=args.rep_ms)
    shapes = parse_shapes(args.shapes, suite, cuda, args.quick)
    machine = results.machine_info(device)
    config = {"dtype": dtype, "backend": args.backend, "peers": list(peers), "rep_ms": args.rep_ms,
              "grid": grid_name(args.shapes, suite, args.quick, cuda), "cpu_smoke": not cuda}
    every = args.suite == "all"
    out = output_path(args.out, name, every, machine, cuda, ".json")
    start = time.perf_counter()

    def save(rows):
        if out is not None:
            config["seconds"] = round(time.perf_counter() - start, 1)
            results.write_result(out, results.make_result(name, machine, config, rows))

    torch.manual_seed(0)
    print(f"# {name} on {machine['name']} ({machine['device']}), torch {machine['torch']}, triton {machine['triton']}, "
          f"CUDA {machine['cuda']}, {dtype}", flush=True)
    rows = run_suite(suite, shapes, setup, on_shape=save)
    save(rows)
    result = results.make_result(name, machine, config, rows)
    print(format_table(rows), flush=True)
    if out is not None:
        print(f"wrote {out} ({config['seconds']} s)")
    plot = output_path(args.plot, name, every, machine, cuda, ".png")
    if plot is not None:
        print(f"wrote {report.plot_result(result, plot)}")
    return result


def suite_names(arg: str) -> tuple:
    return {"all": suites.NAMES, "report": ()}.get(arg, (arg,))


def check_args(args) -> str:
    """Refuse what cannot run before any suite starts; return the device."""
    if args.suite not in (*suites.NAMES, "all", "report"):
        raise UsageError(f"suite: expected one of {', '.join(suites.NAMES)}, 'all' or 'report', got {args.suite!r}")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    usage.device("--device", device)
    if args.rep_ms < 1:
        raise UsageError(f"--rep-ms: expected a positive number of milliseconds, got {args.rep_ms}")
    for name in suite_names(args.suite):
        suite = suites.get(name)
        parse_peers(args.peers, suite, args.quick)
        parse_shapes(args.shapes, suite, torch.device(device).type == "cuda", args.quick)
    return device


def main(argv=None) -> int:
    """Bad arguments raise :class:`regattn.usage.UsageError` before any suite starts (``regattn bench``
    reports it on one line with exit status 2)."""
    args = parser().parse_args(argv)
    device = check_args(args)
    if args.suite == "report":
        print(f"wrote {report.write_report(args.root)}")
        return 0
    for name in suite_names(args.suite):
        run_one(name, args, device)
    return 0


if __name__ == "__main__":
    sys.exit(run_command("regattn bench", main, sys.argv[1:]))
