"""Several training runs in one process, each issuing its steps on its own CUDA stream at its own pace.

    for index, outcome in interleave(starts, width=3):
        ...                     # outcome: the run's result, or the exception it raised

``starts`` yields ``(index, make)``: ``make()`` returns a run as a generator
(:func:`regattn.train.trainer.training`), whose ``next()`` issues one step and whose return value is the result.
``width`` runs are in flight at a time; each ``next()`` runs under its run's stream, so that the device runs one
run's kernels beside another's (on the CPU the runs just take turns). Each slot keeps one stream for the runs that
hold it in turn (:func:`slot_streams`): a run captures its CUDA graph on that stream and releases it as it ends
(:class:`regattn.train.step.TrainStep`), so no two graphs alive at once share a stream, nor the cuBLAS workspace
that torch keeps per stream and frees with any graph captured there (runs that captured on one shared stream stalled
once the first of them ended). A run issues its next step once fewer than :data:`AHEAD` of its steps are unfinished
on the device, so a run of short steps goes on at its own pace beside one of long steps, ends sooner and frees its
stream for the next run, instead of taking one step per turn of the slowest. (Its steps do not come for free: on an
H200 six MAD runs of softmax beside six of MesaNet took 31.3 s, the two groups one after the other 30.3;
benchmarks/results/h200/experiments/trainer-mixed-streams-paced.json.) Runs of one model shape share its compiled
code and its kernels' tuning, where processes (``regattn sweep --jobs``) compile and tune each run for itself; one
process compiles one model at a time, though, while the others wait. On an H200 six runs of the MAD model in flight
kept the device busy 99% of the time, at 1.4x the steps per second of one run alone (docs/EXPERIMENTS.md).
"""
from __future__ import annotations

import collections
import contextlib
import time
from collections.abc import Callable, Generator, Iterable, Iterator

import torch

AHEAD = 2  # steps of a run issued and not yet finished on the device, at most
POLL_S = 5e-5  # the wait before looking again when no run may issue a step


def _mark(stream):
    """A CUDA event recorded on ``stream`` after the work issued to it so far; None without a stream."""
    if stream is None:
        return None
    event = torch.cuda.Event()
    event.record(stream)
    return event


class Slot:
    """A run in flight: its index, its generator, the stream its steps are issued on (None on the CPU) and the
    marks of its steps not yet seen finished."""

    def __init__(self, index: int, steps: Generator, stream):
        self.index, self.steps, self.stream = index, steps, stream
        self.unfinished = collections.deque()

    def advance(self):
        """Issue the run's next step (``StopIteration`` with its result once it has ended)."""
        with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
            next(self.steps)
        mark = _mark(self.stream)
        if mark is not None:
            self.unfinished.append(mark)

    def ready(self) -> bool:
        """Whether the run may issue a step: fewer than :data:`AHEAD` of its steps unfinished on the device."""
        while self.unfinished and self.unfinished[0].query():
            self.unfinished.popleft()
        return len(self.unfinished) < AHEAD


def slot_streams(width: int, device) -> list:
    """``width`` distinct CUDA streams of ``device`` (``None`` each off CUDA), one per slot, each kept by the runs
    that hold its slot in turn. torch hands streams out of a pool, round robin; taken together they differ, as
    long as the pool holds that many."""
    if device is None or torch.device(device).type != "cuda":
        return [None] * width
    streams = [torch.cuda.Stream(device) for _ in range(width)]
    distinct = len({s.cuda_stream for s in streams})
    if distinct < width:
        raise ValueError(f"width: {width} runs in flight need as many CUDA streams; torch's pool has {distinct}")
    return streams


def interleave(starts: Iterable[tuple[int, Callable[[], Generator]]], width: int,
               device: torch.device | None = None) -> Iterator[tuple[int, object]]:
    """``(index, result or exception)`` of each run as it ends, ``width`` runs in flight, each on its own stream of
    ``device`` when it is a CUDA device. A run that raises ends with its exception; the others go on."""
    if width < 1:
        raise ValueError(f"width: expected a value >= 1, got {width}")
    free = slot_streams(width, device)
    pending, slots = iter(starts), []
    while True:
        while free and (start := next(pending, None)) is not None:
            index, make = start
            slots.append(Slot(index, make(), free.pop()))
        if not slots:
            return
        issued = False
        for slot in list(slots):
            if not slot.ready():
                continue
            issued = True
            try:
                slot.advance()
                continue
            except StopIteration as end:
                outcome = end.value
            except Exception as error:                   # noqa: BLE001 (the run's outcome; the others go on)
                outcome = error
            slots.remove(slot)
            free.append(slot.stream)
            yield slot.index, outcome
        if not issued:
            time.sleep(POLL_S)
