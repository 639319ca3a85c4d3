"""A learning-rate sweep as copies of one model on a GPU (``-m gpu``): the Triton kernels under ``vmap`` (their rules
fold the copies into the batch), each copy against its run alone, eager in fp32, and captured in one CUDA graph
under bf16 autocast."""
import math

import pytest

from regattn.train.members import MEMBER_MIXERS
from regattn.train.trainer import TrainConfig, finish, training

pytestmark = pytest.mark.gpu
LRS = [5e-3, 1e-3, 5e-4]


def _config(mixer, **kw):
    base = dict(task="mad_recall", task_options=dict(num_train=1024, num_test=256), mixer=mixer, batch_size=32,
                optimizer="muon", schedule="wsd", warmup=0.0, device="cuda", progress=False, log_every=1)
    return TrainConfig(**{**base, **kw})


def _runs(config):
    return [finish(training(TrainConfig(**{**config.__dict__, "lr": lr}))) for lr in LRS]


@pytest.mark.parametrize("mixer", MEMBER_MIXERS)
def test_copies_match_their_runs_in_fp32(mixer):
    config = _config(mixer, optimizer="adamw", amp=False, steps=3)
    group = finish(training(config, lrs=LRS))
    for ours, theirs in zip(group, _runs(config)):
        for a, b in zip(ours["history"]["train"], theirs["history"]["train"]):
            assert math.isclose(a["loss"], b["loss"], rel_tol=1e-4), (a, b)
            assert math.isclose(a["grad_norm"], b["grad_norm"], rel_tol=1e-3), (a, b)
        params = dict(theirs["model"].named_parameters())
        for name, p in ours["model"].named_parameters():
            assert ((p - params[name]).norm() / params[name].norm()).item() < 1e-3, name


@pytest.mark.parametrize("mixer", MEMBER_MIXERS)
def test_copies_train_captured_in_bf16(mixer):
    """Muon, bf16 autocast, every step one CUDA graph: the copies' losses follow their runs' (bf16 rounding, and
    the Newton-Schulz products in bf16, leave them apart by a few percent after 30 steps)."""
    config = _config(mixer, amp=True, cuda_graph=True, steps=30, log_every=10)
    group = finish(training(config, lrs=LRS))
    for ours, theirs in zip(group, _runs(config)):
        assert ours["captured"] and not ours["diverged"] and ours["skipped_steps"] == 0
        losses = [row["loss"] for row in ours["history"]["train"]]
        assert losses[-1] < losses[0]
        for a, b in zip(losses, [row["loss"] for row in theirs["history"]["train"]]):
            assert math.isclose(a, b, rel_tol=5e-2), (losses, theirs["history"]["train"])
