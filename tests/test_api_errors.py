"""Bad input through every public function: a clear ValueError/TypeError naming the argument.

Hypothesis draws a valid call, breaks one thing in it, and checks the error; the valid call
itself must return the documented shape.
"""
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import regattn

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def attention_shapes(draw):
    B = draw(st.integers(1, 2))
    T = draw(st.integers(1, 6))
    H = draw(st.integers(1, 2))
    G = draw(st.integers(1, 2))
    D = draw(st.sampled_from([2, 4]))
    return B, T, H * G, H, D


def rand(*shape, dtype=torch.float64):
    return torch.randn(*shape, dtype=dtype)


def attention_call(op, B, T, HQ, H, D):
    """A valid call of ``op`` as (positional args, keyword args, expected output shape)."""
    q, k, v = rand(B, T, HQ, D), rand(B, T, H, D), rand(B, T, H, D)
    out = (B, T, HQ, D)
    if op == "softmax_attention":
        return [q, k, v], {"gate": rand(B, T, HQ), "window": 3}, out
    if op == "gatedfwa":
        return [q, k, v, rand(B, T, HQ)], {"window": 2}, out
    if op == "parallax":
        return [q, rand(B, T, HQ, D), k, v], {}, out
    if op in ("lla", "mesanet"):
        return [q, k, v], {"lam": 0.5}, out
    if op == "scan_attention":
        return [q, k, v], {}, out
    raise AssertionError(op)


ATTENTION_OPS = ["softmax_attention", "gatedfwa", "parallax", "lla", "mesanet", "scan_attention"]
QKV_POSITION = {"softmax_attention": 0, "gatedfwa": 0, "parallax": 0, "lla": 0, "mesanet": 0, "scan_attention": 0}


def expect_error(fn, args, kwargs, name):
    with pytest.raises((ValueError, TypeError)) as info:
        fn(*args, **kwargs)
    assert name in str(info.value), f"error does not name {name!r}: {info.value}"


def qkv_index(op):
    """Positions of q, k, v in the positional arguments."""
    return (0, 2, 3) if op == "parallax" else (0, 1, 2)


@pytest.mark.parametrize("op", ATTENTION_OPS)
@SETTINGS
@given(shape=attention_shapes())
def test_valid_call_shape(op, shape):
    args, kwargs, out = attention_call(op, *shape)
    o = getattr(regattn, op)(*args, backend="torch", **kwargs)
    assert tuple(o.shape) == out and o.dtype == torch.float64
    assert torch.isfinite(o).all()


BREAKS = ["rank", "batch", "head_dim", "groups", "int_dtype", "mixed_dtype", "not_tensor", "backend"]


@pytest.mark.parametrize("op", ATTENTION_OPS)
@pytest.mark.parametrize("brk", BREAKS)
@SETTINGS
@given(shape=attention_shapes(), which=st.sampled_from(["q", "k", "v"]))
def test_broken_attention_inputs(op, brk, shape, which):
    B, T, HQ, H, D = shape
    args, kwargs, _ = attention_call(op, *shape)
    iq, ik, iv = qkv_index(op)
    pos = {"q": iq, "k": ik, "v": iv}[which]
    x = args[pos]
    name = which
    if brk == "rank":
        args[pos] = x[0]
    elif brk == "batch":
        if which == "q":
            return  # the batch is taken from q
        args[pos] = torch.cat([x, x], dim=0)
    elif brk == "head_dim":
        if which != "k":
            return  # q fixes D; v may have its own head dim
        args[pos] = rand(B, T, H, D + 1)
    elif brk == "groups":
        if which != "k":
            return
        args[ik] = rand(B, T, HQ + 1, D)
        args[iv] = rand(B, T, HQ + 1, D)
        name = "q" if HQ % (HQ + 1) else "k"
    elif brk == "int_dtype":
        args[pos] = torch.ones(x.shape, dtype=torch.int64)
    elif brk == "mixed_dtype":
        if which == "q":
            return
        args[pos] = x.float()
    elif brk == "not_tensor":
        args[pos] = x.tolist()
    elif brk == "backend":
        kwargs["backend"] = "cuda"
        name = "backend"
    if brk != "backend":
        kwargs["backend"] = "torch"
    expect_error(getattr(regattn, op), args, kwargs, name)


