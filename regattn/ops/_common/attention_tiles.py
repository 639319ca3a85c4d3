"""Tile steps shared by the FlashAttention-style kernels: key ranges, masks, the online softmax, blocks.

Conventions of every kernel that uses these pieces:

* Logits are kept in base 2: ``s2 = log2(e) * (scale * q.k + u_i - u_j)``, so the softmax uses ``exp2``
  and the saved log-sum-exp ``lse2`` is in base 2 too.
* Queries are aligned to the end of the keys: query row ``i`` of a sequence with ``Tq`` queries and
  ``Sk`` keys sits at key position ``pos = i + Sk - Tq``. ``CAUSAL`` keeps ``j <= pos``; a window
  ``WINDOW > 0`` keeps ``j > pos - WINDOW`` (``WINDOW = 0`` means no window).
* A key or query tile is *full* when every (row, key) pair in it is visible; full tiles skip the mask.
* Containment: in a partially masked tile, a non-finite key, value, query or gradient reaches only the
  rows that see it. Hidden scores are selected to exact zeros (``tl.where``) and products over the masked
  dim go through :func:`contained_dot`, since ``0 * NaN = NaN`` inside a plain ``tl.dot``.
"""
from __future__ import annotations

import contextlib
import os

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from regattn.ops._common.checks import capturing, compute_capability
from regattn.ops._common.ints import ceil_div, next_pow2
from regattn.ops._common.launch import launch

LOG2E = 1.4426950408889634


# Building tensor descriptors and encoding them at each launch costs the host time: 32 to 40 us a call more than
# pointers for Parallax's decode on the H200 (ops/parallax/decode.py), so a call over the tensor cores takes them only
# captured in a CUDA graph or from this much work (B x HQ x T x S x D: the q k^T and p v products of 2^31 take about
# 20 us at 400 TFLOP/s).
TMA_WORK = 2 ** 31


def tma_pays(work: int, enough: int | None = None) -> bool:
    """Whether a call of ``work`` takes tensor descriptors: from ``enough`` on (:data:`TMA_WORK` of B x HQ x T x S
    x D by default), or captured in a CUDA graph; code that torch.compile traces keeps its pointer loads."""
    if torch.compiler.is_compiling():
        return False
    return work >= (TMA_WORK if enough is None else enough) or capturing()


def tma_descriptors(*pairs) -> tuple | None:
    """Tensor descriptors (for Hopper's tensor-memory copies) of ``(tensor, box)`` pairs, or None before Hopper or
    where a tensor's base or a stride is not 16-byte aligned or its last dim not contiguous (TMA's rules)."""
    first = pairs[0][0]
    if first.is_cuda and compute_capability(first.device) < (9, 0):
        return None
    for x, _ in pairs:
        if x.stride(-1) != 1 or x.data_ptr() % 16 or any(st * x.element_size() % 16 for st in x.stride()[:-1]):
            return None
    return tuple(TensorDescriptor(x, list(x.shape), list(x.stride()), list(box)) for x, box in pairs)


# Per-kind launch settings that replace the heuristics of :func:`attention_blocks` (for tuning sweeps),
# e.g. ``BLOCK_OVERRIDES["fwd"] = dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=2)``.
BLOCK_OVERRIDES: dict[str, dict] = {}
# fp16/bf16 launch settings per kind of the kernels with the gate bias (GatedFWA) where they differ from those of
# the kernels without it. H100, bf16, B1 H16 T32768 D128 window 512 (``time_tile_variants`` of the gatedfwa
# bench, 3 rounds, benchmarks/results/h100/tiles/gatedfwa-d128.json): forward+backward 2.06 ms with the dK/dV
# pass on 32 x 64 tiles (3 stages) against 2.21 on the softmax's 64 x 64 (which spills 136 bytes a thread
# with the gate). The forward takes the softmax's 64 x 64 (0.467 ms, against 0.492 on 64 x 32).
GATED_BLOCKS: dict[str, dict] = {
    "bwd_kv": dict(BLOCK_M=32, BLOCK_N=64, num_warps=4, num_stages=3),
}


@contextlib.contextmanager
def overridden_blocks(settings: dict[str, dict]):
    """Within the block, :data:`BLOCK_OVERRIDES` holds ``settings`` (full launch settings per kind) over its
    own entries; on leaving it holds what it held before."""
    before = dict(BLOCK_OVERRIDES)
    BLOCK_OVERRIDES.update(settings)
    try:
        yield
    finally:
        BLOCK_OVERRIDES.clear()
        BLOCK_OVERRIDES.update(before)


