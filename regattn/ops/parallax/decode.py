"""Parallax decode in Triton: parallax.txt Appendix C.1, for one new token or a chunk of them.

* The query rows and the probe rows share one tile (queries on top, probes below), so ``S1 = Q K^T``
  and ``S2 = R K^T`` come out of one product, and ``[P1; P2] V`` gives ``O1`` and ``O2`` together.
* The K/V loop of each (batch, key/value head, row tile) is split over ``NUM_SPLITS`` programs so that
  small batches fill the GPU. Each writes its partial state ``(m, d1, d2, O1, O2)`` in fp32, merged by a
  log-sum-exp rescale in fp32: by a second launch, one program per row tile and slice of the value columns,
  every split's partial read at once; or, in eager calls whose time is the host's (:func:`merges_in_launch`),
  by the last split of each row tile to finish, in the same launch (counted in a state each call leaves as it
  found it: :func:`regattn.ops._common.workspace.stream_zeros`). One split writes the output directly.

Queries sit at the end of each sequence's valid cache: new token ``t`` of ``Tn`` is at position
``cache_seqlens[b] - Tn + t`` (the new keys and values are already in the cache).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from regattn.ops._common.checks import last_dim_contiguous, sm_count
from regattn.ops._common.ints import ceil_div, next_pow2
from regattn.ops._common.attention_tiles import tma_pays
from regattn.ops._common.launch import launch as launch_kernel
from regattn.ops._common.workspace import stream_zeros
from regattn.ops.parallax.tiles import (
    LOG2E, contained_dot, dot_precision, group_pad, head_block, interpreting, key_range, kv_descriptors, kv_tile,
    split_range, tile_config, visible,
)


@triton.jit
def _stack_rows(top, bottom):
    """``[H, N], [H, N] -> [2H, N]``."""
    HALF: tl.constexpr = top.shape[0]
    N: tl.constexpr = top.shape[1]
    return tl.reshape(tl.permute(tl.join(top, bottom), (2, 0, 1)), (2 * HALF, N))


@triton.jit
def _unstack_rows(x):
    """``[2H, N] -> ([H, N], [H, N])``."""
    M: tl.constexpr = x.shape[0]
    N: tl.constexpr = x.shape[1]
    return tl.split(tl.permute(tl.reshape(x, (2, M // 2, N)), (1, 2, 0)))


@triton.jit
def _stack_vec(a):
    """``[H] -> [2H]`` holding ``a`` twice (one copy per half of the tile)."""
    H: tl.constexpr = a.shape[0]
    return tl.reshape(tl.permute(tl.join(a, a), (1, 0)), (2 * H,))


@triton.jit
def _finish(o1, o2, d1, d2):
    """eq. (14) from the accumulators ``O1, O2`` and the row sums; zeros where ``d1 = 0``."""
    inv = tl.where(d1 > 0, 1.0 / tl.where(d1 > 0, d1, 1.0), 0.0)
    return (o1 * (1.0 + d2 * inv)[:, None] - o2) * inv[:, None]


@triton.jit
def _decode_tile(qr, K, V, K_DESC, V_DESC, b, h, j0, qpos, klen, window, sk_t, sv_t, m_i, d1, d2, acc, qk_scale,
                 D, DV, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, MASK: tl.constexpr,
                 HAS_WINDOW: tl.constexpr, PRECISION: tl.constexpr, TMA: tl.constexpr):
    """One key tile of the online softmax over the stacked ``[Q; R]`` rows; ``MASK``: a tile some rows see only in
    part, or not at all (through descriptors, keys from ``klen`` on are read too: the masks keep them out)."""
    kt = kv_tile(K_DESC, K, b, h, j0, klen, sk_t, D, BLOCK_N, BLOCK_D, True, TMA)
    v = kv_tile(V_DESC, V, b, h, j0, klen, sv_t, DV, BLOCK_N, BLOCK_DV, False, TMA)
    s1, s2 = _unstack_rows(tl.dot(qr, kt, input_precision=PRECISION))
    s1 = s1 * qk_scale
    if MASK:
        seen = visible(qpos, j0 + tl.arange(0, BLOCK_N), klen, window, True, HAS_WINDOW)
        s1 = tl.where(seen, s1, float("-inf"))
        s2 = tl.where(seen, s2, 0.0)
    m_new = tl.maximum(m_i, tl.max(s1, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_use)
    p1 = tl.math.exp2(s1 - m_use[:, None])
    p2 = p1 * s2
    d1 = d1 * alpha + tl.sum(p1, 1)
    d2 = d2 * alpha + tl.sum(p2, 1)
    pp = _stack_rows(p1, p2)
    acc = acc * _stack_vec(alpha)[:, None]
    if MASK:  # a non-finite value reaches only the rows that see its key
        acc = contained_dot(acc, pp, v, _stack_rows(seen, seen), PRECISION)
    else:
        acc = tl.dot(pp.to(v.dtype), v, acc, input_precision=PRECISION)
    return m_new, d1, d2, acc


@triton.jit
def _parallax_decode_kernel(
    Q, R, K, V, O, LENS, WS, COUNT, K_DESC, V_DESC, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h,
    TN, S, H, D, DV, n_row_tiles, qk_scale, window,
    G: tl.constexpr, GP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, NUM_SPLITS: tl.constexpr, HAS_LENS: tl.constexpr,
    HAS_WINDOW: tl.constexpr, PRECISION: tl.constexpr, TMA: tl.constexpr, MERGE: tl.constexpr = False,
    BLOCK_C: tl.constexpr = 1,
):
    """Grid ``(B * H * n_row_tiles, NUM_SPLITS)``; a tile is ``BLOCK_M // 2`` query rows over as many probe rows.

    ``Q``, ``R`` (``[B, TN, H * G, D]``) and ``O`` (``[B, TN, H * G, DV]``) are contiguous. With more than one
    split, ``WS`` takes each split's partial ``[O1; O2]`` tile, then its ``(m, d1, d2)`` rows (fp32; see
    :func:`_merge_splits_kernel`) and ``O`` is not written, unless ``MERGE``: then the last split of a row tile to
    finish (counted in ``COUNT[row tile]``, zero before the launch and set back to zero) merges them, ``BLOCK_C``
    value columns at a time. ``TMA``: key and value tiles come through the tensor descriptors ``K_DESC``,
    ``V_DESC`` of the caches (Hopper's tensor-memory copies; rows past ``S`` read as 0).
    """
    HALF: tl.constexpr = BLOCK_M // 2
    BLOCK_T: tl.constexpr = HALF // GP
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = (pid // (H * n_row_tiles)).to(tl.int64)  # 64-bit batch offsets
    h = (pid // n_row_tiles) % H
    t0 = (pid % n_row_tiles) * BLOCK_T
    klen = S
    if HAS_LENS:  # clamped to the cache: a bad length reads no key past it
        klen = tl.minimum(tl.maximum(tl.load(LENS + b).to(tl.int32), 0), S)
    off = klen - TN

    # stacked [Q; R] tile: row m < HALF is query row m, row m >= HALF is probe row m - HALF
    m = tl.arange(0, BLOCK_M)
    row = m % HALF
    t = t0 + row // GP
    g = row % GP
    hq = h * G + g
    ok = (g < G) & (t < TN)
    offs_d = tl.arange(0, BLOCK_D)
    qr_off = ((b * TN + t) * (H * G) + hq)[:, None] * D + offs_d[None, :]
    qr_ptr = tl.where((m < HALF)[:, None], Q + qr_off, R + qr_off)
    qr = tl.load(qr_ptr, mask=ok[:, None] & (offs_d[None, :] < D), other=0.0)
    qpos = t0 + tl.arange(0, HALF) // GP + off
    K += b * sk_b + h * sk_h
    V += b * sv_b + h * sv_h
    offs_dv = tl.arange(0, BLOCK_DV)

    # the visible key tiles of the tile's real rows, [lo, hi), of which every row sees [full_lo, full_hi) whole;
    # this split's share of them
    lo, full_lo, full_hi, hi = key_range(t0 + off, tl.minimum(t0 + BLOCK_T, TN) - 1 + off, klen, window, BLOCK_N,
                                         True, HAS_WINDOW)
    per_split = tl.cdiv(tl.cdiv(tl.maximum(hi - lo, 0), BLOCK_N), NUM_SPLITS) * BLOCK_N
    start = lo + split * per_split
    end = tl.minimum(hi, start + per_split)
    # The whole tiles' values feed tl.dot alone, so the pipeliner copies key and value tiles ahead (with the masked
    # tiles' elementwise use in the same loop, the value tiles came through registers). The masked tiles around
    # them, a tile or two a program, run unpipelined.
    whole_lo, whole_hi = split_range(start, end, full_lo, full_hi)

    m_i = tl.full([HALF], float("-inf"), tl.float32)
    d1 = tl.zeros([HALF], tl.float32)
    d2 = tl.zeros([HALF], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for j0 in tl.range(start, whole_lo, BLOCK_N, num_stages=1):
        m_i, d1, d2, acc = _decode_tile(qr, K, V, K_DESC, V_DESC, b, h, j0, qpos, klen, window, sk_t, sv_t, m_i, d1,
                                        d2, acc, qk_scale, D, DV, BLOCK_N, BLOCK_D, BLOCK_DV, True, HAS_WINDOW,
                                        PRECISION, TMA)
    for j0 in range(whole_lo, whole_hi, BLOCK_N):
        m_i, d1, d2, acc = _decode_tile(qr, K, V, K_DESC, V_DESC, b, h, j0, qpos, klen, window, sk_t, sv_t, m_i, d1,
                                        d2, acc, qk_scale, D, DV, BLOCK_N, BLOCK_D, BLOCK_DV, False, HAS_WINDOW,
                                        PRECISION, TMA)
    for j0 in tl.range(whole_hi, end, BLOCK_N, num_stages=1):
        m_i, d1, d2, acc = _decode_tile(qr, K, V, K_DESC, V_DESC, b, h, j0, qpos, klen, window, sk_t, sv_t, m_i, d1,
                                        d2, acc, qk_scale, D, DV, BLOCK_N, BLOCK_D, BLOCK_DV, True, HAS_WINDOW,
                                        PRECISION, TMA)

    orow = tl.arange(0, HALF)
    if NUM_SPLITS == 1:
        o1, o2 = _unstack_rows(acc)
        _store_rows(O, _finish(o1, o2, d1, d2), b, t0, h, orow, offs_dv, TN, H, DV, G, GP)
    else:
        part = pid.to(tl.int64) * NUM_SPLITS + split  # 64-bit workspace offsets
        tl.store(WS + part * BLOCK_M * BLOCK_DV + m[:, None] * BLOCK_DV + offs_dv[None, :], acc,
                 mask=ok[:, None])  # real rows only
        ws_s = WS + tl.num_programs(0).to(tl.int64) * NUM_SPLITS * BLOCK_M * BLOCK_DV + part * 3 * HALF
        tl.store(ws_s + orow, m_i)
        tl.store(ws_s + HALF + orow, d1)
        tl.store(ws_s + 2 * HALF + orow, d2)
        if MERGE:
            tl.debug_barrier()  # every thread's partial stored before the count's release
            if tl.atomic_add(COUNT + pid, 1, sem="acq_rel") == NUM_SPLITS - 1:
                for c0 in tl.static_range(0, BLOCK_DV, BLOCK_C):
                    _merge_tile(WS, O, pid, tl.num_programs(0), b, t0, h, c0, TN, H, DV, G, GP, BLOCK_M, BLOCK_DV,
                                BLOCK_C, NUM_SPLITS)
                tl.store(COUNT + pid, 0)


@triton.jit
def _store_rows(O, o, b, t0, h, orow, cols, TN, H, DV, G: tl.constexpr, GP: tl.constexpr):
    """Write a row tile's outputs ``o: [HALF, len(cols)]`` (row ``r``: new token ``t0 + r // GP``, query head
    ``h * G + r % GP``; padding rows and columns are not written)."""
    ot = t0 + orow // GP
    og = orow % GP
    o_ptr = O + ((b * TN + ot) * (H * G) + h * G + og)[:, None] * DV + cols[None, :]
    tl.store(o_ptr, o.to(O.dtype.element_ty), mask=((og < G) & (ot < TN))[:, None] & (cols[None, :] < DV))


@triton.jit
def _merge_tile(WS, O, pid, programs, b, t0, h, c0, TN, H, DV, G: tl.constexpr, GP: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_C: tl.constexpr, NUM_SPLITS: tl.constexpr):
    """Merge the splits' partial states of row tile ``pid`` (of ``programs``) over the value columns ``c0`` to
    ``c0 + BLOCK_C`` and write them, every split read in one load (from L2: other programs wrote them)."""
    HALF: tl.constexpr = BLOCK_M // 2
    orow = tl.arange(0, HALF)
    ok = ((orow % GP) < G) & (t0 + orow // GP < TN)
    part = pid.to(tl.int64) * NUM_SPLITS + tl.arange(0, NUM_SPLITS)  # 64-bit workspace offsets
    stats_ws = WS + programs.to(tl.int64) * NUM_SPLITS * BLOCK_M * BLOCK_DV  # after the partial tiles
    stats = stats_ws + part[:, None] * 3 * HALF + orow[None, :]
    m_s = tl.load(stats, cache_modifier=".cg")  # [NUM_SPLITS, HALF]
    m_max = tl.max(m_s, 0)
    w = tl.math.exp2(m_s - tl.where(m_max == float("-inf"), 0.0, m_max)[None, :])  # 0 for a split that saw no key
    d1 = tl.sum(w * tl.load(stats + HALF, cache_modifier=".cg"), 0)
    d2 = tl.sum(w * tl.load(stats + 2 * HALF, cache_modifier=".cg"), 0)
    cols = c0 + tl.arange(0, BLOCK_C)
    tile = WS + (part[:, None, None] * BLOCK_M + orow[None, :, None]) * BLOCK_DV + cols[None, None, :]
    mask = ok[None, :, None]
    o1 = tl.sum(w[:, :, None] * tl.load(tile, mask=mask, other=0.0, cache_modifier=".cg"), 0)
    o2 = tl.sum(w[:, :, None] * tl.load(tile + HALF * BLOCK_DV, mask=mask, other=0.0, cache_modifier=".cg"), 0)
    _store_rows(O, _finish(o1, o2, d1, d2), b, t0, h, orow, cols, TN, H, DV, G, GP)


@triton.jit
def _merge_splits_kernel(WS, O, TN, H, DV, n_row_tiles, G: tl.constexpr, GP: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_DV: tl.constexpr, BLOCK_C: tl.constexpr, NUM_SPLITS: tl.constexpr):
    """Grid ``(programs of the decode kernel, BLOCK_DV // BLOCK_C)``: :func:`_merge_tile` of one row tile and
    slice of ``BLOCK_C`` value columns (no loop to wait on, one program per slice of columns so that the merge is
    spread over the GPU)."""
    BLOCK_T: tl.constexpr = BLOCK_M // 2 // GP
    pid = tl.program_id(0)
    b = (pid // (H * n_row_tiles)).to(tl.int64)
    h = (pid // n_row_tiles) % H
    t0 = (pid % n_row_tiles) * BLOCK_T
    _merge_tile(WS, O, pid, tl.num_programs(0), b, t0, h, tl.program_id(1) * BLOCK_C, TN, H, DV, G, GP, BLOCK_M,
                BLOCK_DV, BLOCK_C, NUM_SPLITS)


def decode_config(Tn: int, D: int, Dv: int, groups: int, dtype, split: bool = False) -> dict:
    """Row tile (``HALF`` query rows over ``HALF`` probe rows) and key tile for the decode kernel, its key loop
    ``split`` over programs or not."""
    gp = group_pad(groups)
    half = max(8, min(next_pow2(Tn * gp), 16), gp)
    if interpreting():
        return dict(BLOCK_M=2 * half, BLOCK_N=16, num_warps=4, num_stages=1)
    kind = "decode_chunk" if half > 8 else "decode_split" if split else "decode"
    return dict(BLOCK_M=2 * half, **tile_config(max(D, Dv), kind, dtype))


def choose_splits(programs: int, key_tiles: int, sms: int) -> int:
    """Splits of the K/V loop: a power of two with about two programs per SM, at least two key tiles per split
    and at most 32. On an H100 (32 query heads over 8 key/value heads, D 128; benchmarks/results/h100/tiles/
    parallax-decode-merge.json) 32 splits of 64-key tiles were the fastest measured at B = 1 from 4k to 32k keys
    (16 of 128 keys 1-13% slower, 64 splits slower still), and the rule keeps B = 8 at 4 and B = 64 at 1, the
    counts measured fastest there (parallax-decode.json); on the H200 too (benchmarks/results/h200/tiles/
    parallax-decode-variants.json: 1, 2, 4, 8 and 16 splits at B 1, 8 and 64)."""
    limit = min(2 * sms // max(programs, 1), key_tiles // 2, 32)
    n = 1
    while n * 2 <= limit:
        n *= 2
    return n


# partial outputs a merge program reads in one load (8 fp32 a thread on 4 warps): on an H100, 1024 ran faster
# than 2048 and 4096 (more programs, each waiting on less) and than 512 (benchmarks/results/h100/tiles/
# parallax-decode-merge.json)
MERGE_TILE = 1024


def merge_columns(splits: int, half: int, block_dv: int) -> int:
    """Value columns a merge reads at a time: ``splits x half x columns`` near :data:`MERGE_TILE`."""
    return max(1, min(block_dv, MERGE_TILE // (splits * half)))


# Eager calls merge the splits in the decode launch up to this many splits and bytes of keys and values. A call
# saves the merge launch's host time (12-19 us on the H200's host) and its last split to finish merges alone, one
# step a split at MERGE_TILE: a tail of about a microsecond a split that shows where the kernel outlasts the host.
# Measured back to back against two launches (HQ 32, H 8, D 128, bf16; benchmarks/results/h200/tiles/
# parallax-decode-merge-steps.json, us per call): B 1 at 4k keys (16 splits, 32 MiB) 69.3 against 87.8, B 8 at 4k
# (4 splits, 128 MiB) 49.5 against 62.3; B 8 at 8k (256 MiB) 85.2 against 84.8 and B 1 at 8k (32 splits) 62.7
# against 64.2, ties; B 1 at 32k (32 splits) 107.5 against 74.1. Graphs and compiled code always launch twice.
MERGE_IN_LAUNCH_SPLITS = 16
MERGE_IN_LAUNCH_BYTES = 128 * 2 ** 20


def merges_in_launch(splits: int, kv_bytes: int) -> bool:
    """Whether eager calls of ``splits`` over ``kv_bytes`` of keys and values merge them in the decode launch."""
    return 1 < splits <= MERGE_IN_LAUNCH_SPLITS and kv_bytes <= MERGE_IN_LAUNCH_BYTES


class DecodeLaunch(NamedTuple):
    """What one decode shape launches with."""
    grid: tuple[int, int]  # (programs, splits)
    n_row_tiles: int
    workspace: int  # fp32 elements of the splits' partial states (0 with one split)
    meta: dict  # the kernel's tile constexprs and launch options
    merge_grid: tuple[int, int]  # (programs, column slices) of the merge (unused with one split)
    merge_meta: dict
    kv_bytes: int  # of the keys and values the call reads at most (the split count's keys)
    merge_in_launch: dict | None  # the decode kernel's settings where eager calls merge in it (merges_in_launch)


def plan_decode(B: int, Tn: int, HQ: int, H: int, D: int, Dv: int, keys: int, dtype, sms: int,
                config: dict | None = None, num_splits: int | None = None) -> DecodeLaunch:
    """The launch of a decode shape over at most ``keys`` keys; ``config`` and ``num_splits`` override the
    tiles and the split count."""
    G = HQ // H
    GP = group_pad(G)
    split_cfg = dict(decode_config(Tn, D, Dv, G, dtype, split=True), **(config or {}))
    block_m, block_dv = split_cfg["BLOCK_M"], head_block(Dv)
    n_row_tiles = ceil_div(Tn, block_m // 2 // GP)
    programs = B * H * n_row_tiles
    splits = num_splits or choose_splits(programs, ceil_div(keys, split_cfg["BLOCK_N"]), sms)
    cfg = split_cfg if splits > 1 else dict(decode_config(Tn, D, Dv, G, dtype), **(config or {}))
    workspace = programs * splits * (block_m * block_dv + 3 * block_m // 2) if splits > 1 else 0
    meta = dict(G=G, GP=GP, BLOCK_M=block_m, BLOCK_N=cfg["BLOCK_N"], BLOCK_D=head_block(D), BLOCK_DV=block_dv,
                NUM_SPLITS=splits, PRECISION=dot_precision(dtype), TMA=cfg.get("TMA", False),
                num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    cols = merge_columns(splits, block_m // 2, block_dv)
    merge_meta = dict(G=G, GP=GP, BLOCK_M=block_m, BLOCK_DV=block_dv, BLOCK_C=cols, NUM_SPLITS=splits, num_warps=4)
    kv_bytes = B * keys * H * (D + Dv) * dtype.itemsize
    in_launch = dict(MERGE=True, BLOCK_C=cols) if merges_in_launch(splits, kv_bytes) else None
    return DecodeLaunch((programs, splits), n_row_tiles, workspace, meta, (programs, block_dv // cols), merge_meta,
                        kv_bytes, in_launch)


@functools.lru_cache(maxsize=256)
def decode_launch(B: int, Tn: int, HQ: int, H: int, D: int, Dv: int, keys: int, dtype,
                  device: torch.device) -> DecodeLaunch:
    """:func:`plan_decode` on ``device``, computed once per shape: its tiles read ``TRITON_INTERPRET`` then, as
    ``triton.jit`` read it once to build the kernel for the interpreter or not."""
    return plan_decode(B, Tn, HQ, H, D, Dv, keys, dtype, sm_count(device))


# A launch with tensor descriptors costs the host more (two TensorDescriptors built, then specialized and encoded by
# Triton at each launch): on the H200, 32-40 us more per call at B 1 than pointers, so B 1 at 4k keys took 47.7 us
# eagerly through them against 18.3 through pointers, while in CUDA graphs they ran faster at every shape (9.5 against
# 10.0 us at B 1 and 4k; 68.7 against 80.7 at B 8 and 8k; benchmarks/results/h200/tiles/
# parallax-decode-descriptors.json, parallax-decode-tma.json). So the table's TMA loads are taken where the host's
# time hides behind the kernel's: in a CUDA graph being captured, or over at least this many bytes of keys and
# values. Eager calls timed back to back on the H200 (HQ 32, H 8, D 128; tiles/parallax-decode-eager-rule.json):
# pointers won at 128 MiB (B 1 at 32k keys: 110 against 175 us; B 8 at 4k: 102 against 163) and 256 MiB (B 8 at
# 8k: 107 against 171), descriptors at 1 GiB (B 8 at 32k: 254 against 301; B 64 at 4k: 252 against 303).
TMA_EAGER_BYTES = 512 * 2 ** 20


def parallax_decode_fwd(q, r, k_cache, v_cache, *, cache_seqlens=None, window=None, scale: float,
                        max_seqlen: int | None = None, num_splits: int | None = None, config: dict | None = None):
    """Run the decode kernel; ``o: [B, Tn, HQ, Dv]`` in q's dtype (no autograd).

    Args:
        q, r: ``[B, Tn, HQ, D]`` (made contiguous); k_cache: ``[B, S, H, D]``; v_cache: ``[B, S, H, Dv]``
            (their last dims made contiguous).
        cache_seqlens: int ``[B]`` valid cache lengths (each in ``[Tn, S]``) or None for ``S``.
        max_seqlen: a bound on ``cache_seqlens`` (the K/V loop is split for that many keys); None means ``S``.
        num_splits, config: override the split count and the tiles (for tuning; a ``config`` with ``TMA`` takes
            the tensor descriptors' loads at any size).
    """
    B, Tn, HQ, D = q.shape
    _, S, H, _ = k_cache.shape
    Dv = v_cache.shape[3]
    device = q.device
    if config is None and num_splits is None:
        launch = decode_launch(B, Tn, HQ, H, D, Dv, max_seqlen or S, q.dtype, device)
    else:
        launch = plan_decode(B, Tn, HQ, H, D, Dv, max_seqlen or S, q.dtype, sm_count(device), config, num_splits)
    q, r = q.contiguous(), r.contiguous()
    k_cache, v_cache = last_dim_contiguous(k_cache), last_dim_contiguous(v_cache)
    sk, sv = k_cache.stride(), v_cache.stride()
    o = torch.empty(B, Tn, HQ, Dv, device=device, dtype=q.dtype)
    ws = torch.empty(launch.workspace, device=device, dtype=torch.float32) if launch.workspace else o
    counts = stream_zeros(launch.grid[0], device) if launch.merge_in_launch else None  # None: a merge launch
    meta, descriptors = launch.meta, None
    # the table's descriptors where the kernel outlasts the launch: captured, or over TMA_EAGER_BYTES (code that
    # torch.compile traces keeps the pointer loads)
    if meta["TMA"] and (config is not None or tma_pays(launch.kv_bytes, TMA_EAGER_BYTES)):
        descriptors = kv_descriptors(k_cache, v_cache, meta["BLOCK_N"])
    if meta["TMA"] and descriptors is None:
        meta = dict(meta, TMA=False)
    launch_kernel(
        _parallax_decode_kernel, launch.grid, q, r, k_cache, v_cache, o, o if cache_seqlens is None else cache_seqlens,
        ws, o if counts is None else counts, *(descriptors or (k_cache, v_cache)), sk[0], sk[1], sk[2], sv[0], sv[1],
        sv[2], Tn, S, H, D, Dv, launch.n_row_tiles, scale * LOG2E, 0 if window is None else window,
        HAS_LENS=cache_seqlens is not None, HAS_WINDOW=window is not None, **meta,
        **({} if counts is None else launch.merge_in_launch),
    )
    if launch.workspace and counts is None:
        launch_kernel(_merge_splits_kernel, launch.merge_grid, ws, o, Tn, H, Dv, launch.n_row_tiles,
                      **launch.merge_meta)
    return o
