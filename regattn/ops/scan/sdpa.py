"""Drop-in exact attention: route ``torch.nn.functional.scaled_dot_product_attention`` to the ELSA scan.

``with regattn.exact_attention():`` replaces the function for the duration of the block, so any model that
calls it (``nn.MultiheadAttention`` with ``need_weights=False``, ``nn.TransformerEncoder``, torchvision's
ViT, transformers' ``"sdpa"`` attention) runs the scan kernel without retraining or code changes. Calls
the scan does not express (an explicit ``attn_mask``, dropout, top-left causal masks with ``L != S``,
non-float inputs) go to the original function, and are counted.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from regattn.ops._common.checks import KERNEL_DTYPES
from regattn.ops.scan.api import PRECISIONS, scan_attention
from regattn.ops._common.checks import BACKENDS, check_choice


@dataclass
class RoutingStats:
    """How many SDPA calls ran on the scan (``calls``) and how many fell back (``fallbacks``)."""

    calls: int = 0
    fallbacks: int = 0


def _scan_sdpa(query, key, value, *, is_causal, scale, precision, backend):
    """SDPA layout ``[..., H, L, E]`` (or ``[N, L, E]``) through the scan's ``[B, T, H, D]``."""
    if query.dim() == 3:
        q, k, v = (x.unsqueeze(2) for x in (query, key, value))  # [N, L, 1, E]
        return scan_attention(q, k, v, causal=is_causal, scale=scale, precision=precision,
                              backend=backend).squeeze(2)
    lead = query.shape[:-3]
    q, k, v = (x.reshape(-1, *x.shape[-3:]).transpose(1, 2) for x in (query, key, value))
    o = scan_attention(q, k, v, causal=is_causal, scale=scale, precision=precision, backend=backend).transpose(1, 2)
    return o.reshape(*lead, *o.shape[1:])


def _supported(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa, extra) -> bool:
    if extra or attn_mask is not None or dropout_p != 0.0:
        return False
    if not all(isinstance(x, torch.Tensor) for x in (query, key, value)):
        return False
    if query.dim() not in (3, 4) or key.dim() != query.dim() or value.dim() != query.dim():
        return False
    if query.dtype not in KERNEL_DTYPES + (torch.float64,) or len({query.dtype, key.dtype, value.dtype}) != 1:
        return False
    if query.shape[:-3] != key.shape[:-3] or key.shape[:-1] != value.shape[:-1]:
        return False
    if query.dim() == 4 and query.shape[1] != key.shape[1] and not (enable_gqa and query.shape[1] % key.shape[1] == 0):
        return False
    # SDPA's causal mask is aligned top-left; the scan aligns queries to the end of the keys.
    return not (is_causal and query.shape[-2] != key.shape[-2])


@contextlib.contextmanager
def exact_attention(*, precision: str = "ieee", backend: str = "auto"):
    """Run ``torch.nn.functional.scaled_dot_product_attention`` as the exact ELSA scan inside the block.

    Args:
        precision: ``"ieee" | "tf32x3" | "fp16x3" | "tf32"`` for fp32 inputs (see ``regattn.scan_attention``).
        backend: ``"auto" | "torch" | "triton"``.

    Yields:
        :class:`RoutingStats`, counting routed calls and fallbacks to the original function.
    """
    check_choice("precision", precision, PRECISIONS)
    check_choice("backend", backend, BACKENDS)
    original = F.scaled_dot_product_attention
    stats = RoutingStats()

    def routed(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
               **extra):
        if not _supported(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa, extra):
            stats.fallbacks += 1
            return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                            scale=scale, enable_gqa=enable_gqa, **extra)
        stats.calls += 1
        return _scan_sdpa(query, key, value, is_causal=is_causal, scale=scale, precision=precision,
                          backend=backend)

    # nn.MultiheadAttention's fused inference path skips SDPA; switch it off inside the block.
    fastpath = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    F.scaled_dot_product_attention = routed
    try:
        yield stats
    finally:
        F.scaled_dot_product_attention = original
        torch.backends.mha.set_fastpath_enabled(fastpath)
