"""The Local Linear Attention layer (lla-local-linear-attention.txt Section 2.3, Appendix C eq. 27).

Per query head::

    q, k     = norm(x W_q), norm(x W_k)         (optional per-head RMS norm, the paper's QK normalisation)
    v        = x W_v
    lambda_i = l + (1 - l) sigmoid(x_i W_lambda) (eq. 27 with a floor l = lam_min: one ridge per head
                                                  or per head dimension)
    o        = LLA(q, k, v; lambda, window, blocks, CG iterations)
    y        = concat_h o W_O

Generation keeps every key and value (the last ``window`` with SW-LLA): LLA needs the whole
context per query, like softmax attention.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from regattn.layers.checks import check_fraction, check_layer_input, check_options, head_layout
from regattn.layers.norm import RMSNorm
from regattn.layers.rope import RotaryEmbedding, norm_rope
from regattn.ops._common.checks import check_choice, check_int, check_positive, check_window
from regattn.ops.lla.api import check_cg_gradient, lla_dispatch


@dataclass
class LLACache:
    """Keys ``[B, n, H, D]`` and values ``[B, n, H, D]`` a new token can see; ``pos`` tokens seen so far."""
    k: torch.Tensor
    v: torch.Tensor
    pos: int


class LLA(nn.Module):
    """LLA attention layer: ``x: [B, T, d_model] -> [B, T, d_model]``.

    Args:
        d_model: model width.
        num_heads: query heads ``HQ``; num_kv_heads: key/value heads ``H`` (GQA), defaults to ``HQ``.
        head_dim: defaults to ``d_model // num_heads``.
        lam: ``"head"`` (one ridge per query head and token) or ``"dim"`` (per head dimension), eq. 27.
        window: SW-LLA window, or None; blocks: BD-LLA block count ``g``, or None.
        cg_iters: CG iterations; None (the default) solves exactly. At initialisation (d_model 512, 8 heads of
            64, T 512, fp32 on CPU) 8 iterations left the output 23% away from the exact solve, 16 left 4%.
        cg_tol: CG relative residual tolerance (>= 0).
        cg_gradient: ``"implicit"`` (the kernels') or ``"unrolled"`` (autograd through the iterations, torch
            backend): see :func:`regattn.lla`.
        lam_min: the ridge's floor ``l`` in (0, 1). Eq. 27's bare sigmoid can reach 0 (it underflows)
            and, for a query with fewer keys than dimensions, the estimator's denominator is about
            ``lam / |k - q|^2``: in fp32 it keeps about ``eps |k - q|^2 / lam`` relative error, 1e-4
            at the default with unit-RMS q and k of 8 dims, and loses its sign below about 1e-6.
        qk_norm: RMS-normalise q and k per head; rope: rotate q and k by position.
        backend: passed to the op.
    """

    def __init__(self, d_model: int, num_heads: int, *, num_kv_heads: int | None = None,
                 head_dim: int | None = None, lam: str = "head", window: int | None = None,
                 blocks: int | None = None, cg_iters: int | None = None, cg_tol: float = 1e-6,
                 cg_gradient: str = "implicit", qk_norm: bool = True, rope: bool = False, lam_min: float = 1e-2,
                 backend: str = "auto"):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = head_layout(d_model, num_heads, num_kv_heads, head_dim)
        self.lam_mode = check_choice("lam", lam, ("head", "dim"))
        self.window = check_window(window)
        if blocks is not None and self.head_dim % check_int("blocks", blocks, minimum=1):
            raise ValueError(f"blocks: expected a divisor of head_dim = {self.head_dim}, got {blocks}")
        if cg_iters is not None:
            check_int("cg_iters", cg_iters, minimum=1)
        self.blocks, self.cg_iters = blocks, cg_iters
        self.cg_tol = check_positive("cg_tol", cg_tol, allow_zero=True)
        self.lam_min = check_fraction("lam_min", lam_min)
        self.backend = check_options(backend=backend, flags=dict(qk_norm=qk_norm, rope=rope))
        self.cg_gradient = check_cg_gradient(cg_gradient, backend)
        HQ, H, D = num_heads, self.num_kv_heads, self.head_dim
        self.q_proj = nn.Linear(d_model, HQ * D, bias=False)
        self.k_proj = nn.Linear(d_model, H * D, bias=False)
        self.v_proj = nn.Linear(d_model, H * D, bias=False)
        self.lam_proj = nn.Linear(d_model, HQ * (D if lam == "dim" else 1))
        self.o_proj = nn.Linear(HQ * D, d_model, bias=False)
        self.q_norm = RMSNorm(D) if qk_norm else nn.Identity()
        self.k_norm = RMSNorm(D) if qk_norm else nn.Identity()
        self.rotary = RotaryEmbedding(D) if rope else None

    def ridge(self, x: torch.Tensor) -> torch.Tensor:
        """``lambda = l + (1 - l) sigmoid(x W_lambda)``: ``[B, T, HQ]`` or ``[B, T, HQ, D]`` in x's dtype."""
        lam = self.lam_min + (1 - self.lam_min) * torch.sigmoid(self.lam_proj(x))
        B, T = x.shape[:2]
        return lam.view(B, T, self.num_heads, self.head_dim) if self.lam_mode == "dim" else lam

    def _qkv(self, x, offset: int):
        B, T, _ = x.shape
        angles = None if self.rotary is None else self.rotary.angles(T, offset, x.device)
        q = norm_rope(self.q_proj(x).view(B, T, self.num_heads, self.head_dim), self.q_norm, angles,
                      backend=self.backend)
        k = norm_rope(self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim), self.k_norm, angles,
                      backend=self.backend)
        return q, k, self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim)

    def _solver(self):
        return dict(scale=self.head_dim ** -0.5, window=self.window, blocks=self.blocks, cg_iters=self.cg_iters,
                    cg_tol=self.cg_tol, backend=self.backend)

    def _out(self, o):
        B, T = o.shape[:2]
        return self.o_proj(o.reshape(B, T, self.num_heads * self.head_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x: [B, T, d_model] -> [B, T, d_model]``."""
        return self.prefill(x)[0]

    def prefill(self, x: torch.Tensor) -> tuple[torch.Tensor, LLACache]:
        """Run the prompt; returns the output and the cache for :meth:`step`."""
        check_layer_input(x, self.q_proj)
        q, k, v = self._qkv(x, 0)
        o = lla_dispatch(q, k, v, self.ridge(x), cg_gradient=self.cg_gradient, **self._solver())
        return self._out(o), self._keep(k, v, x.shape[1])

    def step(self, x: torch.Tensor, cache: LLACache) -> tuple[torch.Tensor, LLACache]:
        """New tokens ``x: [B, n, d_model]`` after the cached ones; returns their output and the new cache."""
        check_layer_input(x, self.q_proj)
        q, k, v = self._qkv(x, cache.pos)
        k_all, v_all = torch.cat([cache.k, k], 1), torch.cat([cache.v, v], 1)
        with torch.no_grad():
            o = lla_dispatch(q, k_all, v_all, self.ridge(x), op="lla_decode", **self._solver())
        return self._out(o), self._keep(k_all, v_all, cache.pos + x.shape[1])

    def _keep(self, k, v, pos):
        n = k.shape[1] if self.window is None else min(self.window, k.shape[1])
        return LLACache(k=k[:, -n:], v=v[:, -n:], pos=pos)
