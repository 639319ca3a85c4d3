"""Several training runs in one process, taking turns step by step, each on its own CUDA stream.

    for index, outcome in interleave(starts, width=3):
        ...                     # outcome: the run's result, or the exception it raised

``starts`` yields ``(index, make)``: ``make()`` returns a run as a generator (:func:`regattn.train.trainer.training`),
whose ``next()`` issues one step and whose return value is the result. ``width`` runs are in flight at a time; each
``next()`` runs under its run's stream, so that the device runs one run's kernels beside another's (on the CPU the
runs just take turns). Runs of one model shape share its compiled code and its kernels' tuning, where processes
(``regattn sweep --jobs``) compile and tune each run for itself; one process compiles one model at a time, though,
while the others wait. On an H200 six runs of the MAD model in flight kept the device busy 99% of the time, at
1.4x the steps per second of one run alone (docs/EXPERIMENTS.md).
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator, Iterable, Iterator

import torch


class Slot:
    """A run in flight: its index, its generator, and the stream its steps are issued on (None on the CPU)."""

    def __init__(self, index: int, steps: Generator, stream):
        self.index, self.steps, self.stream = index, steps, stream

    def advance(self):
        """Issue the run's next step (``StopIteration`` with its result once it has ended)."""
        with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
            next(self.steps)


def interleave(starts: Iterable[tuple[int, Callable[[], Generator]]], width: int,
               device: torch.device | None = None) -> Iterator[tuple[int, object]]:
    """``(index, result or exception)`` of each run as it ends, ``width`` runs in flight, each on its own stream of
    ``device`` when it is a CUDA device. A run that raises ends with its exception; the others go on."""
    if width < 1:
        raise ValueError(f"width: expected a value >= 1, got {width}")
    cuda = device is not None and torch.device(device).type == "cuda"
    pending, slots = iter(starts), []
    while True:
        while len(slots) < width and (start := next(pending, None)) is not None:
            index, make = start
            slots.append(Slot(index, make(), torch.cuda.Stream(device) if cuda else None))
        if not slots:
            return
        for slot in list(slots):
            try:
                slot.advance()
            except StopIteration as end:
                slots.remove(slot)
                yield slot.index, end.value
            except Exception as error:                   # noqa: BLE001 (the run's outcome; the others go on)
                slots.remove(slot)
                yield slot.index, error
