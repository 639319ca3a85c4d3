"""Tile pieces the Parallax kernels share: packed GQA rows, visibility, tile ranges, and the tile table.

Rows of a tile are (query position, query head) pairs of one key/value head: row ``m`` holds
position ``t0 + m // GP`` and head ``h * G + m % GP``, where ``G = HQ // H`` and ``GP`` is ``G``
rounded up to a power of two (rows with ``m % GP >= G`` are padding). The query heads that share a
key/value head thus read each K/V tile once.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from regattn.ops._common.attention_tiles import (  # noqa: F401
    LOG2E, contained_dot, dot_precision, head_block, interpreting, query_tile, tma_descriptors, tma_pays,
)
from regattn.ops._common.ints import next_pow2


def _row(fwd, dq, dk, decode, decode_split, decode_chunk) -> dict[str, dict]:
    """One head dim's settings from ``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` (decode: no BLOCK_M), and a
    last entry ``TMA`` where the kernel's key and value tiles load through tensor descriptors on Hopper."""
    names = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "TMA")
    row = {kind: dict(zip(names, cfg)) for kind, cfg in (("fwd", fwd), ("dq", dq), ("dk", dk))}
    row.update({kind: dict(zip(names[1:], cfg))
                for kind, cfg in (("decode", decode), ("decode_split", decode_split), ("decode_chunk", decode_chunk))})
    return row


# Launch settings of every Parallax kernel on a GPU, keyed by the padded head dim (the larger of D and Dv,
# a power of two, 32 at least) and then by kernel: "fwd" (prefill forward), "dq" (the backward's row-tile
# pass), "dk" (its column-tile pass), "decode" (one new token per query head), "decode_split" (the same with
# the key loop split over programs) and "decode_chunk" (more rows).
# BLOCK_M counts packed query rows and BLOCK_N keys; the decode's BLOCK_M comes from the new tokens. fp32
# inputs take FP32_TILES. A benchmark may patch these dicts (see regattn.bench.suites.parallax); the decode
# settings are cached per shape, so a patch of them needs decode.decode_launch.cache_clear().
# Register use per entry on sm_90: `python -m regattn.bench.registers parallax`.
TILES: dict[int, dict[str, dict]] = {
    32: _row(fwd=(128, 64, 8, 3), dq=(64, 64, 4, 2), dk=(64, 64, 4, 2), decode=(128, 4, 3), decode_split=(128, 4, 3),
             decode_chunk=(64, 4, 2)),
    # H200, bf16, B=4 H=16 T=8192 causal: the dQ pass through tensor descriptors (TMA; 16 bytes of stack against 40)
    # ran forward+backward 2% faster in each of three rounds at D 64, and 1% at D 128, whose forward through them
    # (64 bytes of stack against none) ran 2-3% faster; the D 64 forward gained nothing (tiles/
    # parallax-prefill-tma.json). Calls take them from tma_pays's size on.
    64: _row(fwd=(128, 64, 8, 3), dq=(64, 64, 4, 2, True), dk=(64, 64, 4, 2), decode=(128, 4, 3),
             decode_split=(128, 4, 3), decode_chunk=(64, 4, 2)),
    # H100, bf16, B=4 H=16 T=8192 D=128 causal: 64 x 64 with 4 warps was the fastest backward measured for
    # both passes (benchmarks/results/h100/tiles/parallax-d128.json); dk: 128 keys streaming 32 query rows on 8 warps
    # and 3 stages is the screen's tile of most keys that spills no register on sm_90 (64 x 64 spills 2 KB).
    # Decode: an unsplit key loop (B = 64) streams 128-key tiles (64 ran 1.3x slower). Split, 64 keys were the
    # fastest on the H100 at B = 1 from 4k to 32k keys, 128 within 1% (benchmarks/results/h100/tiles/
    # parallax-decode-merge.json, parallax-decode-tiles.json); on the H200 128 keys (no spill, 104 KiB of shared
    # memory) ran 1-7% faster at B = 1 and 8 from 4k to 32k keys (benchmarks/results/h200/tiles/
    # parallax-decode-variants.json), so the split kernel streams 128-key tiles too. Loaded through tensor
    # descriptors (TMA: 186 registers and no spill, against 255 and 32 bytes of stack unsplit) both ran 13-18%
    # faster in CUDA graphs on the H200 at B 8 and 64 from 4k to 32k keys and at B 1 from 8k, 5% at B 1 and 4k
    # (tiles/parallax-decode-tma.json; decode.TMA_EAGER_BYTES: where eager calls take them). Since the key loop
    # runs its whole tiles apart from its masked ones (their key and value tiles both copied ahead, through
    # pointers too), 2 stages: in CUDA graphs on the H200 at B 1, 8 and 64 from 4k to 32k keys (tiles/
    # parallax-decode-whole-tiles-graph.json) 0.99-1.04x cuDNN's time through descriptors (3 stages, 136 KiB of
    # shared memory, up to 1.28x), 1.04-1.22x through pointers (the loop before: 1.08-1.24x). 64-key tiles through
    # pointers ran 1.02-1.03x at B 8, but eager calls would then add up keys in another order than captured ones.
    128: _row(fwd=(128, 64, 8, 3, True), dq=(64, 64, 4, 2, True), dk=(32, 128, 8, 3), decode=(128, 4, 2, True),
              decode_split=(128, 4, 2, True), decode_chunk=(64, 4, 2)),
    # H100, bf16, B=4 H=16 T=8192 D=256: the forward's 32 x 32 tile spills nothing and ran 21.5 ms, the
    # former 64 x 32 (1120 bytes of stack) 55.7 ms (benchmarks/results/h100/tiles/parallax-d256.json)
    256: _row(fwd=(32, 32, 4, 3), dq=(32, 32, 4, 2), dk=(32, 32, 4, 2), decode=(64, 4, 2), decode_split=(64, 4, 2),
              decode_chunk=(64, 4, 2)),
}
FP32_TILES: dict[str, dict] = dict(fwd=dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2),
                                   dq=dict(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=2),
                                   dk=dict(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=2),
                                   decode=dict(BLOCK_N=32, num_warps=4, num_stages=2),
                                   decode_split=dict(BLOCK_N=32, num_warps=4, num_stages=2),
                                   decode_chunk=dict(BLOCK_N=32, num_warps=4, num_stages=2))


