"""The record of Triton's autotuner choices that our benchmark rows carry."""
import triton
from triton.runtime.autotuner import Autotuner

from regattn.bench.tuning import autotuned, config_label


class Tuner:
    """Stands in for an autotuner that picks ``best`` and, when ``tunes``, times the candidates."""

    def __init__(self, name, best, timings, tunes):
        self.fn = type("Fn", (), {"__name__": name})()
        self.best, self.timings, self.tunes = best, timings, tunes


def fake_run(self, *args, **kwargs):
    self.best_config = self.best
    if self.tunes:
        self.configs_timings = dict(self.timings)
    return "launched"


def test_records_the_choice_and_the_candidates_times_of_each_tuning(monkeypatch):
    a = triton.Config({"BLOCK_M": 64, "BLOCK_N": 32}, num_warps=4, num_stages=2)
    b = triton.Config({"BLOCK_M": 128}, num_warps=8)
    monkeypatch.setattr(Autotuner, "run", fake_run)
    tuning = Tuner("_fwd", b, {a: [2.0, 1.9, 2.1], b: 1.5}, tunes=True)
    cached = Tuner("_bwd", a, {}, tunes=False)
    with autotuned() as tiles:
        assert Autotuner.run(tuning) == "launched" and Autotuner.run(cached) == "launched"
    assert Autotuner.run is fake_run                       # restored on leaving
    assert config_label(a) == "BLOCK_M=64 BLOCK_N=32 warps=4 stages=2"
    assert tiles == {"_fwd": {"best": config_label(b), "ms": {config_label(a): 2.0, config_label(b): 1.5}},
                     "_bwd": {"best": config_label(a)}}
