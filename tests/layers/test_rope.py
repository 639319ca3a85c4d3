"""RoPE: packed sequences restart their positions, computed on the device (compiles without a break)."""
import pytest
import torch

from regattn.layers import RotaryEmbedding
from tests.helpers import randn, rel_err


def test_packed_sequences_restart_their_positions():
    rope = RotaryEmbedding(8, base=100.0)
    x = randn(1, 12, 2, 8)
    cu = torch.tensor([0, 5, 5, 6, 12])                 # an empty sequence among them
    per_sequence = torch.cat([rope(x[:, a:b]) for a, b in ((0, 5), (5, 6), (6, 12))], 1)
    assert rel_err(rope(x, cu_seqlens=cu), per_sequence) < 1e-12
    compiled = torch.compile(lambda t, c: rope(t, cu_seqlens=c), fullgraph=True, backend="eager")
    assert rel_err(compiled(x, cu), per_sequence) < 1e-12


def test_bad_arguments():
    with pytest.raises(ValueError, match="^head_dim: "):
        RotaryEmbedding(7)
    with pytest.raises(ValueError, match="^head_dim: "):
        RotaryEmbedding(0)
    with pytest.raises(ValueError, match="^base: "):
        RotaryEmbedding(8, base=-1.0)
