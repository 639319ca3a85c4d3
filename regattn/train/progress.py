"""A one-line progress bar with the latest metrics, on stderr.

On a terminal the line is redrawn at most ten times a second; otherwise a line is printed at
every tenth of the run, so logs stay short.
"""
from __future__ import annotations

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
