"""``row_dot``: the backwards' ``delta = rowsum(o * dO)`` in fp32, in the rows' own layout or heads first, with the
fp32 ``dq`` buffer of the atomics zeroed by the same launch."""
import pytest
import torch

from regattn.ops._common.attention_tiles import row_dot

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _pair(shape, dtype):
    return tuple(torch.randn(shape, device=DEVICE).to(dtype) for _ in range(2))


def _expected(a, b):
    return (a.double() * b.double()).sum(-1)


@pytest.mark.parametrize("shape", [(2, 37, 3, 24), (1, 5, 1, 64), (3, 70, 2, 40)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_rows_and_heads_first(interpret, shape, dtype):
    a, b = _pair(shape, dtype)
    want = _expected(a, b)
    torch.testing.assert_close(row_dot(a, b).double(), want, rtol=1e-5, atol=1e-5)
    got = row_dot(a, b, heads_first=True)
    assert got.shape == (shape[0], shape[2], shape[1]) and got.is_contiguous()
    torch.testing.assert_close(got.double(), want.transpose(1, 2), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("zero_dim", [24, 64, 5])
def test_zeros_filled_by_the_same_launch(interpret, zero_dim):
    """A buffer full of NaN comes back all zeros, its rows wider, narrower or as wide as ``a``'s."""
    a, b = _pair((2, 37, 3, 24), torch.float16)
    zeros = torch.full((2, 37, 3, zero_dim), float("nan"), device=DEVICE)
    got = row_dot(a, b, heads_first=True, zeros=zeros)
    assert torch.equal(zeros, torch.zeros_like(zeros))
    torch.testing.assert_close(got.double(), _expected(a, b).transpose(1, 2), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("zeros", [torch.zeros(2, 37, 4, 8), torch.zeros(2, 37, 3, 8, dtype=torch.float16),
                                   torch.zeros(2, 37, 8, 3).transpose(2, 3)])
def test_wrong_zeros_refused(zeros):
    a, b = _pair((2, 37, 3, 24), torch.float16)
    with pytest.raises(ValueError, match="zeros"):
        row_dot(a, b, zeros=zeros.to(DEVICE))


def test_heads_first_needs_four_dims():
    a, b = _pair((37, 3, 24), torch.float16)
    with pytest.raises(ValueError, match="heads_first"):
        row_dot(a, b, heads_first=True)


def test_zeros_on_another_device_refused():
    a, b = _pair((2, 37, 3, 24), torch.float16)
    with pytest.raises(ValueError, match="zeros"):
        row_dot(a, b, zeros=torch.empty(2, 37, 3, 8, device="meta"))
