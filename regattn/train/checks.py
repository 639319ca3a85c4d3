"""Checks of command-line values, run before any work starts; a bad value raises
:class:`regattn.usage.UsageError` naming its flag."""
from __future__ import annotations

import inspect
import math
import os


from regattn.models.mixers import build_mixer
from regattn.tasks import MAD_TASKS, TASKS
from regattn.usage import UsageError, device  # noqa: F401  (device: re-exported for the commands here)


def at_least(flag: str, value, low) -> None:
    if value is None or value < low:
        raise UsageError(f"{flag}: expected a value >= {low}, got {value}")


def positive(flag: str, value: float | None) -> None:
    """A finite value > 0 (a learning rate, a number of epochs)."""
    if value is None or not (math.isfinite(value) and value > 0):
        raise UsageError(f"{flag}: expected a finite value > 0, got {value}")


def non_negative(flag: str, value: float) -> None:
    if not (math.isfinite(value) and value >= 0):
        raise UsageError(f"{flag}: expected a finite value >= 0, got {value}")


def fraction(flag: str, value: float | None) -> None:
    """None (a default) or a value in [0, 1]."""
    if value is not None and not 0 <= value <= 1:
        raise UsageError(f"{flag}: expected a fraction in [0, 1], got {value}")


def existing_file(flag: str, path: str) -> None:
    if not os.path.exists(path):
        raise UsageError(f"{flag}: no such file or folder {path!r}")


def task_setting_names(task: str) -> set[str]:
    """The settings ``--set`` may give task ``task`` (its builder's keywords but seed and device)."""
    if task.startswith("mad_"):
        return set(MAD_TASKS[task[len("mad_"):]][2]) | {"num_train", "num_test"}
    return set(inspect.signature(TASKS[task]).parameters) - {"seed", "device"}


def task_settings(task: str, settings: dict, flag: str = "--set") -> None:
    unknown = sorted(set(settings) - task_setting_names(task))
    if unknown:
        raise UsageError(f"{flag}: task {task!r} has no setting {', '.join(unknown)}; "
                         f"expected from {sorted(task_setting_names(task))}")


def mixer_options(mixer: str, options: dict, *, dim: int, heads: int, flag: str = "--mixer-opt") -> None:
    """Build the mixer once on the CPU: an unknown option or a bad value is reported with ``flag``; a
    baseline without its extra, with the command to install it."""
    try:
        build_mixer(mixer, dim, heads, seq_len=2, **options)
    except ImportError as e:
        raise UsageError(str(e)) from None
    except (TypeError, ValueError) as e:
        raise UsageError(f"{flag}: mixer {mixer!r} with {options}: {e}") from None
