"""The task trainer on a GPU (``-m gpu``): no host read during training steps, compiled model and loss against
eager, the step captured in a CUDA graph against eager (every mixer, and a resumed run), batches kept on the
host against batches on the device, and the steps per second of each compile mode on the MAD configuration
(printed with ``-s``, not judged against a clock)."""
import dataclasses
import os
import subprocess
import sys

import pytest
import torch

from regattn.models.mixers import MIXERS
from regattn.models.stack import build_model
from regattn.tasks import make_task
from regattn.train import step as step_module
from regattn.train import trainer
from regattn.train.batches import EpochBatches, static_examples
from regattn.train.optim import apply_schedule, build_optimizer
from regattn.train.step import WARMUP_STEPS, TrainStep
from regattn.train.trainer import TrainConfig, train

pytestmark = pytest.mark.gpu
MAD = dict(task="mad_recall", mixer="softmax", optimizer="muon", schedule="wsd", warmup=0.0, decay_start=0.8,
           batch_size=128, device="cuda", progress=False)


def tiny(**kw):
    options = dict(vocab_size=16, seq_len=32, num_train=256, num_test=64)
    return TrainConfig(**{**MAD, "task_options": options, "dim": 32, "batch_size": 32, "steps": 16,
                          "log_every": 4, **kw})


@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("mixer", ["softmax", "parallax"])
@pytest.mark.parametrize("task", ["mad_recall", "mad_selective_copy"])
def test_training_steps_read_nothing_back(task, mixer, graph):
    data = make_task(task, seed=0, num_train=64, num_test=8).to("cuda")
    torch.manual_seed(0)
    model = build_model(data, mixer, dim=64, heads=2).cuda()
    opt = build_optimizer(model, "muon", lr=1e-3, fused=True)
    batches = EpochBatches(static_examples(data.train, data.kind), 16, 0, torch.device("cuda"))
    step = TrainStep(model, data.kind, opt, clip=1.0, cuda_graph=graph)
    first = WARMUP_STEPS + 1 if graph else 1           # kernels tuned and compiled (and the step captured)
    for s in range(first):
        step(batches(s))
    assert (step.graph is not None) == graph
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for s in range(first, first + 8):              # crosses an epoch: its batches are gathered too
            apply_schedule(opt, 0.5)
            step(batches(s))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    stats = step.read()
    assert stats["steps"] == first + 8 and stats["skipped"] == 0


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_compiled_run_matches_eager(mode):
    # the losses of the first log window (the same parameters but for the first updates) and of the rest
    eager, compiled = train(tiny()), train(tiny(compile=mode))
    assert len(compiled["history"]["train"]) == len(eager["history"]["train"]) == 4
    for a, b in zip(eager["history"]["train"], compiled["history"]["train"]):
        assert b["loss"] == pytest.approx(a["loss"], rel=5e-2, abs=5e-2)
        assert b["accuracy"] == pytest.approx(a["accuracy"], abs=5e-2)
    assert compiled["skipped_steps"] == 0 and compiled["steps_per_second"] > 0


@pytest.mark.parametrize("mode", ["none", "default"])
@pytest.mark.parametrize("mixer", sorted(MIXERS))
def test_every_mixer_trains_in_a_cuda_graph(mixer, mode):
    assert_graph_matches_eager(tiny(mixer=mixer, steps=12, compile=mode))


def assert_graph_matches_eager(config):
    """The run of ``config`` with its steps captured in a CUDA graph has the eager run's losses."""
    eager, graphed = train(config), train(dataclasses.replace(config, cuda_graph=True))
    assert_same_losses(eager, graphed)
    assert graphed["skipped_steps"] == 0 and graphed["captured"]


def assert_same_losses(a, b):
    """Runs ``a`` and ``b`` log the same training losses, up to rounding."""
    for x, y in zip(a["history"]["train"], b["history"]["train"], strict=True):
        assert y["loss"] == pytest.approx(x["loss"], rel=5e-2, abs=5e-2), (a["history"], b["history"])


def test_a_step_that_reads_back_trains_eagerly(monkeypatch):
    reads = step_module.batch_loss

    def reading(*args):
        out = reads(*args)
        float(out[0])                                   # a host read: the capture fails
        return out

    monkeypatch.setattr(step_module, "batch_loss", reading)
    with pytest.warns(UserWarning, match="could not be captured"):
        graphed = train(tiny(cuda_graph=True))
    eager = train(tiny())
    assert not graphed["captured"] and graphed["skipped_steps"] == 0
    assert_same_losses(eager, graphed)


def test_cuda_graph_run_resumes(tmp_path):
    # the resumed run captures a new graph after eager steps of its own; the rounding of the learning rates
    # (fp32 tensors in a graph) and Newton-Schulz in bf16 keep it from the uninterrupted run's bits
    kw = dict(steps=16, eval_every=8, mixer="parallax", cuda_graph=True, compile="default")
    whole = train(tiny(**kw))
    path = str(tmp_path / "ckpt.pt")
    assert train(tiny(checkpoint=path, **kw), stop_at=8)["steps"] == 8
    second = train(tiny(checkpoint=path, **kw))
    assert second["captured"] and second["steps"] == 16
    assert_same_losses(whole, second)
    assert second["final"]["loss"] == pytest.approx(whole["final"]["loss"], rel=5e-2, abs=5e-2)


