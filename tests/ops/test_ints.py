"""The host-side launch arithmetic equals Triton's."""
import triton

from regattn.ops._common.ints import ceil_div, next_pow2


def test_next_pow2_is_tritons():
    assert [next_pow2(n) for n in range(1, 5000)] == [triton.next_power_of_2(n) for n in range(1, 5000)]


def test_ceil_div_is_tritons():
    pairs = [(a, b) for a in range(0, 300) for b in range(1, 40)]
    assert [ceil_div(a, b) for a, b in pairs] == [triton.cdiv(a, b) for a, b in pairs]