@SETTINGS
@given(shape=attention_shapes(), w=st.integers(-3, 0))
def test_window_below_one(shape, w):
    for op in ("softmax_attention", "gatedfwa", "parallax", "lla"):
        args, kwargs, _ = attention_call(op, *shape)
        kwargs["window"] = w
        expect_error(getattr(regattn, op), args, kwargs, "window")


@pytest.mark.parametrize("window", [1.5, "3", True])
def test_window_wrong_type(window):
    args, kwargs, _ = attention_call("softmax_attention", 1, 4, 2, 1, 4)
    kwargs["window"] = window
    expect_error(regattn.softmax_attention, args, kwargs, "window")


@SETTINGS
@given(shape=attention_shapes(), bad=st.sampled_from([0.0, -1.0, math.inf, -math.inf, math.nan]))
def test_lam_not_positive_finite(shape, bad):
    args, kwargs, _ = attention_call("lla", *shape)
    expect_error(regattn.lla, args, {"lam": bad}, "lam")
    B, T, HQ, H, D = shape
    lam = torch.rand(B, T, HQ, dtype=torch.float64) + 0.1
    lam[0, 0, 0] = bad
    expect_error(regattn.lla, args, {"lam": lam}, "lam")


def test_lla_structure_arguments():
    args, _, _ = attention_call("lla", 1, 5, 2, 1, 4)
    expect_error(regattn.lla, args, {"lam": torch.ones(1, 5, 3, dtype=torch.float64)}, "lam")
    expect_error(regattn.lla, args, {"lam": 1.0, "blocks": 3}, "blocks")
    expect_error(regattn.lla, args, {"lam": 1.0, "blocks": 0}, "blocks")
    expect_error(regattn.lla, args, {"lam": 1.0, "cg_iters": 0}, "cg_iters")
    expect_error(regattn.lla, args, {"lam": 1.0, "cg_tol": -1.0}, "cg_tol")
    expect_error(regattn.lla, args, {"lam": "1"}, "lam")


def test_gate_and_probe_shapes():
    args, kwargs, _ = attention_call("softmax_attention", 1, 5, 2, 1, 4)
    kwargs["gate"] = rand(1, 5, 1)
    expect_error(regattn.softmax_attention, args, kwargs, "gate")
    kwargs["gate"] = torch.ones(1, 5, 2, dtype=torch.int32)
    expect_error(regattn.softmax_attention, args, kwargs, "gate")
    args, kwargs, _ = attention_call("gatedfwa", 1, 5, 2, 1, 4)
    args[3] = None
    expect_error(regattn.gatedfwa, args, kwargs, "u")
    args, kwargs, _ = attention_call("parallax", 1, 5, 2, 1, 4)
    args[1] = rand(1, 5, 2, 3)
    expect_error(regattn.parallax, args, kwargs, "r")
    args[1] = rand(1, 5, 2, 4).float()
    expect_error(regattn.parallax, args, kwargs, "r")


def test_window_needs_causal():
    args, kwargs, _ = attention_call("softmax_attention", 1, 5, 2, 1, 4)
    expect_error(regattn.softmax_attention, args, {"window": 2, "causal": False}, "window")


def test_scale_and_precision():
    args, _, _ = attention_call("scan_attention", 1, 5, 2, 1, 4)
    expect_error(regattn.scan_attention, args, {"scale": math.nan}, "scale")
    expect_error(regattn.scan_attention, args, {"scale": "0.5"}, "scale")
    expect_error(regattn.scan_attention, args, {"precision": "fp8"}, "precision")


@st.composite
def decay_shapes(draw):
    return (draw(st.integers(1, 2)), draw(st.integers(1, 6)), draw(st.integers(1, 3)),
            draw(st.integers(1, 4)), draw(st.integers(1, 4)))


