"""The softmax / sliding-window / GatedFWA references against their own identities."""
import pytest
import torch
import torch.nn.functional as F

from regattn.reference import gatedfwa, gatedfwa_gate, softmax_attention
from regattn.reference.gatedfwa import safe_softplus
from tests.helpers import randn, rel_err


def _qkvu(B=2, T=12, HQ=2, H=2, D=8, Dv=None, requires_grad=False, u_scale=0.3):
    Dv = D if Dv is None else Dv
    q = randn(B, T, HQ, D, requires_grad=requires_grad)
    k = randn(B, T, H, D, requires_grad=requires_grad)
    v = randn(B, T, H, Dv, requires_grad=requires_grad)
    h, beta = randn(B, T, HQ), 1 + F.elu(randn(B, T, HQ))
    u = (gatedfwa_gate(h, beta) * u_scale).requires_grad_(requires_grad)
    return q, k, v, u


def test_safe_softplus_is_exact_and_stays_finite():
    z = randn(1000, scale=30.0)
    assert rel_err(safe_softplus(z), torch.logaddexp(z, torch.zeros_like(z))) < 1e-14
    big = torch.tensor([-1e4, -80.0, 0.0, 80.0, 1e4], dtype=torch.float32)
    out = safe_softplus(big)
    assert torch.isfinite(out).all() and out[-1] == 1e4 and out[0] >= 0


def test_gate_matches_definition_and_decreases():
    h, beta = randn(2, 37, 3), 1 + F.elu(randn(2, 37, 3))
    u = gatedfwa_gate(h, beta, eps=1e-6)
    alpha = F.softplus(beta * h) / (beta + 1e-6)
    assert u.dtype == torch.float64
    assert rel_err(u, -torch.cumsum(alpha, 1)) < 1e-14
    assert (u[:, 1:] < u[:, :-1]).all() and (u < 0).all()


def test_gate_accumulates_in_fp32_for_low_precision():
    h, beta = randn(1, 50, 2, dtype=torch.bfloat16), 1 + F.elu(randn(1, 50, 2, dtype=torch.bfloat16))
    u = gatedfwa_gate(h, beta)
    assert u.dtype == torch.float32
    assert rel_err(u, gatedfwa_gate(h.double(), beta.double())) < 1e-6


def test_gradcheck_gate():
    h = randn(1, 9, 2, requires_grad=True)
    beta = (1 + F.elu(randn(1, 9, 2))).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda h, b: gatedfwa_gate(h, b), (h, beta))


@pytest.mark.parametrize("window", [None, 3])
def test_gradcheck_gatedfwa(window):
    q, k, v, u = _qkvu(B=1, T=7, HQ=2, H=1, D=4, requires_grad=True)
    assert torch.autograd.gradcheck(lambda q, k, v, u: gatedfwa(q, k, v, u, window=window), (q, k, v, u))


def test_window_none_equals_full_causal_and_large_window_equals_causal():
    q, k, v, u = _qkvu(T=11)
    full = softmax_attention(q, k, v, causal=True, gate=u)
    assert rel_err(gatedfwa(q, k, v, u, window=None), full) < 1e-14
    assert rel_err(gatedfwa(q, k, v, u, window=11), full) < 1e-14
    assert rel_err(gatedfwa(q, k, v, u, window=50), full) < 1e-14


def test_window_one_returns_own_value():
    q, k, v, u = _qkvu(T=9, HQ=4, H=2)
    out = gatedfwa(q, k, v, u, window=1)
    assert rel_err(out, v.repeat_interleave(2, dim=2)) < 1e-14


def test_zero_gate_is_sliding_window_attention():
    q, k, v, _ = _qkvu(T=13)
    u0 = torch.zeros(q.shape[:3], dtype=q.dtype)
    swa = softmax_attention(q, k, v, causal=True, window=4)
    assert rel_err(gatedfwa(q, k, v, u0, window=4), swa) < 1e-14
    assert rel_err(softmax_attention(q, k, v, window=4, gate=u0), swa) < 1e-14


def test_sliding_window_matches_explicit_loop():
    q, k, v, u = _qkvu(B=1, T=10, HQ=1, H=1, D=5)
    w, scale = 3, 0.7
    out = gatedfwa(q, k, v, u, window=w, scale=scale)
    for i in range(10):
        js = list(range(max(0, i - w + 1), i + 1))
        logits = torch.stack([scale * (q[0, i, 0] @ k[0, j, 0]) + u[0, i, 0] - u[0, j, 0] for j in js])
        expect = torch.softmax(logits, 0) @ v[0, js, 0]
        assert rel_err(out[0, i, 0], expect) < 1e-13


