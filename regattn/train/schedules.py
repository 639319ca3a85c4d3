"""Learning-rate schedules and weight-decay annealing (parallax.txt Table 2b, Appendix G.2 eq. 42).

Each schedule maps the 0-based step ``s`` of ``total`` to a factor of the peak learning rate:

* ``wsd``: linear warm-up over ``warmup * total`` steps, constant, then linear decay to ``final``
  from ``decay_start * total`` to ``total`` (Table 2b: warm-up 0, decay start 80%, final 0);
* ``cosine``: linear warm-up over ``warmup * total`` steps, then a cosine from 1 to ``final``
  (Table 2b: warm-up 1%, the decay starting where the warm-up ends);
* ``constant``: 1 after the warm-up.

Weight-decay annealing (WDA, eq. 42) scales the weight decay by ``(1 - t)^gamma`` where ``t`` is the
fractional progress through the decay stage (0 before it); ``gamma = 0`` is the plain recipe.
"""
from __future__ import annotations

import math

SCHEDULES = ("wsd", "cosine", "constant")
DEFAULTS = {"wsd": dict(warmup=0.0, decay_start=0.8), "cosine": dict(warmup=0.01, decay_start=None),
            "constant": dict(warmup=0.0, decay_start=None)}


def decay_start_step(schedule: str, total: int, warmup: float, decay_start: float | None) -> int:
    """The first step of the decay stage (``total`` for the constant schedule)."""
    if schedule == "constant":
        return total
    if schedule == "cosine" and decay_start is None:
        return warmup_steps(total, warmup)
    return int(round(decay_start * total))


def warmup_steps(total: int, warmup: float) -> int:
    return int(round(warmup * total))


def decay_progress(step: int, total: int, start: int) -> float:
    """``t`` in [0, 1]: how far ``step`` is through the decay stage ``[start, total)``."""
    if step < start or total <= start:
        return 0.0
    return min(1.0, (step - start) / (total - start))


def lr_factor(schedule: str, step: int, total: int, *, warmup: float | None = None,
              decay_start: float | None = None, final: float = 0.0) -> float:
    """The learning-rate multiplier at 0-based ``step`` of ``total``."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule: expected one of {SCHEDULES}, got {schedule!r}")
    warmup = DEFAULTS[schedule]["warmup"] if warmup is None else warmup
    decay_start = DEFAULTS[schedule]["decay_start"] if decay_start is None else decay_start
    warm = warmup_steps(total, warmup)
    if step < warm:
        return (step + 1) / warm
    t = decay_progress(step, total, decay_start_step(schedule, total, warmup, decay_start))
    if schedule == "wsd":
        return 1.0 - (1.0 - final) * t
    if schedule == "cosine":
        return final + (1.0 - final) * 0.5 * (1.0 + math.cos(math.pi * t))
    return 1.0


def wd_factor(schedule: str, step: int, total: int, *, gamma: float = 0.0, warmup: float | None = None,
              decay_start: float | None = None) -> float:
    """The weight-decay multiplier ``(1 - t)^gamma`` of WDA (eq. 42) at ``step``."""
    if gamma == 0.0:
        return 1.0
    warmup = DEFAULTS[schedule]["warmup"] if warmup is None else warmup
    decay_start = DEFAULTS[schedule]["decay_start"] if decay_start is None else decay_start
    t = decay_progress(step, total, decay_start_step(schedule, total, warmup, decay_start))
    return (1.0 - t) ** gamma
