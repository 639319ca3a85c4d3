"""fp32 operands as fp16 parts (``precision="fp16x3"``): exact scales, the parts' error, non-finite values kept.
In the interpreter on the CPU, and on a GPU where there is one (its atomics)."""
import torch

from regattn.ops.scan.split import P_SHIFT, TOP, column_parts, row_parts

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _rebuilt(hi, lo):
    return hi.double() + lo.double()


def test_row_parts_hold_each_row_to_2_to_the_minus_22(interpret):
    x = torch.randn(2, 9, 3, 16) * torch.logspace(-30, 30, 9)[None, :, None, None]  # rows far apart in size
    hi, lo, scale = (t.cpu() for t in row_parts(x.to(DEVICE)))
    assert hi.dtype == lo.dtype == torch.float16 and scale.shape == (2, 3, 9)
    per_row = scale.transpose(1, 2)[..., None].double()
    top = hi.double().abs().amax(-1)
    assert ((top >= 2.0 ** (TOP - 1)) & (top <= 2.0 ** TOP)).all()  # each row fills fp16's range
    err = (_rebuilt(hi, lo) * per_row - x.double()).abs()
    assert (err <= 2.0 ** -22 * x.double().abs().amax(-1, keepdim=True)).all()


def test_row_parts_keep_non_finite_values_out_of_the_scale(interpret):
    x = torch.randn(1, 4, 1, 16)
    x[0, 1, 0, 3] = float("inf")
    x[0, 2, 0, 5] = float("nan")
    hi, lo, scale = (t.cpu() for t in row_parts(x.to(DEVICE)))
    assert torch.isfinite(scale).all()
    assert hi[0, 1, 0, 3] == float("inf") and torch.isnan(hi[0, 2, 0, 5])
    rows = [0, 3]
    err = (_rebuilt(hi, lo)[0, rows] * scale[0, 0, rows, None, None].double() - x.double()[0, rows]).abs().max()
    assert err <= 2.0 ** -22 * x[0, rows].abs().max()


def test_column_parts_scale_each_sequence_alone(interpret):
    v = torch.randn(1, 10, 2, 8)
    v[:, 4:] *= 1e6
    cu = torch.tensor([0, 4, 10])
    hi, lo, scale = (t.cpu() for t in column_parts(v.to(DEVICE), cu.to(DEVICE)))
    assert scale.shape == (2, 2, 8)
    seq = torch.tensor([0] * 4 + [1] * 6)
    rebuilt = _rebuilt(hi, lo)[0] * scale[seq].double() * 2.0 ** P_SHIFT
    err = (rebuilt - v[0].double()).abs()
    assert (err[:4] <= 2.0 ** -22 * v[0, :4].abs().amax(0)).all()  # the small sequence keeps its own bits
    whole = column_parts(v.to(DEVICE), None)[0].cpu()
    assert (whole[0, :4].double().abs().amax() < 2.0 ** (TOP - 15))  # one scale for all: the small ones fall low


def test_column_scales_are_each_sequences_largest_finite_value(interpret):
    """Blocks of keys that straddle sequences (an empty one among them), heads apart, a ragged head dim."""
    cu = torch.tensor([0, 5, 5, 77, 140])
    v = torch.randn(1, 140, 3, 24) * torch.logspace(-3, 3, 140)[None, :, None, None]
    v[0, 80, 1, 2] = float("inf")
    hi, lo, scale = (t.cpu() for t in column_parts(v.to(DEVICE), cu.to(DEVICE)))
    top = torch.where(torch.isfinite(v), v.abs(), 0)[0]
    want = torch.stack([top[a:b].amax(0) if b > a else torch.zeros(3, 24) for a, b in zip(cu[:-1], cu[1:])])
    exps = torch.frexp(want).exponent
    assert torch.equal(scale, torch.exp2((exps - TOP - P_SHIFT).double()).float())
    batched = v[0, :140].reshape(2, 70, 3, 24)  # batch entries: each column over its entry's keys
    plain_scale = column_parts(batched.to(DEVICE), None)[2].cpu()
    want = torch.where(torch.isfinite(batched), batched.abs(), 0).amax(1)
    assert torch.equal(plain_scale, torch.exp2((torch.frexp(want).exponent - TOP - P_SHIFT).double()).float())
