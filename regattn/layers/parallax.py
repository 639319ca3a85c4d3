"""The Parallax attention layer (parallax.txt Sections 3.1, 4.3 and Appendix F.1) with a generation cache.

Per query head ``h`` (heads grouped as in GQA; ``W_R`` shares ``W_Q``'s head dim and grouping)::

    q   = rope(norm(x W_Q)),  k = rope(norm(x W_K)),  v = x W_V
    rho = g * rope?(norm(x W_R))        g = sigmoid(x w_g) per head when probe_gate, else 1
    o   = Parallax(q, rho, k, v)        eq. 14: softmax attention plus the covariance correction
    y   = concat_h(o) W_O

``zero_init_probe=True`` starts the probe's gain (``r_norm.weight``, the learnable per-channel gain after
the RMSNorm on rho) at zero and leaves ``W_R`` at its normal initialisation: ``rho = 0``, so the layer is
softmax attention and a Transformer layer converted to Parallax computes the same function at the start.
The output is linear in rho (eq. 14), so it moves smoothly with the gain, and the gradients of the gain and
of ``W_R`` are of the order of the other projections' (``W_R = 0`` under the RMSNorm would instead divide
by ``sqrt(norm_eps)``: a discontinuous layer with huge gradients).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from regattn.layers.checks import check_layer_input, check_options, head_layout
from regattn.layers.norm import RMSNorm
from regattn.layers.rope import RotaryEmbedding, norm_rope
from regattn.layers.padding import attend_left_padded, ragged_cache, trimmed_start
from regattn.ops._common.checks import check_window
from regattn.ops.parallax.api import parallax, parallax_decode


@dataclass
class ParallaxCache:
    """Keys and values a later token can see: ``k: [B, n, H, D]``, ``v: [B, n, H, D]``; ``pos`` tokens seen.

    With a window only the last ``window`` positions are kept. ``start: [B]``: the padding slots
    that open each row of a left-padded batch (None: no padding).
    """
    k: torch.Tensor
    v: torch.Tensor
    pos: int
    start: torch.Tensor | None = None


class Parallax(nn.Module):
    """Parallax attention layer: ``x: [B, T, d_model] -> [B, T, d_model]``.

    Args:
        d_model: model width.
        num_heads: query (and probe) heads ``HQ``.
        num_kv_heads: key/value heads ``H`` (``HQ % H == 0``); defaults to ``num_heads``.
        head_dim: defaults to ``d_model // num_heads``.
        window: sliding window (keys including the query's own); None for full causal attention.
        rope: rotate q and k by position; ``rope_probe`` rotates rho as well (the paper's choice).
        rope_base: RoPE frequency base, finite and > 0 (Qwen3 and the paper: 1e6).
        probe_gate: scale rho by a learned per-head ``sigmoid(x w_g)`` (Section 4.3).
        zero_init_probe: start the probe's gain ``r_norm.weight`` at zero (the layer starts as softmax attention).
        norm_eps: RMSNorm epsilon for q, k and rho.
        backend: passed to the ops (``"auto" | "torch" | "triton"``).
    """

    def __init__(self, d_model: int, num_heads: int, *, num_kv_heads: int | None = None,
                 head_dim: int | None = None, window: int | None = None, rope: bool = True,
                 rope_probe: bool = True, rope_base: float = 1e6, probe_gate: bool = False,
                 zero_init_probe: bool = False, norm_eps: float = 1e-6, backend: str = "auto"):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = head_layout(d_model, num_heads, num_kv_heads, head_dim)
        self.window = check_window(window)
        self.backend = check_options(
            backend=backend, positive=dict(rope_base=rope_base, norm_eps=norm_eps),
            flags=dict(rope=rope, rope_probe=rope_probe, probe_gate=probe_gate, zero_init_probe=zero_init_probe))
        eps = float(norm_eps)
        HQ, H, D = num_heads, self.num_kv_heads, self.head_dim
        self.q_proj = nn.Linear(d_model, HQ * D, bias=False)
        self.k_proj = nn.Linear(d_model, H * D, bias=False)
        self.v_proj = nn.Linear(d_model, H * D, bias=False)
        self.r_proj = nn.Linear(d_model, HQ * D, bias=False)   # W_R
        self.o_proj = nn.Linear(HQ * D, d_model, bias=False)
        self.q_norm = RMSNorm(D, eps=eps)
        self.k_norm = RMSNorm(D, eps=eps)
        self.r_norm = RMSNorm(D, eps=eps)
        self.gate_proj = nn.Linear(d_model, HQ, bias=True) if probe_gate else None
        self.rotary = RotaryEmbedding(D, base=rope_base) if rope else None
        self.rope_probe = rope and rope_probe
        if zero_init_probe:
            nn.init.zeros_(self.r_norm.weight)

    # ------------------------------------------------------------------------------------------ pieces
    def projections(self, x, offset: int = 0, cu_seqlens=None):
        """``q, rho: [B, T, HQ, D]`` and ``k, v: [B, T, H, D]`` for tokens starting at position ``offset``.

        Each of q, k and rho is normalised and rotated in fp32 and rounded once to the projections' dtype
        (:func:`regattn.layers.rope.norm_rope`)."""
        B, T, _ = x.shape
        HQ, H, D = self.num_heads, self.num_kv_heads, self.head_dim
        angles = None if self.rotary is None else self.rotary.angles(T, offset, x.device, cu_seqlens)
        q = norm_rope(self.q_proj(x).view(B, T, HQ, D), self.q_norm, angles, backend=self.backend)
        k = norm_rope(self.k_proj(x).view(B, T, H, D), self.k_norm, angles, backend=self.backend)
        v = self.v_proj(x).view(B, T, H, D)
        rho = norm_rope(self.r_proj(x).view(B, T, HQ, D), self.r_norm, angles if self.rope_probe else None,
                        backend=self.backend)
        if self.gate_proj is not None:
            rho = rho * torch.sigmoid(self.gate_proj(x))[..., None].to(rho.dtype)
        return q, rho, k, v

    def _output(self, o):
        B, T = o.shape[:2]
        return self.o_proj(o.reshape(B, T, self.num_heads * self.head_dim))

    # ------------------------------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor, *, cu_seqlens: torch.Tensor | None = None,
                max_seqlen: int | None = None) -> torch.Tensor:
        """``x: [B, T, d_model]`` (``B == 1`` with packed ``cu_seqlens``) -> ``[B, T, d_model]``.

        ``max_seqlen``: the longest packed sequence, if known (then no offset is read on the host)."""
        check_layer_input(x, self.q_proj)
        q, rho, k, v = self.projections(x, 0, cu_seqlens)
        o = parallax(q, rho, k, v, window=self.window, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                     backend=self.backend)
        return self._output(o)

    # ------------------------------------------------------------------------------------------ generation
    def prefill(self, x: torch.Tensor, start: torch.Tensor | None = None) -> tuple[torch.Tensor, ParallaxCache]:
        """Run the prompt ``x: [B, T, d_model]``; returns the output and the cache for :meth:`step`.

        ``start: [B]`` (int64): rows left-padded with ``start[b]`` slots, whose outputs are to be ignored.
        """
        check_layer_input(x, self.q_proj)
        q, rho, k, v = self.projections(x, 0)
        o = attend_left_padded(parallax, start, q, rho, k, v, window=self.window, backend=self.backend)
        return self._output(o), self._keep(k, v, x.shape[1], start)

    def _keep(self, k, v, pos, start):
        n = k.shape[1]
        if self.window is not None and n > self.window:
            k, v = k[:, -self.window:], v[:, -self.window:]
        return ParallaxCache(k=k, v=v, pos=pos, start=trimmed_start(start, n, k.shape[1]))

    def step(self, x: torch.Tensor, cache: ParallaxCache | None) -> tuple[torch.Tensor, ParallaxCache]:
        """New tokens ``x: [B, Tn, d_model]`` after ``cache`` (None: none yet), through the decode kernel."""
        check_layer_input(x, self.q_proj)
        if cache is None:
            return self.prefill(x)
        q, rho, k, v = self.projections(x, cache.pos)
        keys, values = torch.cat([cache.k, k], 1), torch.cat([cache.v, v], 1)
        if cache.start is None:
            o = parallax_decode(q, rho, keys, values, window=self.window, backend=self.backend)
        else:  # every row's length is at most the cache's: no length is read on the host
            real_k, real_v, lengths = ragged_cache(keys, values, cache.start)
            o = parallax_decode(q, rho, real_k, real_v, cache_seqlens=lengths, max_seqlen=real_k.shape[1],
                                window=self.window, backend=self.backend)
        return self._output(o), self._keep(keys, values, cache.pos + x.shape[1], cache.start)