@triton.jit
def key_span(pos_lo, pos_hi, Sk, CAUSAL: tl.constexpr, WINDOW: tl.constexpr):
    """Keys ``[lo, hi)`` some query with position in ``[pos_lo, pos_hi]`` can see."""
    lo = 0
    hi = Sk
    if CAUSAL:
        hi = tl.minimum(pos_hi + 1, Sk)
    if WINDOW > 0:
        lo = tl.maximum(pos_lo - WINDOW + 1, 0)
    return lo, hi


@triton.jit
def full_key_span(pos_lo, pos_hi, Sk, CAUSAL: tl.constexpr, WINDOW: tl.constexpr):
    """Keys ``[lo, hi)`` that every query with position in ``[pos_lo, pos_hi]`` sees (may be empty)."""
    lo = 0
    hi = Sk
    if CAUSAL:
        hi = tl.minimum(pos_lo + 1, Sk)
    if WINDOW > 0:
        lo = tl.maximum(pos_hi - WINDOW + 1, 0)
    return lo, hi


@triton.jit
def query_span(key_lo, key_hi, Tq, off, CAUSAL: tl.constexpr, WINDOW: tl.constexpr):
    """Query rows ``[lo, hi)`` that see some key of ``[key_lo, key_hi]``, and ``[full_lo, full_hi)`` that see all.

    Rows sit at positions ``row + off``; the result is clipped to ``[0, Tq)``.
    """
    lo = 0
    hi = Tq
    full_lo = 0
    full_hi = Tq
    if CAUSAL:
        lo = tl.maximum(key_lo - off, 0)
        full_lo = tl.maximum(key_hi - off, 0)
    if WINDOW > 0:
        hi = tl.minimum(key_hi + WINDOW - off, Tq)
        full_hi = tl.minimum(key_lo + WINDOW - off, Tq)
    return lo, hi, full_lo, full_hi


@triton.jit
def query_tile(CAUSAL: tl.constexpr):
    """This program's query tile along grid axis 0. Under a causal mask a later tile sees more keys, so the tiles
    run last first: the GPU starts programs in the order of their ids, and the launch's last programs then take
    the shortest tiles, not the longest (the launch's tail). Without one, in order."""
    pid = tl.program_id(0)
    if CAUSAL:
        pid = tl.num_programs(0) - 1 - pid
    return pid


