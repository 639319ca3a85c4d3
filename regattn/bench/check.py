"""Correctness beside every timing: each case's output and gradients against the float64 reference.

The reference runs in float64 on a slice of the problem that fits any GPU at any goal shape:
batch row 0 (or another one named), the query heads of key/value head 0 (all of a GQA group) and a
band of query rows: the last ``rows`` queries against every key (the rows that see the most keys), or, where the
reference needs queries and keys of one length (a gate ``u`` read at both, a backward pass), the
first ``rows`` queries and keys (for causal ops the first rows are a problem of their own). For
gradients the output gradient is random on the slice and zero elsewhere, so every gradient of the
full-size call restricted to the slice is the reference's gradient of the slice.

Errors are relative, ``||ours - ref|| / ||ref||`` per output (``"o"``) and gradient (``"dq"``, ...).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

# How each named input is sliced: query-side tensors by rows, key-side ones by keys, per-head
# parameters by head. Output "o" is query-side; a gradient "dX" is sliced as X.
ROLES = {"q": "row", "r": "row", "u": "row", "h": "row", "beta": "row", "b": "row",
         "k": "key", "v": "key", "c": "key", "kc": "key", "vc": "key", "gamma": "head"}


@dataclass
class Slice:
    """Batch row ``batch``, the first ``1 / kv_heads`` of every head axis, and a band of rows.

    ``rows``: how many query rows (None: all). ``last``: the last rows against every key
    (queries aligned to the end of the keys, as every reference takes them); otherwise the
    first rows, with the first ``rows`` keys as well when ``causal``.
    """
    kv_heads: int
    rows: int | None = None
    last: bool = False
    causal: bool = True
    batch: int = 0

    def take(self, x: torch.Tensor, role: str) -> torch.Tensor:
        if role == "head":
            return x[: max(x.shape[0] // self.kv_heads, 1)]
        heads = max(x.shape[2] // self.kv_heads, 1)
        if self.rows is None or (role == "key" and (self.last or not self.causal)):
            span = slice(None)
        else:
            span = slice(-self.rows, None) if self.last else slice(0, self.rows)
        return x[self.batch:self.batch + 1, span, :heads]

    def grad_out(self, out: torch.Tensor, seed: int = 0) -> torch.Tensor:
        """A full-size output gradient: random on the slice, zero elsewhere."""
        g = torch.zeros_like(out)
        part = self.take(g, "row")
        gen = torch.Generator(device="cpu").manual_seed(seed)
        part.copy_(torch.randn(part.shape, generator=gen).to(out.dtype))
        return g


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """``||ours - ref|| / ||ref||`` in float64; inf where ours is not finite."""
    ours, ref = ours.detach().double(), ref.detach().double()
    if ours.shape != ref.shape:
        raise ValueError(f"ours: expected shape {tuple(ref.shape)} (as the reference's slice), got {tuple(ours.shape)}")
    if not bool(torch.isfinite(ours).all()):
        return float("inf")
    return ((ours - ref).norm() / ref.norm().clamp_min(1e-300)).item()


class Check:
    """The float64 truth of one ``(shape, mode)``, computed on first use, and errors against it.

    ``reference(**inputs) -> out`` is the spec; ``inputs`` are the full-size inputs by name (see
    :data:`ROLES`); ``grads`` names the inputs differentiated in a forward+backward mode, in the
    order of the cases' leaves.
    """

    def __init__(self, reference: Callable, inputs: dict, where: Slice, *, grads: tuple = ()):
        self.reference, self.inputs, self.where, self.grads = reference, inputs, where, tuple(grads)
        self._expected = None
        self._grad_out = None

    def grad_out(self, out: torch.Tensor) -> torch.Tensor:
        """The output gradient of every case of this check (drawn once, in the first case's dtype), laid
        out in memory as ``out`` is, as a loss's gradient comes to each op."""
        if self._grad_out is None:
            self._grad_out = self.where.grad_out(out)
        return torch.empty_like(out).copy_(self._grad_out)

    def take(self, name: str, x: torch.Tensor) -> torch.Tensor:
        return self.where.take(x, "row" if name == "o" else ROLES[name.removeprefix("d")])

    def expected(self) -> dict:
        """``{"o": ..., "dq": ...}`` of the reference on the slice, float64 (gradients once
        :meth:`grad_out` has been drawn)."""
        if self._expected is None:
            sliced = {n: None if x is None else self.take(n, x).detach().double().requires_grad_(n in self.grads)
                      for n, x in self.inputs.items()}
            with torch.enable_grad():
                out = self.reference(**sliced)
                self._expected = {"o": out.detach()}
                if self.grads and self._grad_out is not None:
                    leaves = [sliced[n] for n in self.grads]
                    do = self.take("o", self._grad_out).double()
                    for n, d in zip(self.grads, torch.autograd.grad(out, leaves, do)):
                        self._expected["d" + n] = d
        return self._expected

    def errors(self, out: torch.Tensor, grads: dict | None = None) -> dict:
        """Relative errors of ``out`` (and of ``grads``, by name) on the slice."""
        expected = self.expected()
        err = {"o": relative_error(self.take("o", out), expected["o"])}
        for name, g in (grads or {}).items():
            if name in expected and g is not None:
                err[name] = relative_error(self.take(name, g), expected[name])
        return err
