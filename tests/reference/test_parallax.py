"""The Parallax reference against the paper's identities (parallax.txt eq. 8, 14, 18)."""
import pytest
import torch

from regattn.reference.parallax import parallax, parallax_scores
from regattn.reference.softmax import softmax_attention
from regattn.reference.common import repeat_kv
from tests.helpers import randn, rel_err

CASES = [  # (T, S, causal, window)
    (7, 7, True, None),
    (5, 9, True, None),    # chunked prefill: queries aligned to the end of the keys
    (8, 8, True, 3),
    (6, 6, False, None),
    (1, 11, True, 4),      # decode step
]


def _inputs(B=2, T=7, S=7, HQ=4, H=2, D=5, Dv=6, seed=0, requires_grad=False):
    q = randn(B, T, HQ, D, seed=seed, requires_grad=requires_grad)
    r = randn(B, T, HQ, D, seed=seed + 1, scale=0.5, requires_grad=requires_grad)
    k = randn(B, S, H, D, seed=seed + 2, requires_grad=requires_grad)
    v = randn(B, S, H, Dv, seed=seed + 3, requires_grad=requires_grad)
    return q, r, k, v


@pytest.mark.parametrize("T,S,causal,window", CASES)
def test_forms_agree(T, S, causal, window):
    q, r, k, v = _inputs(T=T, S=S)
    outs = {f: parallax(q, r, k, v, causal=causal, window=window, form=f) for f in ("eq8", "eq14", "score")}
    assert rel_err(outs["eq8"], outs["eq14"]) < 1e-12
    assert rel_err(outs["score"], outs["eq14"]) < 1e-12


def test_covariance_form():
    """eq. 8 right side: o = o_SA - Sigma_KV r with the p-weighted value/key covariance."""
    q, r, k, v = _inputs(H=4)
    o = parallax(q, r, k, v, scale=0.7)
    logits = torch.einsum("bthd,bshd->bhts", q, k) * 0.7
    T = q.shape[1]
    logits = logits.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    p = torch.softmax(logits, -1)
    vbar = torch.einsum("bhts,bshd->bthd", p, v)
    kbar = torch.einsum("bhts,bshd->bthd", p, k)
    cov = torch.einsum("bhts,bshe,bshd->bthed", p, v, k) - vbar[..., :, None] * kbar[..., None, :]
    expected = vbar - torch.einsum("bthed,bthd->bthe", cov, r)
    assert rel_err(o, expected) < 1e-12


def test_zero_probe_is_softmax():
    q, r, k, v = _inputs()
    for window in (None, 3):
        o = parallax(q, torch.zeros_like(r), k, v, window=window)
        assert rel_err(o, softmax_attention(q, k, v, window=window)) < 1e-13


@pytest.mark.parametrize("T,S,causal,window", CASES)
def test_scores_rows_sum_to_one(T, S, causal, window):
    q, r, k, _ = _inputs(T=T, S=S)
    s = parallax_scores(q, r, k, causal=causal, window=window)
    torch.testing.assert_close(s.sum(-1), torch.ones_like(s[..., 0]), rtol=0, atol=1e-12)
    assert (s < 0).any(), "a nonzero probe should give some negative weights"


def test_hidden_rows_are_zero():
    """More queries than keys: the first queries see nothing and get zeros, not NaN."""
    q, r, k, v = _inputs(T=6, S=3)
    for form in ("eq8", "eq14", "score"):
        o = parallax(q, r, k, v, form=form)
        assert torch.isfinite(o).all()
        assert o[:, :3].abs().max() == 0 and o[:, 3:].abs().min() > 0


def test_gqa_equals_repeated_heads():
    q, r, k, v = _inputs(HQ=6, H=2)
    o = parallax(q, r, k, v, window=4)
    o_rep = parallax(q, r, repeat_kv(k, 6), repeat_kv(v, 6), window=4)
    assert rel_err(o, o_rep) < 1e-14


def test_varlen_equals_per_sequence():
    lens = [3, 0, 1, 6]
    cu = torch.tensor([0, 3, 3, 4, 10])
    q, r, k, v = _inputs(B=1, T=10, S=10)
    o = parallax(q, r, k, v, window=2, cu_seqlens=cu)
    start = 0
    for n in lens:
        if n:
            sl = slice(start, start + n)
            ref = parallax(q[:, sl], r[:, sl], k[:, sl], v[:, sl], window=2)
            assert rel_err(o[:, sl], ref) < 1e-14
        start += n


@pytest.mark.parametrize("form", ["eq8", "eq14", "score"])
def test_gradcheck(form):
    q, r, k, v = _inputs(B=1, T=4, S=5, HQ=2, H=1, D=3, Dv=2, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *a: parallax(*a, window=3, form=form), (q, r, k, v))


def test_bad_form():
    q, r, k, v = _inputs()
    with pytest.raises(ValueError, match="form"):
        parallax(q, r, k, v, form="eq7")
