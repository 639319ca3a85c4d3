"""Containment by finite copies (regattn.ops._common.hidden): which positions hold a non-finite key or value, which
rows see one and which keys those rows see, against the visibility of every (row, key) pair."""
import pytest
import torch

from regattn.ops._common.hidden import finite_copy, hidden_flags, keys_reached, rows_seeing
from regattn.reference.common import visible


# (T, S, window): as many rows as keys, fewer (a cache), more (rows before the first key); windows shorter and longer
SHAPES = [(16, 16, None), (16, 16, 3), (5, 23, None), (7, 23, 4), (9, 9, 40), (20, 12, None), (20, 12, 5)]


@pytest.mark.parametrize("T, S, window", SHAPES)
def test_rows_and_keys_match_visibility(T, S, window):
    """Rows that see a flagged position and the keys those rows see, against every (row, key) pair's visibility."""
    gen = torch.Generator().manual_seed(T * S)
    flags = torch.rand(2, 3, S, generator=gen) < 0.1
    flags[0, 0] = False  # a head with no flagged position
    sees = visible(T, S, causal=True, window=window)
    want_rows = (sees[None, None] & flags[..., None, :]).any(-1)
    rows = rows_seeing(flags, T, window)
    assert torch.equal(rows, want_rows)
    assert torch.equal(keys_reached(rows, S, window), (sees[None, None] & rows[..., None]).any(-2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flags_mark_keys_and_values_that_are_not_finite(dtype):
    """Flags per (batch, head, position) from a NaN in k or an inf in v; the copies hold zeros there."""
    k, v = torch.randn(2, 6, 3, 4, dtype=dtype), torch.randn(2, 6, 3, 5, dtype=dtype)
    k[0, 2, 1, 3], v[1, 4, 0, 0], v[1, 5, 2, 1] = float("nan"), float("inf"), -float("inf")
    want = torch.zeros(2, 3, 6, dtype=torch.bool)
    want[0, 1, 2] = want[1, 0, 4] = want[1, 2, 5] = True
    assert torch.equal(hidden_flags(k, v), want)
    safe = finite_copy(v)
    assert torch.isfinite(safe).all() and safe[1, 4, 0, 0] == 0 and torch.equal(safe[0], v[0])
