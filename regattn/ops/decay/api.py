"""Exponentially decaying causal linear attention: the LeetDecoding methods (leetdecoding.txt eq. 4).

Public entry points: ``decay_linear_attention`` (any registered method, or ``"auto"``; from an
initial state, with the final state, over packed sequences as flash-linear-attention's chunk ops
take them), ``decay_linear_prefill`` (the parallel form plus the final state) and
``decay_linear_step`` (one decoding token in O(R * D)).
"""
from __future__ import annotations

from functools import partial
from numbers import Real

import torch

from regattn import reference
from regattn.ops._common.checks import (
    check_choice, check_cu_seqlens, check_device, check_same, check_seqlens_device, check_tensor,
    host_checks_allowed, resolve_kernel_backend,
)
from regattn.ops.decay import function, registry
from regattn.ops.decay.memo import TensorMemo
from regattn.ops.decay.registry import register_decay_method  # noqa: F401  (re-exported)
from regattn.ops.decay.choose import choose_method

HAS_TRITON = True
METHODS = reference.decay.METHODS


_CHECKED_GAMMAS = TensorMemo()


def _gamma_values_ok(gamma: torch.Tensor) -> bool:
    """Every value in (0, 1]. Reading a device tensor's values waits for the device, so a tensor
    that already passed, and has not been written to since, is not read again."""
    if _CHECKED_GAMMAS.get(gamma):
        return True
    ok = bool(((gamma > 0) & (gamma <= 1)).all())
    if ok:
        _CHECKED_GAMMAS.put(gamma, True)
    return ok


def check_gamma(gamma, H: int, like: torch.Tensor):
    """``None`` (no decay), a float, or an ``[H]`` tensor, every value in (0, 1] (a tensor's values are
    checked where :func:`host_checks_allowed`)."""
    if gamma is None:
        return None
    if isinstance(gamma, Real) and not isinstance(gamma, bool):
        if not 0.0 < float(gamma) <= 1.0:
            raise ValueError(f"gamma: expected values in (0, 1], got {gamma}")
        return torch.full((H,), float(gamma), device=like.device, dtype=torch.float32)
    check_tensor("gamma", gamma, 1)
    if gamma.shape[0] != H:
        raise ValueError(f"gamma: expected shape [H] = ({H},), got {tuple(gamma.shape)}")
    check_device("gamma", gamma, like, "b")
    if host_checks_allowed() and not _gamma_values_ok(gamma):
        raise ValueError(f"gamma: expected values in (0, 1], got {gamma.tolist()}")
    return gamma


def check_decay_inputs(b, c, v, *, names=("b", "c", "v"), layout="[B, T, H, R]"):
    """``b, c: layout`` (last dim R), ``v`` the same leading dims with its own last dim D.

    Returns ``(*b.shape, D)``: (B, T, H, R, D) for sequences, (B, H, R, D) for one token.
    """
    nb, nc, nv = names
    for name, x in zip(names, (b, c, v)):
        check_tensor(name, x, layout.count(",") + 1)
    check_same(**{nb: b, nc: c, nv: v})
    if c.shape != b.shape:
        raise ValueError(f"{nc}: expected shape {layout} = {tuple(b.shape)} (as {nb}), got {tuple(c.shape)}")
    if v.shape[:-1] != b.shape[:-1]:
        raise ValueError(f"{nv}: expected leading dims {tuple(b.shape[:-1])} (as {nb}), got shape {tuple(v.shape)}")
    if min(b.shape) < 1 or v.shape[-1] < 1:
        raise ValueError(f"{nb}, {nv}: expected non-empty dims, got {nb} {tuple(b.shape)}, {nv} {tuple(v.shape)}")
    return (*b.shape, v.shape[-1])


def check_method(method) -> str:
    return check_choice("method", method, registry.method_names() + ("auto",))


