import functools

import pytest
import torch

from regattn.train.interleave import interleave
from regattn.train.trainer import train, training
from tests.train.test_trainer import tiny


def counting(name: str, steps: int, log: list, fail_at: int | None = None):
    for step in range(steps):
        if step == fail_at:
            raise RuntimeError(f"{name} failed")
        log.append(name)
        yield
    return f"{name} done"


def test_runs_take_turns_and_end_in_order_of_length():
    log = []
    starts = [(i, functools.partial(counting, name, steps, log)) for i, (name, steps) in
              enumerate([("a", 3), ("b", 1), ("c", 2), ("d", 2)])]
    ended = list(interleave(starts, 2))
    # two in flight: a and b; c takes b's slot once b has ended (at its second turn), d takes a's
    assert log == ["a", "b", "a", "a", "c", "c", "d", "d"]
    assert ended == [(1, "b done"), (0, "a done"), (2, "c done"), (3, "d done")]


def test_a_run_that_raises_ends_alone():
    log = []
    starts = [(0, functools.partial(counting, "a", 3, log, fail_at=1)), (1, functools.partial(counting, "b", 3, log))]
    ended = dict(interleave(starts, 2))
    assert isinstance(ended[0], RuntimeError) and str(ended[0]) == "a failed"
    assert ended[1] == "b done" and log == ["a", "b", "b", "b"]


def test_bad_width():
    with pytest.raises(ValueError, match="width"):
        list(interleave([], 0))


def test_runs_taking_turns_end_as_runs_alone():
    configs = [tiny(steps=4, seed=seed, mixer=mixer) for seed, mixer in [(0, "softmax"), (1, "parallax"), (2, "decay")]]
    alone = [train(config) for config in configs]
    together = dict(interleave([(i, functools.partial(training, c)) for i, c in enumerate(configs)], 3))
    for i, a in enumerate(alone):
        b = together[i]
        assert a["history"]["train"] == b["history"]["train"] and a["best"] == b["best"]
        for p, q in zip(a["model"].parameters(), b["model"].parameters()):
            assert torch.equal(p, q)


class _Event:
    """A stand-in for a CUDA event: finished once it has been asked ``after`` times."""

    def __init__(self, after: int):
        self.left = after

    def query(self) -> bool:
        self.left -= 1
        return self.left < 0


def test_each_run_goes_at_its_own_pace(monkeypatch):
    """A run whose steps take the device long waits for them (at most AHEAD unfinished), while a run of quick steps
    goes on issuing its own: it is not held to one step per turn of the slow one."""
    from regattn.train import interleave as module
    queries = {"slow": 6, "quick": 0}  # until a step's event reads finished
    log, unfinished = [], []

    def mark(stream):
        return _Event(queries[log[-1]])

    monkeypatch.setattr(module, "_mark", mark)
    real_advance = module.Slot.advance

    def advance(slot):
        real_advance(slot)
        unfinished.append((log[-1], len(slot.unfinished)))
    monkeypatch.setattr(module.Slot, "advance", advance)
    starts = [(0, functools.partial(counting, "slow", 3, log)), (1, functools.partial(counting, "quick", 6, log))]
    ended = dict(interleave(starts, 2))
    assert ended == {0: "slow done", 1: "quick done"}
    third_slow = [i for i, name in enumerate(log) if name == "slow"][2]
    assert log[:third_slow].count("quick") >= 3  # in turns it would be 2
    assert max(n for name, n in unfinished if name == "slow") <= module.AHEAD