def table_head_dim(head_dim: int) -> int:
    """The :data:`TILES` key of a head dim: its power-of-two padding, at least 32 (wider dims take the
    widest row)."""
    return min(max(32, next_pow2(head_dim)), max(TILES))


def tile_config(head_dim: int, kind: str, dtype=None) -> dict:
    """A copy of the table's settings of ``kind`` for ``head_dim`` (the larger of D and Dv) and ``dtype``."""
    if dtype == torch.float32:
        return dict(FP32_TILES[kind])
    return dict(TILES[table_head_dim(head_dim)][kind])


def prefill_descriptors(k, v, cfg: dict, cu_seqlens, *, work: int):
    """Tensor descriptors of ``k`` and ``v`` with boxes of one key tile of one head, where the tile setting ``cfg``
    asks for them (``TMA``), the sequences are batch rows (packed ones load through pointers) and the call is
    large enough for them to pay (:func:`tma_pays`); else None."""
    if not cfg.get("TMA") or cu_seqlens is not None or not tma_pays(work):
        return None
    return kv_descriptors(k, v, cfg["BLOCK_N"])


def kv_descriptors(k, v, block_n: int):
    """Tensor descriptors of ``k: [B, S, H, D]`` and ``v: [B, S, H, Dv]`` with boxes of one key tile of one head
    (``block_n`` keys, the head dims padded as the kernels' blocks), or None where TMA cannot read them."""
    return tma_descriptors((k, [1, block_n, 1, head_block(k.shape[3])]), (v, [1, block_n, 1, head_block(v.shape[3])]))


def group_pad(groups: int) -> int:
    """``G`` rounded up to a power of two."""
    return next_pow2(groups)


@triton.jit
def packed_rows(t0, h, qlen, G: tl.constexpr, GP: tl.constexpr, BLOCK_M: tl.constexpr):
    """Position ``t``, query head ``hq`` and validity of each of the ``BLOCK_M`` packed rows."""
    m = tl.arange(0, BLOCK_M)
    t = t0 + m // GP
    g = m % GP
    return t, h * G + g, (g < G) & (t < qlen)


@triton.jit
def kv_tile(desc, ptr, b, h, j0, klen, stride, N_COLS, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
            TRANS: tl.constexpr, TMA: tl.constexpr):
    """Keys (or values) ``j0 .. j0 + BLOCK_N`` of head ``h``: ``[BLOCK_N, BLOCK_C]``, or ``[BLOCK_C, BLOCK_N]``
    with ``TRANS``. ``TMA``: through the tensor descriptor ``desc`` of the ``[B, S, H, N_COLS]`` tensor at
    sequence ``b`` (Hopper's tensor-memory copy: rows past ``S`` read as 0, rows from ``klen`` to ``S`` as they
    are, for the caller's masks); else from ``ptr`` (the head's first row, rows ``stride`` apart), rows from
    ``klen`` on and columns from ``N_COLS`` on as 0."""
    j = j0 + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_C)
    if TMA:
        x = desc.load([b.to(tl.int32), j0, h, 0]).reshape(BLOCK_N, BLOCK_C)
        if TRANS:
            x = tl.trans(x)
    elif TRANS:
        x = tl.load(ptr + j[None, :] * stride + cols[:, None], mask=(j < klen)[None, :] & (cols[:, None] < N_COLS),
                    other=0.0)
    else:
        x = tl.load(ptr + j[:, None] * stride + cols[None, :], mask=(j < klen)[:, None] & (cols[None, :] < N_COLS),
                    other=0.0)
    return x


