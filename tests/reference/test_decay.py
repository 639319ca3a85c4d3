"""The decay reference against itself: every LeetDecoding method equals vanilla, the step equals the parallel form."""
import pytest
import torch

from regattn.reference.decay import METHODS, decay_linear_attention, decay_linear_prefill, decay_linear_step
from tests.helpers import randn, rel_err

GAMMAS = {
    "none": None,
    "one": [1.0, 1.0],
    "mixed": [0.97, 0.5],
    "near_zero": [1e-4, 1e-9],
}


def inputs(B, T, H, R, D, seed=None, requires_grad=False):
    """b, c, v; ``seed=None`` draws fresh inputs."""
    seeds = (None, None, None) if seed is None else (seed, seed + 1, seed + 2)
    return tuple(randn(B, T, H, n, seed=s, requires_grad=requires_grad) for n, s in zip((R, R, D), seeds))


def gamma_of(name):
    g = GAMMAS[name]
    return None if g is None else torch.tensor(g, dtype=torch.float64)


def loop_reference(b, c, v, gamma):
    """``o_i = sum_{j<=i} gamma^(i-j) (b_i.c_j) v_j`` by explicit double loop (tiny sizes only)."""
    B, T, H, _ = b.shape
    g = torch.ones(H, dtype=b.dtype) if gamma is None else gamma
    o = torch.zeros(B, T, H, v.shape[-1], dtype=b.dtype)
    for i in range(T):
        for j in range(i + 1):
            w = (b[:, i] * c[:, j]).sum(-1) * g ** (i - j)            # [B, H]
            o[:, i] += w[..., None] * v[:, j]
    return o


def test_vanilla_is_eq4():
    b, c, v = inputs(2, 9, 2, 3, 4, seed=1)
    g = gamma_of("mixed")
    assert rel_err(decay_linear_attention(b, c, v, g, method="vanilla"), loop_reference(b, c, v, g)) < 1e-13


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("T", [1, 97, 203])
@pytest.mark.parametrize("gname", list(GAMMAS))
def test_method_equals_vanilla(method, T, gname):
    b, c, v = inputs(2, T, 2, 5, 6, seed=T)
    g = gamma_of(gname)
    ref = decay_linear_attention(b, c, v, g, method="vanilla")
    out = decay_linear_attention(b, c, v, g, method=method)
    assert out.shape == v.shape and out.dtype == torch.float64
    assert rel_err(out, ref) < 1e-12


@pytest.mark.parametrize("gname", ["none", "mixed", "near_zero"])
def test_step_reproduces_parallel(gname):
    b, c, v = inputs(2, 37, 2, 3, 5, seed=7)
    g = gamma_of(gname)
    ref, final = decay_linear_prefill(b, c, v, g)
    assert rel_err(ref, decay_linear_attention(b, c, v, g, method="vanilla")) < 1e-14
    state, outs = None, []
    for t in range(b.shape[1]):
        o_t, state = decay_linear_step(state, b[:, t], c[:, t], v[:, t], g)
        outs.append(o_t)
    assert rel_err(torch.stack(outs, 1), ref) < 1e-12
    assert rel_err(state, final) < 1e-12


@pytest.mark.parametrize("block", [1, 3, 16])
@pytest.mark.parametrize("method", ["block_based", "recursion", "lightning2", "fleet"])
def test_block_sizes(method, block):
    b, c, v = inputs(2, 45, 2, 3, 4, seed=13)
    g = gamma_of("mixed")
    ref = decay_linear_attention(b, c, v, g, method="vanilla")
    assert rel_err(decay_linear_attention(b, c, v, g, method=method, block=block), ref) < 1e-12


@pytest.mark.parametrize("split", [1, 20, 36])
def test_prefill_in_segments(split):
    b, c, v = inputs(1, 37, 2, 4, 3, seed=11)
    g = gamma_of("mixed")
    ref, final = decay_linear_prefill(b, c, v, g)
    o1, s1 = decay_linear_prefill(b[:, :split], c[:, :split], v[:, :split], g)
    o2, s2 = decay_linear_prefill(b[:, split:], c[:, split:], v[:, split:], g, initial_state=s1, method="lightning2")
    assert rel_err(torch.cat([o1, o2], 1), ref) < 1e-12
    assert rel_err(s2, final) < 1e-12


@pytest.mark.parametrize("method", METHODS)
def test_gradcheck(method):
    b, c, v = inputs(1, 21, 2, 3, 2, seed=5, requires_grad=True)
    g = torch.tensor([0.9, 0.6], dtype=torch.float64, requires_grad=True)
    fn = lambda b, c, v, g: decay_linear_attention(b, c, v, g, method=method, block=4)
    assert torch.autograd.gradcheck(fn, (b, c, v, g), eps=1e-6, atol=1e-6, nondet_tol=0.0)


def test_gradcheck_step():
    b, c, v = inputs(2, 1, 2, 3, 2, seed=9, requires_grad=True)
    s = randn(2, 2, 3, 2, seed=10, requires_grad=True)
    g = torch.tensor([0.9, 0.6], dtype=torch.float64, requires_grad=True)
    fn = lambda s, b, c, v, g: decay_linear_step(s, b[:, 0], c[:, 0], v[:, 0], g)
    assert torch.autograd.gradcheck(fn, (s, b, c, v, g), eps=1e-6, atol=1e-6)