@triton.jit
def tile_loop_bounds(lo, hi, full_lo, full_hi, BLOCK: tl.constexpr):
    """Split ``[lo, hi)`` into block starts ``[a, b)`` masked, ``[b, c)`` full, ``[c, hi)`` masked.

    ``a`` is ``lo`` rounded down to the block; full tiles lie inside ``[full_lo, full_hi)``.
    """
    a = (lo // BLOCK) * BLOCK
    end = tl.cdiv(hi, BLOCK) * BLOCK
    b = tl.minimum(tl.maximum(tl.cdiv(full_lo, BLOCK) * BLOCK, a), end)
    c = tl.minimum(tl.maximum((full_hi // BLOCK) * BLOCK, b), end)
    return a, b, c


@triton.jit
def _visible(pos, keys, Sk, CAUSAL: tl.constexpr, WINDOW: tl.constexpr):
    """Visibility of broadcastable ``pos`` and ``keys`` (one a column, the other a row). Without ``CAUSAL``
    every key is visible, also to the rows before the keys' start (``pos < 0``) when there are more queries
    than keys."""
    keep = (keys + 0 * pos < Sk) & (keys >= 0)  # (0 * pos: the mask takes the tile's shape)
    if CAUSAL:
        keep = keep & (keys <= pos)
    if WINDOW > 0:
        keep = keep & (keys > pos - WINDOW)
    return keep


@triton.jit
def visible_mask(pos, offs_k, Sk, CAUSAL: tl.constexpr, WINDOW: tl.constexpr):
    """Boolean ``[BM, BN]``: key ``offs_k`` (``[BN]``) is visible to the query at ``pos`` (``[BM]``)."""
    return _visible(pos[:, None], offs_k[None, :], Sk, CAUSAL, WINDOW)


@triton.jit
def visible_mask_t(offs_k, pos, Sk, CAUSAL: tl.constexpr, WINDOW: tl.constexpr):
    """The transpose, ``[BN, BM]``, for kernels that keep keys on the rows (the dK/dV backward)."""
    return _visible(pos[None, :], offs_k[:, None], Sk, CAUSAL, WINDOW)


@triton.jit
def online_softmax_step(m_i, l_i, s, scale2, AXIS: tl.constexpr = 1):
    """One FlashAttention update with base-2 logits ``scale2 * s`` (``s: [BM, BN]``, ``-inf`` where hidden;
    ``scale2 > 0``; with ``AXIS = 0`` the transpose ``[BN, BM]``, the keys on the rows).

    Returns ``(m_new, l_new, p, alpha)``: the running max and sum, the tile's unnormalised
    weights ``p = exp2(scale2 * s - m_new)`` (one fused multiply-add per entry) and the factor ``alpha`` that
    rescales the old accumulator. Rows that have seen no key yet keep ``m = -inf`` and get ``p = 0`` (never
    NaN). Callers whose logits are already scaled pass ``scale2 = 1.0``.
    """
    m_new = tl.maximum(m_i, tl.max(s, AXIS) * scale2)
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s * scale2 - tl.expand_dims(m_use, AXIS))
    alpha = tl.exp2(m_i - m_use)
    l_new = l_i * alpha + tl.sum(p, AXIS)
    return m_new, l_new, p, alpha


@triton.jit
def contained_dot(acc, w, x, seen, PRECISION: tl.constexpr):
    """``acc + w @ x`` over the pairs ``seen`` for a partially masked tile.

    ``w: [R, C]`` counts only where ``seen`` (``[R, C]``) is True (elsewhere it is selected to 0, whatever it
    holds); ``x: [C, E]``. A row ``x_c`` with a non-finite entry enters the product as 0 and makes NaN the
    rows that see it, so it reaches no other row.
    """
    finite = tl.abs(x) < float("inf")
    x_safe = tl.where(finite, x, 0.0).to(x.dtype)
    acc += tl.dot(tl.where(seen, w, 0.0).to(x.dtype), x_safe, input_precision=PRECISION)
    return _poison_seen(acc, finite, seen)


@triton.jit
def sees_non_finite_t(seen_t, x):
    """``[R]``: 1 where the column ``r`` of ``seen_t [C, R]`` (the keys on the rows) sees a row ``x_c`` of
    ``x [C, E]`` that holds a non-finite entry; the mask of :func:`contained_dot_t`, taken before the softmax step
    so that ``seen_t`` need not stay live until the product."""
    return tl.max(tl.where(seen_t, _bad_rows(tl.abs(x) < float("inf"))[:, None], 0), 0)


@triton.jit
def contained_dot_t(acc_t, w_t, x, hits, PRECISION: tl.constexpr):
    """The transpose of :func:`contained_dot`: ``acc_t + x^T @ w_t`` with ``acc_t: [E, R]``, ``w_t: [C, R]`` (the
    keys on the rows; 0 where hidden) and ``x: [C, E]``; a column ``r`` with ``hits[r] > 0``
    (:func:`sees_non_finite_t`) is NaN."""
    x_safe = tl.where(tl.abs(x) < float("inf"), x, 0.0).to(x.dtype)
    acc_t += tl.dot(tl.trans(x_safe), w_t.to(x.dtype), input_precision=PRECISION)
    return tl.where(hits[None, :] > 0, float("nan"), acc_t)


@triton.jit
def _bad_rows(finite):
    """``[C]``: 1 where the row ``c`` of ``finite [C, E]`` is not all True (``x_c`` holds a non-finite entry)."""
    return tl.max(tl.where(finite, 0, 1), 1)


@triton.jit
def _poison_seen(acc, finite, seen):
    """``acc`` with NaN in the rows that see (``seen [R, C]``) a row ``c`` of ``finite [C, E]`` not all True."""
    hits = tl.max(tl.where(seen, _bad_rows(finite)[None, :], 0), 1)  # [R]: the row sees such an x_c
    return tl.where(hits[:, None] > 0, float("nan"), acc)


# fp32 magnitudes from this one on round to inf at TF32's precision (0x7F7FF000: the last half step below 2^128)
TF32_ROUNDS_TO_INF = tl.constexpr(float.fromhex("0x1.ffep127"))


@triton.jit
def _nearest_tf32_bits(x):
    """``x`` rounded to its nearest TF32 value (10 mantissa bits, ties away from zero, as ``cvt.rna.tf32``) by an
    integer addition: its carry turns a NaN whose payload fills the mantissa into a zero, and a value within half
    a TF32 step of fp32's largest into inf."""
    return ((x.to(tl.uint32, bitcast=True) + 0x1000) & 0xFFFFE000).to(tl.float32, bitcast=True)


@triton.jit
def tf32_round(x):
    """``x`` rounded to its nearest TF32 value, NaN kept NaN; a value past TF32's largest rounds to inf, as a cast
    to any narrower format does. The tensor cores read an fp32 operand as TF32 by dropping its low 13 bits, a
    biased truncation; rounding first halves the error and removes the bias."""
    return tl.where(x == x, _nearest_tf32_bits(x), x)


@triton.jit
def tf32_parts(x, KEEP_EXTREMES: tl.constexpr = True):
    """``(hi, lo)``: ``x`` rounded to its nearest TF32 value and the exact rest, whose leading 11 bits a TF32
    product reads: ``x`` to within ``2^-21`` (with ``x`` truncated to TF32 instead, ``2^-20``: the scan's error
    grew by half). Operands of :func:`split_dot`.

    With ``KEEP_EXTREMES`` a value that would round to inf is its own high part (the tensor cores then truncate
    it), and so are inf and NaN. Without, the parts add up to NaN wherever ``x`` is not finite or within half a
    TF32 step of fp32's largest value, and so do their products: where no such value can be finite in the rest of
    the computation, a select an entry saved (MesaNet's kernels ran 4-7% slower with it on the H200:
    benchmarks/results/h200/tiles/mesanet-tf32-parts.json)."""
    hi = _nearest_tf32_bits(x)
    if KEEP_EXTREMES:
        hi = tl.where(tl.abs(x) < TF32_ROUNDS_TO_INF, hi, x)
    return hi, x - hi


@triton.jit
def split_dot(a_hi, a_lo, b_hi, b_lo):
    """``(a_hi + a_lo) @ (b_hi + b_lo)`` less the ``a_lo @ b_lo`` term: three products, the small ones first
    (:mod:`regattn.ops.scan.split`). It starts from zero: Hopper's tensor cores truncate what they add to their
    accumulator, so a running sum is added to it by the caller, rounded, not passed in (which, over 256 tiles of
    keys, biased a sum by 5.7e-5). fp32 parts multiply as TF32 (whatever the default precision)."""
    acc = tl.dot(a_lo, b_hi, input_precision="tf32")
    acc = tl.dot(a_hi, b_lo, acc, input_precision="tf32")
    return tl.dot(a_hi, b_hi, acc, input_precision="tf32")


@triton.jit
def contained_split_dot(acc, w_hi, w_lo, x_hi, x_lo, seen):
    """:func:`contained_dot` of split operands (:func:`split_dot`): ``x_lo`` is non-finite exactly where
    ``x_hi`` is."""
    finite = tl.abs(x_hi) < float("inf")
    hi = tl.where(finite, x_hi, 0.0).to(x_hi.dtype)
    lo = tl.where(finite, x_lo, 0.0).to(x_lo.dtype)
    acc += split_dot(tl.where(seen, w_hi, 0.0).to(w_hi.dtype), tl.where(seen, w_lo, 0.0).to(w_lo.dtype), hi, lo)
    return _poison_seen(acc, finite, seen)


@triton.jit
def softmax_finish(acc, m_i, l_i):
    """Normalise the accumulator; returns ``(o, lse2)``. Rows that saw no key give ``o = 0``, ``lse2 = +inf``."""
    empty = l_i == 0.0
    o = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse2 = tl.where(empty, float("inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
    return o, lse2


@triton.jit
def _row_dot_kernel(A, B, OUT, ZEROS, n_rows, D, ZD, stride_a, stride_b, T, H, BLOCK_R: tl.constexpr,
                    BLOCK_D: tl.constexpr, BLOCK_ZD: tl.constexpr, HEADS_FIRST: tl.constexpr, ZERO: tl.constexpr):
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows < n_rows)[:, None] & (cols < D)[None, :]
    a = tl.load(A + rows[:, None] * stride_a + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + rows[:, None] * stride_b + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    out = rows
    if HEADS_FIRST:  # row (b, t, h) of [B, T, H] goes to (b, h, t)
        out = rows // (T * H) * (T * H) + rows % H * T + rows // H % T
    tl.store(OUT + out, tl.sum(a * b, 1), mask=rows < n_rows)
    if ZERO:
        zcols = tl.arange(0, BLOCK_ZD)
        tl.store(ZEROS + rows[:, None] * ZD + zcols[None, :], tl.zeros([BLOCK_R, BLOCK_ZD], tl.float32),
                 mask=(rows < n_rows)[:, None] & (zcols < ZD)[None, :])


def row_dot(a: torch.Tensor, b: torch.Tensor, *, heads_first: bool = False, zeros: torch.Tensor | None = None):
    """``sum_d a[..., d] * b[..., d]`` in fp32 for contiguous ``a, b: [..., D]`` -> ``[...]``.

    The backward's ``delta = rowsum(o * dO)``, fused so no fp32 copy of ``o`` or ``dO`` is made.
    ``heads_first``: ``a, b: [B, T, H, D]`` give ``[B, H, T]`` (the layout of the kernels' log-sum-exp).
    ``zeros``: a contiguous fp32 ``[..., Dz]`` with ``a``'s leading dims that the same launch fills with zeros
    (the backward's fp32 ``dq`` that its atomics add into).
    """
    D = a.shape[-1]
    a2, b2 = a.reshape(-1, D), b.reshape(-1, D)
    n = a2.shape[0]
    T = H = 1
    shape = a.shape[:-1]
    if heads_first:
        if a.dim() != 4:
            raise ValueError(f"a: heads_first takes [B, T, H, D], got shape {tuple(a.shape)}")
        Bh, T, H = shape
        shape = (Bh, H, T)
    if zeros is not None and (zeros.shape[:-1] != a.shape[:-1] or zeros.dtype != torch.float32
                              or not zeros.is_contiguous() or zeros.device != a.device):
        raise ValueError(f"zeros: expected a contiguous fp32 tensor of shape [{', '.join(map(str, a.shape[:-1]))}, "
                         f"*] on {a.device}, got {zeros.dtype} {tuple(zeros.shape)} on {zeros.device}")
    zd = zeros.shape[-1] if zeros is not None else 1
    out = torch.empty(shape, device=a.device, dtype=torch.float32)
    block_d = next_pow2(D)
    block_r = max(1, min(64, 4096 // max(block_d, next_pow2(zd))))
    launch(_row_dot_kernel, (ceil_div(n, block_r),), a2, b2, out, out if zeros is None else zeros, n, D, zd,
           a2.stride(0), b2.stride(0), T, H, BLOCK_R=block_r, BLOCK_D=block_d, BLOCK_ZD=next_pow2(zd),
           HEADS_FIRST=heads_first, ZERO=zeros is not None)
    return out


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def tile_configs(tiles) -> list:
    """Autotune configs from ``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` tiles."""
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in tiles]


# From 2^19 rows on (B 1, 16 heads, T 16384) a launch fills an H100 with many waves of every tile: the tile
# timed there is kept for larger launches, whose tuning would run each candidate for seconds (the scan's strict
# fp32 forward takes 0.9 s a call at B 1, 16 heads, T 65536).
SIZE_CLASS_CAP = 19


def size_class(rows: int) -> int:
    """A kernel's ``SIZE_CLASS`` argument, in its autotuner's key: the bit length of the rows a launch covers
    (batch x heads x length), at most :data:`SIZE_CLASS_CAP`, so a tile timed at one size is not reused at sizes
    2x and more away. Without it, a 32-row tile chosen at B 1, 4 heads, T 1024 ran FlashLLA 1.8x slower at
    B 4, 16 heads, T 8192 on an H100 (and the autotuner's disk cache carries that choice between processes)."""
    return min(max(int(rows), 1).bit_length(), SIZE_CLASS_CAP)


def head_block(d: int) -> int:
    """Padded head dim: a power of two >= 16 (``tl.dot`` needs it); masks cover the padding."""
    return max(16, next_pow2(d))


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs get exact fp32 products (``"ieee"``), not tf32; fp16/bf16 use the tensor cores."""
    return "ieee" if dtype == torch.float32 else "tf32"


def attention_blocks(head_dim: int, dtype: torch.dtype, kind: str, *, gated: bool = False) -> dict:
    """Tile sizes and launch settings for ``kind`` in ``"fwd" | "bwd_kv" | "bwd_q"``.

    The interpreter gets 16 x 16 tiles (fast on CPU); a GPU gets FlashAttention-2 sized tiles.
    ``BLOCK_M`` tiles queries and ``BLOCK_N`` tiles keys in every kind. ``gated``: the kernels with the gate
    bias, which take the entry of :data:`GATED_BLOCKS` where it has one for ``kind``.
    """
    if kind in BLOCK_OVERRIDES:
        return dict(BLOCK_OVERRIDES[kind])
    if interpreting():
        return dict(BLOCK_M=16, BLOCK_N=16, num_warps=1, num_stages=1)
    if dtype == torch.float32:  # exact fp32 products need smaller tiles
        return dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2)
    if gated and kind in GATED_BLOCKS:
        return dict(GATED_BLOCKS[kind])
    if kind == "fwd":  # H100 sweeps, bf16, d=128, w=512: 64 x 64 beat 128 x 64, 128 x 128 and 64 x 32
        return dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3)
    if kind in ("bwd_kv", "bwd_q"):
        return dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2)
    raise ValueError(f"kind: expected 'fwd', 'bwd_kv' or 'bwd_q', got {kind!r}")
