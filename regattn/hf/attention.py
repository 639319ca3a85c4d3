"""regattn's attention ops behind transformers' attention interface.

After ``import regattn.hf`` a stock model built with ``attn_implementation=NAME`` runs its attention
on our ops:

=================== =====================================================================
``regattn_softmax``  :func:`regattn.softmax_attention` (sliding window where the layer has one)
``regattn_elsa``     :func:`regattn.scan_attention` (exact softmax as a monoid scan, ELSA)
=================== =====================================================================

The ops' ``backend`` is the model config's ``regattn_backend`` (``"auto"`` when unset: the Triton
kernels on CUDA, the reference on CPU). A layer's ``sliding_window`` (Qwen3 ``layer_types``, Mistral)
becomes the ops' ``window``, so sliding-window layers run the windowed kernels. The ops are causal
(or not, following the layer) and take unpadded batches, left-padded batches of a causal layer (each
row rolled so that its real tokens come first, :mod:`regattn.layers.padding`; a decode step on the
cache runs softmax as :func:`regattn.parallax_decode` with a zero probe and ragged lengths), or
packed sequences in one row marked by restarting ``position_ids`` (transformers' padding-free
format; they run as ``cu_seqlens``). transformers builds a boolean mask for these names (its SDPA
mask); a mask that says more than the ops compute — right padding, custom patterns, static caches'
unfilled slots — is refused with a ValueError rather than silently ignored.
"""
from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from regattn.hf.padding import left_padding
from regattn.layers.padding import attend_left_padded, softmax_decode_left_padded
from regattn.ops.scan.api import scan_attention
from regattn.ops.softmax.api import softmax_attention
from regattn.reference.common import visible


def packed_offsets(position_ids, B: int, T: int, S: int) -> torch.Tensor | None:
    """``cu_seqlens: [N + 1]`` (int32) of packed sequences, or None.

    Packed means one row (``B == 1``) of self-attention (``T == S``) whose ``position_ids: [1, T]`` do
    not count up by one everywhere (transformers' padding-free format): a new sequence starts wherever
    they break.
    """
    if position_ids is None or B != 1 or T != S or position_ids.numel() != T or T < 2:
        return None
    pos = position_ids.reshape(T)
    starts = torch.nonzero(pos.diff() != 1).flatten() + 1
    if starts.numel() == 0:
        return None
    ends = torch.tensor([0, T], device=pos.device)
    return torch.cat([ends[:1], starts, ends[1:]]).to(torch.int32)


def _pattern(T: int, S: int, causal: bool, window: int | None, cu_seqlens, device) -> torch.Tensor:
    """Boolean ``[T, S]`` the ops compute: causal/windowed, within each packed sequence when ``cu_seqlens``."""
    mask = visible(T, S, causal=causal, window=window, device=device)
    if cu_seqlens is not None:
        seq = torch.bucketize(torch.arange(T, device=device), cu_seqlens[1:].to(device), right=True)
        mask &= seq[:, None] == seq[None, :]
    return mask


def check_plain_mask(attention_mask, T: int, S: int, *, causal: bool, window: int | None,
                     cu_seqlens: torch.Tensor | None = None) -> None:
    """Accept ``attention_mask`` only if it says no more than the ops already do.

    ``None``, a ``[B, S]`` padding mask with no padding, or a ``[B, 1 | H, T, S]`` mask (boolean: True
    visible; float: 0 visible, additive) equal to the causal/windowed pattern with queries aligned to
    the end of the keys — or, with ``cu_seqlens``, that pattern within each packed sequence (the plain
    pattern is accepted too: the ops then keep the sequences apart, as flash-attn does). Anything else
    (padding, custom masks) raises ValueError.
    """
    if attention_mask is None:
        return
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError("attention_mask: expected None or a torch.Tensor (masks of the sdpa or eager kind), "
                        f"got {type(attention_mask).__name__}")
    allowed = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
    if attention_mask.dim() == 2:
        if attention_mask.shape[-1] != S or not bool(allowed.all()):
            raise ValueError("attention_mask: regattn attention takes unpadded batches; expected a [B, S] mask "
                             f"of ones with S = {S}, got shape {tuple(attention_mask.shape)} with padded positions")
        return
    if attention_mask.dim() != 4 or tuple(attention_mask.shape[-2:]) != (T, S):
        raise ValueError(f"attention_mask: expected shape [B, 1, T, S] with T = {T}, S = {S}, "
                         f"got {tuple(attention_mask.shape)}")
    layouts = [None] if cu_seqlens is None else [None, cu_seqlens]
    patterns = [_pattern(T, S, causal, window, cu, attention_mask.device) for cu in layouts]
    if not any(bool((allowed == expected).all()) for expected in patterns):
        raise ValueError("attention_mask: regattn attention takes unpadded batches with a plain "
                         f"{'causal' if causal else 'full'} mask (window {window}) or packed sequences marked "
                         "by position_ids; got a mask with padding, a static cache's empty slots or a custom pattern")


