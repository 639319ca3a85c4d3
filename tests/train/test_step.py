import functools
import math

import pytest
import torch

from regattn.models.stack import build_model
from regattn.tasks import mqar
from regattn.train.batches import static_examples
from regattn.train.optim import build_optimizer
from regattn.train import step as step_module
from regattn.train.step import TrainStep


def setup(optimizer):
    data = mqar(length=16, pairs=2, vocab_size=30, num_train=8, num_test=1)
    torch.manual_seed(0)
    model = build_model(data, "softmax", dim=16, heads=2)
    opt = build_optimizer(model, optimizer, lr=1e-2, weight_decay=0.1, fused=True)
    return model, opt, static_examples(data.train, data.kind)


def snapshot(model, opt):
    params = [p.detach().clone() for p in model.parameters()]
    state = [{k: v.clone() for k, v in s.items()} for o in opt.optimizers for s in o.state.values()]
    return params, state


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_nonfinite_loss_skips_the_update_and_is_counted(optimizer):
    model, opt, batch = setup(optimizer)
    step = TrainStep(model, "tokens", opt, clip=1.0)
    step(batch)                                                   # the states exist
    before = snapshot(model, opt)
    saved = model.norm.weight.detach().clone()
    with torch.no_grad():
        model.norm.weight[0] = float("nan")                       # the loss is NaN now
    step(batch)
    with torch.no_grad():
        model.norm.weight.copy_(saved)
    after = snapshot(model, opt)
    assert all(torch.equal(a, b) for a, b in zip(before[0], after[0]))
    assert all(torch.equal(a[k], b[k]) for a, b in zip(before[1], after[1]) for k in a)
    stats = step.read()
    assert stats["steps"] == 2 and stats["skipped"] == 1 and math.isfinite(stats["loss"])
    step(batch)                                                   # the next finite step updates
    assert all(not torch.equal(a, p) for a, p in zip(before[0], model.parameters()))
    stats = step.read()
    assert stats["steps"] == 1 and stats["skipped"] == 0


def test_read_gives_window_means_and_resets():
    model, opt, batch = setup("adamw")
    step = TrainStep(model, "tokens", opt, clip=0.0)
    losses = []
    for _ in range(3):
        step(batch)
        losses.append(float(step.totals[0]) - sum(losses))
    stats = step.read()
    assert stats["steps"] == 3 and stats["skipped"] == 0
    assert stats["loss"] == pytest.approx(sum(losses) / 3, rel=1e-6)
    assert 0 <= stats["metric"] <= 1 and stats["grad_norm"] > 0
    empty = step.read()
    assert empty["steps"] == 0 and math.isnan(empty["loss"])


def scaled_sum(weight, x):
    return (weight * x).sum()


def test_a_process_compiles_more_models_than_dynamos_default_limit(monkeypatch):
    """Each model a process trains is an entry of one function's compiled code (a sweep trains dozens); past
    Dynamo's default limit of 8 entries the rest would run uncompiled."""
    from torch._dynamo.utils import counters
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real(fn, **{**kw, "backend": "eager"}))
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 8)
    monkeypatch.setattr(torch._dynamo.config, "accumulated_recompile_limit", 256)
    torch._dynamo.reset()
    counters.clear()
    for n in range(1, 13):                     # twelve models of different shapes
        loss = step_module.compiled(functools.partial(scaled_sum, torch.ones(n)), "default")
        assert loss(torch.full((n,), 2.0)).item() == 2.0 * n
    assert counters["frames"]["ok"] == 12 and torch._dynamo.config.recompile_limit >= 12
    torch._dynamo.reset()
