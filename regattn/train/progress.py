"""A one-line progress bar with the latest metrics, on stderr.

On a terminal the line is redrawn at most ten times a second; otherwise a line is printed at
every tenth of the run, so logs stay short.
"""
from __future__ import annotations

import contextlib
import sys
import time


class Progress:
    """``Progress(total, start=0, enabled=True, label="")``; ``update(step, **metrics)``; ``close()``."""

    def __init__(self, total: int, *, start: int = 0, enabled: bool = True, label: str = "", stream=None):
        self.total, self.enabled, self.label = max(1, total), enabled, label
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.started, self.last_draw, self.last_tenth = time.time(), 0.0, start * 10 // self.total
        self.line = ""

    def render(self, step: int, metrics: dict) -> str:
        width = 24
        filled = width * step // self.total
        rate = step / max(1e-9, time.time() - self.started)
        parts = " ".join(f"{k} {v:.4g}" for k, v in metrics.items())
        return f"{self.label} [{'#' * filled}{'.' * (width - filled)}] {step}/{self.total} {parts} ({rate:.1f} it/s)"

    def update(self, step: int, **metrics) -> None:
        if not self.enabled:
            return
        self.line = self.render(step, metrics)
        now, tenth = time.time(), step * 10 // self.total
        if self.tty and (now - self.last_draw > 0.1 or step == self.total):
            self.stream.write("\r" + self.line)
            self.stream.flush()
            self.last_draw = now
        elif not self.tty and tenth > self.last_tenth:
            self.stream.write(self.line + "\n")
            self.last_tenth = tenth

    def close(self) -> None:
        if self.enabled and self.tty and self.line:
            self.stream.write("\n")
            self.stream.flush()


class Throughput:
    """Steps per second between log points (each right after a host read, so the device has caught up), less
    the time of evaluations and checkpoints in between (``paused``; not those after the last point).

    ``sync``: called as a pause begins (e.g. ``torch.cuda.synchronize``), so training work still queued on the
    device counts as training, not as the pause; pause only around actual work, never every step.
    """

    def __init__(self, sync=None):
        self.sync = sync
        self.first = self.last = None                    # (step, time, paused time before it)
        self.excluded = 0.0

    def mark(self, step: int) -> float | None:
        """Record a log point at ``step``; returns the steps per second since the previous one (None at the first)."""
        now = time.perf_counter()
        if self.first is None:
            self.first, self.excluded = (step, now, 0.0), 0.0
        previous, self.last = self.last, (step, now, self.excluded)
        return None if previous is None else self._between(previous, self.last)

    @contextlib.contextmanager
    def paused(self):
        if self.sync is not None:
            self.sync()
        began = time.perf_counter()
        try:
            yield
        finally:
            if self.first is not None:
                self.excluded += time.perf_counter() - began

    def rate(self) -> float | None:
        """Steps per second from the first log point to the last (None before two points)."""
        return None if self.first is None else self._between(self.first, self.last)

    @staticmethod
    def _between(a, b) -> float | None:
        return (b[0] - a[0]) / max(b[1] - a[1] - (b[2] - a[2]), 1e-9) if b[0] > a[0] else None