@pytest.mark.parametrize("method", ["block_based", "lightning2", "fleet", "recursion"])
def test_long_sequence_no_decay_stays_finite(method):
    """gamma = 1 over 20,000 tokens in float32: the blockwise and recurrent forms never form gamma^-t."""
    T = 20_000
    b, c, v = (x.float() for x in inputs(1, T, 1, 4, 4, seed=3))
    g = torch.ones(1)
    out = decay_linear_attention(b, c, v, g, method=method)
    assert torch.isfinite(out).all()
    # the last row equals b_T . (sum_j c_j^T v_j) computed directly in float64
    last = (b[0, -1, 0].double() @ (c[0, :, 0].double().T @ v[0, :, 0].double()))
    assert rel_err(out[0, -1, 0], last) < 1e-3


def test_long_sequence_recurrent_step_stays_finite():
    T = 5_000
    b, c, v = (x.float() for x in inputs(1, T, 1, 4, 4, seed=4))
    state = None
    for t in range(T):
        o_t, state = decay_linear_step(state, b[:, t], c[:, t], v[:, t], None)
    assert torch.isfinite(o_t).all() and torch.isfinite(state).all()
    direct = c[0, :, 0].double().T @ v[0, :, 0].double()
    assert rel_err(state[0, 0], direct) < 1e-4


@pytest.mark.parametrize("method", METHODS)
def test_state_carried_across_a_split(method):
    """Two calls, the second from the first's final state, equal one call over the whole sequence."""
    b, c, v = inputs(2, 29, 2, 3, 4)
    g = gamma_of("mixed")
    s0 = randn(2, 2, 3, 4)
    whole, final = decay_linear_attention(b, c, v, g, method=method, block=8, initial_state=s0,
                                          output_final_state=True)
    o1, s1 = decay_linear_attention(b[:, :12], c[:, :12], v[:, :12], g, method=method, block=8,
                                    initial_state=s0, output_final_state=True)
    o2, s2 = decay_linear_attention(b[:, 12:], c[:, 12:], v[:, 12:], g, method=method, block=8,
                                    initial_state=s1, output_final_state=True)
    assert rel_err(torch.cat([o1, o2], 1), whole) < 1e-12 and rel_err(s2, final) < 1e-12
    # from the state: o_t = b_t (gamma^t S_0 + ...) with 1-based t, by the token-by-token step
    state, rows = s0, []
    for t in range(b.shape[1]):
        o_t, state = decay_linear_step(state, b[:, t], c[:, t], v[:, t], g)
        rows.append(o_t)
    assert rel_err(torch.stack(rows, 1), whole) < 1e-12 and rel_err(state, final) < 1e-12


def test_final_state_alone_returns_a_pair():
    b, c, v = inputs(1, 9, 2, 3, 4)
    o = decay_linear_attention(b, c, v, gamma_of("mixed"))
    o_again, state = decay_linear_attention(b, c, v, gamma_of("mixed"), output_final_state=True)
    assert torch.equal(o, o_again) and state.shape == (1, 2, 3, 4) and state.dtype == torch.float64


@pytest.mark.parametrize("with_state", [False, True])
def test_packed_equals_one_call_per_sequence(with_state):
    lengths = [5, 0, 17, 1, 9]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    b, c, v = inputs(1, sum(lengths), 2, 3, 4)
    g = gamma_of("mixed")
    s0 = randn(len(lengths), 2, 3, 4) if with_state else None
    o, final = decay_linear_attention(b, c, v, g, method="lightning2", block=4, initial_state=s0,
                                      output_final_state=True, cu_seqlens=cu)
    for n, (start, end) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        one = None if s0 is None else s0[n:n + 1]
        if end == start:                      # an empty sequence passes its state through
            assert torch.equal(final[n:n + 1], torch.zeros(1, 2, 3, 4, dtype=torch.float64) if one is None else one)
            continue
        o_n, s_n = decay_linear_prefill(b[:, start:end], c[:, start:end], v[:, start:end], g, initial_state=one)
        assert rel_err(o[:, start:end], o_n) < 1e-12 and rel_err(final[n:n + 1], s_n) < 1e-12


@pytest.mark.parametrize("method", ["lightning2"])
def test_gradcheck_with_states(method):
    b, c, v = inputs(1, 11, 2, 3, 2, requires_grad=True)
    s0 = randn(2, 2, 3, 2, requires_grad=True)
    g = torch.tensor([0.9, 0.6], dtype=torch.float64, requires_grad=True)
    cu = torch.tensor([0, 4, 11])
    fn = lambda b, c, v, s0, g: decay_linear_attention(b, c, v, g, method=method, block=4, initial_state=s0,
                                                       output_final_state=True, cu_seqlens=cu)
    assert torch.autograd.gradcheck(fn, (b, c, v, s0, g), eps=1e-6, atol=1e-6)
