"""The test-time regression data (lla Appendix F.1): shapes, seeds, cones, the segment maps."""
import pytest
import torch

from regattn.tasks.regression import cone_bits, cone_signs, piecewise_linear_regression, segment_index


def test_shapes_and_segments_when_S_does_not_divide_L():
    data = piecewise_linear_regression(3, 21, 5, 6, seed=1)
    assert data.keys.shape == data.values.shape == (3, 21, 5)
    assert data.maps.shape == (3, 4, 5, 5)                      # ceil(21 / 6) = 4 segments
    assert data.signs.shape == (4, 2)                           # m = ceil(log2 4) = 2
    assert data.segment.tolist() == [i // 6 for i in range(21)]
    assert data.keys.dtype == torch.float64


def test_dtype_and_device_are_honoured():
    data = piecewise_linear_regression(2, 8, 3, 4, seed=0, dtype=torch.float32, device="cpu")
    assert all(t.dtype == torch.float32 for t in (data.keys, data.values, data.maps, data.signs))


def test_same_seed_same_data_other_seed_other_data():
    a = piecewise_linear_regression(4, 32, 6, 8, noise=0.3, seed=7)
    b = piecewise_linear_regression(4, 32, 6, 8, noise=0.3, seed=7)
    c = piecewise_linear_regression(4, 32, 6, 8, noise=0.3, seed=8)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    assert not torch.equal(a.keys, c.keys) and not torch.equal(a.maps, c.maps)


def test_sign_patterns_are_distinct_and_read_from_the_bits():
    signs = cone_signs(8, cone_bits(8))
    assert signs.shape == (8, 3)
    assert len({tuple(r) for r in signs.tolist()}) == 8
    assert signs[0].tolist() == [1, 1, 1] and signs[5].tolist() == [-1, 1, -1]   # 5 = 0b101
    assert cone_bits(1) == 0 and cone_bits(2) == 1 and cone_bits(5) == 3


def test_keys_of_a_segment_lie_in_its_cone_and_nowhere_else():
    data = piecewise_linear_regression(16, 64, 6, 8, seed=3)        # 8 segments, m = 3
    m = data.signs.shape[1]
    head = data.keys[..., :m]                                       # [N, L, m]
    for c in range(data.maps.shape[1]):
        at = data.segment == c
        inside = (head[:, at] * data.signs[c] > 0).all(-1)          # in cone c
        assert inside.all()
        for other in range(data.maps.shape[1]):
            if other != c:
                assert not (head[:, at] * data.signs[other] > 0).all(-1).any()
    tail = data.keys[..., m:]                                       # eq. 51: left Gaussian, both signs
    assert (tail > 0).any() and (tail < 0).any()


def test_values_are_the_segment_map_of_the_key_at_zero_noise():
    data = piecewise_linear_regression(3, 20, 4, 6, noise=0.0, seed=2)
    for n in range(3):
        for i in range(20):
            expected = data.maps[n, i // 6] @ data.keys[n, i]
            torch.testing.assert_close(data.values[n, i], expected, rtol=1e-12, atol=1e-12)


def test_noise_has_the_requested_standard_deviation():
    data = piecewise_linear_regression(64, 64, 8, 16, noise=0.5, seed=4)
    clean = torch.einsum("nlij,nlj->nli", data.maps[:, data.segment], data.keys)
    std = (data.values - clean).std().item()
    assert abs(std - 0.5) < 0.02


def test_segment_index():
    assert segment_index(7, 3).tolist() == [0, 0, 0, 1, 1, 1, 2]


@pytest.mark.parametrize("kwargs, error, word", [
    (dict(num_sequences=2, length=64, dim=2, segment=8), ValueError, "segment"),   # 8 segments need 3 > 2 coordinates
    (dict(num_sequences=0, length=8, dim=2, segment=4), ValueError, "num_sequences"),
    (dict(num_sequences=2, length=8, dim=2, segment=4, noise=-1.0), ValueError, "noise"),
    (dict(num_sequences=2, length=8.0, dim=2, segment=4), TypeError, "length"),
    (dict(num_sequences=2, length=8, dim=2, segment=4, dtype=torch.int64), TypeError, "dtype"),
])
def test_bad_settings_are_named(kwargs, error, word):
    with pytest.raises(error, match=word):
        piecewise_linear_regression(**kwargs)


@pytest.mark.gpu
def test_on_cuda_same_seed_same_data_and_the_same_structure():
    a = piecewise_linear_regression(8, 64, 6, 8, noise=0.0, seed=5, device="cuda")
    b = piecewise_linear_regression(8, 64, 6, 8, noise=0.0, seed=5, device="cuda")
    assert a.keys.is_cuda and all(torch.equal(x, y) for x, y in zip(a, b))
    m = a.signs.shape[1]
    assert (a.keys[..., :m] * a.signs[a.segment] > 0).all()
    clean = torch.einsum("nlij,nlj->nli", a.maps[:, a.segment], a.keys)
    torch.testing.assert_close(a.values, clean, rtol=1e-12, atol=1e-12)
