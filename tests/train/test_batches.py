import pytest
import torch
import torch.nn.functional as F

from regattn.models.stack import build_model
from regattn.tasks import IGNORE, make_task
from regattn.train.batches import EpochBatches, epoch_permutation, static_examples
from regattn.train.step import batch_loss
from tests.train.test_trainer import TINY


def task(name, seed=0):
    return make_task(name, seed=seed, num_train=24, num_test=6, **TINY[name])


def old_order(n, batch_size, seed, step):
    """The examples of ``step`` as the trainer drew them before static batches (BatchOrder)."""
    per_epoch = max(1, n // batch_size)
    epoch, i = divmod(step, per_epoch)
    g = torch.Generator().manual_seed(seed * 1_000_003 + 7919 * epoch + 1)
    return torch.randperm(n, generator=g)[i * batch_size:(i + 1) * batch_size]


@pytest.mark.parametrize("name", sorted(TINY))
def test_labels_at_the_selected_positions(name):
    data = task(name)
    split = data.test
    ex = static_examples(split, data.kind)
    labelled = split.mask if data.kind == "regression" else split.targets != IGNORE
    if ex.select is None:
        assert bool(labelled.all()) and ex.targets is split.targets
        return
    N, K = ex.select.shape
    assert K == int(labelled.sum(1).max()) and ex.valid.shape == (N, K)
    for n in range(N):
        chosen = ex.select[n][ex.valid[n]]
        assert chosen.tolist() == labelled[n].nonzero()[:, 0].tolist()      # every label once, in order
        assert torch.equal(ex.targets[n][ex.valid[n]], split.targets[n, chosen])
        pad = ex.targets[n][~ex.valid[n]]
        assert bool((pad == (0 if data.kind == "regression" else IGNORE)).all())


@pytest.mark.parametrize("name", ["mqar", "mad_recall", "icr"])
def test_batches_are_static_and_follow_the_old_order(name):
    data = task(name, seed=3)
    ex = static_examples(data.train, data.kind)
    batches = EpochBatches(ex, 5, 3, "cpu")                  # 24 examples: 4 batches an epoch
    shapes = set()
    for step in [0, 1, 3, 4, 9, 2]:
        b = batches(step)
        shapes.add(tuple(None if t is None else tuple(t.shape) for t in b.tensors().values()))
        index = old_order(len(data.train), 5, 3, step)
        assert torch.equal(b.inputs, data.train.inputs[index])
        assert torch.equal(b.targets, ex.targets[index]) and torch.equal(b.valid, ex.valid[index])
    assert len(shapes) == 1


def test_an_epoch_visits_every_example_once():
    ex = static_examples(task("mqar").train, "tokens")
    batches = EpochBatches(ex, 6, 1, "cpu")
    seen = torch.cat([batches(s).inputs for s in range(4)])
    assert sorted(map(tuple, seen.tolist())) == sorted(map(tuple, ex.inputs.tolist()))
    assert not torch.equal(batches(0).inputs, batches(4).inputs)
    assert torch.equal(epoch_permutation(24, 1, 2), epoch_permutation(24, 1, 2))


@pytest.mark.parametrize("name", ["mqar", "mad_selective_copy", "state", "icr", "mad_compression"])
def test_loss_matches_the_masked_loss(name):
    # the loss and metric at the selected positions equal those of the whole output masked by the labels
    data = task(name)
    torch.manual_seed(0)
    model = build_model(data, "softmax", dim=16, heads=2, mlp=data.kind != "regression")
    split = data.test
    loss, metric, n = batch_loss(model, data.kind, *static_examples(split, data.kind).tensors().values())
    out = model(split.inputs).float()
    if data.kind == "regression":
        err = ((out - split.targets) ** 2).mean(-1)[split.mask]
        expect_loss, expect_metric, expect_n = err.mean(), err.sum(), err.numel()
    else:
        labelled = split.targets != IGNORE
        logits, targets = out[labelled], split.targets[labelled]
        expect_loss = F.cross_entropy(logits, targets)
        expect_metric, expect_n = (logits.argmax(-1) == targets).sum(), labelled.sum()
    assert int(n) == int(expect_n)
    assert torch.allclose(loss, expect_loss, rtol=1e-5) and torch.allclose(metric.float(), expect_metric.float(), rtol=1e-5)