def op_options(attention_mask, q: torch.Tensor, k: torch.Tensor, *, causal: bool, window: int | None,
               position_ids=None) -> dict:
    """The ops' ``causal``, ``window`` and ``cu_seqlens`` for ``q: [B, T, HQ, D]``, ``k: [B, S, H, D]``,
    after checking ``attention_mask`` against them."""
    B, T, S = q.shape[0], q.shape[1], k.shape[1]
    if attention_mask is None and 1 < T < S:
        # transformers leaves the mask out only when it believes there are T keys (or one query);
        # more keys than that come from a static cache's preallocated, partly empty slots.
        raise ValueError(f"attention_mask: got None with T = {T} queries and S = {S} keys, the layout of a "
                         "static cache's empty slots; regattn attention takes dynamic caches")
    cu_seqlens = packed_offsets(position_ids, B, T, S)
    check_plain_mask(attention_mask, T, S, causal=causal, window=window, cu_seqlens=cu_seqlens)
    return dict(causal=bool(causal), window=window, cu_seqlens=cu_seqlens)


def config_backend(module) -> str:
    """``module.config.regattn_backend`` (``"auto" | "torch" | "triton"``), ``"auto"`` when unset."""
    return getattr(getattr(module, "config", None), "regattn_backend", "auto")


def _check_supported(dropout, softcap) -> None:
    if dropout:
        raise ValueError(f"dropout: regattn attention has no attention dropout, expected 0.0, got {dropout}")
    if softcap is not None:
        raise ValueError(f"softcap: regattn attention has no logit soft-capping, expected None, got {softcap}")


def _transformers_call(op):
    """Wrap ``op(q, k, v, *, causal, window, cu_seqlens, scale, backend)`` on ``[B, T, H, D]`` as a transformers
    attention function.

    transformers passes ``query: [B, HQ, T, D]``, ``key, value: [B, H, S, D]``; the function returns
    ``(out: [B, T, HQ, D], None)`` (no attention weights).
    """
    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
                  softcap=None, **kwargs):
        _check_supported(dropout, softcap)
        causal = kwargs.get("is_causal")
        causal = getattr(module, "is_causal", True) if causal is None else causal
        q, k, v = (x.transpose(1, 2) for x in (query, key, value))
        window, backend = sliding_window or None, config_backend(module)
        start = left_padding(attention_mask, q.shape[1], k.shape[1], window=window) if causal else None
        if start is not None:
            return _attend_left_padded(op, q, k, v, start, window=window, scale=scaling, backend=backend), None
        options = op_options(attention_mask, q, k, causal=causal, window=window,
                             position_ids=kwargs.get("position_ids"))
        return op(q, k, v, scale=scaling, backend=backend, **options), None

    attention.__name__ = f"regattn_{op.__name__}"
    attention.__doc__ = f"transformers attention function running :func:`regattn.{op.__name__}`."
    return attention


def _attend_left_padded(op, q, k, v, start, **options):
    """Causal softmax ``op`` on left-padded rows (``start: [B]`` padding slots): rolled rows without a
    cache (``T == S``), the zero-probe Parallax decode on the ragged cache otherwise."""
    if q.shape[1] == k.shape[1]:
        return attend_left_padded(op, start, q, k, v, causal=True, **options)
    return softmax_decode_left_padded(q, k, v, start, **options)


ATTENTION_FUNCTIONS = {
    "regattn_softmax": _transformers_call(softmax_attention),
    "regattn_elsa": _transformers_call(scan_attention),
}


def register() -> tuple[str, ...]:
    """Register every regattn attention function (and SDPA-style boolean masks for it); returns the names."""
    for name, fn in ATTENTION_FUNCTIONS.items():
        AttentionInterface.register(name, fn)
        ALL_MASK_ATTENTION_FUNCTIONS.register(name, sdpa_mask)
    return tuple(ATTENTION_FUNCTIONS)
