"""Sequence mixers by name, for the small task models: ``x [B, T, dim] -> [B, T, dim]``.

Layers of :mod:`regattn.layers` are used where they exist (GatedFWA, Parallax, LLA with its learned
ridge, Retention for the decaying linear attention); the others are thin subclasses of
:class:`Attention` over a public op or a reference function. :class:`Attention` holds what they
share: the q/k/v/o projections, a per-head RMSNorm of q and k, and RoPE.

| name     | mechanism                                   | op                                   |
|----------|---------------------------------------------|--------------------------------------|
| softmax  | softmax attention                           | regattn.softmax_attention            |
| swa      | sliding-window softmax attention            | regattn.softmax_attention(window)    |
| gatedfwa | GatedFWA (gatedfwa.md eq. 9-12)             | regattn.layers.GatedFWA              |
| parallax | Parallax (parallax.txt eq. 8), rho = W_R x  | regattn.layers.Parallax              |
| lla      | Local Linear Attention (lla eq. 6-8, 27)    | regattn.layers.LLA, CG up to D iters |
| bd_lla   | block-diagonal LLA (lla Appendix E.1), g=4  | regattn.layers.LLA(blocks=g)         |
| linear   | causal linear attention, output RMSNorm     | regattn.reference.linear_attention   |
| mesanet  | MesaNet (lla eq. 2), L2-normalised q and k  | regattn.mesanet (exact, in chunks)   |
| decay    | decaying linear attention (RetNet gammas)   | regattn.layers.Retention             |

The baselines of :mod:`regattn.models.baselines` (``mamba2``, ``gdn``, ``gla``, ``deltanet``: FLA's own
layers, the ``baselines`` extra) are built by name too; :data:`MIXER_NAMES` lists every name.

``window`` (swa, gatedfwa) defaults to half the sequence length, as gatedfwa Section 4.1 sets
``w = N / 2`` so that a two-layer model still sees the whole context. RoPE uses the base 10^4
in every mixer that rotates (the layers' default; the Parallax layer is given the same).
"""
from __future__ import annotations

import torch
from torch import nn

import regattn
from regattn import reference
from regattn.layers import LLA, GatedFWA, Parallax, Retention, RotaryEmbedding
from regattn.layers.norm import L2Norm, RMSNorm
from regattn.layers.rope import norm_rope
from regattn.models.baselines import BASELINES, build_baseline


ROPE_BASE = 10000.0


class Attention(nn.Module):
    """Shared projections for the attention mixers.

    ``q, k, v = x W_q, x W_k, x W_v`` split into ``heads`` of ``dim // heads``; q and k are
    RMS-normalised per head (``qk_norm="rms"``), L2-normalised (``"l2"``) or left (``None``), then
    rotated by RoPE when ``rope``; a subclass's ``attend(q, k, v, x)`` (``[B, T, H, D]`` each, and the
    layer input) mixes them into ``[B, T, H, D]``; the heads are joined by ``W_o``.
    """

    def __init__(self, dim: int, heads: int, *, rope: bool = True, qk_norm: str | None = "rms"):
        super().__init__()
        if dim % heads:
            raise ValueError(f"heads: expected a divisor of dim = {dim}, got {heads}")
        self.heads, self.head_dim = heads, dim // heads
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=False)
        if qk_norm == "rms":
            self.q_norm, self.k_norm = RMSNorm(self.head_dim, eps=1e-6), RMSNorm(self.head_dim, eps=1e-6)
        elif qk_norm == "l2":
            self.q_norm, self.k_norm = L2Norm(), L2Norm()
        self.rotary = RotaryEmbedding(self.head_dim, base=ROPE_BASE) if rope else None

    def split(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, T, dim] -> [B, T, heads, head_dim]``."""
        return x.view(*x.shape[:2], self.heads, self.head_dim)

    def qkv(self, x: torch.Tensor):
        """``q, k, v: [B, T, heads, head_dim]`` in v's dtype: q and k normalised and rotated (one ``cos, sin``)."""
        angles = None if self.rotary is None else self.rotary.angles(x.shape[1], 0, x.device)
        q = norm_rope(self.split(self.q_proj(x)), getattr(self, "q_norm", None), angles)
        k = norm_rope(self.split(self.k_proj(x)), getattr(self, "k_norm", None), angles)
        v = self.split(self.v_proj(x))
        return q.to(v.dtype), k.to(v.dtype), v        # a norm may leave fp32 under autocast

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x)
        return self.o_proj(self.attend(q, k, v, x).flatten(2).to(v.dtype))


