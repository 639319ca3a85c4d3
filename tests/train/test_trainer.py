import math

import pytest
import torch

from regattn.models.mixers import MIXERS
from regattn.tasks import TASKS
from regattn.train.trainer import TrainConfig, train

TINY = {
    "icr": dict(length=8, segment=4, dim_x=4, dim_y=4, queries=2),
    "mqar": dict(length=16, pairs=2, vocab_size=32),
    "state": dict(positions=6, items=16, queries=2),
    "mad_recall": dict(vocab_size=16, seq_len=16),
    "mad_fuzzy_recall": dict(vocab_size=16, seq_len=24),
    "mad_noisy_recall": dict(vocab_size=24, noise_vocab_size=8, seq_len=16),
    "mad_selective_copy": dict(vocab_size=12, seq_len=20, num_tokens_to_copy=4),
    "mad_compression": dict(vocab_size=12, seq_len=8),
    "mad_memorization": dict(vocab_size=32, seq_len=8),
}


def tiny(task="mqar", **kw):
    options = dict(TINY[task], num_train=16, num_test=4)
    base = dict(task=task, task_options=options, mixer="softmax", dim=16, heads=2, steps=2, batch_size=4,
                progress=False, eval_batch_size=4, log_every=1)
    return TrainConfig(**{**base, **kw})


def test_every_task_has_a_tiny_setting():
    assert set(TINY) == set(TASKS)


@pytest.mark.parametrize("task", sorted(TASKS))
def test_smoke_each_task(task):
    r = train(tiny(task, mlp=task != "icr"))
    assert r["steps"] == 2 and len(r["history"]["train"]) == 2
    assert all(math.isfinite(row["loss"]) for row in r["history"]["train"])
    metric = r["final"][r["metric"]]
    assert r["metric"] == ("mse" if task == "icr" else "accuracy")
    assert math.isfinite(metric) and (task == "icr" or 0 <= metric <= 1)


