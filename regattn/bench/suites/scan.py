"""ELSA (elsa-supplementary.txt): exact softmax attention as a scan, in strict fp32, tf32x3, tf32 and
fp16, against SDPA in the same precision (and FlexAttention where a window is set); the fp16
forward+backward against the same peers. Non-causal at the goal shape (the paper's setting); causal,
sliding-window and packed (``seqs``) shapes in the ``full`` grid. The suite sets its own dtypes (fp32 and
fp16): ``--dtype`` does not apply. The reference scan is sequential (one step a key): a peer for small
shapes only, asked for with ``--peers``."""
from __future__ import annotations

import contextlib
import functools
from unittest import mock

import torch

import regattn
from regattn import reference
from regattn.bench import counts
from regattn.bench.runner import backward, flex_case, ours, randn, reference_case, sdpa_cases
from regattn.bench.suites.softmax import check
from regattn.ops.scan.api import PRECISIONS

NAME = "scan"
PEERS = ("sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "sdpa-math", "flex")
QUICK_PEERS = ("sdpa-efficient", "sdpa-flash")
# FlexAttention (block-sparse) is the main peer of windowed shapes, where SDPA takes a dense mask
MAIN = {"fp32": ("flex", "sdpa:efficient"), "fp16": ("flex", "sdpa:flash"), "fp16 fwd+bwd": ("flex", "sdpa:flash")}
MODES = (("fp32", torch.float32), ("fp16", torch.float16), ("fp16 fwd+bwd", torch.float16))
GOAL = [dict(B=1, H=16, T=16384, D=64)]
GRIDS = {
    "tiny": [dict(B=1, H=2, T=40, D=16), dict(B=1, H=2, T=40, D=16, causal=True, window=12),
             dict(B=1, H=2, T=40, D=16, causal=True, seqs=2)],
    "goal": GOAL,
    "quick": GOAL,
    "full": [dict(B=1, H=16, T=T, D=64, causal=c, window=w) for T in (4096, 16384, 65536)
             for c, w in ((None, None), (True, None), (True, 1024))]
    + [dict(B=1, H=16, T=T, D=64, causal=True, seqs=8) for T in (4096, 16384, 65536)],
}
CHECK_ROWS = 512


def packed(B: int, T: int, seqs: int | None, device):
    """``(batch, length, cu_seqlens)``: with ``seqs``, the ``B * T`` tokens as ``seqs`` sequences of equal length
    packed into one row (our op reads ``cu_seqlens``; the peers and the reference see them as a batch, the same
    problem; the last one is checked, as it would see the others were the packing ignored); otherwise
    ``(B, T, None)``."""
    if seqs is None:
        return B, T, None
    if B != 1 or T % seqs:
        raise ValueError(f"seqs: expected B == 1 and T divisible by seqs, got B = {B}, T = {T}, seqs = {seqs}")
    return seqs, T // seqs, torch.arange(0, T + 1, T // seqs, device=device, dtype=torch.int32)


def cases(shape: dict, setup):
    """Shape keys: B, H, T, D, causal, window (implies causal), seqs (packed sequences), precision (only the fp32
    mode, and of ours only that precision). Modes: "fp32" and "fp16" (the input dtype, forward) and
    "fp16 fwd+bwd"."""
    H, D, w = shape["H"], shape["D"], shape.get("window")
    if shape.get("causal") not in (None, True, False):
        raise ValueError(f"causal: expected true or false, got {shape['causal']!r}")
    only = shape.get("precision")
    if only is not None and only not in PRECISIONS:
        raise ValueError(f"precision: expected one of {', '.join(PRECISIONS)}, got {only!r}")
    causal = bool(shape.get("causal")) or w is not None
    B, T, cu = packed(shape["B"], shape["T"], shape.get("seqs"), setup.device)
    for mode, dtype in MODES[:1] if only else MODES:
        bwd = backward(mode)
        q, k, v = (randn(setup, B, T, H, D, dtype=dtype, grad=bwd) for _ in range(3))
        truth = check(mode, q, k, v, w, causal=causal, rows=CHECK_ROWS, batch=B - 1)
        n = dict(flops=counts.attention_flops(B, T, T, H, D, D, causal=causal, window=w, backward=bwd),
                 bytes=counts.attention_bytes(B, T, T, H, H, D, D, q.element_size(), backward=bwd))
        leaves = [q, k, v] if bwd else []
        for precision in ((only,) if only else PRECISIONS) if dtype == torch.float32 else ("ieee",):
            tag = f"[{precision}]" if dtype == torch.float32 else ""
            call = lambda p=precision: scan_call(q, k, v, cu, causal=causal, window=w, precision=p,
                                                 backend=setup.backend)
            yield mode, ours(regattn.scan_attention, q, setup, call, leaves, tag=tag, check=truth, **n)
        yield from sdpa_cases(setup, mode, q, k, v, causal=causal, window=w, check=truth, **n)
        if w is not None:
            yield from flex_case(setup, mode, q, k, v, window=w, check=truth, **n)
        yield from reference_case(setup, mode, lambda: reference.scan_attention(q, k, v, causal=causal, window=w),
                                  leaves, check=truth, **n)


def scan_call(q, k, v, cu_seqlens, **kwargs):
    """``regattn.scan_attention`` of the batch ``q, k, v``, or with ``cu_seqlens`` of its rows packed into one."""
    if cu_seqlens is None:
        return regattn.scan_attention(q, k, v, **kwargs)
    B, T = q.shape[:2]
    flat = [x.reshape(1, B * T, *x.shape[2:]) for x in (q, k, v)]
    o = regattn.scan_attention(*flat, cu_seqlens=cu_seqlens, max_seqlen=T, **kwargs)
    return o.view(B, T, *o.shape[2:])


# The fp16/bf16 backward's forms for time_backward_variants: (label, the kernels' switches it sets).
BACKWARD_VARIANTS = (("two passes", dict(FUSED_DQ=False, TENSOR_DESCRIPTORS=True)),
                     ("fused, atomics", dict(FUSED_DQ=True, TENSOR_DESCRIPTORS=False)),
                     ("fused", dict(FUSED_DQ=True, TENSOR_DESCRIPTORS=True)))


def time_variants(mode: str, variants, shapes=None, *, dtype=torch.float16, precision="ieee", device="cuda",
                  rep_ms=100, rounds=3) -> list[dict]:
    """Time the scan in ``mode`` (``"fp16"`` or ``"fp32"``: forward, ``"fp16 fwd+bwd"``) in each form of
    ``variants`` (label, the switches of :mod:`regattn.ops.scan.kernels` it sets), beside SDPA flash and cuDNN
    (fp32 ``dtype``: SDPA efficient; ``precision``: ours for fp32 inputs), side by side in one process
    (:func:`regattn.bench.variants.time_in_rounds`); every form of ours checked against float64 on the last rows.
    ``shapes``: dicts of B, H, T, D and optionally ``causal`` and ``seqs`` (packed sequences, see :func:`packed`)
    (default: the goal shape). Returns one dict per (shape, contender): ``shape``, ``op`` and the timing's keys."""
    from regattn.bench.runner import Setup, case_errors
    from regattn.bench.variants import Contender, time_in_rounds
    from regattn.ops.scan import kernels

    backends = ("efficient",) if dtype == torch.float32 else ("flash", "cudnn")
    setup = Setup(dtype=dtype, device=device, backend="triton", peers=tuple(f"sdpa-{b}" for b in backends),
                  rep_ms=rep_ms)
    rows, grad = [], backward(mode)
    for shape in shapes or GOAL:
        causal = bool(shape.get("causal"))
        B, T, cu = packed(shape["B"], shape["T"], shape.get("seqs"), setup.device)
        q, k, v = (randn(setup, B, T, shape["H"], shape["D"], grad=grad) for _ in range(3))
        truth = check(mode, q, k, v, None, causal=causal, rows=CHECK_ROWS, batch=B - 1)
        leaves = [q, k, v] if grad else []
        case = ours(regattn.scan_attention, q, setup, lambda: scan_call(
            q, k, v, cu, causal=causal, precision=precision, backend="triton"), leaves, check=truth)
        labels, contenders = [], []
        for label, switches in variants:
            labels.append(f"regattn:triton ({label})")
            setting = contextlib.nullcontext
            if switches:
                setting = functools.partial(mock.patch.multiple, kernels, **switches)
            contenders.append(Contender({mode: (case.call, case.leaves)}, setting, lambda: case_errors(case, mode)))
        for _, peer in sdpa_cases(setup, mode, q, k, v, causal=causal, backends=backends):
            labels.append(peer.op)
            contenders.append(Contender({mode: (peer.call, peer.leaves)}))
        for label, row in zip(labels, time_in_rounds(contenders, cuda=setup.cuda, rep_ms=rep_ms, rounds=rounds)):
            rows.append(dict(shape=shape, op=label, **row))
    return rows


def time_backward_variants(shapes=None, **kwargs) -> list[dict]:
    """:func:`time_variants` of the fp16 forward+backward in each form of :data:`BACKWARD_VARIANTS`.

    On a GPU: ``python -c "from regattn.bench.suites.scan import time_backward_variants as t; print(t())"``"""
    return time_variants("fp16 fwd+bwd", BACKWARD_VARIANTS, shapes, **kwargs)
