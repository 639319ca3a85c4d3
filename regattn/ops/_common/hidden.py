"""Containment by finite copies: a non-finite key or value reaches only the rows that see it, at no cost to the tiles.

A kernel whose key tiles straddle the causal (or window) boundary multiplies a hidden key's entries by zero weights,
and ``0 * NaN = NaN`` would carry it into every row of the tile. Instead the kernels read copies of K and V whose
non-finite entries are zeros (:func:`finite_copy`): a row that does not see such a position never depended on it,
and the results of the rows that do (:func:`rows_seeing`, from the positions :func:`hidden_flags` marks), with the
key gradients those rows reach (:func:`keys_reached`), are set to NaN after the launch. The copies cost a read and
a write of K and V (and their memory while the kernels run), the flags one more read: LLA's forward took 0% to 3%
longer on the H200, where loading a flagged position as zeros inside the tile loops took 5% to 131% longer (and gave
BD-LLA by CG a wrong result), and the masked tiles in loops of their own up to 42% longer
(benchmarks/results/h200/tiles/README.md, "LLA's containment").

Positions follow the kernels' convention: the ``T`` query rows sit at the last ``T`` of the ``S`` key positions,
causal, with a window ``w`` a row at ``p`` sees the keys ``p - w < j <= p``.
"""
from __future__ import annotations

import torch


def hides_keys(T: int, S: int, window) -> bool:
    """Whether some of the ``T`` rows cannot see some of the ``S`` keys: not so for one row without a window shorter
    than the keys (a decode step), which needs no copies."""
    return T > 1 or (window is not None and window < S)


def hidden_flags(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``[B, H, S]`` bool, True where ``k [B, S, H, D]`` or ``v [B, S, H, Dv]`` holds a non-finite entry."""
    def finite_rows(x):
        lo, hi = torch.aminmax(x, dim=-1)  # NaN propagates to both, inf to one
        return torch.isfinite(lo) & torch.isfinite(hi)
    return ~(finite_rows(k) & finite_rows(v)).transpose(1, 2)


def finite_copy(x: torch.Tensor) -> torch.Tensor:
    """``x`` with its non-finite entries zero (a copy)."""
    return torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)


def _window_count(flags: torch.Tensor, window) -> torch.Tensor:
    """``[B, H, S]``: how many flagged positions each position ``p`` sees, those of ``(p - w, p]`` (all of
    ``[0, p]`` without a window)."""
    count = flags.to(torch.int32).cumsum(-1, dtype=torch.int32)  # bool or int flags
    if window is not None and window < count.shape[-1]:
        count[..., window:] -= count[..., :-window].clone()
    return count


def rows_seeing(flags: torch.Tensor, T: int, window) -> torch.Tensor:
    """``[B, H, T]`` bool: the query rows (the last ``T`` positions) that see a flagged position (none of the rows
    before position 0, where ``T > S``)."""
    S = flags.shape[-1]
    seen = _window_count(flags, window)[..., max(S - T, 0):] > 0
    return torch.nn.functional.pad(seen, (max(T - S, 0), 0))


def keys_reached(rows: torch.Tensor, S: int, window) -> torch.Tensor:
    """``[B, H, S]`` bool: the key positions that some row of ``rows`` (``[B, H, T]``, the last ``T`` positions)
    sees: ``j`` is seen by the rows at ``[j, j + w)`` (all from ``j`` on without a window); rows before position 0
    see none."""
    T = rows.shape[-1]
    at = torch.zeros(*rows.shape[:-1], S, dtype=torch.int32, device=rows.device)
    at[..., max(S - T, 0):] = rows[..., max(T - S, 0):].to(torch.int32)
    later = at.flip(-1)  # position j of the flipped sequence is S - 1 - j: a window over it looks forward
    return (_window_count(later, window) > 0).flip(-1)


def per_query_head(x: torch.Tensor, groups: int) -> torch.Tensor:
    """``[B, H, ...] -> [B, H * groups, ...]``: each key/value head's rows for the query heads of its group."""
    return x.repeat_interleave(groups, dim=1) if groups > 1 else x


def poison_rows(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``x [B, N, heads, C]`` with NaN (in place) at the rows where ``rows [B, heads, N]`` holds."""
    return x.masked_fill_(rows.transpose(1, 2)[..., None], float("nan"))
