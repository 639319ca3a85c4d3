"""A learning-rate sweep trained as copies of one model (regattn.train.members) against its runs one by one."""
import math

import pytest
import torch

from regattn.models.mixers import MIXER_NAMES
from regattn.train.members import MEMBER_MIXERS, Members, build_member_optimizer, clip_copies
from regattn.train.optim import BatchedMuon
from regattn.train.trainer import TrainConfig, finish, training
from tests.train.test_trainer import tiny

LRS = [5e-3, 1e-3, 5e-4]


def _trained(config, lrs):
    return finish(training(config, lrs=lrs)), [finish(training(TrainConfig(**{**config.__dict__, "lr": lr})))
                                               for lr in lrs]


def _assert_close(model, other, bound):
    ours, theirs = dict(model.named_parameters()), dict(other.named_parameters())
    assert ours.keys() == theirs.keys()
    for name, p in theirs.items():
        assert ((ours[name] - p).norm() / p.norm()).item() < bound, name


@pytest.mark.parametrize("mixer", MEMBER_MIXERS)
def test_copies_train_as_their_runs_one_by_one(mixer):
    # a few steps of AdamW: the copies' parameters, losses and evaluations are their runs' up to rounding (more
    # steps amplify the rounding: a 1e-7 change of the initial parameters grows to 1e-2 in 12 steps at 5e-3)
    config = tiny("mad_recall", mixer=mixer, optimizer="adamw", steps=3, eval_every=3)
    group, runs = _trained(config, LRS)
    assert [r["config"]["lr"] for r in group] == LRS and all(r["copies"] == 3 for r in group)
    for ours, theirs in zip(group, runs):
        _assert_close(ours["model"], theirs["model"], 1e-4)
        for a, b in zip(ours["history"]["train"], theirs["history"]["train"]):
            assert a["step"] == b["step"] and a["lr"] == b["lr"]
            assert math.isclose(a["loss"], b["loss"], rel_tol=1e-4)
            assert math.isclose(a["grad_norm"], b["grad_norm"], rel_tol=1e-4)
        assert math.isclose(ours["final"]["loss"], theirs["final"]["loss"], rel_tol=1e-4)


def test_muon_steps_each_copy_as_its_own_optimizer():
    """The same gradients give each copy the update its own BatchedMuon and AdamW make at its rate."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 12), torch.nn.RMSNorm(12), torch.nn.Linear(12, 8, bias=False))
    members = Members(model, len(LRS))
    opt = build_member_optimizer(members, "muon", lrs=LRS, weight_decay=0.1)
    grads = [torch.randn_like(p) for p in members.stacked]
    for step in range(2):
        for p, g in zip(members.stacked, grads):
            p.grad = g * (step + 1)
        opt.step()
    for m, lr in enumerate(LRS):
        one = Members(model, 1)
        single = build_member_optimizer(one, "muon", lrs=[lr], weight_decay=0.1)
        for step in range(2):
            for p, g in zip(one.stacked, grads):
                p.grad = (g * (step + 1))[m:m + 1]
            single.step()
        for p, q in zip(members.stacked, one.stacked):
            assert torch.allclose(p[m], q[0], rtol=0, atol=1e-6)


def test_a_copy_stacked_matches_batched_muon_on_its_matrices():
    torch.manual_seed(0)
    weights = [torch.nn.Parameter(torch.randn(12, 8)) for _ in range(2)]
    stacked = [torch.nn.Parameter(w.detach()[None].repeat(2, 1, 1)) for w in weights]
    plain = BatchedMuon([dict(params=weights)], lr=1e-2)
    copies = BatchedMuon([dict(params=stacked)], lr=torch.tensor([1e-2, 1e-2]))
    for w, s in zip(weights, stacked):
        w.grad = torch.randn_like(w)
        s.grad = w.grad[None].repeat(2, 1, 1)
    plain.step()
    copies.step()
    for w, s in zip(weights, stacked):
        assert torch.equal(s[0], w) and torch.equal(s[1], w)


def test_clip_copies_is_each_copys_clip_grad_norm():
    params = [torch.nn.Parameter(torch.zeros(3, 4, 5)), torch.nn.Parameter(torch.zeros(3, 7))]
    grads = [torch.randn(3, 4, 5) * 10, torch.randn(3, 7)]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    norms = clip_copies(params, 1.0)
    for m in range(3):
        alone = [torch.nn.Parameter(torch.zeros_like(g[m])) for g in grads]
        for p, g in zip(alone, grads):
            p.grad = g[m].clone()
        norm = torch.nn.utils.clip_grad_norm_(alone, 1.0)
        assert torch.allclose(norms[m], norm)
        for p, q in zip(params, alone):
            assert torch.allclose(p.grad[m], q.grad, atol=1e-7)


def test_a_diverging_copy_stops_alone():
    config = tiny("mad_recall", optimizer="adamw", clip=0.0, steps=40, log_every=4)
    group = finish(training(config, lrs=[1e-3, 1e12]))
    alone = finish(training(TrainConfig(**{**config.__dict__, "lr": 1e-3})))
    assert group[1]["diverged"] and group[1]["steps"] < 40 and group[1]["final"] is None
    assert not group[0]["diverged"] and group[0]["steps"] == 40
    assert all(bool(torch.isfinite(p).all()) for r in group for p in r["model"].parameters())
    _assert_close(group[0]["model"], alone["model"], 1e-3)


def test_resume_matches_uninterrupted(tmp_path):
    kw = dict(mixer="parallax", optimizer="muon", steps=6, eval_every=2, log_every=3)
    whole = finish(training(tiny("mad_recall", **kw), lrs=LRS))
    path = str(tmp_path / "ckpt.pt")
    first = finish(training(tiny("mad_recall", checkpoint=path, **kw), lrs=LRS, stop_at=3))
    assert [r["steps"] for r in first] == [3, 3, 3]
    second = finish(training(tiny("mad_recall", checkpoint=path, **kw), lrs=LRS))
    for a, b in zip(whole, second):
        assert b["steps"] == 6 and b["resumed_from"] == 3
        for p, q in zip(a["model"].parameters(), b["model"].parameters()):
            assert torch.equal(p, q)
        assert a["history"] == b["history"]


@pytest.mark.parametrize("mixer", sorted(set(MIXER_NAMES) - set(MEMBER_MIXERS)))
def test_mixers_without_vmap_rules_are_refused(mixer):
    with pytest.raises(ValueError, match="lrs"):
        finish(training(tiny("mad_recall", mixer=mixer), lrs=LRS))
