"""Settings of an op (tile variants) timed side by side in one process, in rounds.

Every contender is timed once per round, one after the other, over several rounds, and keeps the least
median of each timing: a drift of the machine's speed during a pass reaches every contender alike (on an
H100, one pass over Parallax's tile variants saw the same forward settings take 3.9 to 9.4 ms).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

from regattn.bench.runner import timed
from regattn.bench.timing import measure


def tile(m: int, n: int, warps: int, stages: int) -> dict:
    """Launch settings of one tile: ``BLOCK_M`` query rows, ``BLOCK_N`` keys, warps and pipeline stages."""
    return dict(BLOCK_M=m, BLOCK_N=n, num_warps=warps, num_stages=stages)


@dataclass
class Contender:
    """One row of a timing in rounds.

    ``calls``: ``{label: (call, leaves)}``, each timed as :func:`regattn.bench.runner.timed` times a
    mode (a label ending in ``fwd+bwd`` differentiates ``leaves``, any other is the forward alone).
    ``setting()``: a context manager inside which the calls run with the contender's settings; it puts
    back the settings in use before on leaving. ``errors()``: relative errors against float64, read once,
    inside the setting. ``graphs``: the labels timed as replays of a CUDA graph; ``back_to_back``: those timed
    as eager calls issued back to back (:func:`regattn.bench.timing.back_to_back_ms`).
    """
    calls: dict
    setting: Callable = contextlib.nullcontext
    errors: Callable | None = None
    graphs: frozenset = frozenset()
    back_to_back: frozenset = frozenset()


def least(times: list) -> float | None:
    """The least of the measured times (None where a round failed), or None."""
    return min((t for t in times if t is not None), default=None)


def time_in_rounds(contenders: list[Contender], *, cuda: bool, rep_ms: int = 100, rounds: int = 3) -> list[dict]:
    """Time every contender's calls once per round, in order, for ``rounds`` rounds.

    Returns:
        One dict per contender: ``status`` (``"ok"`` or why a timing failed), ``rounds`` (each round's
        median ms per label, None where it failed), ``err`` (what ``errors()`` gave, where given) and
        ``{label}_ms`` (the least over the rounds of the median ms, None where no round measured it).
    """
    rows = [dict(status="ok", rounds={label: [] for label in c.calls}) for c in contenders]
    for _ in range(rounds):
        for contender, row in zip(contenders, rows):
            with contender.setting():
                for label, (call, leaves) in contender.calls.items():
                    m = measure(timed(call, leaves, label), cuda=cuda, graph=label in contender.graphs,
                                back_to_back=label in contender.back_to_back, rep_ms=rep_ms)
                    row["rounds"][label].append(m.ms)
                    if m.status != "ok":
                        row["status"] = m.status
                if contender.errors is not None and "err" not in row:
                    row["err"] = contender.errors()
    for row in rows:
        for label, times in row["rounds"].items():
            row[f"{label}_ms"] = least(times)
    return rows
