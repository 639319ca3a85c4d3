import pytest
import torch

from regattn.tasks import IGNORE, MAD_TASKS, mad_benchmark_settings, mad_hard_settings, mad_task
from regattn.tasks.mad import memorization_map


def test_seeded_and_shapes():
    for name in MAD_TASKS:
        a = mad_task(name, num_train=4, num_test=3, seed=2)
        b = mad_task(name, num_train=4, num_test=3, seed=2)
        c = mad_task(name, num_train=4, num_test=3, seed=3)
        L = a.info["seq_len"] - (1 if "recall" in name and name != "fuzzy_recall" else 0)
        assert a.train.inputs.shape == a.train.targets.shape == (4, L), name
        assert a.test.inputs.shape == (3, L), name
        assert torch.equal(a.train.inputs, b.train.inputs) and torch.equal(a.test.targets, b.test.targets), name
        assert not torch.equal(a.train.inputs, c.train.inputs), name
        assert int(a.train.inputs.max()) < a.vocab_size and int(a.train.inputs.min()) >= 0


@pytest.mark.parametrize("name,setting", [("recall", {}), ("noisy_recall", dict(frac_noise=0.4))])
def test_recall_labels_are_earlier_values(name, setting):
    t = mad_task(name, num_train=8, num_test=8, seed=0, **setting)
    clean = t.vocab_size - t.info.get("noise_vocab_size", 0)
    assert torch.equal(t.train.targets[:, :-1], t.train.inputs[:, 1:])     # next-token training
    for x, y in zip(t.test.inputs.tolist(), t.test.targets.tolist()):
        seen = {}
        labelled = 0
        for p in range(0, len(x) - 1, 2):
            k, v = x[p], x[p + 1]
            if k >= clean:                                   # a noise pair
                assert v >= clean and y[p] == IGNORE
                continue
            assert k < clean // 2 <= v < clean
            if k in seen:
                assert y[p] == seen[k] == v
                labelled += 1
            else:
                assert y[p] == IGNORE
            seen[k] = v
        assert labelled >= 1 and y[-1] != IGNORE             # the final key always repeats a seen one
        assert all(y[p] == IGNORE for p in range(1, len(y), 2))


def test_noisy_recall_has_noise():
    t = mad_task("noisy_recall", num_train=4, num_test=4, seed=0, frac_noise=0.6)
    assert (t.test.inputs >= 16).float().mean() > 0.3


def test_fuzzy_recall_labels():
    t = mad_task("fuzzy_recall", num_train=4, num_test=6, seed=1, seq_len=64)
    pad = t.vocab_size - 1
    assert torch.equal(t.train.targets[:, :-1], t.train.inputs[:, 1:])
    for x, y in zip(t.test.inputs.tolist(), t.test.targets.tolist()):
        labels = [(p, v) for p, v in enumerate(y) if v != IGNORE]
        assert labels and labels[-1][0] == len(y) - 1
        assert all(7 <= v < 15 for _, v in labels)                     # values come from the value vocabulary
        for p, v in labels[:-1]:
            assert x[p + 1] == v                                        # shifted: the label is the next token
        body = [tok for tok in x if tok != pad]
        assert x[:len(x) - len(body)] == [pad] * (len(x) - len(body))  # left padding only


def test_selective_copy():
    t = mad_task("selective_copy", num_train=3, num_test=3, seed=0, seq_len=40, num_tokens_to_copy=5)
    blank, copy = t.vocab_size - 2, t.vocab_size - 1
    for x, y in zip(t.test.inputs.tolist(), t.test.targets.tolist()):
        assert x[40 - 6] == copy and x[-5:] == [blank] * 5
        content = [tok for tok in x[:34] if tok != blank]
        assert y[-5:] == content and all(v == IGNORE for v in y[:-5])


def test_compression():
    t = mad_task("compression", num_train=3, num_test=3, seed=0)
    assert t.kind == "autoencode"
    assert torch.equal(t.test.inputs, t.test.targets)
    assert torch.all(t.test.inputs[:, -1] == t.vocab_size - 1) and torch.all(t.test.inputs[:, :-1] < t.vocab_size - 1)


def test_memorization_map_is_fixed_across_splits_and_seeds():
    table = memorization_map(256, 12345)
    assert len(set(table.tolist())) == table.numel() == 127
    for seed in (0, 1):
        t = mad_task("memorization", num_train=5, num_test=5, seed=seed)
        for split in (t.train, t.test):
            keys, labels = split.inputs[:, 0::2], split.targets[:, 1::2]
            assert torch.equal(labels, table[keys])
            assert torch.all(split.inputs[:, 1::2] == 255) and torch.all(split.targets[:, 0::2] == IGNORE)
    assert len(mad_task("memorization", num_test=1).train) == 256


def test_settings_lists_build():
    bench = mad_benchmark_settings()
    assert len(bench) == 11 + 11 + 14 + 13 + 11 + 6
    hard = mad_hard_settings()
    assert max(s["vocab_size"] for _, s in hard) >= 512 and max(s["seq_len"] for _, s in hard) == 2048
    for name, setting in bench + hard:
        setting = {k: v for k, v in setting.items() if k != "num_train"}
        t = mad_task(name, num_train=1, num_test=1, **setting)
        assert len(t.train) == 1


def test_bad_input():
    with pytest.raises(ValueError, match="task"):
        mad_task("copying")
    with pytest.raises(ValueError, match="seq_len"):
        mad_task("selective_copy", seq_len=20, num_tokens_to_copy=16, num_train=1, num_test=1)
    with pytest.raises(ValueError, match="frac_noise"):
        mad_task("noisy_recall", frac_noise=0.0, num_train=1, num_test=1)
