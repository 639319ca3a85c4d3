"""The FLOP and byte formulas against direct counts."""
import pytest

from regattn.bench import counts
from regattn.reference.common import visible


@pytest.mark.parametrize("T,S,window", [(1, 1, None), (7, 7, None), (7, 7, 3), (5, 12, None), (5, 12, 4),
                                        (1, 9, 2), (9, 9, 20), (16, 16, 1)])
def test_visible_pairs_counts_the_mask(T, S, window):
    assert counts.visible_pairs(T, S, window=window) == int(visible(T, S, causal=True, window=window).sum())


def test_visible_pairs_non_causal_is_every_pair():
    assert counts.visible_pairs(6, 11, causal=False) == 66


def test_attention_flops_two_products_per_pair_and_backward_factor():
    pairs = counts.visible_pairs(10, 10, window=4)
    fwd = counts.attention_flops(2, 10, 10, 3, 8, 5, window=4)
    assert fwd == 2 * pairs * (8 + 5) * 2 * 3
    assert counts.attention_flops(2, 10, 10, 3, 8, 5, window=4, backward=True) == pytest.approx(3.5 * fwd)
    assert counts.parallax_flops(2, 10, 10, 3, 8, 5, window=4) == 2 * fwd


def test_attention_bytes_reads_inputs_and_writes_output_once():
    B, T, S, HQ, H, D, Dv, elt = 2, 5, 7, 4, 2, 8, 6, 2
    q, k, v, o = B * T * HQ * D, B * S * H * D, B * S * H * Dv, B * T * HQ * Dv
    assert counts.attention_bytes(B, T, S, HQ, H, D, Dv, elt) == elt * (q + k + v + o)
    with_r = counts.attention_bytes(B, T, S, HQ, H, D, Dv, elt, extra_per_query=D)
    assert with_r == elt * (2 * q + k + v + o)
    fwd_bwd = counts.attention_bytes(B, T, S, HQ, H, D, Dv, elt, backward=True)
    assert fwd_bwd == elt * (3 * (q + k + v + o))


def test_decay_counts_match_the_recurrence():
    B, T, H, R, D = 2, 9, 3, 4, 5
    # the recurrence S = gamma S + c v^T; o = b S: R*D multiply-adds each, per token and head
    macs = sum(2 * R * D for _ in range(B * T * H))
    assert counts.decay_flops(B, T, H, R, D) == 2 * macs
    assert counts.decay_bytes(B, T, H, R, D, 4) == 4 * (2 * B * T * H * R + 2 * B * T * H * D)


def test_gate_counts():
    assert counts.gate_flops(2, 3, 4) == 6 * 24
    assert counts.gate_bytes(2, 3, 4, 2) == 24 * (2 * 2 + 4)


def test_lla_flops_grow_with_cg_iterations_and_exact_adds_the_solve():
    B, T, H, D = 1, 16, 2, 8
    pairs = counts.visible_pairs(T, T) * B * H
    one = counts.lla_flops(B, T, T, H, D, D, cg_iters=1)
    two = counts.lla_flops(B, T, T, H, D, D, cg_iters=2)
    assert two - one == 2 * pairs * 2 * D
    exact = counts.lla_flops(B, T, T, H, D, D)
    assert exact == pytest.approx(2 * pairs * (4 * D + D) + 2 * pairs * D * D + (2 / 3) * D ** 3 * B * T * H)
    pairs_of_2 = counts.lla_flops(B, T, T, H, D, D, blocks=D // 2)  # BD-LLA: 2 x 2 blocks, built and factored
    solves = (2 / 3) * (D // 2) * 2 ** 3 * B * T * H
    assert pairs_of_2 == pytest.approx(2 * pairs * (4 * D + D) + 2 * pairs * D * 2 + solves)
    assert counts.lla_flops(B, T, T, H, D, D, blocks=D // 2, cg_iters=2) == two