def test_batches_from_the_host_match_batches_on_the_device(monkeypatch):
    on_device = train(tiny(steps=6, optimizer="adamw", amp=False))
    monkeypatch.setattr(trainer, "DEVICE_DATA_BYTES", 0)
    on_host = train(tiny(steps=6, optimizer="adamw", amp=False))
    assert [r["loss"] for r in on_host["history"]["train"]] == [r["loss"] for r in on_device["history"]["train"]]


@pytest.mark.parametrize("mode,graph", [("none", False), ("default", False), ("reduce-overhead", False),
                                        ("none", True), ("default", True)])
def test_steps_per_second_on_the_mad_configuration(mode, graph):
    # the 2-layer d=128 model, batch 128, length 128, Muon: 500 steps (the first 100 are not timed)
    r = train(TrainConfig(**MAD, task_options=dict(num_train=6400), epochs=10, compile=mode, cuda_graph=graph))
    print(f"\nmad_recall softmax compile={mode} cuda_graph={graph}: {r['steps_per_second']:.0f} steps/s over "
          f"{r['steps']} steps, test accuracy {r['final']['accuracy']:.3f}")
    assert r["skipped_steps"] == 0 and r["steps"] == 500


def test_runs_side_by_side_on_streams_end_as_runs_alone():
    """Runs of different mixers in flight together, each at its own pace on its own stream, every step a CUDA graph:
    each ends with the losses, scores and parameters it has alone."""
    import functools

    from regattn.train.interleave import interleave
    from regattn.train.trainer import training
    configs = [tiny(mixer=mixer, seed=seed, cuda_graph=True, steps=24)
               for seed, mixer in enumerate(["softmax", "mesanet", "decay", "softmax"])]
    alone = [train(config) for config in configs]
    together = dict(interleave([(i, functools.partial(training, c)) for i, c in enumerate(configs)], 4, "cuda"))
    for i, a in enumerate(alone):
        b = together[i]
        assert a["history"]["train"] == b["history"]["train"] and a["final"] == b["final"]
        for p, q in zip(a["model"].parameters(), b["model"].parameters()):
            assert torch.equal(p, q)


def test_runs_starting_as_others_end_keep_a_stream_each(monkeypatch):
    """More runs than slots, of different lengths, every step a CUDA graph: runs start, capture and end while others
    replay theirs. Each captures on its slot's stream (three streams for six runs), its graph is released as it
    ends, and each ends with the losses, scores and parameters it has alone."""
    import functools

    from regattn.train.interleave import interleave
    from regattn.train.trainer import training
    made = []
    init = TrainStep.__init__

    def recorded(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    configs = [tiny(mixer=mixer, seed=seed, cuda_graph=True, steps=steps) for seed, (mixer, steps) in
               enumerate([("softmax", 24), ("softmax", 8), ("decay", 16), ("softmax", 12), ("mesanet", 8),
                          ("softmax", 20)])]
    alone = [train(config) for config in configs]
    monkeypatch.setattr(TrainStep, "__init__", recorded)
    together = dict(interleave([(i, functools.partial(training, c)) for i, c in enumerate(configs)], 3, "cuda"))
    assert len(made) == 6 and all(s.captured and s.graph is None for s in made)
    assert len({s.stream.cuda_stream for s in made}) == 3
    for i, a in enumerate(alone):
        b = together[i]
        assert b["captured"] and a["history"]["train"] == b["history"]["train"] and a["final"] == b["final"]
        for p, q in zip(a["model"].parameters(), b["model"].parameters()):
            assert torch.equal(p, q)


WARMED = ["--set", "num_train=64", "--set", "num_test=64", "--dim", "64", "--batch-size", "16",
          "--eval-batch-size", "32", "--device", "cuda", "--cuda-graph", "--steps", "3", "--quiet"]


@pytest.mark.parametrize("mixer,task", [("gatedfwa", "mad_recall"), ("decay", "mad_compression"), ("softmax", "icr")])
def test_a_run_finds_the_kernels_its_mixer_compiled_warming_up(mixer, task, tmp_path):
    # the sweep's warm-up (regattn.train.cli.warm_mixer) in one process, then a run in another, both on an empty
    # cache of their own: the run compiles no kernel. The inputs come from the task: MAD recall's are 127 tokens;
    # MAD compression's model decodes its code before the readout's norm, icr's reads vectors, both in bf16
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "cache")}
    warm = ("import sys; from regattn.train import sweep, cli; args = sweep.build_parser().parse_args(sys.argv[1:]); "
            "cli.warm_mixer(args, args.mixers, sweep.task_inputs(sweep.sweep_points(args.task, None), "
            "cli.parse_pairs(args.set, '--set')))")
    subprocess.run([sys.executable, "-c", warm, task, "--mixers", mixer] + WARMED, env=env, check=True)
    warmed = sorted((tmp_path / "cache").rglob("*.cubin"))
    assert warmed
    subprocess.run([sys.executable, "-m", "regattn", "train", task, "--mixer", mixer, "--out", str(tmp_path / "out")]
                   + WARMED, env=env, check=True)
    assert sorted((tmp_path / "cache").rglob("*.cubin")) == warmed
