"""The ELSA reference against softmax attention and the monoid laws (elsa-supplementary.txt A.1-A.4)."""
import pytest
import torch

from regattn.reference.elsa import combine, finalize, identity, scan_attention
from regattn.reference.softmax import softmax_attention
from tests.helpers import randn, rel_err


def _qkv(B=2, T=13, S=13, HQ=4, H=2, D=8, Dv=6, dtype=torch.float64, seed=0, scale=1.0, requires_grad=False):
    q = randn(B, T, HQ, D, dtype=dtype, seed=seed, scale=scale, requires_grad=requires_grad)
    k = randn(B, S, H, D, dtype=dtype, seed=seed + 1, scale=scale, requires_grad=requires_grad)
    v = randn(B, S, H, Dv, dtype=dtype, seed=seed + 2, requires_grad=requires_grad)
    return q, k, v


def _state(shape, dv, seed, empty_fraction=0.25):
    """Random states; some entries are the identity."""
    m = randn(*shape, seed=seed) * 3
    s = randn(*shape, seed=seed + 1).abs() + 0.1
    w = randn(*shape, dv, seed=seed + 2)
    g = torch.Generator().manual_seed(seed + 3)
    empty = torch.rand(shape, generator=g) < empty_fraction
    m = m.masked_fill(empty, float("-inf"))
    return m, s.masked_fill(empty, 0.0), w.masked_fill(empty[..., None], 0.0)


def _close(a, b, tol=1e-13):
    for x, y in zip(a, b):
        assert torch.equal(torch.isinf(x), torch.isinf(y))
        fx, fy = x.masked_fill(torch.isinf(x), 0), y.masked_fill(torch.isinf(y), 0)
        assert (fx - fy).abs().max().item() <= tol * (1 + fy.abs().max().item())


@pytest.mark.parametrize("order", ["sequential", "tree"])
@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (False, 4), (True, 3)])
def test_equals_softmax(order, causal, window):
    q, k, v = _qkv(seed=10)
    ref = softmax_attention(q, k, v, causal=causal, window=window)
    out = scan_attention(q, k, v, causal=causal, window=window, order=order)
    assert rel_err(out, ref) < 1e-13


@pytest.mark.parametrize("T,S", [(1, 1), (1, 9), (9, 5), (5, 9)])
def test_shapes_and_alignment(T, S):
    q, k, v = _qkv(B=1, T=T, S=S, seed=20)
    for causal in (False, True):
        ref = softmax_attention(q, k, v, causal=causal)
        for order in ("sequential", "tree"):
            out = scan_attention(q, k, v, causal=causal, order=order)
            assert out.shape == ref.shape
            assert (out - ref).abs().max().item() < 1e-13


def test_varlen():
    q, k, v = _qkv(B=1, T=17, S=17, seed=30)
    cu = torch.tensor([0, 5, 5, 12, 17])
    for causal in (False, True):
        ref = softmax_attention(q, k, v, causal=causal, cu_seqlens=cu)
        assert rel_err(scan_attention(q, k, v, causal=causal, cu_seqlens=cu, order="tree"), ref) < 1e-13


def test_order_changes_only_rounding_fp32():
    q, k, v = _qkv(T=64, S=64, dtype=torch.float32, seed=40)
    ref = softmax_attention(*(x.double() for x in (q, k, v)), causal=False)
    a = scan_attention(q, k, v, order="sequential")
    b = scan_attention(q, k, v, order="tree")
    assert a.dtype == torch.float32
    assert rel_err(a, ref) < 1e-5 and rel_err(b, ref) < 1e-5
    assert 0 < rel_err(a, b) < 1e-5 or torch.equal(a, b)


def test_identity_law():
    a = _state((5, 7), 3, seed=50)
    e = identity((5, 7), 3)
    _close(combine(a, e), a)
    _close(combine(e, a), a)
    _close(combine(e, e), e)


def test_associativity():
    a, b, c = (_state((6, 11), 4, seed=s) for s in (60, 70, 80))
    _close(combine(combine(a, b), c), combine(a, combine(b, c)))


def test_merge_is_softmax_of_union():
    """Merging two blocks' states gives the state of all their keys together."""
    s = randn(3, 10, seed=90) * 5
    v = randn(3, 10, 2, seed=91)

    def block(sl):
        m = s[:, sl].amax(-1)
        e = torch.exp(s[:, sl] - m[:, None])
        return m, e.sum(-1), (e[..., None] * v[:, sl]).sum(-2)

    merged = finalize(combine(block(slice(0, 4)), block(slice(4, 10))))
    ref = (torch.softmax(s, -1)[..., None] * v).sum(-2)
    assert (merged - ref).abs().max().item() < 1e-14


def test_large_logits_no_overflow():
    """|q.k| up to 1e4: every exponent is taken against the running max, so nothing overflows."""
    q, k, v = _qkv(T=9, S=11, D=4, seed=100)
    q = q / q.norm(dim=-1, keepdim=True) * 100.0
    k = k / k.norm(dim=-1, keepdim=True) * 100.0
    for dtype in (torch.float32, torch.float64):
        qq, kk, vv = (x.to(dtype) for x in (q, k, v))
        ref = softmax_attention(q, k, v, causal=False, scale=1.0)
        for order in ("sequential", "tree"):
            out = scan_attention(qq, kk, vv, scale=1.0, order=order)
            assert torch.isfinite(out).all()
            assert rel_err(out, ref) < (1e-4 if dtype == torch.float32 else 1e-12)


def test_fully_masked_rows_are_zero():
    q, k, v = _qkv(B=1, T=6, S=3, seed=110)
    out = scan_attention(q, k, v, causal=True, order="tree")
    ref = softmax_attention(q, k, v, causal=True)
    assert torch.equal(out[:, :3], torch.zeros_like(out[:, :3]))
    assert (out - ref).abs().max().item() < 1e-13


@pytest.mark.parametrize("order", ["sequential", "tree"])
@pytest.mark.parametrize("causal", [False, True])
def test_gradcheck(order, causal):
    q, k, v = _qkv(B=1, T=5, S=6, HQ=2, H=1, D=3, Dv=2, seed=120, requires_grad=True)
    assert torch.autograd.gradcheck(lambda q, k, v: scan_attention(q, k, v, causal=causal, order=order, window=4),
                                    (q, k, v))


def test_bad_order():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="order"):
        scan_attention(q, k, v, order="random")
