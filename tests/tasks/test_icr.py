import pytest
import torch

from regattn.tasks import in_context_regression


def small(**kw):
    args = dict(length=48, segment=16, dim_x=4, dim_y=3, queries=5, num_train=6, num_test=5, seed=3)
    return in_context_regression(**{**args, **kw})


def test_shapes_and_mask():
    t = small()
    assert t.kind == "regression" and t.dim_in == 7 and t.dim_out == 3
    assert t.train.inputs.shape == (6, 53, 7) and t.train.targets.shape == (6, 53, 3)
    assert t.test.inputs.shape == (5, 53, 7)
    expected = torch.zeros(53, dtype=torch.bool)
    expected[48:] = True
    assert torch.equal(t.test.mask, expected.expand(5, 53))
    # the queries carry x' and a zero target slot; the context carries its targets
    assert torch.all(t.test.inputs[:, 48:, 4:] == 0)
    assert torch.equal(t.test.inputs[:, :48, 4:], t.test.targets[:, :48])


def test_seeded():
    a, b, c = small(), small(), small(seed=4)
    assert torch.equal(a.train.inputs, b.train.inputs) and torch.equal(a.test.targets, b.test.targets)
    assert not torch.equal(a.train.inputs, c.train.inputs)
    assert not torch.equal(a.train.inputs[:5], a.test.inputs)    # the splits are drawn independently


def segment_of(x: torch.Tensor, bits: int) -> torch.Tensor:
    """The cone index from the signs of the first ``bits`` coordinates (bit j set where x_j < 0)."""
    neg = (x[..., :bits] < 0).long()
    return (neg << torch.arange(bits)).sum(-1)


def test_piecewise_linear_structure_noiseless():
    # test data is noiseless: within a cone, targets are one linear map of the inputs, queries included
    t = small()
    x, y = t.test.inputs[..., :4], t.test.targets
    seg = segment_of(x, bits=2)
    for n in range(5):
        for c in range(3):
            ctx = (seg[n, :48] == c)
            assert ctx.sum() == 16                       # each segment keeps its 16 pairs after shuffling
            A = torch.linalg.lstsq(x[n, :48][ctx].double(), y[n, :48][ctx].double()).solution
            q = seg[n, 48:] == c
            pred = x[n, 48:][q].double() @ A
            assert torch.allclose(pred, y[n, 48:][q].double(), atol=1e-4)


def test_train_noise_level():
    t = small(num_train=20, length=64, segment=64, dim_x=4, dim_y=4)
    x, y = t.train.inputs[:, :64, :4].double(), t.train.targets[:, :64].double()
    resid = []
    for n in range(20):
        A = torch.linalg.lstsq(x[n], y[n]).solution
        resid.append(y[n] - x[n] @ A)
    std = torch.cat(resid).std().item()
    assert 0.07 < std < 0.12


def test_bad_input():
    with pytest.raises(ValueError, match="segment"):
        in_context_regression(length=64, segment=1, dim_x=4, num_train=1, num_test=1)
    with pytest.raises(ValueError, match="queries"):
        in_context_regression(queries=0, num_train=1, num_test=1)


def test_segments_count():
    assert small(segment=None, segments=4).info["segment"] == 12
    with pytest.raises(ValueError, match="segments"):
        small(segments=4)
