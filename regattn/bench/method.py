"""``benchmark_method``: check a user's decaying linear attention against the reference, then time
it beside the built-in methods (leetdecoding.txt Listing 1)."""
from __future__ import annotations

import functools
import types

import torch

from regattn import reference
from regattn.bench.runner import Setup, format_table, relative_diff, run_suite
from regattn.bench.suites import decay

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}
# Slack added to twice the reference's own error in the same dtype (flash-attn's rule).
SLACK = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}
CHECK_T = 256


def as_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype: expected a torch.dtype or one of {', '.join(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def decay_per_head(gamma, heads: int, device) -> torch.Tensor:
    """A float or a tensor of ``heads`` values (``[H]`` or Listing 2's ``[H, 1]``) -> fp32 ``[H]`` in (0, 1]."""
    g = gamma if isinstance(gamma, torch.Tensor) else torch.full((heads,), float(gamma))
    g = g.reshape(-1).to(device=device, dtype=torch.float32)
    if g.numel() != heads:
        raise ValueError(f"gamma: expected a float or {heads} values (one a head), got shape {tuple(gamma.shape)}")
    if not bool(((g > 0) & (g <= 1)).all()):
        raise ValueError(f"gamma: expected values in (0, 1], got {g.tolist()}")
    return g


def check_method(method, *, device, dtype, heads, rank, dim, gamma, seqlen=CHECK_T, name="method") -> float:
    """Relative error of ``method(b, c, v, gamma)`` to the float64 reference; raises ValueError when it
    exceeds twice the reference's own error in ``dtype`` plus the dtype's slack. Returns the error."""
    g = torch.Generator(device="cpu").manual_seed(0)
    b, c, v = (torch.randn(1, seqlen, heads, n, generator=g, dtype=torch.float64) for n in (rank, rank, dim))
    b, c = b * rank ** -0.25, c * rank ** -0.25
    b, c, v = (x.to(device) for x in (b, c, v))
    truth = reference.decay_linear_attention(b, c, v, None if gamma is None else gamma.double())
    low = [x.to(dtype) for x in (b, c, v)]
    own = relative_diff(reference.decay_linear_attention(*low, gamma), truth)
    out = method(*low, gamma)
    if not isinstance(out, torch.Tensor) or out.shape != truth.shape:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"{name}: expected an output of shape [B, T, H, D] = {tuple(truth.shape)}, got {got}")
    err, bound = relative_diff(out, truth), 2 * own + SLACK[dtype]
    if not err <= bound:
        raise ValueError(f"{name}: expected the reference's numbers (relative error <= {bound:.2e} in {dtype}), "
                         f"got relative error {err:.2e}")
    return err


def benchmark_method(method, *, device=None, dtype="float32", batch_size=1, heads=8, seqlens=(512, 2048, 8192),
                     rank=64, dim=64, is_weight_decay=True, gamma=0.99, peers=("fla", "reference"),
                     rep_ms=100, verbose=True) -> list[dict]:
    """Check ``method`` against the reference, then time it beside every built-in method.

    Args:
        method: ``fn(b, c, v, gamma) -> o`` with ``b, c: [B, T, H, R]``, ``v: [B, T, H, D]``,
            ``gamma: [H]`` (fp32, in (0, 1]) or None; returns ``o: [B, T, H, D]``
            (``O = (B C^T ⊙ M) V``, ``M_ij = gamma^(i-j)`` for ``i >= j``).
        device: ``"cuda"`` or ``"cpu"`` (default: cuda when available).
        dtype: ``"float32" | "float16" | "bfloat16" | "float64"`` or a torch dtype.
        batch_size, heads, seqlens, rank, dim: the shapes timed (one row group per sequence length).
        is_weight_decay, gamma: with decay ``gamma`` (a float, ``[H]`` or ``[H, 1]``), else no decay.
        peers: peers timed beside the built-ins (``"fla"``, ``"reference"``).

    Returns:
        The result rows (as in the JSON files): the user's method is ``ours``; ``ratio`` is its
        time over the fastest built-in method or peer.

    Raises:
        ValueError: the method's output differs from the reference (checked before any timing).
    """
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = as_dtype(dtype)
    name = getattr(method, "__name__", "method")
    g = decay_per_head(gamma, heads, device) if is_weight_decay else None
    check_method(method, device=device, dtype=dtype, heads=heads, rank=rank, dim=dim, gamma=g, name=name)
    suite = types.SimpleNamespace(NAME="decay", cases=functools.partial(decay.cases, user=(f"user:{name}", method)))
    # Timing does not depend on gamma's values: the suite's inputs use the first head's for all.
    shapes = [dict(B=batch_size, H=heads, T=T, R=rank, D=dim, gamma=None if g is None else float(g[0]))
              for T in seqlens]
    setup = Setup(dtype=dtype, device=device, backend="auto", peers=tuple(peers), rep_ms=rep_ms)
    rows = run_suite(suite, shapes, setup)
    if verbose:
        print(format_table(rows))
    return rows
