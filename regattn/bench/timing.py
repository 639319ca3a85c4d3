"""Time and peak memory of one zero-argument callable, with out-of-memory reported, not raised.

On CUDA: ``triton.testing.do_bench`` medians after a warm-up call (the warm-up also compiles;
do_bench flushes L2 between calls), or CUDA-graph replay (``do_bench_cudagraph``, no flush:
a small KV cache stays in L2 for every op alike) for decode-sized work whose launch overhead
would otherwise dominate; peak memory is ``torch.cuda.max_memory_allocated`` during one
call, above what was allocated before it. On CPU (the smoke mode) the ``perf_counter``
calls made within the timing window give a median and no peak memory is read.
"""
from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass

import torch


@dataclass
class Measurement:
    """``status`` is ``"ok"``, ``"OOM"`` or ``"error: ..."``; ``ms`` and ``peak_mb`` are None unless measured."""
    status: str
    ms: float | None = None
    peak_mb: float | None = None
    graph: bool = False


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


def cuda_ms(fn, *, graph: bool = False, rep_ms: int = 100) -> tuple[float, bool]:
    """Median milliseconds; with ``graph`` try CUDA-graph replay and fall back to plain launches
    when the call cannot be captured (a host sync inside it). Returns (ms, replayed)."""
    import triton.testing

    if graph:  # one graph replays ~rep_ms / 5 of unrolled calls, ten times
        try:
            return triton.testing.do_bench_cudagraph(fn, rep=max(rep_ms // 5, 5), return_mode="median"), True
        except RuntimeError as err:
            if is_oom(err):
                raise
            torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=max(rep_ms // 4, 5), rep=rep_ms, return_mode="median"), False


def peak_mb(fn) -> float:
    """MiB allocated at the peak of one call, above what was allocated before it."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    del out
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def describe(err: BaseException) -> str:
    """``"OOM"`` or ``"error: Type: first line of the message"``."""
    if is_oom(err):
        return "OOM"
    if "no viable backend" in str(err).lower() or "no available kernel" in str(err).lower():
        return "unsupported"
    lines = str(err).strip().splitlines()
    return f"error: {type(err).__name__}: {lines[0][:160] if lines else ''}".rstrip(": ")


def measure(fn, *, cuda: bool, graph: bool = False, rep_ms: int = 100) -> Measurement:
    """Warm up, then time ``fn`` and read its peak memory; OOM and other failures become a status."""
    try:
        fn()
        if not cuda:
            return Measurement("ok", ms=cpu_ms(fn, rep_ms))
        torch.cuda.synchronize()
        mem = peak_mb(fn)
        ms, replayed = cuda_ms(fn, graph=graph, rep_ms=rep_ms)
        return Measurement("ok", ms=ms, peak_mb=mem, graph=replayed)
    except Exception as err:  # a failing case is a result, never the end of a suite
        return Measurement(describe(err))
    finally:
        if cuda:
            free_memory()
