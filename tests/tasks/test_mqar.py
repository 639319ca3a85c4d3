import pytest
import torch

from regattn.tasks import IGNORE, mqar


def test_shapes_and_seed():
    a = mqar(length=32, pairs=4, vocab_size=40, num_train=7, num_test=3, seed=1)
    b = mqar(length=32, pairs=4, vocab_size=40, num_train=7, num_test=3, seed=1)
    c = mqar(length=32, pairs=4, vocab_size=40, num_train=7, num_test=3, seed=2)
    assert a.kind == "tokens" and a.vocab_size == 40
    assert a.train.inputs.shape == a.train.targets.shape == (7, 32) and a.test.inputs.shape == (3, 32)
    assert a.train.inputs.dtype == torch.long
    assert torch.equal(a.train.inputs, b.train.inputs) and torch.equal(a.test.targets, b.test.targets)
    assert not torch.equal(a.train.inputs, c.train.inputs)


@pytest.mark.parametrize("offset_power", [None, 0.01])
@pytest.mark.parametrize("length,pairs", [(64, 4), (64, 16)])
def test_answers_are_the_values_paired_earlier(length, pairs, offset_power):
    t = mqar(length=length, pairs=pairs, vocab_size=64, num_train=20, num_test=2, seed=0, offset_power=offset_power)
    x, y = t.train.inputs, t.train.targets
    for n in range(20):
        keys, values = x[n, 0:2 * pairs:2].tolist(), x[n, 1:2 * pairs:2].tolist()
        assert len(set(keys)) == pairs and all(1 <= k < 32 for k in keys) and all(32 <= v < 64 for v in values)
        table = dict(zip(keys, values))
        asked = (y[n] != IGNORE).nonzero().flatten().tolist()
        assert len(asked) == pairs and min(asked) >= 2 * pairs          # every key queried once, after the context
        assert sorted(x[n, asked].tolist()) == sorted(keys)
        for p in asked:
            assert y[n, p].item() == table[x[n, p].item()]
        others = [p for p in range(2 * pairs, length) if p not in asked]
        assert all(x[n, p].item() == 0 for p in others)


def test_bad_input():
    with pytest.raises(ValueError, match="pairs"):
        mqar(length=32, pairs=9, num_train=1, num_test=1)
    with pytest.raises(TypeError, match="length"):
        mqar(length=32.0, num_train=1, num_test=1)


def test_power_law_offsets_are_drawn_in_proportion_to_their_weights():
    n, a = 4000, 0.01
    t = mqar(length=64, pairs=1, vocab_size=64, num_train=n, num_test=1, seed=3, offset_power=a)
    slot = ((t.train.targets != IGNORE).nonzero()[:, 1] - 2) // 2        # the free offset of the one query
    weights = torch.arange(1, 32, dtype=torch.float64) ** (a - 1)
    p = weights / weights.sum()
    seen = torch.bincount(slot, minlength=31).double() / n
    assert torch.all((seen - p).abs() <= 5 * (p * (1 - p) / n).sqrt() + 1e-3)
    uniform = mqar(length=64, pairs=1, vocab_size=64, num_train=n, num_test=1, seed=3)
    counts = torch.bincount(((uniform.train.targets != IGNORE).nonzero()[:, 1] - 2) // 2, minlength=31).double()
    assert (counts / (n / 31) - 1).abs().max() < 0.4                         # uniform: every offset alike


@pytest.mark.parametrize("bad, error", [(0.0, ValueError), (1.5, ValueError), (float("nan"), ValueError),
                                        ("x", TypeError), (True, TypeError)])
def test_offset_power_must_be_in_0_1(bad, error):
    with pytest.raises(error, match="offset_power"):
        mqar(length=32, num_train=1, num_test=1, offset_power=bad)


def test_pairs_per_length():
    assert mqar(length=64, pairs_per_length=16, num_train=1, num_test=1).info["pairs"] == 4
    with pytest.raises(ValueError, match="pairs_per_length"):
        mqar(length=64, pairs=4, pairs_per_length=16, num_train=1, num_test=1)
