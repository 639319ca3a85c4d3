"""Time and peak memory of one zero-argument callable, with out-of-memory reported, not raised.

On CUDA: ``triton.testing.do_bench`` medians after a warm-up call (the warm-up also compiles;
do_bench flushes L2 between calls), or CUDA-graph replay (``do_bench_cudagraph``, no flush: a
small KV cache stays in L2 for every op alike) for decode-sized work, where the launch overhead is
what an eager caller pays and a graph removes; a call that cannot be captured (a host sync inside
it) gets the status ``not capturable``. Decode calls made eagerly are timed back to back
(:func:`back_to_back_ms`; no flush either): do_bench's flush before each call gives the host that
long a head start, so a call's host time showed only when it outlasted the flush, which near the
flush's time changed from run to run (Parallax's decode on the H200: benchmarks/results/h200/tiles/
parallax-decode-eager-repeats.json). Peak memory is ``torch.cuda.max_memory_allocated`` during
one call, above what was allocated before it. A call slower than the timing window itself is timed
by the median of three event-timed calls, the peak-memory call among them (do_bench would run it
about ten times). On CPU (the smoke mode) the ``perf_counter`` calls made within the timing window
give a median and no peak memory is read.
"""
from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass

import torch


@dataclass
class Measurement:
    """``status`` is ``"ok"``, ``"OOM"``, ``"not capturable: ..."`` or ``"error: ..."``; ``ms`` and
    ``peak_mb`` are None unless measured."""
    status: str
    ms: float | None = None
    peak_mb: float | None = None


class NotCapturable(RuntimeError):
    """A call that cannot run inside a CUDA graph."""


def is_oom(err: BaseException) -> bool:
    return isinstance(err, torch.cuda.OutOfMemoryError) or "out of memory" in str(err).lower()


def free_memory() -> None:
    """Return cached blocks between cases so one case's peak does not hide in the next one's."""
    gc.collect()
    torch.cuda.empty_cache()


def cpu_ms(fn, rep_ms: int = 100, max_reps: int = 100) -> float:
    """Median wall time of the calls made within ``rep_ms`` (at least one), after the caller's warm-up."""
    times = []
    while not times or (sum(times) < rep_ms and len(times) < max_reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def cuda_ms(fn, *, graph: bool = False, rep_ms: int = 100) -> float:
    """Median milliseconds of plain launches, or with ``graph`` of CUDA-graph replays (one graph replays
    ~rep_ms / 5 of unrolled calls, ten times)."""
    import triton.testing

    if not graph:
        return triton.testing.do_bench(fn, warmup=max(rep_ms // 4, 5), rep=rep_ms, return_mode="median")
    try:
        return triton.testing.do_bench_cudagraph(fn, rep=max(rep_ms // 5, 5), return_mode="median")
    except RuntimeError as err:
        if is_oom(err):
            raise
        torch.cuda.synchronize()
        raise NotCapturable(str(err)) from err


SLOW_REPS = 3


def event_ms(fn) -> tuple[float, object]:
    """Milliseconds of one call timed with CUDA events, and what it returned."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    out = fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end), out


def slow_ms(fn, first: float) -> float:
    """Median of :data:`SLOW_REPS` event-timed calls, ``first`` (the peak-memory call's time) among them,
    for calls longer than the timing window."""
    return statistics.median([first] + [event_ms(fn)[0] for _ in range(SLOW_REPS - 1)])


def peak_mb(fn) -> tuple[float, float]:
    """MiB allocated at the peak of one call, above what was allocated before it, and that call's milliseconds."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    ms, out = event_ms(fn)
    del out
    return (torch.cuda.max_memory_allocated() - base) / 2**20, ms


def describe(err: BaseException) -> str:
    """``"OOM"``, ``"unsupported"``, ``"not capturable: ..."`` or ``"error: Type: first line of the message"``."""
    if is_oom(err):
        return "OOM"
    if "no viable backend" in str(err).lower() or "no available kernel" in str(err).lower():
        return "unsupported"
    lines = str(err).strip().splitlines()
    first = lines[0][:160] if lines else ""
    if isinstance(err, NotCapturable):
        return f"not capturable: {first}".rstrip(": ")
    return f"error: {type(err).__name__}: {first}".rstrip(": ")


def back_to_back_ms(fn, first: float, rep_ms: int = 100, batches: int = 5) -> float:
    """Median milliseconds per call over ``batches`` batches of calls issued back to back (no flush and no sync
    between them, each batch synced at its end), a batch about ``rep_ms / batches`` long by ``first`` (one call's
    milliseconds): what a loop of eager calls pays, its host's time or its device's, whichever is longer."""
    calls = max(1, min(1000, int(rep_ms / batches / max(first, 1e-3))))
    times = []
    for _ in range(batches):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3 / calls)
    return statistics.median(times)


def measure(fn, *, cuda: bool, graph: bool = False, back_to_back: bool = False, rep_ms: int = 100) -> Measurement:
    """Warm up, then time ``fn`` (``back_to_back``: :func:`back_to_back_ms`) and read its peak memory; OOM and other
    failures become a status."""
    try:
        if not cuda:
            fn()
            return Measurement("ok", ms=cpu_ms(fn, rep_ms))
        fn()  # compiles, autotunes
        mem, first = peak_mb(fn)
        if first > rep_ms and not graph:
            ms = slow_ms(fn, first)
        elif back_to_back:
            ms = back_to_back_ms(fn, first, rep_ms)
        else:
            ms = cuda_ms(fn, graph=graph, rep_ms=rep_ms)
        return Measurement("ok", ms=ms, peak_mb=mem)
    except Exception as err:  # a failing case is a result, never the end of a suite
        return Measurement(describe(err))
    finally:
        if cuda:
            free_memory()
