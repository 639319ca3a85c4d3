"""Retention: a RetNet / TransNormer-style layer on exponentially decaying causal linear attention.

    q, k = x W_q, x W_k          [B, T, H, R]   (b = q * R^-0.5, c = k: leetdecoding.txt Section 2.2)
    v, g = x W_v, x W_g          [B, T, H, D]
    o    = decay_linear_attention(b, c, v, gamma)           gamma fixed per head
    y    = (RMSNorm_head(o) * silu(g)) W_o                  [B, T, dim]

The per-head decays follow RetNet: ``gamma_h = 1 - 2^(-5 - h)`` unless given. Generation keeps
the state ``[B, H, R, D]`` (float32): ``forward(x, state=..., return_state=True)`` prefills a
prompt (or continues from a state) and ``step(x_t, state)`` decodes one token in O(H * R * D).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from regattn.layers.checks import check_layer_input, check_options, per_head_dim
from regattn.ops._common.checks import check_int
from regattn.ops.decay.api import check_method, decay_linear_attention, decay_linear_prefill, decay_linear_step


def retnet_gammas(num_heads: int) -> torch.Tensor:
    """RetNet's per-head decays ``1 - 2^(-5 - h)``, ``h = 0 .. H-1`` (float32, in (0, 1])."""
    return (1 - 2.0 ** (-5 - torch.arange(num_heads, dtype=torch.float64))).float()


def check_gammas(gammas, num_heads: int) -> torch.Tensor:
    """``gammas``: ``num_heads`` numbers in (0, 1], a tensor or a sequence; returns a float32 copy."""
    try:
        values = torch.as_tensor(gammas, dtype=torch.float32).detach().clone()
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(f"gammas: expected a tensor or a sequence of {num_heads} numbers, "
                        f"got {type(gammas).__name__}") from None
    if values.shape != (num_heads,) or not bool(((values > 0) & (values <= 1)).all()):
        raise ValueError(f"gammas: expected {num_heads} values in (0, 1], got {values.tolist()}")
    return values


class Retention(nn.Module):
    """Decaying linear attention layer with output norm and gate.

    Args:
        dim: model width.
        num_heads: H.
        key_dim: R, the width of b = q and c = k per head (default ``dim // num_heads``).
        head_dim: D, the width of v per head (default ``dim // num_heads``).
        gammas: ``[H]`` decays in (0, 1] (default ``retnet_gammas(H)``); a buffer, not trained.
        method: the decay method (``"auto"`` picks the fastest for the input).
        backend: ``"auto" | "torch" | "triton"``.
        eps: RMSNorm epsilon.
    """

    def __init__(self, dim: int, num_heads: int, *, key_dim: int | None = None, head_dim: int | None = None,
                 gammas: torch.Tensor | None = None, method: str = "auto", backend: str = "auto",
                 eps: float = 1e-6, bias: bool = False):
        super().__init__()
        check_int("dim", dim, minimum=1)
        self.num_heads = H = check_int("num_heads", num_heads, minimum=1)
        self.key_dim = R = per_head_dim("key_dim", key_dim, dim, H, width_name="dim")
        self.head_dim = D = per_head_dim("head_dim", head_dim, dim, H, width_name="dim")
        self.backend = check_options(backend=backend, flags=dict(bias=bias), positive=dict(eps=eps))
        self.method, self.eps = check_method(method), float(eps)
        self.q_proj = nn.Linear(dim, H * R, bias=bias)
        self.k_proj = nn.Linear(dim, H * R, bias=bias)
        self.v_proj = nn.Linear(dim, H * D, bias=bias)
        self.g_proj = nn.Linear(dim, H * D, bias=bias)
        self.o_proj = nn.Linear(H * D, dim, bias=bias)
        self.norm_weight = nn.Parameter(torch.ones(D))
        self.register_buffer("gammas", retnet_gammas(H) if gammas is None else check_gammas(gammas, H))

    def _project(self, x):
        """``x [..., dim] -> b, c [..., H, R]``, ``v, g [..., H, D]``."""
        H, R, D = self.num_heads, self.key_dim, self.head_dim
        shape = x.shape[:-1]
        b = self.q_proj(x).view(*shape, H, R) * R ** -0.5
        c = self.k_proj(x).view(*shape, H, R)
        v = self.v_proj(x).view(*shape, H, D)
        g = self.g_proj(x).view(*shape, H, D)
        return b, c, v, g

    def _output(self, o, g):
        """Per-head RMSNorm of ``o``, gate ``silu(g)``, output projection; ``o, g: [..., H, D]``."""
        acc = torch.promote_types(o.dtype, torch.float32)
        o = F.rms_norm(o.to(acc), (self.head_dim,), self.norm_weight.to(acc), self.eps).to(g.dtype)
        y = o * F.silu(g)
        return self.o_proj(y.flatten(-2))

    def forward(self, x, *, state=None, return_state: bool = False):
        """``x: [B, T, dim] -> y: [B, T, dim]``; with ``return_state`` (or a ``state [B, H, R, D]`` to
        continue from) also the state after the last token: ``(y, state)``."""
        check_layer_input(x, self.q_proj, "[B, T, dim]")
        b, c, v, g = self._project(x)
        gam = self.gammas.to(x.device)
        if state is None and not return_state:
            o = decay_linear_attention(b, c, v, gam, method=self.method, backend=self.backend)
            return self._output(o, g)
        o, state = decay_linear_prefill(b, c, v, gam, initial_state=state, method=self.method, backend=self.backend)
        return self._output(o, g), state

    def step(self, x_t, state=None):
        """One decoding token: ``x_t: [B, dim]``, ``state: [B, H, R, D]`` or None -> ``(y_t [B, dim], state)``."""
        check_layer_input(x_t, self.q_proj, "[B, dim]", name="x_t")
        b, c, v, g = self._project(x_t)
        o, state = decay_linear_step(state, b, c, v, self.gammas.to(x_t.device))
        return self._output(o, g), state
