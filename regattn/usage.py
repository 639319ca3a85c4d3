"""Usage errors of the ``regattn`` commands: one line on stderr and exit status 2, as argparse does.

A command validates its arguments before it starts working and raises :class:`UsageError` for a bad
one; :func:`run_command` reports it as ``regattn CMD: error: MESSAGE``. An argparse parser's own
errors (an unknown option, a value of the wrong type, ``parser.error``) take the same path, without
argparse's usage block. Any other exception is a bug and keeps its traceback.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys


class UsageError(ValueError):
    """A bad command-line argument; the message names it."""


def raise_usage_error(parser: argparse.ArgumentParser, message: str):
    raise UsageError(message)


@contextlib.contextmanager
def parser_errors_raise():
    """While open, ``ArgumentParser.error(message)`` raises :class:`UsageError` instead of printing the
    usage and exiting (the commands build plain argparse parsers)."""
    error = argparse.ArgumentParser.error
    argparse.ArgumentParser.error = raise_usage_error
    try:
        yield
    finally:
        argparse.ArgumentParser.error = error


def run_command(prog: str, main, argv: list[str]) -> int:
    """``main(argv)``'s exit status; 2 with one line on stderr for a :class:`UsageError`."""
    try:
        with parser_errors_raise():
            return main(argv) or 0
    except UsageError as e:
        print(f"{prog}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2


def exit_process(code: int) -> None:
    """End the process with ``code``; a rank of a torchrun launch (``WORLD_SIZE > 1``) ends without
    finalizing Python.

    A distributed run's process group outlives ``destroy_process_group`` (DTensor's sharding caches keep
    its device mesh), so gloo's worker threads still run while Python finalizes. One that then drops the
    last reference to a finished collective's tensors must take the GIL, and Python ends such a thread in
    a way that aborts the process ("terminate called without an active exception"). Once the command has
    returned, its results are written and the process group destroyed: nothing is left to finalize."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def device(flag: str, name: str) -> None:
    """``auto``, ``cpu``, or a CUDA device this machine has."""
    import torch

    if name == "auto":
        return
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise UsageError(f"{flag}: expected auto, cpu or cuda[:N], got {name!r}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"{flag} {name}: no CUDA device is available")
    if dev.type == "cuda" and (dev.index or 0) >= torch.cuda.device_count():
        raise UsageError(f"{flag} {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
