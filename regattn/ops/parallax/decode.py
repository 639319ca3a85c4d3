"""Parallax decode in Triton: parallax.txt Appendix C.1, for one new token or a chunk of them.

* The query rows and the probe rows share one tile (queries on top, probes below), so ``S1 = Q K^T``
  and ``S2 = R K^T`` come out of one product, and ``[P1; P2] V`` gives ``O1`` and ``O2`` together.
* The K/V loop of each (batch, key/value head, row tile) is split over ``NUM_SPLITS`` programs so that
  small batches fill the GPU. Each writes its partial state ``(m, d1, d2, O1, O2)`` in fp32 and counts
  itself done on an atomic counter; the last one merges the partials (log-sum-exp rescale in fp32),
  writes the output and resets the counter, all in the same launch. One split writes directly.

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
from regattn.ops.parallax.tiles import (
    LOG2E, contained_dot, dot_precision, group_pad, head_block, interpreting, tile_config, visible,
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
def _finish(acc, d1, d2):
    """eq. (14) from the stacked accumulator ``[O1; O2]`` and the row sums; zeros where ``d1 = 0``."""
    o1, o2 = _unstack_rows(acc)
    inv = tl.where(d1 > 0, 1.0 / tl.where(d1 > 0, d1, 1.0), 0.0)
    return (o1 * (1.0 + d2 * inv)[:, None] - o2) * inv[:, None]


@triton.jit
def _parallax_decode_kernel(
    Q, R, K, V, O, LENS, WS, COUNT, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h,
    TN, S, H, D, DV, n_row_tiles, qk_scale, window,
    G: tl.constexpr, GP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, NUM_SPLITS: tl.constexpr, HAS_LENS: tl.constexpr,
    HAS_WINDOW: tl.constexpr, PRECISION: tl.constexpr,
):
    """Grid ``(B * H * n_row_tiles, NUM_SPLITS)``; a tile is ``BLOCK_M // 2`` query rows over as many probe rows.

    ``Q``, ``R`` (``[B, TN, H * G, D]``) and ``O`` (``[B, TN, H * G, DV]``) are contiguous. ``WS`` holds the
    splits' partial ``[O1; O2]`` tiles, then their ``(m, d1, d2)`` rows (fp32).
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

    # this split's share of the visible key tiles
    lo = 0
    if HAS_WINDOW:
        lo = (tl.maximum(t0 + off - window + 1, 0) // BLOCK_N) * BLOCK_N
    hi = tl.maximum(tl.minimum(klen, t0 + BLOCK_T + off), 0)
    per_split = tl.cdiv(tl.cdiv(tl.maximum(hi - lo, 0), BLOCK_N), NUM_SPLITS) * BLOCK_N
    start = lo + split * per_split
    end = tl.minimum(hi, start + per_split)
    # key tiles every real row of this tile sees whole, [full_lo, full_hi): the first row's causal end, the
    # last row's window start; a non-finite value there reaches only rows that see it anyway
    full_hi = tl.minimum(klen, t0 + off + 1)
    full_lo = 0
    if HAS_WINDOW:
        full_lo = tl.minimum(t0 + BLOCK_T, TN) - 1 + off - window + 1

    m_i = tl.full([HALF], float("-inf"), tl.float32)
    d1 = tl.zeros([HALF], tl.float32)
    d2 = tl.zeros([HALF], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for j0 in range(start, end, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        kv_ok = j < klen
        kt = tl.load(K + j[None, :] * sk_t + offs_d[:, None], mask=kv_ok[None, :] & (offs_d[:, None] < D),
                     other=0.0)
        v = tl.load(V + j[:, None] * sv_t + offs_dv[None, :], mask=kv_ok[:, None] & (offs_dv[None, :] < DV),
                    other=0.0)
        s1, s2 = _unstack_rows(tl.dot(qr, kt, input_precision=PRECISION))
        seen = visible(qpos, j, klen, window, True, HAS_WINDOW)  # keys past the cache length never load
        s1 = tl.where(seen, s1 * qk_scale, float("-inf"))
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
        if (j0 >= full_lo) & (j0 + BLOCK_N <= full_hi):
            acc = tl.dot(pp.to(v.dtype), v, acc, input_precision=PRECISION)
        else:  # a partly visible tile: a non-finite value reaches only the rows that see its key
            acc = contained_dot(acc, pp, v, _stack_rows(seen, seen), PRECISION)
        m_i = m_new

    orow = tl.arange(0, HALF)
    ot = t0 + orow // GP
    og = orow % GP
    o_ok = (og < G) & (ot < TN)
    o_ptr = O + ((b * TN + ot) * (H * G) + h * G + og)[:, None] * DV + offs_dv[None, :]
    o_mask = o_ok[:, None] & (offs_dv[None, :] < DV)
    if NUM_SPLITS == 1:
        tl.store(o_ptr, _finish(acc, d1, d2).to(O.dtype.element_ty), mask=o_mask)
    else:
        # write this split's partial state, then let the last split to finish merge all of them
        WS_S = WS + tl.num_programs(0) * NUM_SPLITS * BLOCK_M * BLOCK_DV
        ws_o = WS + (pid * NUM_SPLITS + split) * BLOCK_M * BLOCK_DV
        tl.store(ws_o + m[:, None] * BLOCK_DV + offs_dv[None, :], acc, mask=ok[:, None])  # real rows only
        ws_s = WS_S + (pid * NUM_SPLITS + split) * 3 * HALF
        tl.store(ws_s + orow, m_i)
        tl.store(ws_s + HALF + orow, d1)
        tl.store(ws_s + 2 * HALF + orow, d2)
        tl.debug_barrier()
        done = tl.atomic_add(COUNT + pid, 1, sem="acq_rel")
        if done == NUM_SPLITS - 1:
            sp = tl.arange(0, NUM_SPLITS)
            s_base = WS_S + (pid * NUM_SPLITS + sp)[:, None] * 3 * HALF + orow[None, :]
            m_max = tl.max(tl.load(s_base, cache_modifier=".cg"), 0)
            m_ref = tl.where(m_max == float("-inf"), 0.0, m_max)
            d1 = tl.zeros([HALF], tl.float32)
            d2 = tl.zeros([HALF], tl.float32)
            acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
            # one split at a time (all at once spills from 16 splits on; a few at a time is slower), each read
            # as a [1, ...] block: read as [BLOCK_M, BLOCK_DV] instead, the whole decode took 16.1 us, not 11.2,
            # on an H100 at B = 1, 32/8 heads, 4k keys (benchmarks/results/h100/tiles/parallax-decode.json)
            one = tl.arange(0, 1)
            for s in range(NUM_SPLITS):
                part = pid * NUM_SPLITS + s + one
                s_part = WS_S + part[:, None] * 3 * HALF + orow[None, :]
                w = tl.math.exp2(tl.load(s_part, cache_modifier=".cg") - m_ref[None, :])  # [1, HALF]
                d1 += tl.sum(w * tl.load(s_part + HALF, cache_modifier=".cg"), 0)
                d2 += tl.sum(w * tl.load(s_part + 2 * HALF, cache_modifier=".cg"), 0)
                w2 = tl.reshape(tl.permute(tl.join(w, w), (0, 2, 1)), (1, BLOCK_M))
                o_part = WS + part[:, None, None] * BLOCK_M * BLOCK_DV + m[None, :, None] * BLOCK_DV
                acc += tl.sum(w2[:, :, None] * tl.load(o_part + offs_dv[None, None, :], mask=ok[None, :, None],
                                                       other=0.0, cache_modifier=".cg"), 0)
            tl.store(o_ptr, _finish(acc, d1, d2).to(O.dtype.element_ty), mask=o_mask)
            tl.atomic_xchg(COUNT + pid, 0)


_COUNTERS: dict = {}


def _counters(n: int, device) -> torch.Tensor:
    """Zeroed int32 split counters, kept per device (the merging program sets its counter back to 0)."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
        _COUNTERS[device] = buf
    return buf


def decode_config(Tn: int, D: int, Dv: int, groups: int, dtype) -> dict:
    """Row tile (``HALF`` query rows over ``HALF`` probe rows) and key tile for the decode kernel."""
    gp = group_pad(groups)
    half = max(8, min(next_pow2(Tn * gp), 16), gp)
    if interpreting():
        return dict(BLOCK_M=2 * half, BLOCK_N=16, num_warps=4, num_stages=1)
    return dict(BLOCK_M=2 * half, **tile_config(max(D, Dv), "decode_chunk" if half > 8 else "decode", dtype))


def choose_splits(programs: int, key_tiles: int, sms: int) -> int:
    """Splits of the K/V loop: a power of two with about two programs per SM and at least two key tiles per
    split; at most 16, or 32 where each split still streams 8 tiles or more. On an H100 (8 KV heads, 4k-32k
    keys; benchmarks/results/h100/tiles/parallax-decode.json and parallax-decode-splits.json) this picked the
    fastest count measured at B = 8 (4) and B = 64 (1), and at B = 1 16 for 4k and 8k keys (32 ran 1-15%
    slower) and 32 for 32k (8% faster than 16 on the same tiles)."""
    limit = min(2 * sms // max(programs, 1), key_tiles // 2, 32 if key_tiles >= 8 * 32 else 16)
    n = 1
    while n * 2 <= limit:
        n *= 2
    return n


class DecodeLaunch(NamedTuple):
    """What one decode shape launches with."""
    grid: tuple[int, int]  # (programs, splits)
    n_row_tiles: int
    workspace: int  # fp32 elements of the splits' partial states (0 with one split)
    meta: dict  # the kernel's tile constexprs and launch options


def plan_decode(B: int, Tn: int, HQ: int, H: int, D: int, Dv: int, keys: int, dtype, sms: int,
                config: dict | None = None, num_splits: int | None = None) -> DecodeLaunch:
    """The launch of a decode shape over at most ``keys`` keys; ``config`` and ``num_splits`` override the
    tiles and the split count."""
    G = HQ // H
    GP = group_pad(G)
    cfg = decode_config(Tn, D, Dv, G, dtype)
    if config:
        cfg = dict(cfg, **config)
    block_m, block_dv = cfg["BLOCK_M"], head_block(Dv)
    n_row_tiles = ceil_div(Tn, block_m // 2 // GP)
    programs = B * H * n_row_tiles
    splits = num_splits or choose_splits(programs, ceil_div(keys, cfg["BLOCK_N"]), sms)
    workspace = programs * splits * (block_m * block_dv + 3 * block_m // 2) if splits > 1 else 0
    meta = dict(G=G, GP=GP, BLOCK_M=block_m, BLOCK_N=cfg["BLOCK_N"], BLOCK_D=head_block(D), BLOCK_DV=block_dv,
                NUM_SPLITS=splits, PRECISION=dot_precision(dtype), num_warps=cfg["num_warps"],
                num_stages=cfg["num_stages"])
    return DecodeLaunch((programs, splits), n_row_tiles, workspace, meta)


@functools.lru_cache(maxsize=256)
def decode_launch(B: int, Tn: int, HQ: int, H: int, D: int, Dv: int, keys: int, dtype,
                  device: torch.device) -> DecodeLaunch:
    """:func:`plan_decode` on ``device``, computed once per shape: its tiles read ``TRITON_INTERPRET`` then, as
    ``triton.jit`` read it once to build the kernel for the interpreter or not."""
    return plan_decode(B, Tn, HQ, H, D, Dv, keys, dtype, sm_count(device))


def parallax_decode_fwd(q, r, k_cache, v_cache, *, cache_seqlens=None, window=None, scale: float,
                        max_seqlen: int | None = None, num_splits: int | None = None, config: dict | None = None):
    """Run the decode kernel; ``o: [B, Tn, HQ, Dv]`` in q's dtype (no autograd).

    Args:
        q, r: ``[B, Tn, HQ, D]`` (made contiguous); k_cache: ``[B, S, H, D]``; v_cache: ``[B, S, H, Dv]``
            (their last dims made contiguous).
        cache_seqlens: int ``[B]`` valid cache lengths (each in ``[Tn, S]``) or None for ``S``.
        max_seqlen: a bound on ``cache_seqlens`` (the K/V loop is split for that many keys); None means ``S``.
        num_splits, config: override the split count and the tiles (for tuning).
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
    if launch.workspace:
        ws = torch.empty(launch.workspace, device=device, dtype=torch.float32)
        count = _counters(launch.grid[0], device)
    else:
        ws = count = o
    _parallax_decode_kernel[launch.grid](
        q, r, k_cache, v_cache, o, o if cache_seqlens is None else cache_seqlens, ws, count,
        sk[0], sk[1], sk[2], sv[0], sv[1], sv[2],
        Tn, S, H, D, Dv, launch.n_row_tiles, scale * LOG2E, 0 if window is None else window,
        HAS_LENS=cache_seqlens is not None, HAS_WINDOW=window is not None, **launch.meta,
    )
    return o