@pytest.mark.parametrize("mixer", sorted(MIXERS))
def test_smoke_each_mixer(mixer):
    r = train(tiny("mqar", mixer=mixer, optimizer="muon", schedule="cosine"))
    assert all(math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"]) for row in r["history"]["train"])
    assert 0 <= r["final"]["accuracy"] <= 1


def test_learns_something():
    # enough steps on a trivially small memorization task for the loss to fall
    r = train(tiny("mad_memorization", steps=30, lr=1e-2, batch_size=8, schedule="constant"))
    losses = [row["loss"] for row in r["history"]["train"]]
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5


def test_fixed_seed_gives_identical_runs():
    a, b = train(tiny(steps=3)), train(tiny(steps=3))
    for p, q in zip(a["model"].parameters(), b["model"].parameters()):
        assert torch.equal(p, q)
    c = train(tiny(steps=3, seed=1))
    assert not torch.equal(next(a["model"].parameters()), next(c["model"].parameters()))


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_resume_matches_uninterrupted(tmp_path, optimizer):
    kw = dict(steps=6, optimizer=optimizer, wda_gamma=1.0, eval_every=2, mixer="parallax", log_every=3)
    whole = train(tiny(**kw))
    path = str(tmp_path / "ckpt.pt")
    first = train(tiny(checkpoint=path, **kw), stop_at=3)
    assert first["steps"] == 3
    second = train(tiny(checkpoint=path, **kw))
    assert second["steps"] == 6
    for (name, p), q in zip(whole["model"].named_parameters(), second["model"].parameters()):
        assert torch.equal(p, q), name
    assert [e["step"] for e in second["history"]["eval"]] == [2, 4, 6]
    assert second["history"]["train"] == whole["history"]["train"]


def test_large_data_stays_on_host(monkeypatch):
    from regattn.train import trainer
    on_device = train(tiny(steps=2))
    monkeypatch.setattr(trainer, "DEVICE_DATA_BYTES", 0)
    on_host = train(tiny(steps=2))
    for p, q in zip(on_device["model"].parameters(), on_host["model"].parameters()):
        assert torch.equal(p, q)


def test_epochs_set_the_step_count():
    r = train(tiny(epochs=1.5))                                    # 16 examples, batches of 4: 6 steps
    assert r["steps"] == 6 and [e["step"] for e in r["history"]["eval"]] == [6]


def test_diagnostics_during_training():
    r = train(tiny(steps=4, mixer="parallax", analyze_every=2, analyze_examples=2))
    rows = r["history"]["analysis"]
    assert [a["step"] for a in rows] == [2, 4] and len(rows[0]["layers"]) == 2
    assert all(math.isfinite(layer["cor"]) for a in rows for layer in a["layers"])


def test_divergence_stops_the_run():
    # every step after the first overflows: its update is skipped, and the first log window with no update ends it
    r = train(tiny(steps=60, lr=1e12, clip=0.0, log_every=4))
    assert r["diverged"] and r["steps"] < 60 and r["final"] is None
    last = r["history"]["train"][-1]
    assert last["skipped"] == 4 and math.isnan(last["loss"]) and r["skipped_steps"] >= 4
    assert all(bool(torch.isfinite(p).all()) for p in r["model"].parameters())
    assert not train(tiny())["diverged"]


def test_nonfinite_step_is_skipped_and_counted(monkeypatch):
    # a forward that overflows at step 2: its update must not reach the parameters (or the next forward of a
    # mechanism that validates its inputs, LLA's ridge, fails); the run goes on and counts the skipped step
    from regattn.train import step as step_module
    calls = []

    def overflow_at_step_2(*args):
        loss, metric, n = batch_loss(*args)
        calls.append(1)
        return (loss * float("nan") if len(calls) == 2 else loss), metric, n

    batch_loss = step_module.batch_loss
    monkeypatch.setattr(step_module, "batch_loss", overflow_at_step_2)
    r = train(tiny(mixer="lla", steps=8, log_every=4, eval_batch_size=16))
    assert not r["diverged"] and r["steps"] == 8 and r["skipped_steps"] == 1
    assert [row["skipped"] for row in r["history"]["train"]] == [1, 0]
    assert all(math.isfinite(row["loss"]) for row in r["history"]["train"])
    assert all(bool(torch.isfinite(p).all()) for p in r["model"].parameters())


def test_log_every_sets_the_rows():
    r = train(tiny(steps=10, log_every=4))
    rows = r["history"]["train"]
    assert [row["step"] for row in rows] == [4, 8, 10]
    every = train(tiny(steps=10, log_every=1))["history"]["train"]
    assert len(every) == 10
    # a row holds the means over its window, the learning rate at its step
    assert rows[0]["loss"] == pytest.approx(sum(row["loss"] for row in every[:4]) / 4, rel=1e-5)
    assert rows[1]["accuracy"] == pytest.approx(sum(row["accuracy"] for row in every[4:8]) / 4, rel=1e-5)
    assert rows[2]["lr"] == every[9]["lr"]
    assert r["steps_per_second"] > 0 and train(tiny(steps=3, log_every=4))["steps_per_second"] is None


def test_bad_trainer_options():
    with pytest.raises(ValueError, match="compile"):
        train(tiny(compile="max"))
    with pytest.raises(ValueError, match="log_every"):
        train(tiny(log_every=0))
    with pytest.raises(ValueError, match="cuda_graph"):
        train(tiny(cuda_graph=True, compile="reduce-overhead"))
    with pytest.raises(ValueError, match="wda_gamma"):
        train(tiny(cuda_graph=True, wda_gamma=1.0))


def test_throughput_leaves_out_pauses_after_the_last_log_point(monkeypatch):
    """An evaluation after the last log point (the end of a short run) is not time between the log points."""
    from regattn.train import progress
    now = [0.0]
    monkeypatch.setattr(progress.time, "perf_counter", lambda: now[0])
    clock = progress.Throughput()
    clock.mark(100)
    now[0] = 2.0
    with clock.paused():                                  # an evaluation between the log points
        now[0] = 3.0
    now[0] = 4.0
    clock.mark(120)
    with clock.paused():                                  # the final evaluation
        now[0] = 40.0
    assert clock.rate() == 20 / (4.0 - 1.0)
