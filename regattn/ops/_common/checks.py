"""Input checks shared by every public op.

Each check raises ``ValueError`` or ``TypeError`` naming the argument, what was
expected and what came, before any kernel is launched.
"""
from __future__ import annotations

import functools
import math
import os
from numbers import Real

import torch

BACKENDS = ("auto", "torch", "triton")
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def host_checks_allowed() -> bool:
    """Whether a check may read tensor values on the host (a device sync, a graph break).

    Only in eager code: not while torch.compile traces, not while a CUDA graph is captured, not under a
    ``torch.func`` transform (``vmap``: a batched tensor has no values to read). Such code skips the checks; the
    eager call of the same inputs runs them.
    """
    if torch.compiler.is_compiling() or torch._C._functorch.maybe_current_level() is not None:
        return False
    return not capturing()


def capturing() -> bool:
    """Whether a CUDA graph is being captured on the current stream."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def check_tensor(name: str, x, ndim: int | None = None) -> torch.Tensor:
    """A floating-point tensor of rank ``ndim``."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name}: expected a floating-point tensor (fp16, bf16, fp32, fp64), got {x.dtype}")
    if ndim is not None and x.dim() != ndim:
        raise ValueError(f"{name}: expected a rank-{ndim} tensor, got shape {tuple(x.shape)}")
    return x


def check_shape(name: str, x: torch.Tensor, expected: tuple, layout: str) -> None:
    """``x.shape == expected``; ``layout`` spells the dims, e.g. ``"[B, T, H]"``."""
    if tuple(x.shape) != tuple(expected):
        raise ValueError(f"{name}: expected shape {layout} = {tuple(expected)}, got {tuple(x.shape)}")


def check_same(**tensors: torch.Tensor) -> None:
    """All tensors share one device and one dtype."""
    items = iter(tensors.items())
    first_name, first = next(items)
    device, dtype = first.device, first.dtype
    for name, t in items:
        if t.device != device:
            raise ValueError(f"{name}: expected device {device} (as {first_name}), got {t.device}")
        if t.dtype != dtype:
            raise TypeError(f"{name}: expected dtype {dtype} (as {first_name}), got {t.dtype}")


def check_device(name: str, x: torch.Tensor, like: torch.Tensor, like_name: str) -> None:
    if x.device != like.device:
        raise ValueError(f"{name}: expected device {like.device} (as {like_name}), got {x.device}")


def check_attention_inputs(q, k, v, *, value_dim_may_differ: bool = True):
    """Check ``q: [B, T, HQ, D]``, ``k: [B, S, H, D]``, ``v: [B, S, H, Dv]``; return (B, T, S, HQ, H, D, Dv).

    ``HQ`` must be a multiple of ``H`` (grouped-query attention).
    """
    check_tensor("q", q, 4)
    check_tensor("k", k, 4)
    check_tensor("v", v, 4)
    check_same(q=q, k=k, v=v)
    B, T, HQ, D = q.shape
    Bk, S, H, Dk = k.shape
    if Bk != B:
        raise ValueError(f"k: expected batch {B} (as q), got {Bk}")
    if Dk != D:
        raise ValueError(f"k: expected head dim {D} (as q), got {Dk}")
    if tuple(v.shape[:3]) != (B, S, H):
        raise ValueError(f"v: expected shape [B, S, H, Dv] with (B, S, H) = {(B, S, H)} (as k), got {tuple(v.shape)}")
    if not value_dim_may_differ and v.shape[3] != D:
        raise ValueError(f"v: expected head dim {D} (as q), got {v.shape[3]}")
    for name, n in (("q", T), ("k", S)):
        if n < 1:
            raise ValueError(f"{name}: expected at least one token, got sequence length {n}")
    if H < 1 or HQ < 1 or D < 1 or v.shape[3] < 1:
        raise ValueError(f"q, k, v: expected non-empty heads and head dims, got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if HQ % H != 0:
        raise ValueError(f"q: expected a number of heads divisible by k's {H} (grouped-query attention), got {HQ}")
    return B, T, S, HQ, H, D, v.shape[3]


def check_window(window) -> int | None:
    """``None`` or an integer >= 1 (keys ``i - window < j <= i``)."""
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int):
        raise TypeError(f"window: expected None or an int >= 1, got {type(window).__name__}")
    if window < 1:
        raise ValueError(f"window: expected an int >= 1, got {window}")
    return window


