"""``regattn bench SUITE | all | report``: run a suite, print its table, write JSON and a plot."""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

from regattn.bench import report, results, suites
from regattn.bench.runner import Setup, format_table, run_suite

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}


def parse_value(text: str):
    if text.lower() == "none":
        return None
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            return text


def parse_shapes(specs: list[str] | None, suite, cuda: bool) -> list[dict]:
    """Grid names (``tiny``, ``default``, ``full``) or ``KEY=V[/V...],...`` specs, each expanded
    to the product of its alternatives: ``B=4,H=16,T=2048/8192,D=128,window=none/1024``."""
    if not specs:
        return list(suite.GRIDS["default" if cuda else "tiny"])
    shapes = []
    for spec in specs:
        if spec in suite.GRIDS:
            shapes += suite.GRIDS[spec]
            continue
        keys, choices = [], []
        for item in spec.split(","):
            key, sep, values = item.partition("=")
            if not sep or not key:
                raise ValueError(f"--shapes: expected KEY=VALUE[/VALUE...] items or one of {sorted(suite.GRIDS)}, "
                                 f"got {item!r}")
            keys.append(key.strip())
            choices.append([parse_value(v.strip()) for v in values.split("/")])
        shapes += [dict(zip(keys, combo)) for combo in itertools.product(*choices)]
    return shapes


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="regattn bench", description=__doc__)
    p.add_argument("suite", help=f"one of {', '.join(suites.NAMES)}; 'all' for every suite; 'report' to "
                                 "write docs/PERFORMANCE.md from benchmarks/results")
    p.add_argument("--shapes", nargs="+", help="grid names (tiny, default, full) or KEY=V[/V...],... specs")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="input dtype (default bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--peers", help="comma-separated peers (sdpa-flash, sdpa-cudnn, sdpa-efficient, sdpa-math, "
                                   "sdpa, flex, fla, reference, copy) or 'none'; default: the suite's own list")
    p.add_argument("--backend", default="auto", choices=("auto", "torch", "triton"), help="backend of our ops")
    p.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    p.add_argument("--rep-ms", type=int, default=100, help="timing window of do_bench, in ms")
    p.add_argument("--out", help="result JSON (default benchmarks/results/<device>/<suite>.json on a GPU; "
                                 "none written on CPU unless given)")
    p.add_argument("--plot", help="PNG of the results")
    p.add_argument("--root", default=".", help="for 'report': the folder holding benchmarks/ and docs/")
    return p


def run_one(name: str, args, device: str) -> dict:
    suite = suites.get(name)
    cuda = device.startswith("cuda")
    dtype = DTYPES[args.dtype or ("bf16" if cuda else "fp32")]
    peers = tuple(suite.PEERS) if args.peers is None else tuple(p for p in args.peers.split(",") if p and p != "none")
    setup = Setup(dtype=dtype, device=device, backend=args.backend, peers=peers, rep_ms=args.rep_ms)
    shapes = parse_shapes(args.shapes, suite, cuda)
    machine = results.machine_info(device)
    config = {"dtype": args.dtype or ("bf16" if cuda else "fp32"), "backend": args.backend, "peers": list(peers),
              "rep_ms": args.rep_ms, "cpu_smoke": not cuda}
    out = Path(args.out) if args.out else (results.default_path(name, machine) if cuda else None)
    if out is not None and args.suite == "all" and args.out:
        out = out.with_name(f"{out.stem}-{name}{out.suffix}")

    def save(rows):
        if out is not None:
            results.write_result(out, results.make_result(name, machine, config, rows))

    torch.manual_seed(0)
    print(f"# {name} on {machine['name']} ({machine['device']}), torch {machine['torch']}, triton {machine['triton']}, "
          f"CUDA {machine['cuda']}, {config['dtype']}", flush=True)
    rows = run_suite(suite, shapes, setup, on_shape=save)
    result = results.make_result(name, machine, config, rows)
    print(format_table(rows), flush=True)
    if out is not None:
        print(f"wrote {results.write_result(out, result)}")
    if args.plot:
        plot = Path(args.plot)
        if args.suite == "all":
            plot = plot.with_name(f"{plot.stem}-{name}{plot.suffix}")
        print(f"wrote {report.plot_result(result, plot)}")
    return result


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.suite == "report":
        path = report.write_report(args.root)
        print(f"wrote {path}")
        return 0
    names = suites.NAMES if args.suite == "all" else (args.suite,)
    if args.suite != "all" and args.suite not in suites.NAMES:
        parser().error(f"suite: expected one of {', '.join(suites.NAMES)}, 'all' or 'report', got {args.suite!r}")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    for name in names:
        run_one(name, args, device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
