"""The tiles Triton's autotuner chose for a case's kernels, and what each candidate took.

Our rows in a GPU run record ``tiles``: ``{kernel: {"best": tiles, "ms": {tiles: median ms}}}``,
``ms`` only where the case tuned (the first call at a new shape); the lists of candidates in the
kernels are trimmed from these times.
"""
from __future__ import annotations

import contextlib

from triton.runtime.autotuner import Autotuner


def config_label(config) -> str:
    """``"BLOCK_M=64 BLOCK_N=32 warps=4 stages=2"``."""
    tiles = " ".join(f"{k}={v}" for k, v in config.kwargs.items())
    return f"{tiles} warps={config.num_warps} stages={config.num_stages}"


def median_ms(timing) -> float:
    """The median of an autotuner timing (a float, or do_bench's quantiles with the median first)."""
    return float(timing[0] if isinstance(timing, (list, tuple)) else timing)


@contextlib.contextmanager
def autotuned():
    """Inside the block, every autotuned launch is recorded in the dict it yields (see the module text)."""
    record = {}
    run = Autotuner.run

    def recording(self, *args, **kwargs):
        before = getattr(self, "configs_timings", None)
        out = run(self, *args, **kwargs)
        entry = record.setdefault(getattr(self, "base_fn", self.fn).__name__, {})
        entry["best"] = config_label(self.best_config)
        timings = getattr(self, "configs_timings", None)
        if isinstance(timings, dict) and timings is not before:  # (a disk-cached tuning holds a list)
            entry["ms"] = {config_label(c): median_ms(t) for c, t in timings.items()}
        return out

    Autotuner.run = recording
    try:
        yield record
    finally:
        Autotuner.run = run