def check_positive(name: str, value, *, allow_zero: bool = False) -> float:
    """A finite real number > 0 (or >= 0)."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name}: expected a real number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name}: expected a finite number {bound}, got {value}")
    return value


def check_scale(scale, head_dim: int) -> float:
    """``None`` (meaning ``head_dim ** -0.5``) or a finite real number."""
    if scale is None:
        return head_dim ** -0.5
    if isinstance(scale, bool) or not isinstance(scale, Real):
        raise TypeError(f"scale: expected None or a real number, got {type(scale).__name__}")
    if not math.isfinite(float(scale)):
        raise ValueError(f"scale: expected a finite number, got {scale}")
    return float(scale)


def check_choice(name: str, value, choices) -> str:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name}: expected one of {', '.join(map(repr, choices))}, got {value!r}")
    return value


def check_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected a bool, got {type(value).__name__}")
    return value


def check_int(name: str, value, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int >= {minimum}, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value}")
    return value


def check_seqlens_device(name: str, seqlens, like: torch.Tensor, like_name: str = "q") -> None:
    """``cu_seqlens`` / ``cache_seqlens`` on ``like``'s device; call before any of its values is read
    on the host (a tensor elsewhere, a meta tensor included, would fail there with a foreign message)."""
    if isinstance(seqlens, torch.Tensor) and seqlens.device != like.device:
        raise ValueError(f"{name}: expected device {like.device} (as {like_name}), got {seqlens.device}")


def check_cu_seqlens(cu_seqlens, batch: int, total: int, max_seqlen=None) -> torch.Tensor | None:
    """Packed variable length: ``cu_seqlens`` int32/int64, starts at 0, non-decreasing, ends at T, and B == 1.

    ``max_seqlen`` (as in flash-attn): the caller's bound on the longest sequence, an int in ``[1, T]``.
    With it no value of ``cu_seqlens`` is read on the host: the caller vouches for the offsets, as in
    flash-attn (the kernels clamp them to ``[0, T]``, so none reads outside the tensors). Without it the offsets are checked where
    :func:`host_checks_allowed`.
    """
    if cu_seqlens is None:
        if max_seqlen is not None:
            raise ValueError(f"max_seqlen: bounds packed sequences, expected None without cu_seqlens, "
                             f"got {max_seqlen!r}")
        return None
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens: expected a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"cu_seqlens: expected an int32 or int64 tensor, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens: expected a 1-D tensor of at least 2 offsets, got shape {tuple(cu_seqlens.shape)}")
    if batch != 1:
        raise ValueError(f"cu_seqlens: packed sequences need batch size 1, got B = {batch}")
    if max_seqlen is not None:
        check_int("max_seqlen", max_seqlen, minimum=1)
        if max_seqlen > total:
            raise ValueError(f"max_seqlen: expected at most T = {total}, got {max_seqlen}")
        return cu_seqlens
    if not host_checks_allowed():
        return cu_seqlens
    c = cu_seqlens.detach().cpu()
    if int(c[0]) != 0 or int(c[-1]) != total or bool((c[1:] < c[:-1]).any()):
        raise ValueError(f"cu_seqlens: expected non-decreasing offsets from 0 to T = {total}, got {c.tolist()}")
    return cu_seqlens


def last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    """``x`` with its last dim contiguous, as the kernels read rows (copied only where it is not)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def longest_sequence(cu_seqlens: torch.Tensor, max_seqlen: int | None) -> int:
    """``max_seqlen`` when the caller gave it, else the longest packed sequence read from the device
    (a host sync: hot paths pass ``max_seqlen``)."""
    if max_seqlen is not None:
        return max_seqlen
    return int((cu_seqlens[1:] - cu_seqlens[:-1]).max())


@functools.lru_cache(maxsize=None)
def _properties(index: int):
    return torch.cuda.get_device_properties(index)


def _cuda_properties(device: torch.device):
    """The properties of a CUDA device, read once per device."""
    return _properties(device.index if device.index is not None else torch.cuda.current_device())


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (read once per device); 4 on the CPU, where kernels
    run in the interpreter."""
    device = torch.device(device)
    if device.type != "cuda":
        return 4
    return _cuda_properties(device).multi_processor_count


def compute_capability(device: torch.device) -> tuple[int, int]:
    """``(major, minor)`` of a CUDA device (read once per device)."""
    props = _cuda_properties(torch.device(device))
    return props.major, props.minor


def resolve_backend(backend, x: torch.Tensor, *, op: str, has_triton: bool) -> str:
    """Pick ``"torch"`` or ``"triton"`` for an op whose first input is ``x``.

    ``"auto"``: Triton on CUDA tensors when the op has a kernel, else the torch reference.
    ``"triton"`` on CPU tensors needs ``TRITON_INTERPRET=1`` (kernels run in the interpreter).
    """
    check_choice("backend", backend, BACKENDS)
    if backend == "auto":
        return "triton" if (x.is_cuda and has_triton) else "torch"
    if backend == "triton":
        if not has_triton:
            raise NotImplementedError(f"backend: {op} has no Triton kernel; use backend='torch'")
        if not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("backend: 'triton' needs CUDA tensors, or TRITON_INTERPRET=1 to run kernels on the CPU")
    return backend


def resolve_kernel_backend(backend, x: torch.Tensor, *, op: str, has_triton: bool, name: str = "q") -> str:
    """``resolve_backend`` for kernels that cover fp16, bf16 and fp32: under ``"auto"`` float64 inputs
    (the exact spec) go to the reference; ``"triton"`` refuses them with a TypeError naming ``name``."""
    resolved = resolve_backend(backend, x, op=op, has_triton=has_triton)
    if resolved == "triton" and x.dtype not in KERNEL_DTYPES:
        if backend == "auto":
            return "torch"
        raise TypeError(f"{name}: backend='triton' expects fp16, bf16 or fp32 inputs, got {x.dtype}")
    return resolved