def resolve_method(method: str, B: int, T: int, H: int, R: int, D: int, dtype, gamma, backend: str,
                   device, stateful: bool) -> str:
    """``"auto"`` -> the measured fastest method for this shape (``choose.choose_method``); the torch
    backend uses the CPU rule, which picks among the torch forms. With a state (an initial state, the
    final state or packed sequences) the Triton backend runs ``lightning2``, the kernel that takes one."""
    if method != "auto":
        return method
    if stateful and backend == "triton":
        return "lightning2"
    on_gpu = backend == "triton" and device.type == "cuda"
    return choose_method(B, T, H, R, D, dtype, gamma is not None, device if on_gpu else torch.device("cpu"))


def check_packed(cu_seqlens, B: int, T: int, like: torch.Tensor) -> int:
    """``cu_seqlens`` (None, or ``[N + 1]`` offsets on like's device with ``B == 1``); returns N (B when None)."""
    check_seqlens_device("cu_seqlens", cu_seqlens, like, "b")
    if cu_seqlens is None:
        return B
    check_cu_seqlens(cu_seqlens, B, T)  # reads the offsets where host_checks_allowed()
    return cu_seqlens.numel() - 1


def check_state(name: str, state, like: torch.Tensor, like_name: str, shape: tuple) -> None:
    """``state``: a ``[B, H, R, D]`` tensor of ``shape`` on ``like``'s device."""
    check_tensor(name, state, 4)
    check_device(name, state, like, like_name)
    if tuple(state.shape) != shape:
        raise ValueError(f"{name}: expected shape [B, H, R, D] = {shape}, got {tuple(state.shape)}")


def decay_linear_attention(b, c, v, gamma=None, *, initial_state=None, output_final_state=False, cu_seqlens=None,
                           method="auto", backend="auto"):
    """Causal linear attention with exponential decay (leetdecoding.txt eq. 4), from a state.

    ``O = (B C^T ⊙ M) V`` with ``M_ij = gamma^(i - j)`` for ``i >= j`` and 0 otherwise, per head.
    With an initial state ``S_0`` (1-based t): ``o_t = b_t (gamma^t S_0 + sum_{j<=t} gamma^(t-j) c_j^T v_j)``;
    the final state is ``S_T = gamma^T S_0 + sum_j gamma^(T-j) c_j^T v_j`` (what ``decay_linear_step`` continues).

    Args:
        b: ``[B, T, H, R]`` (the query role); c: ``[B, T, H, R]`` (the key role); R may differ from D.
        v: ``[B, T, H, D]``.
        gamma: ``[H]`` decay per head in (0, 1], a float for every head, or None for 1.
            The Triton methods treat gamma as a constant (no gradient); the torch methods
            differentiate through it.
        initial_state: ``[N, H, R, D]`` (N = B, or the number of packed sequences), any float dtype
            (used in float32; float64 for float64 inputs on the torch backend), or None for zeros.
            Differentiable.
        output_final_state: also return the state after each sequence's last token.
        cu_seqlens: ``[N + 1]`` int offsets of packed sequences (``B == 1``), on b's device; each
            sequence starts from its own initial state.
        method: ``"vanilla", "causal_dot_product", "block_based", "recursion", "lightning2",
            "fleet"``, a name added with ``register_decay_method``, or ``"auto"`` (the fastest
            method measured for this shape on this kind of GPU; see ``regattn.ops.decay.choose``).
            All give the same numbers up to rounding. ``lightning2``'s kernel takes the state itself
            (what ``"auto"`` picks on the Triton backend when a state or ``cu_seqlens`` is given); other
            methods add the state terms in torch, and on the Triton backend take no ``cu_seqlens``.
        backend: ``"auto" | "torch" | "triton"``. ``lightning2``, ``fleet`` and
            ``causal_dot_product`` have Triton kernels (forward and backward, fp16, bf16, fp32);
            ``vanilla``, ``block_based`` and ``recursion`` are torch on every backend. float64 runs
            the reference under ``"auto"``; ``"triton"`` refuses it.

    Returns:
        ``o: [B, T, H, D]`` in v's dtype (accumulated in fp32 by the kernels); with
        ``output_final_state``, ``(o, S_T [N, H, R, D])``, S_T in float32 (float64 for float64 inputs).
    """
    B, T, H, R, D = check_decay_inputs(b, c, v)
    gamma = check_gamma(gamma, H, b)
    method = check_method(method)
    backend = resolve_kernel_backend(backend, v, op="decay_linear_attention", has_triton=HAS_TRITON, name="v")
    N = check_packed(cu_seqlens, B, T, b)
    if initial_state is not None:
        check_state("initial_state", initial_state, b, "b", (N, H, R, D))
    if not isinstance(output_final_state, bool):
        raise TypeError(f"output_final_state: expected a bool, got {type(output_final_state).__name__}")
    stateful = initial_state is not None or output_final_state or cu_seqlens is not None
    method = resolve_method(method, B, T, H, R, D, v.dtype, gamma, backend, b.device, stateful)
    if not stateful:
        return registry.get_method(method).run(b, c, v, gamma, backend)
    return _run_with_state(method, backend, b, c, v, gamma, initial_state, output_final_state, cu_seqlens)


