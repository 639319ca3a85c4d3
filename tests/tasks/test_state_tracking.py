import pytest
import torch

from regattn.tasks import IGNORE, state_tracking
from regattn.tasks.state_tracking import COMMA, EQ, HASH, PAD, SPECIAL, swap_range


def replay(tokens: list[int], N: int):
    """Parse one example and apply its swaps in plain Python: (final state, queries, swap count)."""
    state = {}
    for n in range(N):
        p, eq, a, comma = tokens[4 * n: 4 * n + 4]
        assert (p, eq, comma) == (SPECIAL + n, EQ, COMMA)
        state[n] = a
    assert tokens[4 * N] == HASH
    i, swaps = 4 * N + 1, 0
    while tokens[i] != HASH:
        a, b, comma = tokens[i: i + 3]
        assert comma == COMMA and a != b
        pa, pb = a - SPECIAL, b - SPECIAL
        state[pa], state[pb] = state[pb], state[pa]
        i, swaps = i + 3, swaps + 1
    return state, i + 1, swaps


@pytest.mark.parametrize("N", [6, 24])
def test_answers_follow_the_swaps(N):
    t = state_tracking(positions=N, items=50, queries=4, num_train=30, num_test=2, seed=5)
    low, high = swap_range(N)
    assert t.vocab_size == SPECIAL + N + 50
    assert t.train.inputs.shape[1] == 4 * N + 2 + 3 * high + 16
    counts = set()
    for tokens, targets in zip(t.train.inputs.tolist(), t.train.targets.tolist()):
        state, q, swaps = replay(tokens, N)
        counts.add(swaps)
        assert low <= swaps <= high
        assert len(set(state.values())) == N                     # distinct items
        labelled = [k for k, v in enumerate(targets) if v != IGNORE]
        assert labelled == [q + 4 * j + 1 for j in range(4)]      # at each query's '='
        asked = [tokens[q + 4 * j] - SPECIAL for j in range(4)]
        assert len(set(asked)) == 4
        for j, pos in enumerate(labelled):
            assert tokens[pos] == EQ
            assert targets[pos] == state[asked[j]] == tokens[pos + 1]
        assert all(v == PAD for v in tokens[q + 16:])
    assert len(counts) > 1                                       # the swap count varies


def test_seeded():
    a = state_tracking(positions=8, items=20, num_train=5, num_test=5, seed=0)
    b = state_tracking(positions=8, items=20, num_train=5, num_test=5, seed=0)
    assert torch.equal(a.train.inputs, b.train.inputs) and torch.equal(a.test.targets, b.test.targets)
    assert not torch.equal(a.train.inputs, a.test.inputs)


def test_bad_input():
    with pytest.raises(ValueError, match="items"):
        state_tracking(positions=16, items=8, num_train=1, num_test=1)
    with pytest.raises(ValueError, match="positions"):
        state_tracking(positions=1, num_train=1, num_test=1)
