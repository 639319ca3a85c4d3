"""The decay-method registry: every name ``method=`` accepts, the tuner times and ``benchmark_method`` runs.

A method is a function ``fn(b, c, v, gamma) -> o`` with ``b, c: [B, T, H, R]``, ``v: [B, T, H, D]``,
``gamma: [H]`` float tensor or None (no decay), returning ``o: [B, T, H, D]`` in v's dtype.
Built-in methods have a torch form (the reference, run in float32 for fp16/bf16 inputs) and, for ``lightning2``, ``fleet`` and
``causal_dot_product``, a Triton form; ``vanilla``, ``block_based`` and ``recursion`` are torch on
every backend (leetdecoding.txt Table 2: a kernel would not make them faster). A user's method
runs as given on every backend::

    @regattn.register_decay_method("mine")
    def mine(b, c, v, gamma):
        ...
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch

from regattn import reference
from regattn.reference.decay import METHODS as BUILTIN_METHODS


@dataclass(frozen=True)
class DecayMethod:
    name: str
    torch_fn: Callable
    triton_fn: Callable | None = None

    def run(self, b, c, v, gamma, backend: str):
        """``backend`` is ``"torch"`` or ``"triton"``; methods without a Triton form run their torch form."""
        if backend == "triton" and self.triton_fn is not None:
            return self.triton_fn(b, c, v, gamma)
        return self.torch_fn(b, c, v, gamma)


_REGISTRY: dict[str, DecayMethod] = {}


def _in_fp32(fn):
    """Run ``fn(b, c, v, gamma)`` in float32 for fp16/bf16 inputs (decay powers and sums included),
    returning the inputs' dtype; float32 and float64 run as they come."""
    def run(b, c, v, gamma):
        if b.dtype in (torch.float32, torch.float64):
            return fn(b, c, v, gamma)
        return fn(b.float(), c.float(), v.float(), gamma).to(v.dtype)
    return run


def _builtin(name: str, triton_fn=None) -> DecayMethod:
    torch_fn = _in_fp32(partial(reference.decay_linear_attention, method=name))
    return DecayMethod(name, torch_fn, triton_fn)


def _register_builtins() -> None:
    from regattn.ops.decay import function
    kernels = {"lightning2": function.lightning2, "fleet": function.fleet,
               "causal_dot_product": function.causal_dot_product}
    for name in BUILTIN_METHODS:
        _REGISTRY[name] = _builtin(name, kernels.get(name))


def register_decay_method(name: str, *, replace: bool = False):
    """Decorator: add ``fn(b, c, v, gamma) -> o`` under ``name`` so ``method=name`` and the tuner see it.

    Raises ValueError for ``"auto"``, a non-identifier name, or a taken name unless ``replace=True``
    (built-in names can never be replaced).
    """
    if not isinstance(name, str) or not name.isidentifier() or name == "auto":
        raise ValueError(f"name: expected an identifier other than 'auto', got {name!r}")
    if name in BUILTIN_METHODS or (name in _REGISTRY and not replace):
        raise ValueError(f"name: {name!r} is already a decay method; pick another name"
                         + ("" if name in BUILTIN_METHODS else " or pass replace=True"))

    def add(fn):
        if not callable(fn):
            raise TypeError(f"register_decay_method: expected a callable, got {type(fn).__name__}")
        _REGISTRY[name] = DecayMethod(name, fn, None)
        return fn
    return add


def unregister_decay_method(name: str) -> None:
    """Remove a user's method (built-in methods stay)."""
    if name in BUILTIN_METHODS:
        raise ValueError(f"name: the built-in method {name!r} cannot be removed")
    _REGISTRY.pop(name, None)


def get_method(name: str) -> DecayMethod:
    return _REGISTRY[name]


def method_names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def has_kernel(name: str) -> bool:
    return _REGISTRY[name].triton_fn is not None


_register_builtins()