def _run_with_state(method, backend, b, c, v, gamma, initial_state, output_final_state, cu_seqlens):
    """The lightning2 kernel takes the state itself; any other method runs its parallel form from a zero
    state with the state terms added in torch (``reference.decay.with_state``)."""
    if backend == "triton" and method == "lightning2":
        o, final = function.lightning2_with_state(b, c, v, gamma, initial_state, cu_seqlens)
        return (o, final) if output_final_state else o
    if backend == "triton" and registry.has_kernel(method) and cu_seqlens is not None:
        raise ValueError(f"cu_seqlens: the Triton method {method!r} takes no packed sequences; use "
                         "method='lightning2' (or 'auto'), or backend='torch'")
    parallel = partial(registry.get_method(method).run, backend=backend)
    return reference.decay.with_state(parallel, b, c, v, gamma, initial_state=initial_state,
                                      output_final_state=output_final_state, cu_seqlens=cu_seqlens)


def decay_linear_prefill(b, c, v, gamma=None, *, initial_state=None, method="auto", backend="auto"):
    """The parallel form and the state after the last token, for decoding with ``decay_linear_step``:
    ``decay_linear_attention(..., output_final_state=True)``.

    Args:
        b, c: ``[B, T, H, R]``; v: ``[B, T, H, D]``; gamma: ``[H]`` in (0, 1], a float, or None.
        initial_state: ``[B, H, R, D]`` from an earlier segment or step, or None (zeros).
        method, backend: as in ``decay_linear_attention``.

    Returns:
        ``(o [B, T, H, D] in v's dtype, state [B, H, R, D] in float32, float64 for float64 inputs)``.
    """
    return decay_linear_attention(b, c, v, gamma, initial_state=initial_state, output_final_state=True,
                                  method=method, backend=backend)


def decay_linear_step(state, b_t, c_t, v_t, gamma=None):
    """One decoding token in O(R * D): ``S <- gamma S + c_t^T v_t``, ``o_t = b_t S``.

    Args:
        state: ``[B, H, R, D]`` (from ``decay_linear_prefill`` or the previous step) or None (zeros).
        b_t, c_t: ``[B, H, R]``; v_t: ``[B, H, D]``; gamma: ``[H]`` in (0, 1], a float, or None.

    Returns:
        ``(o_t [B, H, D] in v_t's dtype, state [B, H, R, D] in float32, float64 for float64 inputs)``.
    """
    B, H, R, D = check_decay_inputs(b_t, c_t, v_t, names=("b_t", "c_t", "v_t"), layout="[B, H, R]")
    gamma = check_gamma(gamma, H, b_t)
    sdt = reference.decay.state_dtype(v_t.dtype)
    if state is not None:
        check_state("state", state, b_t, "b_t", (B, H, R, D))
        state = state.to(sdt)
    o_t, state = reference.decay_linear_step(state, b_t.to(sdt), c_t.to(sdt), v_t.to(sdt),
                                             None if gamma is None else gamma.to(sdt))
    return o_t.to(v_t.dtype), state
