"""Left padding in transformers' attention masks: where each row's real tokens start.

The rows are then run as :mod:`regattn.layers.padding` describes (rolled so that real tokens come first).
"""
from __future__ import annotations

import torch

from regattn.reference.common import visible


def left_padding(attention_mask, T: int, S: int, *, window: int | None) -> torch.Tensor | None:
    """``start: [B]`` (int64), the first key any query of each row sees, when ``attention_mask`` is a
    causal (windowed) mask of left-padded rows with some padding; None otherwise (no padding, or a
    mask of another kind: :func:`regattn.hf.attention.check_plain_mask` then accepts or refuses it).

    Accepted masks: ``[B, S]`` (1 for real tokens, zeros first) or ``[B, 1, T, S]`` (boolean True
    visible, or additive float 0 visible) equal to the causal pattern, within ``window``, restricted
    to keys and queries at or after ``start`` (padded queries see nothing, as transformers builds it).
    """
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() not in (2, 4):
        return None
    pattern = visible(T, S, causal=True, window=window, device=attention_mask.device)
    if attention_mask.dim() == 2:
        if attention_mask.shape[-1] != S:
            return None
        allowed = attention_mask.bool()[:, None, None, :] & pattern
    else:
        allowed = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
    if tuple(allowed.shape[-2:]) != (T, S) or allowed.shape[1] != 1:
        return None
    start = allowed.any(dim=-2).flatten(1).int().argmax(-1).long()                  # [B]
    keys = torch.arange(S, device=allowed.device)
    queries = keys[S - T:]
    expected = (pattern & (keys >= start[:, None])[:, None, :] & (queries >= start[:, None])[:, :, None])
    if not bool((allowed[:, 0] == expected).all()) or not bool(start.any()):
        return None
    return start
