"""The ``regattn`` command: each subcommand lives in its own module and is imported on use.

A bad argument ends a subcommand with one line on stderr and exit status 2 (:mod:`regattn.usage`).
"""
from __future__ import annotations

import importlib
import sys

from regattn.usage import exit_process, run_command

COMMANDS = {
    "demo": ("regattn.demo", "test-time regression on non-stationary piecewise-linear data (LLA paper, Section 4)"),
    "tune": ("regattn.ops.decay.tune", "measure the decay methods on this GPU; write the method='auto' table"),
    "bench": ("regattn.bench.cli", "time ops against their peers; write JSON results and plots"),
    "verify": ("regattn.ops.scan.verify", "drift of the ELSA scan against float64 over a sweep of n (elsa C.2)"),
    "train": ("regattn.train.cli", "train a mixer on a synthetic task (MQAR, MAD, state tracking, ...); JSON and plots"),
    "sweep": ("regattn.train.sweep", "mixers x learning rates x seeds on a task; best lr, mean over seeds; JSON and plots"),
    "analyze": ("regattn.analysis.cli", "diagnostics of a checkpoint per layer: COR, Corr, CPA, ranks, circuits, scores"),
    "lm": ("regattn.train.lm", "train a decoder LM (any mixer per layer) on the standard-library byte corpus; torchrun-ready"),
    "scaling": ("regattn.train.scaling", "the LM's throughput on 1 and N processes (FSDP2) per mixer; JSON, table, curves"),
}


def usage() -> str:
    rows = "\n".join(f"  {name:<8} {doc}" for name, (_, doc) in COMMANDS.items())
    return f"usage: regattn [--version] COMMAND [ARGS...]\n\ncommands:\n{rows}\n"


def version() -> str:
    from regattn import __version__
    return __version__


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv:
        print(usage(), file=sys.stderr)
        return 2
    if argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if argv[0] == "--version":
        print(f"regattn {version()}")
        return 0
    if argv[0] not in COMMANDS:
        print(f"regattn: error: unknown command {argv[0]!r}\n\n{usage()}", file=sys.stderr)
        return 2
    name, rest = argv[0], argv[1:]
    command = importlib.import_module(COMMANDS[name][0]).main
    return run_command(f"regattn {name}", command, rest)


def run() -> None:
    """The ``regattn`` executable and ``python -m regattn``: the process ends with :func:`main`'s status
    (:func:`regattn.usage.exit_process`)."""
    exit_process(main())


if __name__ == "__main__":
    run()
