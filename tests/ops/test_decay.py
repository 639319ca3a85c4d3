"""Decay kernels (lightning2, fleet, causal_dot_product) against the float64 reference, forward and backward."""
import pytest
import torch

import regattn
from regattn import reference
from regattn.ops.decay.function import log2_gamma
from regattn.ops.decay.lightning2 import lightning2_forward
from tests.helpers import TOL, randn, rel_err

KERNELS = ("lightning2", "fleet", "causal_dot_product")


def case(B, T, H, R, D, dtype, seed, gamma):
    """b, c, v, do, gamma; ``seed=None`` draws fresh inputs."""
    at = lambda i: None if seed is None else seed + i
    b, c, v = (randn(B, T, H, n, seed=at(i), scale=n ** -0.25 if i < 2 else 1.0) for i, n in enumerate((R, R, D)))
    do = randn(B, T, H, D, seed=at(3))
    g = None if gamma is None else torch.tensor(gamma, dtype=torch.float64)
    return b, c, v, do, g


def forward_backward(fn, b, c, v, do, dtype):
    x = [t.detach().to(dtype).requires_grad_() for t in (b, c, v)]
    o = fn(*x)
    grads = torch.autograd.grad(o, x, do.to(dtype))
    return [o, *grads]


def bound(dtype, low_err):
    """fp32: the dtype bound; fp16: twice the torch reference's own error in fp16 plus slack."""
    return TOL[dtype] if dtype == torch.float32 else 2 * low_err + 1e-3


