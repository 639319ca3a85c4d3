"""Parallax prefill (forward, forward+backward) and decode against a KV cache (parallax.txt Figure 2b).

SDPA's plain attention at the same shape is the floor (Parallax does twice its matrix work);
flash-linear-attention's Parallax functions are the direct peers. Decode is timed eagerly and
inside a CUDA graph: users call it both ways.
"""
from __future__ import annotations

import contextlib
import functools
from unittest import mock

import torch

import regattn
from regattn import reference
from regattn.bench import counts, peers
from regattn.bench.check import Check, Slice
from regattn.bench.runner import (
    Case, Setup, build, case_errors, for_mode, ours, randn, reference_case, sdpa_cases,
)
from regattn.bench.variants import Contender, tile, time_in_rounds
from regattn.ops.parallax import tiles

NAME = "parallax"
PEERS = ("sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "fla")
QUICK_PEERS = ("sdpa-cudnn", "sdpa-flash")
MAIN = {"fwd": ("sdpa:cudnn",), "fwd+bwd": ("sdpa:cudnn",), "decode": ("sdpa:",)}  # decode: the fastest SDPA
MODES = ("fwd", "fwd+bwd")
PREFILL = [dict(B=4, H=16, T=8192, D=D) for D in (128, 64, 32, 256)]  # the targets hold at 128 and 64
DECODE = [dict(B=B, HQ=32, H=8, ctx=c, D=128) for B in (1, 8, 64) for c in (4096, 8192, 32768)]
GRIDS = {
    "tiny": [dict(B=1, H=2, T=40, D=16), dict(B=2, HQ=4, H=2, ctx=48, D=16)],
    "goal": PREFILL + DECODE,
    "quick": PREFILL[:1] + [dict(B=B, HQ=32, H=8, ctx=8192, D=128) for B in (1, 64)],
    "full": [dict(B=4, H=16, T=T, D=D) for D in (32, 64, 128, 256) for T in (1024, 2048, 4096, 8192, 16384)]
    + [dict(B=B, HQ=32, H=8, ctx=c, D=128) for B in (1, 4, 16, 64, 256, 1024, 2048)
       for c in (128, 512, 2048, 8192, 32768)],
}
CHECK_ROWS = 1024


def cases(shape: dict, setup):
    """Prefill shapes: B, H, HQ (default H), T, D, window. Decode shapes: B, HQ, H, ctx, D."""
    yield from (decode_cases if "ctx" in shape else prefill_cases)(shape, setup)


def check(mode, q, r, k, v, w) -> Check:
    bwd = mode == "fwd+bwd"
    where = Slice(kv_heads=k.shape[2], rows=min(q.shape[1], CHECK_ROWS), last=not bwd)
    return Check(lambda q, r, k, v: reference.parallax(q, r, k, v, window=w), dict(q=q, r=r, k=k, v=v), where,
                 grads=("q", "r", "k", "v") if bwd else ())


def fla_prefill(q, r, k, v, window):
    fn = peers.fla_function("parallel_parallax")
    leaves = [peers.leaf(x) for x in (q, r, k, v)]
    return (lambda: fn(*leaves, window_size=window)), leaves


def prefill_cases(shape, setup):
    B, H, T, D, w = shape["B"], shape["H"], shape["T"], shape["D"], shape.get("window")
    HQ = shape.get("HQ", H)
    q, r = randn(setup, B, T, HQ, D, grad=True), randn(setup, B, T, HQ, D, grad=True, scale=0.1)
    k, v = randn(setup, B, T, H, D, grad=True), randn(setup, B, T, H, D, grad=True)
    for mode in MODES:
        bwd = mode == "fwd+bwd"
        truth = check(mode, q, r, k, v, w)
        n = dict(flops=counts.parallax_flops(B, T, T, HQ, D, D, window=w, backward=bwd),
                 bytes=counts.attention_bytes(B, T, T, HQ, H, D, D, q.element_size(), backward=bwd,
                                              extra_per_query=D))
        yield mode, ours(regattn.parallax, q, setup,
                         lambda: regattn.parallax(q, r, k, v, window=w, backend=setup.backend), [q, r, k, v],
                         check=truth, **n)
        yield from sdpa_cases(setup, mode, q, k, v, window=w, backends=("cudnn", "flash"), tag=" (attention)", **n)
        if peers.wanted(setup.peers, "fla"):
            yield mode, build("fla:parallel_parallax", lambda: fla_prefill(*for_mode(mode, q, r, k, v), w),
                              check=truth, **n)
        yield from reference_case(setup, mode, lambda: reference.parallax(q, r, k, v, window=w), [q, r, k, v],
                                  check=truth, **n)


def fla_decode(q, r, k, v):
    fn = peers.fla_function("parallax_decode_one_step")
    return (lambda: fn(q, r, k, v)), []


def decode_inputs(shape, setup):
    """``(q, r, k, v, truth)``: one new token of each query head over a cache of ``ctx`` keys, and the float64
    check of its output (the first key/value head's queries of the first batch row)."""
    B, HQ, H, S, D = shape["B"], shape["HQ"], shape["H"], shape["ctx"], shape["D"]
    q, r = randn(setup, B, 1, HQ, D), randn(setup, B, 1, HQ, D, scale=0.1)
    k, v = randn(setup, B, S, H, D), randn(setup, B, S, H, D)
    truth = Check(lambda q, r, k, v: reference.parallax(q, r, k, v), dict(q=q, r=r, k=k, v=v), Slice(kv_heads=H))
    return q, r, k, v, truth


def decode_cases(shape, setup):
    B, HQ, H, S, D = shape["B"], shape["HQ"], shape["H"], shape["ctx"], shape["D"]
    q, r, k, v, truth = decode_inputs(shape, setup)
    n = dict(flops=counts.parallax_flops(B, 1, S, HQ, D, D),
             bytes=counts.attention_bytes(B, 1, S, HQ, H, D, D, q.element_size(), extra_per_query=D))
    for graph in (False, True):
        yield "decode", ours(regattn.parallax_decode, q, setup,
                             lambda: regattn.parallax_decode(q, r, k, v, backend=setup.backend), [],
                             check=truth, graph=graph, **n)
        yield from sdpa_cases(setup, "decode", q, k, v, backends=("flash", "cudnn", "efficient"),
                              tag=" (attention)", graph=graph, **n)
        if peers.wanted(setup.peers, "fla"):
            yield "decode", build("fla:parallax_decode_one_step", lambda: fla_decode(q, r, k, v), check=truth,
                                  graph=graph, **n)
        yield from reference_case(setup, "decode", lambda: reference.parallax(q, r, k, v), [], check=truth,
                                  graph=graph, **n)


# Tile variants of the prefill kernels for time_tile_variants, per head dim: the table's entry first, then one
# kernel at a time changed to a candidate that compiles without spilling on sm_90, or to the one that spills
# least where none is free, then together; ``TMA``: the table's tile with its key and value tiles loaded through
# tensor descriptors (Hopper's tensor-memory copies) or through pointers, whichever the table does not. Registers per
# candidate: benchmarks/results/sm90-registers/parallax.txt (python -m regattn.bench.registers parallax
# --head-dims D --candidates).
TILE_VARIANTS = {
    # the table spills in fwd (88 bytes of stack) and dq (872); dk (32 x 128 on 8 warps, 3 stages) spills none
    # since the dK/dV pass was reordered
    128: [
        {},
        {"fwd": tile(128, 32, 8, 3)},    # REG 246
        {"fwd": tile(128, 32, 8, 2)},    # REG 243
        {"fwd": tile(64, 64, 8, 1)},     # REG 255
        {"dq": tile(128, 32, 8, 2)},     # REG 254
        {"dq": tile(64, 32, 8, 3)},      # REG 250
        {"dq": tile(32, 32, 4, 2)},      # REG 228
        {"dk": tile(64, 64, 4, 2)},      # the entry before: 528 bytes of stack with the reordered pass
        {"dk": tile(32, 128, 8, 2)},     # 48 bytes, saved and reloaded outside the loops
        {"dk": tile(16, 128, 8, 3)},     # no stack
        {"fwd": tile(128, 32, 8, 3), "dq": tile(128, 32, 8, 2)},
        {"fwd": dict(TMA=False)},         # triton 3.6 through pointers: REG 254, no stack (descriptors: 64 bytes)
        {"dq": dict(TMA=False)},          # 840 bytes of stack (descriptors: 760)
    ],
    # the table's dq spills 40 bytes; fwd and dk (with the reordered dK/dV pass) fit
    64: [
        {},
        {"dq": tile(64, 64, 8, 2)},      # REG 238
        {"dq": tile(128, 32, 8, 2)},     # REG 183
        {"dk": tile(32, 64, 8, 2)},
        {"dk": tile(32, 128, 8, 2)},
        {"dk": tile(32, 128, 8, 3)},     # no stack with triton 3.9 or 3.6
        {"dk": tile(16, 64, 8, 3)},
        {"dq": tile(64, 64, 8, 2), "dk": tile(32, 64, 8, 2)},
        {"dq": tile(128, 32, 8, 2), "dk": tile(32, 128, 8, 2)},
        {"fwd": dict(TMA=True)},          # triton 3.6: REG 174 (through pointers 225)
        {"dq": dict(TMA=False)},          # 40 bytes of stack (descriptors: 16)
        {"fwd": dict(TMA=True), "dq": dict(TMA=False)},
    ],
    # every candidate spills in dq and dk (the table's: dq 200, dk 376 bytes); fwd 32 x 32 fits (the table's
    # since the first pass of these variants; the former 64 x 32 spilled 1120 bytes)
    256: [
        {},
        {"fwd": tile(64, 32, 4, 2)},     # 1120 bytes
        {"fwd": tile(32, 32, 4, 2)},     # REG 255, no stack
        {"fwd": tile(64, 16, 8, 3)},     # 152 bytes
        {"fwd": tile(64, 32, 8, 3)},     # 256 bytes
        {"dq": tile(64, 16, 8, 3)},      # 504 bytes
        {"dk": tile(32, 32, 4, 3)},      # 992 bytes
        {"dk": tile(32, 32, 4, 3), "dq": tile(64, 16, 8, 3)},
    ],
}


def time_tile_variants(variants=None, *, shape=None, dtype=torch.bfloat16, device="cuda", rep_ms=100,
                       rounds: int = 3) -> list[dict]:
    """Time Parallax's forward and forward+backward with each tile variant, side by side in one process.

    A variant overrides entries of the tile table (:data:`regattn.ops.parallax.tiles.TILES`) at the shape's
    head dim: ``{"fwd": {...}, "dq": {...}, "dk": {...}}``, each merged over the table's settings of that
    kernel (``{}`` is the table itself). The table is restored afterwards. The inputs are drawn once, and
    each variant's output and gradients are checked against float64 on a slice, as the suite's rows are.

    Args:
        variants: list of variants (default: :data:`TILE_VARIANTS` of the shape's head dim).
        shape: ``B, H, T, D`` and optionally ``HQ`` and ``window`` (default: the goal shape
            B=4 H=16 T=8192 D=128, causal).
        rounds: how many times every variant is timed, one variant after the other in each round (on an
            H100, one pass over the variants saw the same forward settings take 3.9 to 9.4 ms).

    Returns:
        One dict per variant: ``tiles`` (the settings of fwd, dq and dk used), ``fwd_ms`` and ``fwd+bwd_ms``
        (the least over the rounds of the median ms), ``rounds`` (each round's median per mode), ``status``
        (``"ok"`` or why a timing failed) and ``err`` (relative errors of o, dq, dr, dk and dv against float64),
        as :func:`regattn.bench.variants.time_in_rounds` gives them.

    On a GPU (D=64 and D=256: ``time_tile_variants(shape=dict(D=64))``)::

        python -c "from regattn.bench.suites.parallax import time_tile_variants
        for row in time_tile_variants(): print(row)"
    """
    shape = dict(PREFILL[0], **(shape or {}))
    variants = TILE_VARIANTS.get(tiles.table_head_dim(shape["D"]), [{}]) if variants is None else variants
    for variant in variants:
        unknown = set(variant) - {"fwd", "dq", "dk"}
        if unknown:
            raise ValueError(f"variants: expected overrides of 'fwd', 'dq' or 'dk', got {sorted(unknown)}")
    setup = Setup(dtype=dtype, device=device, backend="triton", rep_ms=rep_ms)
    B, H, T, D, w = shape["B"], shape["H"], shape["T"], shape["D"], shape.get("window")
    HQ = shape.get("HQ", H)
    q, r = randn(setup, B, T, HQ, D, grad=True), randn(setup, B, T, HQ, D, grad=True, scale=0.1)
    k, v = randn(setup, B, T, H, D, grad=True), randn(setup, B, T, H, D, grad=True)
    leaves = [q, r, k, v]
    key = tiles.table_head_dim(D)
    table = tiles.TILES[key]
    case = Case("regattn:triton", lambda: regattn.parallax(q, r, k, v, window=w, backend="triton"), leaves,
                check=check("fwd+bwd", q, r, k, v, w))
    contenders = [Contender({mode: (case.call, leaves) for mode in MODES},
                            functools.partial(_table_variant, key, variant),
                            lambda: case_errors(case, "fwd+bwd")) for variant in variants]
    rows = time_in_rounds(contenders, cuda=setup.cuda, rep_ms=rep_ms, rounds=rounds)
    return [dict(tiles={kind: dict(table[kind], **variant.get(kind, {})) for kind in ("fwd", "dq", "dk")}, **row)
            for variant, row in zip(variants, rows)]


@contextlib.contextmanager
def _table_variant(key: int, variant: dict):
    """Within the block, the tile table's entry ``key`` has the variant's settings merged over its own."""
    table = tiles.TILES[key]
    tiles.TILES[key] = {kind: dict(cfg, **variant.get(kind, {})) for kind, cfg in table.items()}
    try:
        yield
    finally:
        tiles.TILES[key] = table


# Launch variants of the decode kernel for time_decode_variants: the launch in use first ({}), then its key tile,
# warps or stages changed (``config``, merged over the tile of whichever kernel the shape runs: split or not), its
# split count (``num_splits``) or its loads (``TMA``: key and value tiles through tensor descriptors). On the H200
# B 8 and 64 took 1.2x to 1.3x cuDNN's time, where the H100 had 1.03x to 1.08x (benchmarks/results/h200/
# parallax.json, tiles/parallax-decode-variants.json: stages, tiles, warps and split counts).
DECODE_VARIANTS = [
    {},
    {"config": dict(TMA=True)},
    {"config": dict(TMA=True, num_stages=4)},
    {"config": dict(TMA=True, num_stages=2)},
    {"config": dict(TMA=True, BLOCK_N=64)},
    {"config": dict(TMA=True, BLOCK_N=64, num_stages=4)},
    {"config": dict(TMA=True, num_warps=8)},
]


def time_decode_variants(variants=None, *, shapes=None, dtype=torch.bfloat16, device="cuda", rep_ms=100,
                         rounds: int = 3, eager: bool = False) -> list[dict]:
    """Time the Parallax decode kernel (one new token) with each launch variant inside a CUDA graph, beside
    SDPA-cuDNN's decode of the same cache, side by side in one process.

    A variant is ``{"config": {...}, "num_splits": n, "switches": {...}}`` (any may be left out): the first two as
    :func:`regattn.ops.parallax.decode.parallax_decode_fwd` takes them, ``switches`` names of that module set
    while the variant runs (another build of ``_parallax_decode_kernel``, say); ``{}`` is the launch in use. Each
    variant's output is checked against float64 as the suite's decode rows are (:func:`decode_inputs`).

    Args:
        variants: list of variants (default :data:`DECODE_VARIANTS`).
        shapes: decode shapes ``B, HQ, H, ctx, D`` (default: the goal grid's).
        rounds: every timing is repeated over this many rounds, SDPA first, then each variant (a drift of the
            clocks reaches them all alike); a row keeps the least round's median.
        eager: time calls issued back to back (the host's time or the device's, whichever is longer), SDPA's too,
            instead of graph replays.

    Returns:
        One dict per (shape, variant): the shape, ``variant``, ``status``, ``decode_ms``, ``rounds``,
        ``err`` (relative error of ``o``) and ``ratio`` (its time over SDPA's in the same rounds, ``sdpa_ms``).

    On a GPU::

        python -c "from regattn.bench.suites.parallax import time_decode_variants
        for row in time_decode_variants(): print(row)"
    """
    from regattn.ops.parallax import decode as decode_module

    variants = DECODE_VARIANTS if variants is None else variants
    for variant in variants:
        unknown = set(variant) - {"config", "num_splits", "switches"}
        if unknown:
            raise ValueError(f"variants: expected 'config', 'num_splits' or 'switches', got {sorted(unknown)}")
    setup = Setup(dtype=dtype, device=device, backend="triton", rep_ms=rep_ms)
    timing = dict(back_to_back=frozenset({"decode"})) if eager else dict(graphs=frozenset({"decode"}))
    rows = []
    for shape in shapes or DECODE:
        q, r, k, v, truth = decode_inputs(shape, setup)
        sdpa_call, _, _ = peers.sdpa(q, k, v, backend="cudnn" if setup.cuda else "math")
        sdpa = Contender({"decode": (sdpa_call, [])}, **timing)

        def launch(variant):
            launch_args = {key: value for key, value in variant.items() if key != "switches"}

            def call():
                return decode_module.parallax_decode_fwd(q, r, k, v, scale=q.shape[-1] ** -0.5, **launch_args)
            setting = contextlib.nullcontext
            if variant.get("switches"):
                setting = functools.partial(mock.patch.multiple, decode_module, **variant["switches"])
            return Contender({"decode": (call, [])}, setting, lambda: truth.errors(call()), **timing)
        sdpa_row, *timed_rows = time_in_rounds([sdpa] + [launch(v) for v in variants], cuda=setup.cuda,
                                               rep_ms=rep_ms, rounds=rounds)
        sdpa_ms = sdpa_row["decode_ms"]
        for variant, row in zip(variants, timed_rows):
            ratio = row["decode_ms"] / sdpa_ms if row["decode_ms"] and sdpa_ms else None
            rows.append(dict(shape, variant=variant, sdpa_ms=sdpa_ms, ratio=ratio, **row))
    return rows
