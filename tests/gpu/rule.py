"""The accuracy rule of the GPU tests (flash-attn's rule for low precision, a fixed bound for fp32).

A result is judged against the float64 reference. With ``same`` (the torch reference run in the
inputs' precision) the bound is flash-attn's rule, ``factor * error(same) + slack`` (at most ``cap``);
without it, the fixed bound ``fixed``. Packed sequences are judged one by one as well.
"""
import math

import torch

from tests.helpers import rel_err


def outputs(fn, leaves, do):
    """``[fn(*leaves), *d fn / d leaves]`` for the upstream gradient ``do`` (cast to the output's dtype)."""
    out = fn(*leaves)
    return [out, *torch.autograd.grad(out, leaves, do.to(out.dtype))]


def leaves(xs, dtype=None):
    """Fresh leaves that need gradients, optionally cast to ``dtype``."""
    return [x.detach().to(dtype or x.dtype).clone().requires_grad_(True) for x in xs]


def segments(cu_seqlens):
    """``(start, end)`` of the packed sequences longer than one token."""
    bounds = [int(x) for x in cu_seqlens]
    return [(s, e) for s, e in zip(bounds[:-1], bounds[1:]) if e - s > 1]


def assert_within(names, got, exact, same=None, *, fixed=None, factor=2.0, slack=1e-3, cap=None, parts=()):
    """Each ``got[i]`` against ``exact[i]``; ``parts``: ``(start, end)`` slices of dim 1 judged on their own.
    Every output and part is judged before the test fails, and the message lists each one out of bounds."""
    failures = []
    for i, (name, a, b) in enumerate(zip(names, got, exact)):
        for lo, hi in [(None, None), *parts]:
            err = rel_err(a[:, lo:hi], b[:, lo:hi])
            if same is None:
                limit = fixed
            else:
                limit = factor * rel_err(same[i][:, lo:hi], b[:, lo:hi]) + slack
                limit = limit if cap is None else min(limit, cap)
            where = "" if lo is None else f" (sequence {lo}:{hi})"
            if not math.isfinite(limit):
                failures.append(f"{name}{where}: the reference in low precision is not finite")
            elif not err <= limit:
                failures.append(f"{name}{where}: error {err:.3g} > bound {limit:.3g}")
    assert not failures, "; ".join(failures)