@pytest.mark.parametrize("method,B,T,H,R,D,gamma", [
    ("lightning2", 2, 37, 2, 16, 24, [0.9, 0.6]),
    ("lightning2", 1, 1, 2, 5, 7, [0.9, 0.6]),
    ("lightning2", 1, 50, 1, 20, 16, None),
    ("lightning2", 1, 45, 2, 8, 8, [1e-6, 1.0]),
    ("fleet", 2, 37, 2, 12, 20, [0.9, 0.6]),
    ("fleet", 1, 21, 2, 8, 8, [1e-6, 1.0]),
    ("causal_dot_product", 1, 23, 2, 12, 20, [0.9, 1e-6]),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_matches_reference(interpret, method, B, T, H, R, D, gamma, dtype):
    b, c, v, do, g = case(B, T, H, R, D, dtype, seed=T + R, gamma=gamma)
    truth = forward_backward(lambda *x: reference.decay_linear_attention(*x, g), b, c, v, do, torch.float64)
    low = forward_backward(lambda *x: reference.decay_linear_attention(*x, None if g is None else g.to(dtype)),
                           b, c, v, do, dtype) if dtype != torch.float32 else None
    gk = None if g is None else g.float()
    got = forward_backward(lambda *x: regattn.decay_linear_attention(*x, gk, method=method, backend="triton"),
                           b, c, v, do, dtype)
    for name, out, ref, i in zip(("o", "db", "dc", "dv"), got, truth, range(4)):
        assert out.dtype == dtype and out.shape == ref.shape
        err = rel_err(out, ref)
        tol = bound(dtype, rel_err(low[i], ref)) if low else TOL[dtype]
        assert err <= tol, f"{method} {name}: {err:.2e} > {tol:.2e}"


@pytest.mark.parametrize("reverse", [False, True])
def test_lightning2_segments(interpret, reverse):
    """The sequence-parallel path (segment states chained between two launches) equals the reference."""
    b, c, v, _, g = case(2, 70, 2, 16, 16, torch.float32, seed=3, gamma=[0.95, 0.7])
    x = [t.float() for t in (b, c, v)]
    if reverse:
        x = [t.flip(1) for t in x]
    out = lightning2_forward(*x, log2_gamma(g.float(), 2, "cpu"), reverse=reverse, segment=16)
    out = out.flip(1) if reverse else out
    assert rel_err(out, reference.decay_linear_attention(b, c, v, g)) <= TOL[torch.float32]


def test_prefill_and_step_through_kernels(interpret):
    b, c, v, _, g = case(1, 33, 2, 8, 16, torch.float32, seed=4, gamma=[0.9, 0.99])
    x = [t.float() for t in (b, c, v)]
    ref_o, ref_s = reference.decay_linear_prefill(b[:, :32], c[:, :32], v[:, :32], g)
    o, s = regattn.decay_linear_prefill(*(t[:, :32] for t in x), g.float(), method="lightning2", backend="triton")
    assert rel_err(o, ref_o) <= TOL[torch.float32] and rel_err(s, ref_s) <= TOL[torch.float32]
    o1, s1 = regattn.decay_linear_step(s, *(t[:, 32] for t in x), g.float())
    full = reference.decay_linear_attention(b, c, v, g)
    assert rel_err(o1, full[:, 32]) <= TOL[torch.float32]
    o2, s2 = regattn.decay_linear_prefill(*(t[:, 32:] for t in x), g.float(), initial_state=s, method="fleet",
                                          backend="triton")
    assert rel_err(o2, full[:, 32:]) <= TOL[torch.float32] and rel_err(s2, s1) <= TOL[torch.float32]


def small():
    return [randn(1, 6, 2, n, dtype=torch.float32, seed=i) for i, n in enumerate((4, 4, 3))]


@pytest.mark.parametrize("gamma", [1.5, 0.0, -0.1, float("nan"), torch.tensor([0.5, 1.01])])
def test_gamma_outside_range(gamma):
    b, c, v = small()
    with pytest.raises(ValueError, match="gamma"):
        regattn.decay_linear_attention(b, c, v, gamma)
    with pytest.raises(ValueError, match="gamma"):
        regattn.decay_linear_step(None, b[:, 0], c[:, 0], v[:, 0], gamma)


def test_different_rank():
    b, c, v = small()
    with pytest.raises(ValueError, match="c: expected shape"):
        regattn.decay_linear_attention(b, c[..., :3], v)
    with pytest.raises(ValueError, match="c_t"):
        regattn.decay_linear_step(None, b[:, 0], c[:, 0, :, :3], v[:, 0])
    with pytest.raises(ValueError, match="v_t: expected leading dims"):
        regattn.decay_linear_step(None, b[:, 0], c[:, 0], v[:, 0, :1])
    with pytest.raises(ValueError, match="b_t: expected a rank-3"):
        regattn.decay_linear_step(None, b, c[:, 0], v[:, 0])


def test_unknown_method():
    b, c, v = small()
    with pytest.raises(ValueError, match="method: expected one of"):
        regattn.decay_linear_attention(b, c, v, method="lightning3")


def test_bad_states():
    b, c, v = small()
    with pytest.raises(ValueError, match="initial_state"):
        regattn.decay_linear_prefill(b, c, v, initial_state=torch.zeros(1, 2, 3, 3))
    with pytest.raises(ValueError, match="state"):
        regattn.decay_linear_step(torch.zeros(1, 2, 4), b[:, 0], c[:, 0], v[:, 0])


def test_gamma_with_grad_on_kernels(interpret):
    b, c, v = small()
    g = torch.tensor([0.9, 0.8], requires_grad=True)
    with pytest.raises(ValueError, match="gamma"):
        regattn.decay_linear_attention(b, c, v, g, method="lightning2", backend="triton")
    o = regattn.decay_linear_attention(b.double(), c.double(), v.double(), g.double(), method="fleet", backend="torch")
    assert torch.autograd.grad(o.sum(), g)[0].shape == (2,)


def test_gamma_written_in_place_is_checked_again(interpret):
    """Validation and log2 gamma are remembered per tensor only until it is written to."""
    b, c, v = small()
    g = torch.tensor([0.9, 0.8])
    first = regattn.decay_linear_attention(b, c, v, g, method="lightning2", backend="triton")
    assert rel_err(first, reference.decay_linear_attention(b, c, v, g)) <= TOL[torch.float32]
    g.copy_(torch.tensor([0.5, 0.3]))
    again = regattn.decay_linear_attention(b, c, v, g, method="lightning2", backend="triton")
    assert rel_err(again, reference.decay_linear_attention(b, c, v, g)) <= TOL[torch.float32]
    g.fill_(1.5)
    with pytest.raises(ValueError, match="gamma"):
        regattn.decay_linear_attention(b, c, v, g, method="lightning2", backend="triton")


def stateful_grads(fn, b, c, v, s0, do, ds, dtype):
    """``(o, S_T) = fn(b, c, v, s0)`` in ``dtype`` (state float32 or float64), and the gradients of
    ``<o, do> + <S_T, ds>`` w.r.t. b, c, v and s0."""
    x = [t.detach().to(dtype).requires_grad_() for t in (b, c, v)]
    s = s0.detach().to(torch.float64 if dtype == torch.float64 else torch.float32).requires_grad_()
    o, final = fn(*x, s)
    loss = (o.double() * do).sum() + (final.double() * ds).sum()
    return [o, final, *torch.autograd.grad(loss, [*x, s])]


def check_against_reference(got, truth, tol, what):
    for name, out, ref in zip(("o", "S_T", "db", "dc", "dv", "dS_0"), got, truth):
        assert out.shape == ref.shape, f"{what} {name}"
        err = rel_err(out, ref)
        assert err <= tol, f"{what} {name}: {err:.2e} > {tol:.2e}"


@pytest.mark.parametrize("B,T,H,R,D", [(2, 37, 2, 16, 24), (1, 5, 1, 5, 7)])
def test_lightning2_from_a_state(interpret, B, T, H, R, D):
    """o and S_T from an initial state, and the gradients of both (d initial_state included)."""
    b, c, v, do, g = case(B, T, H, R, D, torch.float32, seed=None, gamma=[0.9, 0.6][:H])
    s0, ds = randn(B, H, R, D), randn(B, H, R, D)
    run = lambda fn_gamma, **kw: lambda b, c, v, s: regattn.decay_linear_attention(
        b, c, v, fn_gamma, initial_state=s, output_final_state=True, **kw)
    truth = stateful_grads(run(g, backend="torch", method="vanilla"), b, c, v, s0, do, ds, torch.float64)
    got = stateful_grads(run(g.float(), backend="triton"), b, c, v, s0, do, ds, torch.float32)
    check_against_reference(got, truth, TOL[torch.float32], "lightning2")


def test_lightning2_segments_from_a_state(interpret):
    """The sequence-parallel path chains the segments with the initial state entering every row."""
    b, c, v, _, g = case(2, 70, 2, 16, 16, torch.float32, seed=None, gamma=[0.95, 0.7])
    s0 = randn(2, 2, 16, 16)
    ref_o, ref_s = reference.decay_linear_attention(b, c, v, g, initial_state=s0, output_final_state=True)
    o, s = lightning2_forward(*(t.float() for t in (b, c, v)), log2_gamma(g.float(), 2, "cpu"), segment=16,
                              initial_state=s0.float(), output_final_state=True)
    assert rel_err(o, ref_o) <= TOL[torch.float32] and rel_err(s, ref_s) <= TOL[torch.float32]


def test_lightning2_segments_backward_state(interpret):
    """What the backward asks of the kernel, over segments: rows from the last, the state entering row t
    with gamma^t (``init_pow=0``) and the final state times gamma (``final_pow=1``)."""
    T = 70
    b, c, v, _, g = case(1, T, 2, 16, 16, torch.float32, seed=None, gamma=[0.95, 0.7])
    x = randn(1, 2, 16, 16)
    flipped = [t.flip(1) for t in (b, c, v)]
    o_zero, s_zero = reference.decay_linear_attention(*flipped, g, output_final_state=True)
    powers = g[None, :] ** torch.arange(T, dtype=torch.float64)[:, None]                      # [T, H]: gamma^t
    want_o = o_zero + torch.einsum("bthr,bhrd->bthd", powers[None, :, :, None] * flipped[0], x)
    want_s = g[:, None, None] * s_zero + (g ** T)[:, None, None] * x
    o, s = lightning2_forward(*(t.float() for t in (b, c, v)), log2_gamma(g.float(), 2, "cpu"), reverse=True,
                              segment=16, initial_state=x.float(), init_pow=0, final_pow=1, output_final_state=True)
    assert rel_err(o.flip(1), want_o) <= TOL[torch.float32] and rel_err(s, want_s) <= TOL[torch.float32]


def test_state_carried_across_a_split_through_kernels(interpret):
    b, c, v, _, g = case(1, 41, 2, 8, 12, torch.float32, seed=None, gamma=[0.9, 0.99])
    x = [t.float() for t in (b, c, v)]
    whole, final = reference.decay_linear_attention(b, c, v, g, output_final_state=True)
    o1, s1 = regattn.decay_linear_attention(*(t[:, :19] for t in x), g.float(), output_final_state=True,
                                            backend="triton")
    o2, s2 = regattn.decay_linear_attention(*(t[:, 19:] for t in x), g.float(), initial_state=s1,
                                            output_final_state=True, backend="triton")
    assert rel_err(torch.cat([o1, o2], 1), whole) <= TOL[torch.float32] and rel_err(s2, final) <= TOL[torch.float32]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_packed_sequences(interpret, backend):
    """Packed sequences (one of them empty) equal one call per sequence, gradients included."""
    lengths = [7, 0, 20, 1, 13]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    N, H, R, D = len(lengths), 2, 8, 12
    b, c, v, do, g = case(1, sum(lengths), H, R, D, torch.float32, seed=None, gamma=[0.9, 0.7])
    s0, ds = randn(N, H, R, D), randn(N, H, R, D)
    packed = lambda b, c, v, s: regattn.decay_linear_attention(b, c, v, g.float(), initial_state=s,
                                                               output_final_state=True, cu_seqlens=cu, backend=backend)
    got = stateful_grads(packed, b, c, v, s0, do, ds, torch.float32)

    def one_by_one(b, c, v, s):
        outs, finals = [], []
        for n, (start, end) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
            if end == start:
                finals.append(s[n:n + 1])
                continue
            o_n, s_n = reference.decay_linear_attention(b[:, start:end], c[:, start:end], v[:, start:end], g,
                                                        initial_state=s[n:n + 1], output_final_state=True)
            outs.append(o_n)
            finals.append(s_n)
        return torch.cat(outs, 1), torch.cat(finals)
    truth = stateful_grads(one_by_one, b, c, v, s0, do, ds, torch.float64)
    check_against_reference(got, truth, TOL[torch.float32], backend)


def test_state_terms_added_to_other_kernels(interpret):
    """fleet and causal_dot_product run from a zero state and add the state terms in torch; packed
    sequences are lightning2's alone on the Triton backend."""
    b, c, v, _, g = case(1, 23, 2, 8, 8, torch.float32, seed=None, gamma=[0.9, 0.6])
    x = [t.float() for t in (b, c, v)]
    s0 = randn(1, 2, 8, 8)
    ref_o, ref_s = reference.decay_linear_attention(b, c, v, g, initial_state=s0, output_final_state=True)
    for method in ("fleet", "causal_dot_product"):
        o, s = regattn.decay_linear_attention(*x, g.float(), initial_state=s0.float(), output_final_state=True,
                                              method=method, backend="triton")
        assert rel_err(o, ref_o) <= TOL[torch.float32] and rel_err(s, ref_s) <= TOL[torch.float32], method
    with pytest.raises(ValueError, match="cu_seqlens"):
        regattn.decay_linear_attention(*x, g.float(), cu_seqlens=torch.tensor([0, 23]), method="fleet",
                                       backend="triton")


def test_bad_state_arguments():
    b, c, v = small()
    with pytest.raises(ValueError, match="initial_state: expected shape"):
        regattn.decay_linear_attention(b, c, v, initial_state=torch.zeros(2, 2, 4, 3))
    with pytest.raises(ValueError, match="initial_state: expected shape"):     # N = 2 packed sequences
        regattn.decay_linear_attention(b, c, v, initial_state=randn(1, 2, 4, 3), cu_seqlens=torch.tensor([0, 2, 6]))
    with pytest.raises(TypeError, match="output_final_state"):
        regattn.decay_linear_attention(b, c, v, output_final_state=1)
    with pytest.raises(ValueError, match="cu_seqlens"):
        regattn.decay_linear_attention(b, c, v, cu_seqlens=torch.tensor([0, 2, 5]))
    with pytest.raises(ValueError, match="cu_seqlens: packed sequences need batch size 1"):
        regattn.decay_linear_attention(*(torch.cat([t, t]) for t in (b, c, v)), cu_seqlens=torch.tensor([0, 6]))


def test_float64_on_triton_is_refused(interpret):
    b, c, v = (t.double() for t in small())
    with pytest.raises(TypeError, match="v: backend='triton' expects fp16, bf16 or fp32"):
        regattn.decay_linear_attention(b, c, v, 0.9, method="lightning2", backend="triton")


# lightning2 and fleet multiply a block's later rows by zero weights inside their intra-block products:
# containing a non-finite later row there cost 21% to 44% of lightning2's time at the bench goal shapes
# on an H100 (benchmarks/results/h100/containment/{old,new}-decay.json), far over the 2% it may cost.
UNCONTAINED = {"lightning2": "containment in the intra-block product cost 21-44% on the goal shapes",
               "fleet": "the same intra-block product as lightning2"}
NONFINITE_CASES = [(m, "torch") for m in reference.decay.METHODS] + [
    pytest.param(m, "triton", marks=pytest.mark.xfail(run=False, reason=UNCONTAINED[m])) if m in UNCONTAINED
    else (m, "triton") for m in KERNELS]


@pytest.mark.parametrize("method,backend", NONFINITE_CASES)
@pytest.mark.parametrize("role,bad", [("b", float("nan")), ("c", float("inf")), ("v", float("-inf"))])
def test_nonfinite_at_the_last_position_stays_there(request, method, backend, role, bad):
    """A NaN or inf in b, c or v at the last position leaves the earlier rows as a finite value there
    would: their outputs and, for the loss over every row, db of every earlier row; and dc, dv of the
    earlier positions when it sits in c or v (a non-finite b_T makes o_T non-finite, and dc_j, dv_j
    rightly depend on o_T). The last row itself is non-finite."""
    if backend == "triton":
        request.getfixturevalue("interpret")
    b, c, v, do, _ = case(1, 21, 2, 8, 8, torch.float32, seed=None, gamma=None)
    g = torch.tensor([0.9, 0.6])
    run = lambda *x: regattn.decay_linear_attention(*x, g, method=method, backend=backend)
    finite = forward_backward(run, b, c, v, do, torch.float32)
    inputs = {"b": b, "c": c, "v": v}
    inputs[role] = inputs[role].clone()
    inputs[role][:, -1, 1, 2] = bad
    got = forward_backward(run, *inputs.values(), do, torch.float32)
    assert not torch.isfinite(got[0][:, -1]).all()
    checked = ("o", "db") + (("dc", "dv") if role != "b" else ())
    for name, out, ref in zip(("o", "db", "dc", "dv"), got, finite):
        if name in checked:
            assert rel_err(out[:, :-1], ref[:, :-1]) <= 1e-6, f"{name} of the earlier rows"


def seqlens_ops():
    """Every op that takes cu_seqlens or cache_seqlens, as ``(argument name, call(seqlens))`` on CPU inputs."""
    q, k, v, r = (randn(1, 6, 2, 4, dtype=torch.float32) for _ in range(4))
    u = -torch.rand(1, 6, 2).cumsum(1)
    return [
        ("cu_seqlens", lambda s: regattn.softmax_attention(q, k, v, cu_seqlens=s)),
        ("cu_seqlens", lambda s: regattn.gatedfwa(q, k, v, u, window=3, cu_seqlens=s)),
        ("cu_seqlens", lambda s: regattn.parallax(q, r, k, v, cu_seqlens=s)),
        ("cu_seqlens", lambda s: regattn.scan_attention(q, k, v, causal=True, cu_seqlens=s)),
        ("cu_seqlens", lambda s: regattn.decay_linear_attention(q, k, v, 0.9, cu_seqlens=s)),
        ("cache_seqlens", lambda s: regattn.parallax_decode(q[:, :1], r[:, :1], k, v, cache_seqlens=s)),
    ]


@pytest.mark.parametrize("index", range(len(seqlens_ops())))
def test_seqlens_on_another_device_is_named(index):
    """A seqlens tensor on another device than q (here meta) is refused by name before any host copy."""
    name, call = seqlens_ops()[index]
    with pytest.raises(ValueError, match=f"{name}: expected device cpu"):
        call(torch.empty(2 if name == "cu_seqlens" else 1, dtype=torch.int32, device="meta"))


@pytest.mark.parametrize("attn_method,method", [
    ("vanilla", "vanilla"), ("causal-dot-product", "causal_dot_product"), ("block-based", "block_based"),
    ("recursion", "recursion"), ("lightningAttention-2", "lightning2"), ("FleetAttention", "fleet"), ("auto", "auto"),
])
@pytest.mark.parametrize("is_mask_weight", [False, True])
def test_causal_linear_decoder_is_decay_linear_attention(attn_method, method, is_mask_weight):
    """LeetDecoding's call on ``[B, H, T, X]`` with gamma ``[H, 1]`` is ours on ``[B, T, H, X]`` with the
    named method (the same rounding), and equals the reference."""
    q, k, v = (randn(2, 3, 70, n) for n in (5, 5, 6))
    gamma = torch.rand(3, 1, dtype=torch.float64) * 0.5 + 0.5 if is_mask_weight else None
    flat_gamma = None if gamma is None else gamma[:, 0]
    got = regattn.causal_linear_decoder(q, k, v, gamma, attn_method=attn_method, is_mask_weight=is_mask_weight)
    ours = regattn.decay_linear_attention(*(x.transpose(1, 2) for x in (q, k, v)), flat_gamma, method=method)
    assert got.shape == v.shape and torch.equal(got, ours.transpose(1, 2))
    want = reference.decay_linear_attention(*(x.transpose(1, 2) for x in (q, k, v)), flat_gamma)
    assert rel_err(got, want.transpose(1, 2)) < 1e-12


def test_causal_linear_decoder_names_bad_arguments():
    q, k, v = (randn(1, 2, 7, 4) for _ in range(3))
    with pytest.raises(ValueError, match="attn_method: expected one of"):
        regattn.causal_linear_decoder(q, k, v, attn_method="lightning2")
    for bad in (torch.full((2,), 0.9), torch.full((1, 2), 0.9), torch.full((2, 1, 1), 0.9)):
        with pytest.raises(ValueError, match="gamma"):
            regattn.causal_linear_decoder(q, k, v, bad, is_mask_weight=True)
    with pytest.raises(ValueError, match="gamma: given with is_mask_weight=False"):
        regattn.causal_linear_decoder(q, k, v, torch.full((2, 1), 0.9))
    with pytest.raises(ValueError, match="gamma: expected a \\[H, 1\\] tensor"):
        regattn.causal_linear_decoder(q, k, v, is_mask_weight=True)
    with pytest.raises(ValueError, match="k: expected shape \\[B, H, T, R\\]"):
        regattn.causal_linear_decoder(q, k[..., :3], v)


@pytest.mark.parametrize("method", KERNELS)
def test_rows_not_contiguous(interpret, method):
    """b, c, v whose last dim is strided (every other element of a wider tensor): made contiguous once before the
    kernels, forward and backward as the reference's; and the stateful lightning2 likewise."""
    b, c, v, do, g = case(2, 29, 2, 8, 12, torch.float32, seed=None, gamma=[0.9, 0.7])
    strided = [torch.stack([t.float(), t.float()], -1).flatten(-2)[..., ::2] for t in (b, c, v)]
    truth = forward_backward(lambda *x: reference.decay_linear_attention(*x, g), b, c, v, do, torch.float64)
    runs = {"stateless": lambda *x: regattn.decay_linear_attention(*x, g.float(), method=method, backend="triton")}
    if method == "lightning2":
        runs["stateful"] = lambda *x: regattn.decay_linear_attention(*x, g.float(), method=method, backend="triton",
                                                                      output_final_state=True)[0]
    for name, fn in runs.items():
        x = [t.detach().requires_grad_() for t in strided]
        assert all(t.stride(-1) == 2 for t in x)
        got = [fn(*x)]
        got += torch.autograd.grad(got[0], x, do.float())
        for out, ref in zip(got, truth):
            assert rel_err(out, ref) <= TOL[torch.float32], name