@SETTINGS
@given(shape=decay_shapes(), method=st.sampled_from(["vanilla", "block_based", "recursion", "auto"]))
def test_decay_valid_and_broken(shape, method):
    B, T, H, R, D = shape
    b, c, v = rand(B, T, H, R), rand(B, T, H, R), rand(B, T, H, D)
    gamma = torch.rand(H, dtype=torch.float64) * 0.5 + 0.5
    o = regattn.decay_linear_attention(b, c, v, gamma, method=method, backend="torch")
    assert tuple(o.shape) == (B, T, H, D) and torch.isfinite(o).all()
    f = regattn.decay_linear_attention
    expect_error(f, [b, rand(B, T, H, R + 1), v], {}, "c")
    expect_error(f, [b, c, rand(B, T + 1, H, D)], {}, "v")
    expect_error(f, [b[0], c, v], {}, "b")
    expect_error(f, [b, c.float(), v], {}, "c")
    expect_error(f, [b, c, v.to(torch.int32)], {}, "v")
    expect_error(f, [b, c, v, torch.full((H,), 1.5, dtype=torch.float64)], {}, "gamma")
    expect_error(f, [b, c, v, torch.zeros(H, dtype=torch.float64)], {}, "gamma")
    expect_error(f, [b, c, v, torch.full((H + 1,), 0.9, dtype=torch.float64)], {}, "gamma")
    expect_error(f, [b, c, v, -0.5], {}, "gamma")
    expect_error(f, [b, c, v], {"method": "fastest"}, "method")


@SETTINGS
@given(B=st.integers(1, 2), T=st.integers(1, 6), H=st.integers(1, 3))
def test_gatedfwa_gate_valid_and_broken(B, T, H):
    h, beta = rand(B, T, H), torch.rand(B, T, H, dtype=torch.float64) + 0.5
    u = regattn.gatedfwa_gate(h, beta, backend="torch")
    assert tuple(u.shape) == (B, T, H) and bool((u[:, 1:] <= u[:, :-1]).all())
    expect_error(regattn.gatedfwa_gate, [h, beta[:, :, :1] if H > 1 else beta[:, :1].expand(B, T + 1, H)], {}, "beta")
    expect_error(regattn.gatedfwa_gate, [h[0], beta], {}, "h")
    expect_error(regattn.gatedfwa_gate, [h, beta.float()], {}, "beta")
    expect_error(regattn.gatedfwa_gate, [h.long(), beta], {}, "h")
    expect_error(regattn.gatedfwa_gate, [h, beta], {"eps": 0.0}, "eps")


@pytest.mark.parametrize("op", ATTENTION_OPS)
def test_mixed_devices(op):
    """A tensor on another device (the meta device stands in for a GPU) is refused before any work."""
    args, kwargs, _ = attention_call(op, 1, 4, 2, 1, 4)
    ik = qkv_index(op)[1]
    args[ik] = args[ik].to("meta")
    expect_error(getattr(regattn, op), args, kwargs, "k")
    b, c, v = rand(1, 4, 2, 3), rand(1, 4, 2, 3), rand(1, 4, 2, 5)
    expect_error(regattn.decay_linear_attention, [b, c, v.to("meta")], {}, "v")
    expect_error(regattn.decay_linear_attention, [b, c, v, torch.full((2,), 0.9, device="meta")], {}, "gamma")


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("name", ["h", "beta"])
def test_gatedfwa_gate_refuses_non_finite(name, bad):
    x = {"h": rand(1, 6, 2), "beta": torch.rand(1, 6, 2, dtype=torch.float64) + 0.5}
    x[name][0, 3, 1] = bad
    with pytest.raises(ValueError, match=rf"^{name}: expected finite values"):
        regattn.gatedfwa_gate(x["h"], x["beta"], backend="torch")


def test_gatedfwa_names_u():
    args, kwargs, _ = attention_call("gatedfwa", 1, 5, 2, 1, 4)
    u = args[3]
    for wrong, error in [(u[:, :4], ValueError), (u[..., :1], ValueError), (u[0], ValueError),
                         (u.to(torch.int32), TypeError), (u.to("meta"), ValueError)]:
        args[3] = wrong
        with pytest.raises(error, match=r"^u: "):
            regattn.gatedfwa(*args, **kwargs)
