"""Peers, run in the same process on the same inputs as our ops.

Each builder takes our ``[B, T, H, D]`` tensors, makes the peer's own layout once (outside
the timed call) and returns ``(call, leaves[, grads])``: a zero-argument callable giving the
output (viewed back in our layout, so outputs can be checked), the tensors to differentiate for
a forward+backward timing and, where those are not our inputs in our layout, ``grads`` mapping
their gradients back to ours by name (``{"dq": ..., "dk": ..., "dv": ...}``). A peer that cannot
run raises :class:`Unavailable` with the reason ("not installed", ...), which becomes its status.
"""
from __future__ import annotations

import functools
import importlib

import torch
import torch.nn.functional as F

from regattn.reference.common import visible

SDPA_BACKENDS = ("flash", "cudnn", "efficient", "math")
PEERS = tuple(f"sdpa-{b}" for b in SDPA_BACKENDS) + ("flex", "fla", "reference", "copy")

# flash-linear-attention functions and the submodule each lives in.
FLA_MODULES = {
    "parallel_parallax": "parallax", "parallax_decode_one_step": "parallax.decode", "parallel_nsa": "nsa",
    "parallel_forgetting_attn": "forgetting_attn", "chunk_simple_gla": "simple_gla",
    "chunk_lightning_attn": "lightning_attn",
}


class Unavailable(Exception):
    """A peer that cannot run here; the message is reported as its status."""


def leaf(x: torch.Tensor, layout=None) -> torch.Tensor:
    """A fresh leaf copy of ``x`` (in another layout), needing grad when ``x`` does."""
    y = x.detach() if layout is None else layout(x.detach()).contiguous()
    return y.requires_grad_(x.requires_grad)


def heads_first(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2)


def sdpa_mask(T: int, S: int, causal: bool, window: int | None, device):
    """``(attn_mask, is_causal)`` for SDPA with queries aligned to the end of the keys."""
    if not causal or (T == 1 and window is None):
        return None, False
    if T == S and window is None:
        return None, True
    return visible(T, S, causal=True, window=window, device=device), False


def sdpa(q, k, v, *, backend: str, causal=True, window=None, scale=None):
    """torch SDPA restricted to one backend (``flash | cudnn | efficient | math``), GQA by ``enable_gqa``."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kernel = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
              "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[backend]
    qt, kt, vt = (leaf(x, heads_first) for x in (q, k, v))
    mask, is_causal = sdpa_mask(q.shape[1], k.shape[1], causal, window, q.device)
    gqa = q.shape[2] != k.shape[2]

    def call():
        with sdpa_kernel([kernel]):
            o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, is_causal=is_causal,
                                               scale=scale, enable_gqa=gqa)
        return o.transpose(1, 2)  # a view: back to [B, T, HQ, Dv] at no cost
    return call, [qt, kt, vt], ours_grads("dq", "dk", "dv")


def ours_grads(*names):
    """Gradients of heads-first leaves, back in our layout by name; trailing leaves (the two reads
    of a gate) add up to the last name's gradient."""
    def grads(gs):
        out = dict(zip(names, (g.transpose(1, 2) for g in gs)))
        if len(gs) > len(names):
            out[names[-1]] = sum(g.transpose(1, 2) for g in gs[len(names) - 1:])
        return out
    return grads


@functools.lru_cache(maxsize=None)
def compiled_flex():
    """One compiled FlexAttention for the process. Each shape and mask compiles anew, so the
    recompile limit is raised: past it torch falls back to eager and would time that instead."""
    from torch.nn.attention.flex_attention import flex_attention
    import torch._dynamo

    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 256))
    return torch.compile(flex_attention, dynamic=False)


def flex(q, k, v, *, causal=True, window=None, gate=None, scale=None, compiled=True):
    """FlexAttention: a mask_mod for causality and the window, a score_mod adding ``u_i - u_j``.

    The block mask is built once, outside the timed call. ``compiled=False`` runs it eagerly
    (the CPU smoke mode, where compiling would dominate).
    """
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError as err:
        raise Unavailable(f"not installed: {err}") from err
    T, S = q.shape[1], k.shape[1]
    offset = S - T

    def mask_mod(b, h, i, j):
        pos = i + offset
        keep = j <= pos
        return keep & (pos - j < window) if window is not None else keep

    block_mask = create_block_mask(mask_mod, None, None, T, S, device=q.device) if causal else None
    qt, kt, vt = (leaf(x, heads_first) for x in (q, k, v))
    leaves = [qt, kt, vt]
    score_mod = None
    if gate is not None:
        # u_i and u_j from two leaves [B, HQ, T]: FlexAttention cannot differentiate two reads of
        # one captured tensor; the two gradients add up to du.
        uq, uk = (leaf(gate, lambda g: g.float().transpose(1, 2)) for _ in range(2))
        leaves += [uq, uk]

        def score_mod(score, b, h, i, j):
            return score + uq[b, h, i] - uk[b, h, j]
    fn = compiled_flex() if compiled else flex_attention
    gqa = q.shape[2] != k.shape[2]

    def call():
        return fn(qt, kt, vt, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=gqa).transpose(1, 2)
    return call, leaves, ours_grads("dq", "dk", "dv", *(("du",) if gate is not None else ()))


def copy_floor(nbytes: float, device):
    """A device copy moving ``nbytes`` (half read, half written): the memory-bound floor of an op
    that reads and writes that many bytes once."""
    src = torch.empty(max(int(nbytes) // 2, 1), dtype=torch.uint8, device=device)
    return (lambda: src.clone()), []


def fla_function(name: str):
    """A flash-linear-attention function by name, or :class:`Unavailable`."""
    try:
        ops = importlib.import_module("fla.ops")
    except ImportError as err:
        raise Unavailable("not installed") from err
    fn = getattr(ops, name, None)
    if fn is None:
        try:
            fn = getattr(importlib.import_module(f"fla.ops.{FLA_MODULES[name]}"), name, None)
        except ImportError:
            fn = None
    if fn is None:
        raise Unavailable(f"not in this flash-linear-attention version: {name}")
    return fn


def wanted(peers, name: str) -> bool:
    """Whether the peer ``name`` (``"sdpa-flash"``, ``"flex"``, ...) was asked for."""
    return name in peers or name.split("-")[0] in peers