def test_gate_multiplies_weights_by_decay():
    """The bias u_i - u_j makes weights exp(s_ij) * prod_{j < s <= i} exp(-alpha_s)."""
    q, k, v, _ = _qkvu(B=1, T=6, HQ=1, H=1, D=4)
    alpha = torch.rand(1, 6, 1, dtype=torch.float64) + 0.1
    u = -torch.cumsum(alpha, 1)
    out = gatedfwa(q, k, v, u, window=None)
    i = 5
    s = (q[0, i, 0] @ k[0, :, 0].T) * 0.5
    decay = torch.stack([torch.exp(-alpha[0, j + 1:i + 1, 0].sum()) for j in range(6)])
    wts = torch.exp(s) * decay
    assert rel_err(out[0, i, 0], (wts / wts.sum()) @ v[0, :, 0]) < 1e-13


def test_strong_gates_give_no_nan_and_first_token_sees_itself():
    q, k, v, _ = _qkvu(T=16)
    h = randn(*q.shape[:3], scale=1e3).abs() + 1e3
    u = gatedfwa_gate(h, torch.ones_like(h))
    assert (u[:, -1] < -1e4).all()
    for dtype in (torch.float32, torch.float64):
        out = gatedfwa(q.to(dtype), k.to(dtype), v.to(dtype), u.to(dtype), window=5)
        assert torch.isfinite(out).all()
        # Each token then sees (almost) only itself.
        assert rel_err(out, v.to(dtype)) < 1e-5
    assert rel_err(gatedfwa(q, k, v, u, window=5)[:, 0], v[:, 0]) < 1e-15


def test_varlen_equals_per_sequence_calls():
    q, k, v, u = _qkvu(B=1, T=17, HQ=4, H=2)
    cu = torch.tensor([0, 5, 5, 12, 17])
    out = gatedfwa(q, k, v, u, window=3, cu_seqlens=cu)
    for a, b in [(0, 5), (5, 12), (12, 17)]:
        ref = gatedfwa(q[:, a:b], k[:, a:b], v[:, a:b], u[:, a:b], window=3)
        assert rel_err(out[:, a:b], ref) < 1e-14


def test_gate_offset_per_sequence_does_not_matter():
    """Softmax is invariant to a constant shift of u, so a packed cumulative u equals per-sequence u's."""
    q, k, v, u = _qkvu(B=1, T=10)
    shifted = u + torch.tensor([0.0] * 4 + [-7.0] * 6, dtype=u.dtype)[None, :, None]
    cu = torch.tensor([0, 4, 10])
    assert rel_err(gatedfwa(q, k, v, shifted, window=6, cu_seqlens=cu),
                   gatedfwa(q, k, v, u, window=6, cu_seqlens=cu)) < 1e-13


def test_gqa_equals_repeated_kv_heads():
    q, k, v, u = _qkvu(T=9, HQ=6, H=2, Dv=5)
    out = gatedfwa(q, k, v, u, window=4)
    ref = gatedfwa(q, k.repeat_interleave(3, 2), v.repeat_interleave(3, 2), u, window=4)
    assert out.shape == (2, 9, 6, 5)
    assert rel_err(out, ref) < 1e-14


def test_non_causal_softmax_is_plain_softmax():
    q, k, v, _ = _qkvu(T=7)
    out = softmax_attention(q, k, v, causal=False)
    ref = torch.softmax(torch.einsum("bthd,bshd->bhts", q, k) * 8 ** -0.5, -1)
    assert rel_err(out, torch.einsum("bhts,bshd->bthd", ref, v)) < 1e-14



@pytest.mark.parametrize("T", [256, 2048])
def test_bf16_inputs_keep_the_gate_and_scores_in_fp32(T):
    """bf16 inputs cost about their own rounding (2^-9), forward and backward; the plain bf16 computation
    (``upcast=False``) rounds ``u`` and the scores to bf16 and is far off."""
    x = [randn(1, T, 2, 16, requires_grad=True) for _ in range(3)]
    h, beta = randn(1, T, 2), 1 + F.elu(randn(1, T, 2))
    x.append(gatedfwa_gate(h, beta).requires_grad_(True))
    exact = gatedfwa(*x, window=None)
    do = randn(*exact.shape)
    exact_grads = torch.autograd.grad(exact, x, do)
    low = [t.detach().to(dt).requires_grad_(True) for t, dt in zip(x, [torch.bfloat16] * 3 + [torch.float32])]
    out = gatedfwa(*low, window=None)
    assert out.dtype == torch.bfloat16
    grads = torch.autograd.grad(out, low, do.bfloat16())
    for a, b in zip([out, *grads], [exact, *exact_grads]):
        assert rel_err(a, b) < 6e-3
    assert rel_err(gatedfwa(*low, window=None, upcast=False), exact) > 0.1
