"""The per-head RMSNorm + RoPE of queries and keys (``regattn.layers.rope.norm_rope``): the fused kernel and the
torch ops against the float64 definition, forward and backward, at sizes that leave tiles partly empty."""
import pytest
import torch
from torch import nn

from regattn.layers import RotaryEmbedding
from regattn.layers.norm import L2Norm, RMSNorm
from regattn.layers.rope import norm_rope
from tests.helpers import TOL, randn, rel_err

BASE = 1e4
EPS = 1e-6


def _spec(x, weight, positions, rotate: bool):
    """float64: ``x / sqrt(mean(x^2) + eps) * weight`` (no norm without ``weight``), then each pair
    ``(y_i, y_{i + D/2})`` turned by ``pos * BASE^(-2i/D)``."""
    y = x.double()
    if weight is not None:
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + EPS) * weight.double()
    if not rotate:
        return y
    D = x.shape[-1]
    angles = positions.double()[:, None] * BASE ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    c, s = angles.cos()[None, :, None], angles.sin()[None, :, None]
    y1, y2 = y.chunk(2, -1)
    return torch.cat((y1 * c - y2 * s, y2 * c + y1 * s), -1)


def _norm(D, dtype):
    norm = RMSNorm(D, eps=EPS)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.5 * randn(D))
    return norm.to(dtype)


