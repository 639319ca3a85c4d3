"""benchmark_method: a correct user method is timed beside the built-ins, a wrong one is refused."""
import pytest
import torch

from regattn.bench import benchmark_method


def masked(b, c, v, gamma):
    """The definition, written out: ``(B C^T ⊙ M) V``."""
    T = b.shape[1]
    dist = torch.arange(T)[:, None] - torch.arange(T)[None, :]
    log_g = torch.zeros(b.shape[2]) if gamma is None else gamma.log()
    mask = torch.where(dist >= 0, torch.exp(log_g[:, None, None] * dist.clamp_min(0)), 0.0).to(b.dtype)
    return torch.einsum("bhts,bshd->bthd", torch.einsum("bthr,bshr->bhts", b, c) * mask, v)


def test_user_method_is_checked_then_timed_beside_builtins(capsys):
    rows = benchmark_method(masked, device="cpu", heads=2, seqlens=(16, 24), rank=4, dim=6, gamma=0.9,
                            peers=("reference",), rep_ms=1)
    user = [r for r in rows if r["ours"]]
    assert [r["op"] for r in user] == ["user:masked", "user:masked"]
    assert all(r["status"] == "ok" and r["ratio"] is not None for r in user)
    ops = {r["op"] for r in rows}
    assert "regattn:torch[vanilla]" in ops and "regattn:torch[fleet]" in ops and "reference" in ops
    assert "user:masked" in capsys.readouterr().out


def test_wrong_method_is_refused_before_timing():
    def no_decay(b, c, v, gamma):
        return masked(b, c, v, None)

    with pytest.raises(ValueError, match="relative error"):
        benchmark_method(no_decay, device="cpu", heads=2, seqlens=(16,), rank=4, dim=4, gamma=0.5)

    def wrong_shape(b, c, v, gamma):
        return v[:, :-1]

    with pytest.raises(ValueError, match="shape"):
        benchmark_method(wrong_shape, device="cpu", heads=2, seqlens=(16,), rank=4, dim=4)


def test_gamma_per_head_as_in_listing_2():
    rows = benchmark_method(masked, device="cpu", heads=2, seqlens=(8,), rank=4, dim=4,
                            gamma=torch.tensor([[0.9], [0.5]]), peers=())
    assert rows[0]["op"] == "user:masked" and rows[0]["status"] == "ok"
    with pytest.raises(ValueError, match="gamma"):
        benchmark_method(masked, device="cpu", heads=2, seqlens=(8,), rank=4, dim=4, gamma=1.5)
