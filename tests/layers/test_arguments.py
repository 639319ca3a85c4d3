"""Every layer refuses a bad argument at construction, and a bad ``x`` at forward, with an error that
names it; None means the documented default; autocast inputs pass."""
import math

import pytest
import torch

from regattn.layers import LLA, GatedFWA, GatedFWANSA, Parallax, Retention
from tests.helpers import randn

WIDTH = 16
LAYERS = {
    "gatedfwa": (GatedFWA, dict(d_model=WIDTH, num_heads=4, window=3)),
    "gatedfwa_nsa": (GatedFWANSA, dict(d_model=WIDTH, num_heads=4, window=3, block_cmp=4, stride_cmp=2,
                                       block_slc=4, topk=2)),
    "parallax": (Parallax, dict(d_model=WIDTH, num_heads=4)),
    "lla": (LLA, dict(d_model=WIDTH, num_heads=4)),
    "retention": (Retention, dict(dim=WIDTH, num_heads=4)),
}
ATTENTION = ("gatedfwa", "gatedfwa_nsa", "parallax", "lla")


def build(name, dtype=torch.float32, **overrides):
    cls, good = LAYERS[name]
    return cls(**{**good, "backend": "torch", **overrides}).to(dtype)


def bad_sizes():
    """(layer, bad argument, the name its error must start with) for the arguments every attention layer has."""
    for layer in ATTENTION:
        yield layer, dict(d_model=0), "d_model"
        yield layer, dict(d_model=16.0), "d_model"
        yield layer, dict(num_heads=0), "num_heads"
        yield layer, dict(num_heads=-2), "num_heads"
        yield layer, dict(num_heads=WIDTH + 1), "num_heads"     # the default head_dim would be 0
        yield layer, dict(num_kv_heads=0), "num_kv_heads"
        yield layer, dict(num_kv_heads=3), "num_kv_heads"
        yield layer, dict(num_kv_heads=True), "num_kv_heads"
        yield layer, dict(head_dim=0), "head_dim"
        yield layer, dict(head_dim=-4), "head_dim"
        yield layer, dict(window=0), "window"
        yield layer, dict(backend="cuda"), "backend"
        yield layer, dict(rope=1), "rope"
        yield layer, dict(rope=True, head_dim=5), "head_dim"      # RoPE rotates pairs


CASES = [
    *bad_sizes(),
    ("gatedfwa", dict(eps=0.0), "eps"),
    ("gatedfwa", dict(eps=math.nan), "eps"),
    ("gatedfwa_nsa", dict(block_cmp=0), "block_cmp"),
    ("gatedfwa_nsa", dict(stride_cmp=5), "stride_cmp"),
    ("gatedfwa_nsa", dict(block_slc=0), "block_slc"),
    ("gatedfwa_nsa", dict(topk=0), "topk"),
    ("parallax", dict(rope_base=-1.0), "rope_base"),
    ("parallax", dict(rope_base=0.0), "rope_base"),
    ("parallax", dict(rope_base=math.inf), "rope_base"),
    ("parallax", dict(rope_base=math.nan, rope=False), "rope_base"),
    ("parallax", dict(norm_eps=-1e-6), "norm_eps"),
    ("parallax", dict(rope_probe="yes"), "rope_probe"),
    ("parallax", dict(probe_gate=None), "probe_gate"),
    ("parallax", dict(zero_init_probe=0), "zero_init_probe"),
    ("lla", dict(lam="token"), "lam"),
    ("lla", dict(lam_min=0.0), "lam_min"),
    ("lla", dict(lam_min=1.0), "lam_min"),
    ("lla", dict(lam_min=math.nan), "lam_min"),
    ("lla", dict(blocks=3), "blocks"),
    ("lla", dict(blocks=0), "blocks"),
    ("lla", dict(cg_iters=0), "cg_iters"),
    ("lla", dict(cg_tol=-1e-6), "cg_tol"),
    ("lla", dict(qk_norm="rms"), "qk_norm"),
    ("retention", dict(dim=0), "dim"),
    ("retention", dict(num_heads=0), "num_heads"),
    ("retention", dict(num_heads=WIDTH + 1), "num_heads"),
    ("retention", dict(key_dim=0), "key_dim"),
    ("retention", dict(head_dim=0), "head_dim"),
    ("retention", dict(head_dim=-3), "head_dim"),
    ("retention", dict(gammas=[0.5, 0.9]), "gammas"),
    ("retention", dict(gammas=[0.5, 0.9, 1.5, 0.9]), "gammas"),
    ("retention", dict(gammas=[0.5, 0.9, math.nan, 0.9]), "gammas"),
    ("retention", dict(gammas="0.9"), "gammas"),
    ("retention", dict(method="fastest"), "method"),
    ("retention", dict(backend="gpu"), "backend"),
    ("retention", dict(eps=0.0), "eps"),
    ("retention", dict(bias="no"), "bias"),
]