class Softmax(Attention):
    """Causal softmax attention, optionally within a sliding ``window``."""

    def __init__(self, dim, heads, *, window: int | None = None, **kw):
        super().__init__(dim, heads, **kw)
        self.window = window

    def attend(self, q, k, v, x):
        return regattn.softmax_attention(q, k, v, causal=True, window=self.window)


class Linear(Attention):
    """Causal linear attention ``o_i = sum_j (q_i.k_j / sqrt(D)) v_j`` with a per-head RMSNorm on the output
    (the sum is not normalised, so its scale grows with the position)."""

    def __init__(self, dim, heads, **kw):
        super().__init__(dim, heads, **kw)
        self.o_norm = RMSNorm(self.head_dim)

    def attend(self, q, k, v, x):
        return self.o_norm(reference.linear_attention(q * self.head_dim ** -0.5, k, v))


class MesaNet(Attention):
    """MesaNet (lla eq. 2) with L2-normalised q and k and ridge ``lam``; ``chunk``: positions per chunk of the
    exact solve (its cost, not its numbers)."""

    def __init__(self, dim, heads, *, lam: float = 1.0, chunk: int = 64, **kw):
        super().__init__(dim, heads, **{"qk_norm": "l2", **kw})
        self.lam, self.chunk = lam, chunk

    def attend(self, q, k, v, x):
        return regattn.mesanet(q, k, v, lam=self.lam, chunk=self.chunk)     # exact, in fp32 or better


def _gatedfwa(dim, heads, *, window, rope=True, **options):
    return GatedFWA(dim, heads, window, rope=rope, **options)


def _parallax(dim, heads, *, window=None, rope=True, **options):
    return Parallax(dim, heads, window=window, rope=rope, **{"rope_base": ROPE_BASE, **options})


def _lla(dim, heads, *, rope=True, **options):
    # CG runs up to D iterations (it stops per query at cg_tol): at D = 64 the layer's default of 8
    # leaves a relative error of 0.7-0.8 against the exact solve on these tasks at initialisation.
    options.setdefault("cg_iters", dim // heads)
    return LLA(dim, heads, rope=rope, **options)


def _decay(dim, heads, *, rope=None, **options):
    return Retention(dim, heads, **options)


def _bd_lla(dim, heads, *, blocks=4, **options):
    return _lla(dim, heads, blocks=blocks, **options)


MIXERS = {
    "softmax": Softmax,
    "swa": Softmax,
    "gatedfwa": _gatedfwa,
    "parallax": _parallax,
    "lla": _lla,
    "bd_lla": _bd_lla,
    "linear": Linear,
    "mesanet": MesaNet,
    "decay": _decay,
}
WINDOWED = ("swa", "gatedfwa")
MIXER_NAMES = tuple(sorted(MIXERS)) + BASELINES


def options_for(name: str, options: dict) -> dict:
    """The options of ``options`` that reach the mixer ``name``: every ``key``, and every ``name.key`` as ``key``
    (it wins over a plain ``key``); an ``other.key`` is the mixer ``other``'s (ValueError if no mixer is named so)."""
    plain, own = {}, {}
    for key, value in options.items():
        mixer, dot, option = key.partition(".")
        if not dot:
            plain[key] = value
        elif mixer not in MIXER_NAMES:
            raise ValueError(f"mixer option {key!r}: {mixer!r} names no mixer; expected one of {list(MIXER_NAMES)}")
        elif mixer == name:
            own[option] = value
    return {**plain, **own}


def build_mixer(name: str, dim: int, heads: int, *, seq_len: int | None = None, **options) -> nn.Module:
    """The mixer ``name`` of :data:`MIXER_NAMES` at width ``dim`` with ``heads`` heads.

    ``options`` go to the mixer (``window``, ``lam``, ``blocks``, ``rope``, ...; ``name.key`` to this mixer
    alone, see :func:`options_for`); the windowed mixers default to ``window = max(1, seq_len // 2)``. A
    baseline without its extra raises ImportError.
    """
    options = options_for(name, options)
    if name in BASELINES:
        return build_baseline(name, dim, heads, **options)
    if name not in MIXERS:
        raise ValueError(f"mixer: expected one of {list(MIXER_NAMES)}, got {name!r}")
    if name in WINDOWED and options.get("window") is None:
        if seq_len is None:
            raise ValueError(f"seq_len: mixer {name!r} needs a window or seq_len to default it")
        options["window"] = max(1, seq_len // 2)
    return MIXERS[name](dim, heads, **options)
