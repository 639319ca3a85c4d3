"""Synthetic tasks: in-context regression, MQAR, permutation state tracking, the MAD suite,
and the test-time regression data of the demo (:mod:`regattn.tasks.regression`).

:data:`TASKS` maps a task name to its builder ``f(*, seed, device, num_train, num_test, **setting) -> TaskData``.
"""
from functools import partial

from regattn.tasks.common import IGNORE, Split, TaskData
from regattn.tasks.icr import in_context_regression
from regattn.tasks.mad import MAD_TASKS, mad_benchmark_settings, mad_hard_settings, mad_task
from regattn.tasks.mqar import mqar
from regattn.tasks.state_tracking import state_tracking

TASKS = {
    "icr": in_context_regression,
    "mqar": mqar,
    "state": state_tracking,
    **{f"mad_{name}": partial(mad_task, name) for name in MAD_TASKS},
}


def make_task(name: str, **kwargs) -> TaskData:
    """Build task ``name`` from :data:`TASKS` with keyword settings."""
    if name not in TASKS:
        raise ValueError(f"task: expected one of {sorted(TASKS)}, got {name!r}")
    return TASKS[name](**kwargs)


def task_input(name: str, **settings) -> tuple[str, int]:
    """The kind (:class:`TaskData`'s) and the length of task ``name``'s inputs with these settings (from one example
    of each split)."""
    data = make_task(name, **{**settings, "num_train": 1, "num_test": 1})
    return data.kind, data.seq_len


__all__ = ["IGNORE", "Split", "TaskData", "TASKS", "make_task", "task_input", "in_context_regression", "mqar",
           "state_tracking", "mad_task", "MAD_TASKS", "mad_benchmark_settings", "mad_hard_settings"]
