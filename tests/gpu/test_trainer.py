"""The task trainer on a GPU (``-m gpu``): no host read during training steps, compiled model and loss against
eager, batches kept on the host against batches on the device, and the steps per second of each compile mode
on the MAD configuration (printed with ``-s``, not judged against a clock)."""
import pytest
import torch

from regattn.models.stack import build_model
from regattn.tasks import make_task
from regattn.train import trainer
from regattn.train.batches import EpochBatches, static_examples
from regattn.train.optim import build_optimizer
from regattn.train.step import TrainStep
from regattn.train.trainer import TrainConfig, train

pytestmark = pytest.mark.gpu
MAD = dict(task="mad_recall", mixer="softmax", optimizer="muon", schedule="wsd", warmup=0.0, decay_start=0.8,
           batch_size=128, device="cuda", progress=False)


def tiny(**kw):
    options = dict(vocab_size=16, seq_len=32, num_train=256, num_test=64)
    return TrainConfig(**{**MAD, "task_options": options, "dim": 32, "batch_size": 32, "steps": 16,
                          "log_every": 4, **kw})


@pytest.mark.parametrize("mixer", ["softmax", "parallax"])
@pytest.mark.parametrize("task", ["mad_recall", "mad_selective_copy"])
def test_training_steps_read_nothing_back(task, mixer):
    data = make_task(task, seed=0, num_train=64, num_test=8).to("cuda")
    torch.manual_seed(0)
    model = build_model(data, mixer, dim=64, heads=2).cuda()
    opt = build_optimizer(model, "muon", lr=1e-3, fused=True)
    batches = EpochBatches(static_examples(data.train, data.kind), 16, 0, torch.device("cuda"))
    step = TrainStep(model, data.kind, opt, clip=1.0)
    step(batches(0))                                   # kernels tuned and compiled
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for s in range(1, 9):                          # crosses an epoch: its batches are gathered too
            step(batches(s))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    stats = step.read()
    assert stats["steps"] == 9 and stats["skipped"] == 0


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_compiled_run_matches_eager(mode):
    # the losses of the first log window (the same parameters but for the first updates) and of the rest
    eager, compiled = train(tiny()), train(tiny(compile=mode))
    assert len(compiled["history"]["train"]) == len(eager["history"]["train"]) == 4
    for a, b in zip(eager["history"]["train"], compiled["history"]["train"]):
        assert b["loss"] == pytest.approx(a["loss"], rel=5e-2, abs=5e-2)
        assert b["accuracy"] == pytest.approx(a["accuracy"], abs=5e-2)
    assert compiled["skipped_steps"] == 0 and compiled["steps_per_second"] > 0


def test_batches_from_the_host_match_batches_on_the_device(monkeypatch):
    on_device = train(tiny(steps=6, optimizer="adamw", amp=False))
    monkeypatch.setattr(trainer, "DEVICE_DATA_BYTES", 0)
    on_host = train(tiny(steps=6, optimizer="adamw", amp=False))
    assert [r["loss"] for r in on_host["history"]["train"]] == [r["loss"] for r in on_device["history"]["train"]]


@pytest.mark.parametrize("mode", ["none", "default", "reduce-overhead"])
def test_steps_per_second_on_the_mad_configuration(mode):
    # the 2-layer d=128 model, batch 128, length 128, Muon: 500 steps (the first 100 are not timed)
    r = train(TrainConfig(**MAD, task_options=dict(num_train=6400), epochs=10, compile=mode))
    print(f"\nmad_recall softmax compile={mode}: {r['steps_per_second']:.0f} steps/s over {r['steps']} steps, "
          f"test accuracy {r['final']['accuracy']:.3f}")
    assert r["skipped_steps"] == 0 and r["steps"] == 500