CASES = [  # (B, T, H, D, offset, norm, rotate)
    (2, 7, 3, 16, 0, True, True),
    (1, 5, 1, 48, 3, True, True),      # half a row of 24: the tile's columns partly masked
    (3, 33, 2, 8, 0, True, False),
    (2, 9, 5, 32, 11, False, True),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("B,T,H,D,offset,with_norm,rotate", CASES)
def test_kernel_matches_definition_forward_and_backward(interpret, B, T, H, D, offset, with_norm, rotate, dtype):
    norm = _norm(D, torch.float32) if with_norm else None
    rope = RotaryEmbedding(D, base=BASE) if rotate else None
    x = randn(B, T, H, D, dtype=dtype, scale=3.0, requires_grad=True)
    angles = rope.angles(T, offset, x.device) if rotate else None
    y = norm_rope(x, norm, angles, backend="triton")
    assert y.dtype == dtype and y.shape == x.shape
    x64 = x.detach().double().requires_grad_(True)
    w64 = norm.weight.detach().double().requires_grad_(True) if with_norm else None
    truth = _spec(x64, w64, torch.arange(offset, offset + T), rotate)
    assert rel_err(y, truth) < TOL[dtype]
    dy = randn(B, T, H, D, dtype=dtype)
    y.backward(dy)
    truth.backward(dy.double())
    assert rel_err(x.grad, x64.grad) < TOL[dtype]
    if with_norm:
        assert norm.weight.grad.dtype == torch.float32
        assert rel_err(norm.weight.grad, w64.grad) < TOL[dtype]


def _rotate(y, positions):
    return _spec(y, None, positions, True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("B,T,H,D,offset,rotate", [(2, 7, 3, 16, 0, True), (1, 5, 2, 48, 3, True),
                                                    (3, 9, 2, 8, 0, False)])
def test_l2_norm_matches_definition_forward_and_backward(interpret, B, T, H, D, offset, rotate, dtype):
    """``L2Norm``: ``F.normalize`` of each row (float64), then the rotation, through the kernels."""
    rope = RotaryEmbedding(D, base=BASE) if rotate else None
    x = randn(B, T, H, D, dtype=dtype, scale=3.0, requires_grad=True)
    y = norm_rope(x, L2Norm(), rope.angles(T, offset, x.device) if rotate else None, backend="triton")
    x64 = x.detach().double().requires_grad_(True)
    truth = torch.nn.functional.normalize(x64, dim=-1)
    truth = _rotate(truth, torch.arange(offset, offset + T)) if rotate else truth
    assert y.dtype == dtype and rel_err(y, truth) < TOL[dtype]
    dy = randn(B, T, H, D, dtype=dtype)
    y.backward(dy)
    truth.backward(dy.double())
    assert rel_err(x.grad, x64.grad) < TOL[dtype]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_l2_norm_of_a_zero_row_is_clamped_as_f_normalize(interpret, backend):
    """A row whose norm is below ``eps`` is divided by ``eps``, and so is its gradient (no projection)."""
    x = randn(1, 3, 2, 8, dtype=torch.float32)
    x[0, 1, 0] = 0.0
    x.requires_grad_(True)
    y = norm_rope(x, L2Norm(), None, backend=backend)
    x64 = x.detach().double().requires_grad_(True)
    truth = torch.nn.functional.normalize(x64, dim=-1)
    dy = randn(1, 3, 2, 8, dtype=torch.float32)
    y.backward(dy)
    truth.backward(dy.double())
    assert torch.equal(y[0, 1, 0], torch.zeros(8)) and rel_err(y, truth) < TOL[torch.float32]
    assert rel_err(x.grad[0, 1, 0], dy[0, 1, 0].double() * 1e12) < 1e-6
    assert rel_err(x.grad[0, 0], x64.grad[0, 0]) < TOL[torch.float32]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_packed_sequences_restart_their_positions(interpret, backend):
    norm, rope = _norm(16, torch.float32), RotaryEmbedding(16, base=BASE)
    x = randn(1, 12, 2, 16, dtype=torch.float32)
    cu = torch.tensor([0, 5, 5, 6, 12])
    y = norm_rope(x, norm, rope.angles(12, 0, x.device, cu), backend=backend)
    per_sequence = torch.cat([norm_rope(x[:, a:b], norm, rope.angles(b - a, 0, x.device), backend=backend)
                              for a, b in ((0, 5), (5, 6), (6, 12))], 1)
    assert rel_err(y, per_sequence) < 1e-6
    positions = torch.tensor([0, 1, 2, 3, 4, 0, 0, 1, 2, 3, 4, 5])
    assert rel_err(y, _spec(x, norm.weight.detach(), positions, True)) < TOL[torch.float32]


def test_torch_ops_match_definition_in_float64():
    """The torch path keeps float64 in float64 (the angles are fp32); ``nn.Identity`` and None mean no norm."""
    norm, rope = _norm(8, torch.float64), RotaryEmbedding(8, base=BASE)
    x = randn(2, 6, 3, 8)
    assert rel_err(norm_rope(x, norm, None), _spec(x, norm.weight.detach(), None, False)) < 1e-12
    angles = rope.angles(6, 2, x.device)
    assert rel_err(norm_rope(x, norm, angles), _spec(x, norm.weight.detach(), torch.arange(2, 8), True)) < 1e-6
    assert torch.equal(norm_rope(x, nn.Identity(), angles), norm_rope(x, None, angles))
    assert norm_rope(x, None, None) is x


def test_one_rounding_in_low_precision(interpret):
    """bf16 input: the norm and the rotation in fp32, one rounding at the end, on both paths."""
    norm, rope = _norm(16, torch.float32), RotaryEmbedding(16, base=BASE)
    x = randn(2, 5, 3, 16, dtype=torch.bfloat16, scale=40.0)
    truth = _spec(x, norm.weight.detach(), torch.arange(5), True)
    for backend in ("torch", "triton"):
        y = norm_rope(x, norm, rope.angles(5, 0, x.device), backend=backend)
        assert y.dtype == torch.bfloat16 and rel_err(y, truth) < 2 ** -8


def test_non_finite_rows_stay_in_their_rows(interpret):
    norm, rope = _norm(16, torch.float32), RotaryEmbedding(16, base=BASE)
    x = randn(1, 6, 2, 16, dtype=torch.float32)
    x[0, 3, 1, 5] = float("nan")
    x[0, 4, 0, 2] = float("inf")
    y = norm_rope(x, norm, rope.angles(6, 0, x.device), backend="triton")
    bad = ~torch.isfinite(y)
    assert bad[0, 3, 1].all() and bad[0, 4, 0].any()       # an inf row: rstd = 0, finite entries 0
    bad[0, 3, 1] = False
    bad[0, 4, 0] = False
    assert not bad.any()


def test_bad_arguments():
    norm, rope = _norm(16, torch.float32), RotaryEmbedding(16, base=BASE)
    x = randn(2, 5, 3, 16, dtype=torch.float32)
    angles = rope.angles(5, 0, x.device)
    with pytest.raises(ValueError, match="^x: expected a rank-4 tensor"):
        norm_rope(x[0], norm, angles)
    with pytest.raises(TypeError, match="^x: expected a floating-point tensor"):
        norm_rope(x.long(), norm, None)
    with pytest.raises(ValueError, match=r"^norm: expected an RMSNorm over the head dim \(16,\)"):
        norm_rope(x, _norm(8, torch.float32), angles)
    with pytest.raises(ValueError, match=r"^angles\[0\] \(cos\): expected shape \[T, D/2\]"):
        norm_rope(x, norm, rope.angles(6, 0, x.device))
    with pytest.raises(ValueError, match=r"^angles\[1\] \(sin\): expected shape \[T, D/2\]"):
        norm_rope(x, norm, (angles[0], angles[1][:, :4]))
    with pytest.raises(ValueError, match="^x: a rotation needs an even head dim"):
        norm_rope(randn(2, 5, 3, 15, dtype=torch.float32), None, angles)
