"""The TF32 rounding and split that the fp32 kernels' tensor-core products share (attention_tiles)."""
import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from regattn.ops._common.attention_tiles import tf32_parts, tf32_round


@triton.jit
def _parts_kernel(X, HI, LO, ROUNDED, N, BLOCK: tl.constexpr, KEEP_EXTREMES: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < N)
    hi, lo = tf32_parts(x, KEEP_EXTREMES)
    tl.store(HI + offs, hi, mask=offs < N)
    tl.store(LO + offs, lo, mask=offs < N)
    tl.store(ROUNDED + offs, tf32_round(x), mask=offs < N)


def _nearest_tf32(x: np.ndarray) -> np.ndarray:
    """Round to the nearest multiple of TF32's spacing at ``x`` (10 mantissa bits; below fp32's smallest normal,
    its subnormals' spacing 2^-136), ties away from zero; in float64, exact for fp32 inputs."""
    x = x.astype(np.float64)
    _, e = np.frexp(x)  # |x| in [2^(e-1), 2^e)
    step = np.ldexp(1.0, np.maximum(e - 1, -126) - 10)
    return np.sign(x) * np.floor(np.abs(x) / step + 0.5) * step


def _values() -> torch.Tensor:
    """Random bit patterns (every class: subnormal to inf and NaN), values about fp32's largest and ties."""
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(0, 2 ** 31 - 1, (4096,), generator=g, dtype=torch.int64)
    bits = torch.cat([bits, bits | 2 ** 31])
    x = torch.tensor(bits.numpy().astype(np.uint32).view(np.float32))
    edge = [float.fromhex("0x1.ffdfffp127"), float.fromhex("0x1.ffep127"), float.fromhex("0x1.fffffep127"),
            float.fromhex("0x1.001p0"), float.fromhex("0x1.003p0"), float("inf"), 0.0]
    x = torch.cat([x, torch.tensor(edge), -torch.tensor(edge)])
    x[:4].view(torch.int32)[:] = torch.tensor([-1, 0x7FFFFFFF, 0x7F800001, -0x7FFFF], dtype=torch.int32)  # NaNs
    return x


def _parts(x, keep_extremes):
    """``(hi, lo, tf32_round(x))``."""
    hi, lo, rounded = (torch.empty_like(x) for _ in range(3))
    _parts_kernel[(triton.cdiv(x.numel(), 256),)](x, hi, lo, rounded, x.numel(), BLOCK=256,
                                                  KEEP_EXTREMES=keep_extremes)
    return hi, lo, rounded


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # inf - inf in the interpreter
@pytest.mark.parametrize("keep_extremes", [True, False])
def test_tf32_parts(interpret, keep_extremes):
    x = _values()
    hi, lo, rounded = _parts(x, keep_extremes)
    top = x.abs() >= float.fromhex("0x1.ffep127")  # rounds to inf (inf included; NaN not)
    plain = torch.isfinite(x) & ~top
    want = torch.tensor(_nearest_tf32(x[plain].numpy()), dtype=torch.float32)
    assert torch.equal(hi[plain], want) and not (hi[plain].view(torch.int32) & 0x1FFF).any()  # TF32 values
    assert torch.equal((hi + lo)[plain], x[plain]) and torch.equal(rounded[plain], hi[plain])
    assert torch.isnan(rounded[x.isnan()]).all()  # whatever the payload
    assert torch.equal(rounded[~x.isnan() & top], torch.sign(x[~x.isnan() & top]) * float("inf"))
    if keep_extremes:  # the largest finite values exact, inf and NaN as they are
        assert torch.equal((hi + lo)[top & x.isfinite()], x[top & x.isfinite()])
        assert torch.isnan(hi[x.isnan()]).all() and torch.equal(hi[x.isinf()], x[x.isinf()])
    else:  # the parts add up to NaN wherever x is not finite or would round to inf
        assert torch.isnan((hi + lo)[~plain]).all()
