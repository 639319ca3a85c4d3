"""The GatedFWA attention layer (gatedfwa.md Section 3.3, Figure 7 middle) with a generation cache.

Per head ``h``::

    q, k      = norm(x W_q), norm(x W_k)              (per-head RMS-normalised query and key)
    v         = x W_v
    h_t       = x_t W_g + b_g                         (gate pre-activation, eq. 10)
    beta_t    = 1 + elu(x_t W_beta), W_beta = 0 at init
    u         = preprocess(h, beta)                   (eq. 9-11: -cumsum(softplus(beta h) / (beta + eps)))
    o~        = GatedFWA(q, k, v, u; window w)        (eq. 12)
    y         = (swish(x W_G) * concat_h norm(o~_h)) W_O   (output_gate=False: y = concat_h o~_h W_O)

Generation keeps the last ``w`` keys, values and gate values ``u_j`` plus the running ``u``: that is
all a query can see, so one step costs ``O(w)`` whatever the position.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from regattn.layers.checks import check_layer_input, check_options, head_layout
from regattn.layers.norm import RMSNorm
from regattn.layers.padding import attend_left_padded, trimmed_start
from regattn.ops._common.checks import check_int, check_window
from regattn.ops.gatedfwa.api import gate_dispatch, gatedfwa
from regattn.ops.nsa import nsa_attention
from regattn.layers.rope import RotaryEmbedding, norm_rope


@dataclass
class GatedFWACache:
    """What one step of generation needs: the last ``w`` positions of one layer.

    ``k: [B, n, H, D]``, ``v: [B, n, H, D]``, ``u: [B, n, HQ]`` (the gate values of those keys, fp32),
    ``u_last: [B, HQ]`` (the running cumulative gate), ``pos``: tokens seen so far, ``start: [B]``: the
    padding slots that open each row of a left-padded batch (None: no padding).
    """
    k: torch.Tensor
    v: torch.Tensor
    u: torch.Tensor
    u_last: torch.Tensor
    pos: int
    start: torch.Tensor | None = None


def gate_bias_init(num_heads: int, low: float = 1e-3, high: float = 1e-1) -> torch.Tensor:
    """``b_g`` whose per-head decay ``softplus(b_g)`` spreads log-uniformly over ``[low, high]``.

    With ``W_g`` near zero at init each head then forgets at its own rate: horizons from about
    10 to 1000 tokens (a choice of this library; the paper leaves the gate bias init open).
    """
    if num_heads == 1:
        rates = torch.tensor([math.sqrt(low * high)])
    else:
        rates = torch.logspace(math.log10(low), math.log10(high), num_heads)
    return torch.log(torch.expm1(rates))


class GatedFWA(nn.Module):
    """GatedFWA attention layer: ``x: [B, T, d_model] -> [B, T, d_model]``.

    Args:
        d_model: model width.
        num_heads: query heads ``HQ``.
        window: sliding window ``w`` (keys including the query's own); None for full causal.
        num_kv_heads: key/value heads ``H`` (``HQ % H == 0``); defaults to ``num_heads``.
        head_dim: defaults to ``d_model // num_heads``.
        rope: rotate q and k by position (RoPE) after their norm.
        eps: the gate's ``eps`` (eq. 9).
        output_gate: the paper's output path, the per-head RMSNorm of ``o~`` times ``swish(x W_G)``; False
            joins the heads as they are (an ablation).
        decay_low, decay_high: the range of the heads' forget rates ``softplus(b_g)`` at init
            (:func:`gate_bias_init`).
        backend: passed to the ops (``"auto" | "torch" | "triton"``).
    """

    GATE_PROJECTIONS = ("g_proj", "beta_proj")  # trained with Adam's update under Muon (regattn.train.optim)

    def __init__(self, d_model: int, num_heads: int, window: int | None, *, num_kv_heads: int | None = None,
                 head_dim: int | None = None, rope: bool = False, eps: float = 1e-6, output_gate: bool = True,
                 decay_low: float = 1e-3, decay_high: float = 1e-1, backend: str = "auto"):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = head_layout(d_model, num_heads, num_kv_heads, head_dim)
        self.window = check_window(window)
        self.backend = check_options(backend=backend, flags=dict(rope=rope, output_gate=output_gate),
                                     positive=dict(eps=eps, decay_low=decay_low, decay_high=decay_high))
        if decay_high < decay_low:
            raise ValueError(f"decay_high: expected at least decay_low = {decay_low}, got {decay_high}")
        self.eps = float(eps)
        self.output_gate = output_gate
        HQ, H, D = num_heads, self.num_kv_heads, self.head_dim
        self.q_proj = nn.Linear(d_model, HQ * D, bias=False)
        self.k_proj = nn.Linear(d_model, H * D, bias=False)
        self.v_proj = nn.Linear(d_model, H * D, bias=False)
        self.g_proj = nn.Linear(d_model, HQ)                  # h = x W_g + b_g
        self.beta_proj = nn.Linear(d_model, HQ, bias=False)   # beta = 1 + elu(x W_beta)
        if output_gate:
            self.out_gate = nn.Linear(d_model, HQ * D, bias=False)
        self.o_proj = nn.Linear(HQ * D, d_model, bias=False)
        self.q_norm = RMSNorm(D)
        self.k_norm = RMSNorm(D)
        if output_gate:
            self.o_norm = RMSNorm(D)
        self.rotary = RotaryEmbedding(D) if rope else None
        with torch.no_grad():
            nn.init.zeros_(self.beta_proj.weight)
            self.g_proj.bias.copy_(gate_bias_init(HQ, decay_low, decay_high))

    # ------------------------------------------------------------------------------------------ pieces
    def _qkv(self, x, offset: int = 0, cu_seqlens=None):
        """``q, k`` normalised and rotated for tokens from position ``offset``, and ``v``."""
        B, T, _ = x.shape
        angles = None if self.rotary is None else self.rotary.angles(T, offset, x.device, cu_seqlens)
        q = norm_rope(self.q_proj(x).view(B, T, self.num_heads, self.head_dim), self.q_norm, angles,
                      backend=self.backend)
        k = norm_rope(self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim), self.k_norm, angles,
                      backend=self.backend)
        return q, k, self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim)

    def gate_inputs(self, x):
        """``(h, beta)``, each ``[B, T, HQ]``."""
        return self.g_proj(x), 1 + F.elu(self.beta_proj(x))

    def _output(self, x, o):
        """``(swish(x W_G) * per-head-normalised o) W_O`` (without ``output_gate``: ``o W_O``); ``o: [B, T, HQ, D]``."""
        B, T = o.shape[:2]
        if not self.output_gate:
            return self.o_proj(o.reshape(B, T, self.num_heads * self.head_dim))
        o = self.o_norm(o).reshape(B, T, self.num_heads * self.head_dim)
        return self.o_proj(F.silu(self.out_gate(x)) * o)

    # ------------------------------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor, *, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        """``x: [B, T, d_model]`` (``B == 1`` with packed ``cu_seqlens``) -> ``[B, T, d_model]``."""
        return self._prefill(x, cu_seqlens=cu_seqlens)[0]

    def _prefill(self, x, *, cu_seqlens=None, start=None):
        """Output and ``(k, v, u)``; ``start``: left padding (the gate differences ``u_i - u_j`` of real
        tokens do not depend on the padding before them)."""
        check_layer_input(x, self.q_proj)
        q, k, v = self._qkv(x, 0, cu_seqlens)
        h, beta = self.gate_inputs(x)
        u = gate_dispatch(h, beta, eps=self.eps, backend=self.backend)
        o = attend_left_padded(gatedfwa, start, q, k, v, u, window=self.window, cu_seqlens=cu_seqlens,
                               backend=self.backend)
        return self._output(x, o), (k, v, u)

    # ------------------------------------------------------------------------------------------ generation
    def prefill(self, x: torch.Tensor, start: torch.Tensor | None = None) -> tuple[torch.Tensor, GatedFWACache]:
        """Run the prompt ``x: [B, T, d_model]``; returns the output and the cache for :meth:`step`.

        ``start: [B]`` (int64): rows left-padded with ``start[b]`` slots, whose outputs are to be ignored.
        """
        y, (k, v, u) = self._prefill(x, start=start)
        return y, self._keep(k, v, u, x.shape[1], start)

    def _keep(self, k, v, u, pos, start=None):
        n = k.shape[1] if self.window is None else min(self.window, k.shape[1])
        return GatedFWACache(k=k[:, -n:], v=v[:, -n:], u=u[:, -n:], u_last=u[:, -1], pos=pos,
                             start=trimmed_start(start, k.shape[1], n))

    def _check_token(self, x: torch.Tensor) -> None:
        """``x`` as ``step`` takes it: the layer's input with one token."""
        check_layer_input(x, self.q_proj)
        if x.shape[1] != 1:
            raise ValueError(f"x: expected one token [B, 1, d_model], got shape {tuple(x.shape)}")

    def step(self, x: torch.Tensor, cache: GatedFWACache | None) -> tuple[torch.Tensor, GatedFWACache]:
        """One token ``x: [B, 1, d_model]`` after ``cache`` (None: the first token); O(w) work."""
        self._check_token(x)
        if cache is None:
            return self.prefill(x)
        o, new, _ = self._local_step(x, cache)
        return self._output(x, o), new

    def _local_step(self, x, cache: GatedFWACache):
        """``(o, new cache, (q, k, v))`` of one checked token: the attention output ``o: [B, 1, HQ, D]`` over
        the cached window, and the token's rotated query, key and value."""
        q, k, v = self._qkv(x, cache.pos)
        h, beta = self.gate_inputs(x)
        minus_alpha = gate_dispatch(h, beta, eps=self.eps, backend="torch")  # u of one token is -alpha
        u_t = cache.u_last[:, None] + minus_alpha.to(cache.u.dtype)             # [B, 1, HQ]
        keys, values = torch.cat([cache.k, k], 1), torch.cat([cache.v, v], 1)
        gates = torch.cat([cache.u, u_t], 1)
        n = keys.shape[1]
        if self.window is not None:
            keys, values, gates = keys[:, -self.window:], values[:, -self.window:], gates[:, -self.window:]
        start = trimmed_start(cache.start, n, keys.shape[1])
        o = self._attend_one(q, keys, values, gates, u_t, start)
        new = GatedFWACache(k=keys, v=values, u=gates, u_last=u_t[:, 0], pos=cache.pos + 1, start=start)
        return o, new, (q, k, v)

    def _attend_one(self, q, keys, values, gates, u_t, start=None):
        """Softmax over the cached window for one query: ``q: [B, 1, HQ, D]`` -> ``[B, 1, HQ, D]``;
        the first ``start[b]`` keys of row ``b`` (left padding) are left out."""
        groups = self.num_heads // self.num_kv_heads
        keys = keys.repeat_interleave(groups, 2)
        values = values.repeat_interleave(groups, 2)
        acc = torch.promote_types(q.dtype, torch.float32)
        logits = torch.einsum("bqhd,bshd->bhqs", q.to(acc), keys.to(acc)) * self.head_dim ** -0.5
        logits = logits + (u_t.transpose(1, 2)[..., None] - gates.transpose(1, 2)[:, :, None, :]).to(acc)
        if start is not None:
            padded = torch.arange(keys.shape[1], device=keys.device) < start[:, None]          # [B, n]
            logits = logits.masked_fill(padded[:, None, None, :], float("-inf"))
        p = torch.softmax(logits, dim=-1)
        return torch.einsum("bhqs,bshd->bqhd", p, values.to(acc)).to(q.dtype)


@dataclass
class GatedFWANSACache:
    """Generation state of :class:`GatedFWANSA`: the local branch's :class:`GatedFWACache`, every key and
    value so far (the selection may pick any block; ``k, v: [B, pos, H, D]``) and the compressed blocks
    completed so far (``kc, vc: [B, n, H, D]``)."""
    local: GatedFWACache
    k: torch.Tensor
    v: torch.Tensor
    kc: torch.Tensor
    vc: torch.Tensor


class GatedFWANSA(GatedFWA):
    """GatedFWA with NSA's compression and selection branches (gatedfwa.md Appendix B, eq. 15-26).

    ``o_t = g_cmp o_cmp + g_slc o_slc + g_loc o_gatedfwa`` per head, with sigmoid branch gates from ``x``:

    * compression: blocks of ``block_cmp`` tokens with stride ``stride_cmp``; a learnable MLP ``phi``
      maps each block (plus an intra-block position embedding) to one key and one value; query ``t``
      sees the blocks that end at or before ``t``.
    * selection: block importance = the compression attention probabilities summed over the
      compressed blocks that overlap each selection block of ``block_slc`` tokens (and over the query
      heads of a key/value group); the top ``topk`` blocks that start at or before ``t`` are kept, the
      block holding ``t`` always among them; plain causal softmax attention over their tokens.
    * local: the GatedFWA kernel over the last ``window`` tokens.

    Compression and selection run :func:`regattn.ops.nsa.nsa_attention` (linear memory, no ``[T, T]``
    mask; spec :mod:`regattn.reference.nsa`); the local branch runs the fused kernel. Generation
    (:meth:`prefill`, :meth:`step`) keeps a :class:`GatedFWANSACache`: a step attends its one query over the
    compressed blocks and its selected blocks, ``O(T / stride_cmp + topk block_slc + w)`` work.

    Args: as :class:`GatedFWA`, plus ``block_cmp``, ``stride_cmp`` (``<= block_cmp``), ``block_slc``, ``topk``.
    """

    GATE_PROJECTIONS = GatedFWA.GATE_PROJECTIONS + ("branch_gate",)

    def __init__(self, d_model: int, num_heads: int, window: int | None, *, block_cmp: int = 32,
                 stride_cmp: int = 16, block_slc: int = 64, topk: int = 16, **kw):
        super().__init__(d_model, num_heads, window, **kw)
        self.block_cmp = check_int("block_cmp", block_cmp, minimum=1)
        self.stride_cmp = check_int("stride_cmp", stride_cmp, minimum=1)
        if stride_cmp > block_cmp:
            raise ValueError(f"stride_cmp: expected at most block_cmp = {block_cmp}, got {stride_cmp}")
        self.block_slc = check_int("block_slc", block_slc, minimum=1)
        self.topk = check_int("topk", topk, minimum=1)
        D = self.head_dim
        self.cmp_pos = nn.Parameter(torch.zeros(block_cmp, D))
        self.phi_k = nn.Sequential(nn.Linear(block_cmp * D, D), nn.SiLU(), nn.Linear(D, D))
        self.phi_v = nn.Sequential(nn.Linear(block_cmp * D, D), nn.SiLU(), nn.Linear(D, D))
        self.branch_gate = nn.Linear(d_model, 3 * num_heads)

    def compress(self, x: torch.Tensor, phi: nn.Module) -> torch.Tensor:
        """``[B, T, H, D] -> [B, n_cmp, H, D]``: ``phi`` of every block of ``block_cmp`` tokens (none when
        ``T < block_cmp``).

        Blocks start every ``stride_cmp`` tokens; ``cmp_pos`` is added as an intra-block position embedding.
        """
        B, T, H, D = x.shape
        if T < self.block_cmp:
            return x.new_zeros(B, 0, H, D)
        blocks = x.unfold(1, self.block_cmp, self.stride_cmp)               # [B, n, H, D, b]
        blocks = blocks.permute(0, 1, 2, 4, 3) + self.cmp_pos.to(x.dtype)   # [B, n, H, b, D]
        return phi(blocks.flatten(3))

    def _sparse(self, q, k, v, kc, vc, offset: int = 0):
        """``(o_cmp, o_slc)`` of the queries at ``offset ..`` over the keys ``k, v`` and blocks ``kc, vc``."""
        return nsa_attention(q, k, v, kc, vc, block_cmp=self.block_cmp, stride_cmp=self.stride_cmp,
                             block_slc=self.block_slc, topk=self.topk, scale=self.head_dim ** -0.5, offset=offset,
                             backend=self.backend)

    def _branches(self, x):
        """The three branch outputs and ``(k, v, u, kc, vc)``."""
        check_layer_input(x, self.q_proj)
        q, k, v = self._qkv(x, 0)
        h, beta = self.gate_inputs(x)
        u = gate_dispatch(h, beta, eps=self.eps, backend=self.backend)
        o_loc = gatedfwa(q, k, v, u, window=self.window, backend=self.backend)
        kc, vc = self.compress(k, self.phi_k), self.compress(v, self.phi_v)   # [B, n, H, D]
        o_cmp, o_slc = self._sparse(q, k, v, kc, vc)
        return (o_cmp, o_slc, o_loc), (k, v, u, kc, vc)

    def branches(self, x: torch.Tensor):
        """``(o_cmp, o_slc, o_loc)``, each ``[B, T, HQ, D]``, for ``x: [B, T, d_model]``."""
        return self._branches(x)[0]

    def _mix(self, x, o_cmp, o_slc, o_loc):
        g = torch.sigmoid(self.branch_gate(x)).view(*x.shape[:2], 3, self.num_heads, 1).to(o_loc.dtype)
        return self._output(x, g[:, :, 0] * o_cmp + g[:, :, 1] * o_slc + g[:, :, 2] * o_loc)

    def forward(self, x: torch.Tensor, *, cu_seqlens=None) -> torch.Tensor:
        """``x: [B, T, d_model] -> [B, T, d_model]`` (no packed sequences)."""
        if cu_seqlens is not None:
            raise ValueError("cu_seqlens: GatedFWANSA takes padded batches, got packed sequences")
        return self._mix(x, *self.branches(x))

    def prefill(self, x: torch.Tensor, start: torch.Tensor | None = None) -> tuple[torch.Tensor, GatedFWANSACache]:
        """Run the prompt ``x: [B, T, d_model]``; returns the output and the cache for :meth:`step`
        (no left padding: ``start`` must be None)."""
        if start is not None:
            raise ValueError("start: GatedFWANSA takes no left-padded batches, expected None")
        branches, (k, v, u, kc, vc) = self._branches(x)
        cache = GatedFWANSACache(local=self._keep(k, v, u, x.shape[1]), k=k, v=v, kc=kc, vc=vc)
        return self._mix(x, *branches), cache

    def step(self, x: torch.Tensor, cache: GatedFWANSACache | None) -> tuple[torch.Tensor, GatedFWANSACache]:
        """One token ``x: [B, 1, d_model]`` after ``cache`` (None: the first token)."""
        self._check_token(x)
        if cache is None:
            return self.prefill(x)
        t = cache.local.pos                                                   # the new token's position
        o_loc, local, (q, k, v) = self._local_step(x, cache.local)
        keys, values = torch.cat([cache.k, k], 1), torch.cat([cache.v, v], 1)
        kc, vc = cache.kc, cache.vc
        if t + 1 >= self.block_cmp and (t + 1 - self.block_cmp) % self.stride_cmp == 0:   # a block ends at t
            last = slice(t + 1 - self.block_cmp, t + 1)
            kc = torch.cat([kc, self.compress(keys[:, last], self.phi_k)], 1)
            vc = torch.cat([vc, self.compress(values[:, last], self.phi_v)], 1)
        o_cmp, o_slc = self._sparse(q, keys, values, kc, vc, offset=t)
        return self._mix(x, o_cmp, o_slc, o_loc), GatedFWANSACache(local=local, k=keys, v=values, kc=kc, vc=vc)
