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


def _rotated(x, positions, base):
    """The rotation by hand in float64: pair ``(x_i, x_{i + D/2})`` turned by ``pos * base^(-2i/D)``."""
    D = x.shape[-1]
    angles = positions.double()[:, None] * base ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    c, s = angles.cos()[None, :, None], angles.sin()[None, :, None]
    x1, x2 = x.double().chunk(2, -1)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1)


def test_rotation_in_each_dtype():
    """Each dtype rotated in fp32 and returned in its own: the error of the fp32 angles, then one rounding."""
    rope = RotaryEmbedding(16, base=1e4)
    positions = torch.arange(5, 14)
    for x in (randn(2, 9, 3, 16), randn(2, 9, 1, 16, dtype=torch.float32), randn(2, 9, 3, 16, dtype=torch.bfloat16)):
        r = rope(x, 5)
        assert r.dtype == x.dtype and r.shape == x.shape
        bound = 1e-6 if x.dtype == torch.float64 else 2 ** -8
        assert rel_err(r, _rotated(x, positions, 1e4)) < bound