@pytest.mark.parametrize("layer,bad,name", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_bad_argument_is_refused_by_name(layer, bad, name):
    cls, good = LAYERS[layer]
    with pytest.raises((ValueError, TypeError), match=rf"^{name}: "):
        cls(**{**good, **bad})


@pytest.mark.parametrize("layer", LAYERS)
def test_none_means_the_default(layer):
    m = build(layer, head_dim=None)
    assert m.head_dim == WIDTH // 4
    if layer in ATTENTION:
        assert build(layer, num_kv_heads=None).num_kv_heads == 4
    else:
        assert build(layer, key_dim=None).key_dim == WIDTH // 4


def bad_inputs():
    """(x, the error type) for a layer of width WIDTH in float32."""
    yield randn(2, 5, WIDTH - 4, dtype=torch.float32), ValueError        # another model width
    yield randn(2, 5, WIDTH, dtype=torch.float64), TypeError             # another dtype, no autocast
    yield randn(2, 5, WIDTH, dtype=torch.float32).long(), TypeError      # not floating
    yield randn(2 * 5, WIDTH, dtype=torch.float32), ValueError           # no time axis
    yield randn(2, 0, WIDTH, dtype=torch.float32), ValueError            # no token
    yield torch.empty(2, 5, WIDTH, device="meta"), ValueError            # another device


@pytest.mark.parametrize("layer", LAYERS)
def test_bad_input_is_refused_by_name(layer):
    m = build(layer)
    for x, error in bad_inputs():
        with pytest.raises(error, match=r"^x: "):
            m(x)


@pytest.mark.parametrize("layer", ("gatedfwa", "parallax", "lla"))
def test_bad_input_to_generation_is_refused_by_name(layer):
    m = build(layer)
    _, cache = m.prefill(randn(1, 4, WIDTH, dtype=torch.float32))
    with pytest.raises(ValueError, match=r"^x: "):
        m.step(randn(1, 1, WIDTH + 2, dtype=torch.float32), cache)
    with pytest.raises(TypeError, match=r"^x: "):
        m.step(randn(1, 1, WIDTH, dtype=torch.float64), cache)


def test_bad_token_to_retention_step_is_refused_by_name():
    m = build("retention")
    with pytest.raises(ValueError, match=r"^x_t: "):
        m.step(randn(2, WIDTH + 1, dtype=torch.float32))
    with pytest.raises(ValueError, match=r"^x_t: "):
        m.step(randn(2, 1, WIDTH, dtype=torch.float32))
    with pytest.raises(TypeError, match=r"^x_t: "):
        m.step(randn(2, WIDTH, dtype=torch.float16))


@pytest.mark.parametrize("layer", LAYERS)
def test_autocast_takes_inputs_of_another_dtype(layer):
    """Under autocast an fp32 layer takes bf16 activations (another layer's autocast output) and fp32 ones."""
    m = build(layer)
    for dtype in (torch.bfloat16, torch.float32):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = m(randn(2, 6, WIDTH, dtype=dtype))
        assert y.shape == (2, 6, WIDTH) and y.dtype == torch.bfloat16 and torch.isfinite(y).all()
