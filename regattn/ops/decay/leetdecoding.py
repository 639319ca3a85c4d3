"""``causal_linear_decoder``: LeetDecoding's entry point (leetdecoding.txt Listing 2), the migration path.

Code written against LeetDecoding keeps its call, layout and method names::

    output = causal_linear_decoder(B, C, V, is_mask_weight=True, gamma=gamma, attn_method="block-based")

and runs ``regattn.decay_linear_attention`` underneath (``[B, H, T, X]`` transposed to ``[B, T, H, X]``
as views, gamma ``[H, 1]`` flattened to ``[H]``).
"""
from __future__ import annotations

import torch

from regattn.ops._common.checks import check_choice, check_tensor
from regattn.ops.decay.api import check_decay_inputs, decay_linear_attention

# LeetDecoding's method names (leetdecoding.txt Tables 1-2) -> regattn's; "auto" is regattn's own
ATTN_METHODS = {
    "vanilla": "vanilla",
    "causal-dot-product": "causal_dot_product",
    "block-based": "block_based",
    "recursion": "recursion",
    "lightningAttention-2": "lightning2",
    "FleetAttention": "fleet",
    "auto": "auto",
}


def check_leet_gamma(gamma, is_mask_weight: bool, H: int):
    """``gamma [H, 1]`` when ``is_mask_weight``, else None; returns it as ``[H]`` (or None)."""
    if not isinstance(is_mask_weight, bool):
        raise TypeError(f"is_mask_weight: expected a bool, got {type(is_mask_weight).__name__}")
    if not is_mask_weight:
        if gamma is not None:
            raise ValueError("gamma: given with is_mask_weight=False (the 0-1 causal mask); pass "
                             "is_mask_weight=True to apply the decay")
        return None
    if gamma is None:
        raise ValueError("gamma: expected a [H, 1] tensor with is_mask_weight=True, got None")
    check_tensor("gamma", gamma, 2)
    if tuple(gamma.shape) != (H, 1):
        raise ValueError(f"gamma: expected shape [H, 1] = ({H}, 1), got {tuple(gamma.shape)}")
    return gamma.reshape(H)


def causal_linear_decoder(q, k, v, gamma=None, *, attn_method: str = "auto", is_mask_weight: bool = False,
                          backend: str = "auto") -> torch.Tensor:
    """LeetDecoding's ``causal_linear_decoder``: ``O = (Q K^T ⊙ M) V`` per head, with the 0-1 causal mask
    or, with ``is_mask_weight``, ``M_ij = gamma^(i - j)`` for ``i >= j``.

    Args:
        q, k: ``[B, H, T, R]`` (LeetDecoding's B and C); v: ``[B, H, T, D]``.
        gamma: ``[H, 1]`` decay per head in (0, 1], with ``is_mask_weight=True`` only.
        attn_method: ``"vanilla"``, ``"causal-dot-product"``, ``"block-based"``, ``"recursion"``,
            ``"lightningAttention-2"``, ``"FleetAttention"``, or ``"auto"`` (the fastest measured method).
        is_mask_weight: apply the exponentially decaying mask.
        backend: ``"auto" | "torch" | "triton"``, as in ``decay_linear_attention``.

    Returns:
        ``o: [B, H, T, D]`` in v's dtype.
    """
    check_decay_inputs(q, k, v, names=("q", "k", "v"), layout="[B, H, T, R]")
    method = ATTN_METHODS[check_choice("attn_method", attn_method, tuple(ATTN_METHODS))]
    gamma = check_leet_gamma(gamma, is_mask_weight, q.shape[1])
    o = decay_linear_attention(*(x.transpose(1, 2) for x in (q, k, v)), gamma, method=method, backend=backend)
    return o.transpose(1, 2)
