"""The ops under ``torch.func.vmap`` (an ensemble's copies stacked on a leading dim): each copy's output and
gradients equal the op's on that copy alone, for the Triton kernels (their rules fold the copies into the batch,
or run once per copy when a weight of each copy or packed sequences say so) and the torch paths."""
import copy

import pytest
import torch
from torch.func import functional_call, stack_module_state, vmap

import regattn
from regattn.layers.rope import RotaryEmbedding, norm_rope
from regattn.models.stack import MixerStack
from tests.helpers import randn, rel_err

DEV = "cuda" if torch.cuda.is_available() else "cpu"
COPIES = 3


def _copies_match(fn, *shapes, batched=None, dtype=torch.float32, bound=1e-5):
    """``vmap(fn)`` over ``COPIES`` stacked inputs of ``shapes`` (those whose index is in ``batched``, default all;
    the others shared) against ``fn`` on each copy: outputs and every input's gradient (a shared input's summed
    over the copies)."""
    batched = set(range(len(shapes))) if batched is None else set(batched)
    xs = [randn(*((COPIES,) if i in batched else ()), *shape, dtype=dtype, device=DEV, requires_grad=True)
          for i, shape in enumerate(shapes)]
    out = vmap(fn, in_dims=tuple(0 if i in batched else None for i in range(len(xs))))(*xs)
    grad = randn(*out.shape, dtype=dtype, device=DEV)
    got = torch.autograd.grad(out, xs, grad)
    ref = torch.stack([fn(*(x[m] if i in batched else x for i, x in enumerate(xs))) for m in range(COPIES)])
    want = torch.autograd.grad(ref, xs, grad)
    assert rel_err(out, ref) < bound
    for g, w in zip(got, want):
        assert rel_err(g, w) < bound

B, T, H, D = 2, 37, 2, 16


@pytest.mark.parametrize("window", [None, 9])
def test_softmax_attention(interpret, window):
    _copies_match(lambda q, k, v: regattn.softmax_attention(q, k, v, window=window, backend="triton"),
                  (B, T, H, D), (B, T, H, D), (B, T, H, D))


def test_gatedfwa_and_its_gate_scan(interpret):
    def gated(q, k, v, h, beta):
        u = regattn.gatedfwa_gate(h, torch.nn.functional.softplus(beta), backend="triton")
        return regattn.gatedfwa(q, k, v, u, window=7, backend="triton")
    _copies_match(gated, (B, T, H, D), (B, T, H, D), (B, T, H, D), (B, T, H), (B, T, H))


def test_parallax(interpret):
    _copies_match(lambda q, r, k, v: regattn.parallax(q, r, k, v, backend="triton"),
                  (B, T, H, D), (B, T, H, D), (B, T, H, D), (B, T, H, D))


@pytest.mark.parametrize("method", ["lightning2", "fleet", "causal_dot_product"])
def test_decay_methods(interpret, method):
    gamma = torch.tensor([0.9, 0.99], device=DEV)
    _copies_match(lambda b, c, v: regattn.decay_linear_attention(b, c, v, gamma, method=method, backend="triton"),
                  (B, T, H, D), (B, T, H, D), (B, T, H, D))


def test_decay_over_packed_sequences_runs_once_per_copy(interpret):
    gamma = torch.tensor([0.9, 0.99], device=DEV)
    cu = torch.tensor([0, 11, 30, T], device=DEV, dtype=torch.int32)
    _copies_match(lambda b, c, v: regattn.decay_linear_attention(b, c, v, gamma, cu_seqlens=cu, backend="triton"),
                  (1, T, H, D), (1, T, H, D), (1, T, H, D))


@pytest.mark.parametrize("shared_weight", [True, False])
def test_norm_rope(interpret, shared_weight):
    """The norm's weight shared (folded into the batch) or each copy's own (one launch per copy)."""
    norm = torch.nn.RMSNorm(D, eps=1e-6).to(DEV)
    angles = RotaryEmbedding(D).angles(T, 0, torch.device(DEV))

    def fn(x, weight):
        return norm_rope(x, _with_weight(norm, weight), angles, backend="triton")
    _copies_match(fn, (B, T, H, D), (D,), batched=(0,) if shared_weight else (0, 1))


def _with_weight(norm: torch.nn.RMSNorm, weight: torch.Tensor) -> torch.nn.RMSNorm:
    """``norm`` with ``weight`` in place of its own (a tensor of the caller's graph)."""
    clone = torch.nn.RMSNorm(norm.normalized_shape, eps=norm.eps, device=weight.device)
    del clone.weight
    clone.weight = weight
    return clone


def test_mesanet_and_the_torch_reference_paths():
    _copies_match(lambda q, k, v: regattn.mesanet(q, k, v, chunk=16, backend="torch"), (B, T, H, D), (B, T, H, D),
                  (B, T, H, D), bound=1e-4)
    _copies_match(lambda q, k, v: regattn.softmax_attention(q, k, v, backend="torch"),
                  (B, T, H, D), (B, T, H, D), (B, T, H, D), dtype=torch.float64, bound=1e-12)


def test_mesanet_triton(interpret):
    _copies_match(lambda q, k, v: regattn.mesanet(q, k, v, chunk=16, backend="triton"), (B, T, H, D), (B, T, H, D),
                  (B, T, H, D), bound=1e-4)


@pytest.mark.parametrize("mixer", ["softmax", "swa", "parallax", "gatedfwa", "decay", "mesanet", "linear"])
def test_an_ensemble_of_task_models(mixer):
    """Three task models stacked (``torch.func.stack_module_state``) and called under ``vmap``, as PyTorch's
    ensembling recipe does: each model's output and parameters' gradients are its own."""
    models = [MixerStack(mixer, kind="tokens", seq_len=T, vocab_size=16, dim=32, heads=2).to(DEV)
              for _ in range(COPIES)]
    params, buffers = stack_module_state(models)
    template = copy.deepcopy(models[0]).to("meta")
    tokens = torch.randint(0, 16, (B, T), device=DEV)
    out = vmap(lambda p, b: functional_call(template, (p, b), (tokens,)))(params, buffers)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, list(params.values()), grad)
    for m, model in enumerate(models):
        ref = model(tokens)
        assert rel_err(out[m], ref) < 1e-5
        want = torch.autograd.grad(ref, list(model.parameters()), grad[m])
        for name, g, w in zip(params, got, want):
            assert rel_err(g[m], w) < 1e-4, name