@triton.jit
def visible(qpos, j, klen, window, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """``[M, N]`` mask: key ``j`` exists and query position ``qpos`` sees it (window counts itself)."""
    ok = j[None, :] < klen
    if CAUSAL:
        ok = ok & (j[None, :] <= qpos[:, None])
    if HAS_WINDOW:
        ok = ok & (j[None, :] > qpos[:, None] - window)
    return ok


@triton.jit
def split_range(lo, hi, full_lo, full_hi):
    """Cut ``[lo, hi)`` into masked ``[lo, a)``, unmasked ``[a, b)`` and masked ``[b, hi)``."""
    a = tl.minimum(tl.maximum(full_lo, lo), hi)
    b = tl.minimum(tl.maximum(full_hi, a), hi)
    return a, b


@triton.jit
def key_range(p0, p1, klen, window, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """Key tiles for query positions ``[p0, p1]``: all ``[lo, hi)`` and the mask-free ``[a, b)``."""
    lo = 0
    a = 0
    hi = klen
    b = (klen // BLOCK_N) * BLOCK_N
    if HAS_WINDOW:
        lo = (tl.maximum(p0 - window + 1, 0) // BLOCK_N) * BLOCK_N
        a = tl.cdiv(tl.maximum(p1 - window + 1, 0), BLOCK_N) * BLOCK_N
    if CAUSAL:
        hi = tl.maximum(tl.minimum(klen, p1 + 1), 0)
        b = (tl.maximum(tl.minimum(klen, p0 + 1), 0) // BLOCK_N) * BLOCK_N
    a, b = split_range(lo, hi, a, b)
    return lo, a, b, hi


@triton.jit
def query_range(j0, j1, qlen, off, window, BLOCK_T: tl.constexpr, CAUSAL: tl.constexpr,
                HAS_WINDOW: tl.constexpr):
    """Query tiles (in positions ``t``, ``qpos = t + off``) that see keys ``[j0, j1]``: ``[lo, a, b, hi)``."""
    lo = 0
    a = 0
    hi = qlen
    b = qlen
    if CAUSAL:
        lo = (tl.maximum(j0 - off, 0) // BLOCK_T) * BLOCK_T
        a = tl.cdiv(tl.maximum(j1 - off, 0), BLOCK_T) * BLOCK_T
    if HAS_WINDOW:
        hi = tl.minimum(qlen, tl.maximum(j1 + window - off, 0))
        b = (tl.maximum(j0 + window - off, 0) // BLOCK_T) * BLOCK_T
    a, b = split_range(lo, hi, a, b)
    return lo, a, b, hi


@triton.jit
def sequence_bounds(CU, seq, T, S, VARLEN: tl.constexpr):
    """First token and lengths of sequence ``seq``: ``(start, qlen, klen)`` (start 0 without varlen)."""
    start = 0
    qlen = T
    klen = S
    if VARLEN:  # offsets clamped to [0, T]: bad offsets read nothing outside the tensors
        first = tl.minimum(tl.maximum(tl.load(CU + seq), 0), T)
        last = tl.minimum(tl.maximum(tl.load(CU + seq + 1), first), T)
        start = first.to(tl.int64)  # 64-bit: start * stride may pass 2**31
        qlen = (last - first).to(tl.int32)
        klen = qlen
    return start, qlen, klen


@triton.jit
def program_tile(CU, T, S, H, BLOCK: tl.constexpr, VARLEN: tl.constexpr, CAUSAL_ROWS: tl.constexpr):
    """``(tile start, key/value head, first token, qlen, klen, sequence)`` of this program: grid axis 0
    runs over tiles of ``BLOCK`` rows (or keys), axis 1 over ``sequences * H``. ``CAUSAL_ROWS``: tiles of rows
    under a causal mask, taken last first (``attention_tiles.query_tile``)."""
    pid = query_tile(CAUSAL_ROWS)
    seq = tl.program_id(1) // H
    h = tl.program_id(1) % H
    start, qlen, klen = sequence_bounds(CU, seq, T, S, VARLEN)
    return pid * BLOCK, h, start, qlen, klen, seq


@triton.jit
def load_row_scalars(LSE, TAU, BETA, TBAR, row, row_ok):
    """The backward's per-row ``lse`` (``+inf`` outside), ``tau``, ``beta`` and ``tbar`` at ``row``."""
    lse = tl.load(LSE + row, mask=row_ok, other=float("inf"))
    tau = tl.load(TAU + row, mask=row_ok, other=0.0)
    beta = tl.load(BETA + row, mask=row_ok, other=0.0)
    tbar = tl.load(TBAR + row, mask=row_ok, other=0.0)
    return lse, tau, beta, tbar


@triton.jit
def visible_t(j, qpos, klen, window, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """The transpose of :func:`visible`: ``[N, M]`` with keys on rows."""
    ok = j[:, None] < klen
    if CAUSAL:
        ok = ok & (j[:, None] <= qpos[None, :])
    if HAS_WINDOW:
        ok = ok & (j[:, None] > qpos[None, :] - window)
    return ok
