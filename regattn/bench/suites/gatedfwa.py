"""GatedFWA (gatedfwa.md Figure 10 and Section 4): windowed gated attention forward and
forward+backward (with the gate's gradient) against FlexAttention (the gate as a score_mod reading
u twice, the window as a mask_mod), flash-linear-attention's forgetting attention, our ungated
sliding window and full-causal FlashAttention; and the gate scan, forward and backward, in fp32 against a
device copy of the same bytes (the memory floor)."""
from __future__ import annotations

import functools
import inspect
import statistics

import torch
import triton

import regattn
from regattn import reference
from regattn.bench import counts, peers
from regattn.bench.check import Check, Slice
from regattn.bench.runner import (
    Case, Setup, build, case_errors, flex_case, for_mode, ours, randn, reference_case, sdpa_cases,
)
from regattn.bench.variants import Contender, time_in_rounds, tile
from regattn.ops._common.attention_tiles import attention_blocks, overridden_blocks
from regattn.ops.gatedfwa.api import gate_dispatch

NAME = "gatedfwa"
PEERS = ("sdpa-flash", "sdpa-cudnn", "flex", "fla", "copy")
QUICK_PEERS = ("flex", "copy")
MAIN = {"fwd": ("flex",), "fwd+bwd": ("flex",), "gate fwd": ("copy",), "gate fwd+bwd": ("copy",)}
MODES = ("fwd", "fwd+bwd")
ATTENTION = [dict(B=1, H=16, T=32768, D=128, w=512)]
GATE = [dict(part="gate", B=1, T=T, H=H) for T in (8192, 65536) for H in (16, 64, 128)]
GRIDS = {
    "tiny": [dict(B=1, H=2, T=48, D=16, w=16), dict(part="gate", B=1, T=64, H=4)],
    "goal": ATTENTION + GATE,
    "quick": ATTENTION + GATE[-1:],
    "full": [dict(B=1, H=16, T=T, D=128, w=w) for T in (4096, 8192, 16384, 32768, 65536, 131072) for w in (512, 1024)]
    + GATE,
}
CHECK_ROWS = 2048
# Tiles of the chunked gate scan timed by time_chunked_tiles: (elements of a tile, heads of a block, num_warps).
# Each compiles for sm_90 (triton 3.6) without spilling, forward and backward, at 16, 64 and 128 heads
# (``python -m regattn.bench.registers gatedfwa_gate --candidates``). Left out as they spill: 16384 elements
# and more at up to 16 warps, 4096 at 4 warps below 64 heads a block, 8192 at 4 warps and at 8 above 16 heads
# (backward); a block of all 64 heads with 4096 elements at 8 warps or 8192 at 16 (forward); 8192 elements in
# blocks of 16 heads at 8 warps and of 32 at 16 (the look-back's wider step there, see gate.look_back_width).
CHUNK_TILES = [(512, 16, 4), (512, 64, 4), (1024, 8, 4), (1024, 16, 4), (2048, 16, 4), (2048, 64, 4),
               (2048, 8, 8), (2048, 16, 8), (2048, 32, 8), (2048, 64, 8), (4096, 16, 8), (4096, 32, 8),
               (4096, 16, 16), (4096, 32, 16), (4096, 64, 16), (4096, 128, 16), (8192, 16, 16)]


def cases(shape: dict, setup):
    """Attention shapes: B, H, HQ (default H), T, D, w. Gate shapes: part="gate", B, T, H."""
    yield from (gate_cases if shape.get("part") == "gate" else attention_cases)(shape, setup)


def gate_inputs(setup, B, T, H, dtype=None, grad=False):
    """Gate pre-activations ``h`` and amplitudes ``beta`` near 1 (the layer's ``1 + elu(.)`` at init)."""
    h = randn(setup, B, T, H, dtype=dtype, grad=grad)
    beta = (1.0 + 0.1 * torch.rand(B, T, H, device=setup.device, dtype=dtype or setup.dtype)).requires_grad_(grad)
    return h, beta


def gate_cases(shape, setup):
    """The gate in fp32 (as the layer computes it); the backward moves du, h, beta in and dh, dbeta out.

    The scan is timed as the layers call it (:func:`gate_dispatch`, no value check); the public
    :func:`regattn.gatedfwa_gate` once more with its eager value check (three reductions over h and beta
    and a device sync). On a GPU the scan and the copy once more inside a CUDA graph: at these sizes the
    eager forward and backward launches' host work can exceed the kernels' time."""
    B, T, H = shape["B"], shape["T"], shape["H"]
    h, beta = gate_inputs(setup, B, T, H, dtype=torch.float32, grad=True)
    where = Slice(kv_heads=H)
    for mode in ("gate fwd", "gate fwd+bwd"):
        bwd = mode.endswith("fwd+bwd")
        truth = Check(lambda h, beta: reference.gatedfwa_gate(h, beta), dict(h=h, beta=beta), where,
                      grads=("h", "beta") if bwd else ())
        nbytes = counts.gate_bytes(B, T, H, 4) * (8 / 3 if bwd else 1)  # fwd: 3 arrays; fwd+bwd: 3 + 5
        n = dict(flops=None if bwd else counts.gate_flops(B, T, H), bytes=nbytes)
        layer_call = lambda: gate_dispatch(h, beta, eps=1e-6, backend=setup.backend)  # noqa: E731 (no value check)
        yield mode, ours(gate_dispatch, h, setup, layer_call, [h, beta], check=truth, **n)
        yield mode, ours(regattn.gatedfwa_gate, h, setup,  # the public op: its value check reads h and beta
                         lambda: regattn.gatedfwa_gate(h, beta, backend=setup.backend), [h, beta],
                         tag=" (value check)", check=truth, **n)
        yield from reference_case(setup, mode, lambda: reference.gatedfwa_gate(h, beta), [h, beta], check=truth, **n)
        copy = lambda: peers.copy_floor(nbytes, setup.device)  # noqa: E731
        if peers.wanted(setup.peers, "copy"):
            yield mode, build("copy (memory floor)", copy, bytes=nbytes)
        if setup.cuda:  # the kernels' own time: a CUDA graph takes the launches' host work away
            yield mode, ours(gate_dispatch, h, setup, layer_call, [h, beta], check=truth, graph=True, **n)
            if peers.wanted(setup.peers, "copy"):
                yield mode, build("copy (memory floor)", copy, bytes=nbytes, graph=True)


def fla_forgetting(q, k, v, u, window):
    """flash-linear-attention's forgetting attention with per-step log-gates ``g_t = u_t - u_{t-1}``;
    its gradient ``dg`` gives ours as ``du_t = dg_t - dg_{t+1}``."""
    fn = peers.fla_function("parallel_forgetting_attn")
    g = torch.diff(u.detach().float(), dim=1, prepend=torch.zeros_like(u[:, :1]).float())
    kwargs = {"window_size": window} if "window_size" in inspect.signature(fn).parameters else {}
    leaves = [peers.leaf(x) for x in (q, k, v)] + [g.requires_grad_(u.requires_grad)]

    def grads(gs):
        dg = gs[3]
        du = dg.clone()
        du[:, :-1] -= dg[:, 1:]
        return {"dq": gs[0], "dk": gs[1], "dv": gs[2], "du": du}
    return (lambda: fn(*leaves, **kwargs)), leaves, grads


def attention_inputs(setup, shape) -> tuple:
    """``q, k, v`` and the cumulative log-gate ``u`` (fp32) of an attention shape, all needing grad."""
    B, H, T, D = shape["B"], shape["H"], shape["T"], shape["D"]
    HQ = shape.get("HQ", H)
    q = randn(setup, B, T, HQ, D, grad=True)
    k, v = randn(setup, B, T, H, D, grad=True), randn(setup, B, T, H, D, grad=True)
    h, beta = gate_inputs(setup, B, T, HQ, dtype=torch.float32)
    return q, k, v, reference.gatedfwa_gate(h, beta).requires_grad_(True)


def attention_check(mode, q, k, v, u, w) -> Check:
    """The float64 truth of a mode on the first rows (the gate is read at rows and keys)."""
    where = Slice(kv_heads=k.shape[2], rows=min(q.shape[1], CHECK_ROWS))
    return Check(lambda q, k, v, u: reference.gatedfwa(q, k, v, u, window=w), dict(q=q, k=k, v=v, u=u), where,
                 grads=("q", "k", "v", "u") if mode == "fwd+bwd" else ())


def attention_cases(shape, setup):
    B, H, T, D, w = shape["B"], shape["H"], shape["T"], shape["D"], shape["w"]
    HQ = shape.get("HQ", H)
    q, k, v, u = attention_inputs(setup, shape)
    for mode in MODES:
        bwd = mode == "fwd+bwd"
        truth = attention_check(mode, q, k, v, u, w)
        n = dict(flops=counts.attention_flops(B, T, T, HQ, D, D, window=w, backward=bwd),
                 bytes=counts.attention_bytes(B, T, T, HQ, H, D, D, q.element_size(), backward=bwd, extra_per_query=1))
        yield mode, ours(regattn.gatedfwa, q, setup,
                         lambda: regattn.gatedfwa(q, k, v, u, window=w, backend=setup.backend), [q, k, v, u],
                         check=truth, **n)
        yield mode, ours(regattn.softmax_attention, q, setup,
                         lambda: regattn.softmax_attention(q, k, v, window=w, backend=setup.backend), [q, k, v],
                         tag=" (window, no gate)", **n)
        yield from sdpa_cases(setup, mode, q, k, v, backends=("flash", "cudnn"), tag=" (full causal)", **n)
        yield from flex_case(setup, mode, q, k, v, window=w, gate=u, check=truth, **n)
        if peers.wanted(setup.peers, "fla"):
            yield mode, build("fla:parallel_forgetting_attn", lambda: fla_forgetting(*for_mode(mode, q, k, v, u), w),
                              check=truth, **n)
        yield from reference_case(setup, mode, lambda: reference.gatedfwa(q, k, v, u, window=w), [q, k, v, u],
                                  check=truth, **n)


# The softmax kernels' tile kinds (attention_blocks), which a variant of time_tile_variants overrides.
TILE_KINDS = ("fwd", "bwd_kv", "bwd_q")
# Tile variants of the softmax kernels for time_tile_variants at D = 128, bf16, window 512: the table's entries
# first, then other tiles of one kernel that compile without spilling on sm_90, and the dK/dV pass on the
# softmax's table. REG per kernel with the gate / without, triton 3.6: benchmarks/results/sm90-registers/gatedfwa.txt
# (python -m regattn.bench.registers gatedfwa --candidates; softmax: without the gate); bwd_kv holds BLOCK_N keys
# and streams BLOCK_M query rows.
TILE_VARIANTS = [
    {},                                                   # fwd REG 206 / 166, bwd_kv 255 / 246, bwd_q 220 / 182
    {"fwd": tile(64, 32, 4, 3)},                          # REG 152 / 128
    {"fwd": tile(64, 64, 4, 2)},                          # REG 206 / 166
    {"fwd": tile(128, 64, 8, 2)},                         # REG 206 / 161
    {"bwd_q": tile(64, 64, 8, 2)},                        # REG 137 / 128
    {"bwd_q": tile(64, 32, 4, 3)},                        # REG 156 / 139
    {"bwd_kv": tile(32, 64, 8, 3)},                       # REG 209 / 180
    {"bwd_kv": tile(64, 64, 4, 2)},                       # REG 255 / 255, spills 136 / 72 bytes
]


def time_tile_variants(variants=None, *, shape=None, dtype=torch.bfloat16, device="cuda", rep_ms=100,
                       rounds: int = 3) -> list[dict]:
    """Time GatedFWA's forward and forward+backward (with du) with each tile variant of the softmax kernels,
    the ungated sliding window with the same tiles, and FlexAttention's gated window, in one process.

    A variant sets launch settings of :func:`attention_blocks`: ``{"fwd": {...}, "bwd_kv": {...},
    "bwd_q": {...}}``, each merged over the gated kernel's settings of that kind, for the gated and the
    ungated kernel alike (``{}``: each kernel its own entry); the overrides in place before come back
    afterwards. FlexAttention (as the suite builds it) is timed first in every round, so each variant has
    ratios to it from the same round. The inputs are drawn once; the gated output and gradients of each
    variant, and Flex's, are checked against float64 on a slice, as the suite's rows are. Rounds as in
    :mod:`regattn.bench.variants`.

    Args:
        variants: list of variants (default: :data:`TILE_VARIANTS`).
        shape: ``B, H, T, D, w`` and optionally ``HQ`` (default: the goal shape B=1 H=16 T=32768 D=128 w=512).
        rounds: how many times each variant (and Flex) is timed, one after the other in each round.

    Returns:
        Flex's row, then one per variant: ``op`` (``"flex"`` or ``"regattn:triton"``), ``tiles`` (the gated
        kernels' settings of fwd, bwd_kv and bwd_q; None for Flex), ``status`` (``"ok"`` or why a timing
        failed), ``rounds`` (each round's median ms per timing), ``err`` (relative errors of o, dq, dk, dv, du
        against float64), the least median ms of each timing: ``fwd_ms`` and ``fwd+bwd_ms`` (variants also
        ``window fwd_ms`` and ``window fwd+bwd_ms``: the ungated window). Variants also get, per mode,
        ``of_flex`` and ``gate_cost``: the median over the rounds of the variant's ms over Flex's, and over the
        ungated window's, of that round.

    On a GPU::

        python -c "from regattn.bench.suites.gatedfwa import time_tile_variants
        for row in time_tile_variants(): print(row)"
    """
    shape = dict(ATTENTION[0], **(shape or {}))
    variants = TILE_VARIANTS if variants is None else variants
    for variant in variants:
        unknown = set(variant) - set(TILE_KINDS)
        if unknown:
            raise ValueError(f"variants: expected overrides of 'fwd', 'bwd_kv' or 'bwd_q', got {sorted(unknown)}")
    setup = Setup(dtype=dtype, device=device, backend="triton", peers=("flex",), rep_ms=rep_ms)
    q, k, v, u = attention_inputs(setup, shape)
    w = shape["w"]
    truth = attention_check("fwd+bwd", q, k, v, u, w)
    table = {kind: attention_blocks(shape["D"], dtype, kind, gated=True) for kind in TILE_KINDS}
    overrides = [{kind: dict(table[kind], **cfg) for kind, cfg in variant.items()} for variant in variants]
    flex, flex_status = flex_contender(setup, q, k, v, u, w, truth)
    contenders = [flex] + [tiled_contender(q, k, v, u, w, truth, tiles) for tiles in overrides]
    first, *rows = time_in_rounds(contenders, cuda=setup.cuda, rep_ms=rep_ms, rounds=rounds)
    first = dict(op="flex", tiles=None, **first)
    first["status"] = flex_status if first["status"] == "ok" else first["status"]
    return [first] + [dict(op="regattn:triton", tiles=dict(table, **tiles), **row,
                           of_flex={m: round_ratio(row["rounds"][m], first["rounds"].get(m, [])) for m in MODES},
                           gate_cost={m: round_ratio(row["rounds"][m], row["rounds"][f"window {m}"]) for m in MODES})
                      for tiles, row in zip(overrides, rows)]


def flex_contender(setup, q, k, v, u, w, truth) -> tuple[Contender, str]:
    """FlexAttention's gated window as the suite times it, forward and forward+backward, and ``"ok"`` or why
    it cannot run."""
    cases = {mode: case for mode in MODES for _, case in flex_case(setup, mode, q, k, v, window=w, gate=u,
                                                                    check=truth)}
    calls = {mode: (case.call, case.leaves) for mode, case in cases.items() if case.call is not None}
    status = next((case.status for case in cases.values() if case.call is None), "ok")
    both = cases["fwd+bwd"]
    return Contender(calls, errors=(lambda: case_errors(both, "fwd+bwd")) if both.call else None), status


def tiled_contender(q, k, v, u, w, truth, tiles: dict) -> Contender:
    """Our gated window and the ungated one (timings ``"window fwd"``, ``"window fwd+bwd"``), forward and
    forward+backward, launched with ``tiles`` (launch settings of the kinds of :func:`attention_blocks` they
    override)."""
    def gated():
        return regattn.gatedfwa(q, k, v, u, window=w, backend="triton")

    def window():
        return regattn.softmax_attention(q, k, v, window=w, backend="triton")
    case = Case("regattn:triton", gated, [q, k, v, u], check=truth)
    calls = {**{mode: (gated, case.leaves) for mode in MODES},
             **{f"window {mode}": (window, [q, k, v]) for mode in MODES}}
    return Contender(calls, functools.partial(overridden_blocks, tiles), lambda: case_errors(case, "fwd+bwd"))


def round_ratio(times: list, base: list) -> float | None:
    """The median over the rounds of ``times[r] / base[r]`` (rounds where both were measured), or None."""
    ratios = [t / b for t, b in zip(times, base) if t is not None and b]
    return statistics.median(ratios) if ratios else None


def chunk_blocks(H: int, tiles=None) -> list[tuple[int, int, int]]:
    """The distinct ``(BLOCK_T, BLOCK_H, num_warps)`` of ``tiles`` (default :data:`CHUNK_TILES`) at ``H``
    heads, in order: the block of heads cut to the heads' next power of two, ``BLOCK_T = elements // BLOCK_H``."""
    blocks = []
    for elements, heads, num_warps in tiles or CHUNK_TILES:
        block_h = min(heads, triton.next_power_of_2(H))
        block = (max(1, elements // block_h), block_h, num_warps)
        blocks += [block] if block not in blocks else []
    return blocks


# The timings of time_chunked_tiles: name -> (the pass, bytes an fp32 element moves, timed in a CUDA graph).
CHUNK_TIMINGS = {"fwd": ("fwd", 12, False), "bwd": ("bwd", 20, False),
                 "fwd_graph": ("fwd", 12, True), "bwd_graph": ("bwd", 20, True)}


def time_chunked_tiles(tiles=None, *, shapes=None, device="cuda", rep_ms=100, rounds=3) -> list[dict]:
    """Time the chunked gate scan's forward and backward kernels with each tile, eagerly and inside a CUDA
    graph, beside device copies of the bytes each moves (fp32: 12 bytes an element forward, 20 backward)
    timed alike, in one process.

    Eager times include each call's host work and the launch zeroing the look-back state; graph times are
    the kernels' own. Every timing is repeated over ``rounds`` rounds, each timing the copies and then every
    tile once (a drift of the clocks reaches them all alike); a row keeps the least round's median.

    Args:
        tiles: ``(elements of a tile, heads of a block, num_warps)`` triples (default :data:`CHUNK_TILES`),
            made blocks by :func:`chunk_blocks`; the default tiles of :func:`chunked_blocks` are timed first.
        shapes: ``(B, T, H)`` triples (default: the full grid's gate shapes).

    Returns:
        One dict per (shape, tile): ``B, T, H, BLOCK_T, BLOCK_H, num_warps``, ``default`` (the passes,
        ``"fwd"`` and ``"bwd"``, for which :func:`chunked_blocks` picks the tile), ``status`` (``"ok"`` or
        why a timing failed), for each timing of :data:`CHUNK_TIMINGS` ``{name}_ms`` and ``{name}_of_copy``
        (the copy's time over the kernel's: the fraction of copy bandwidth reached), ``copy_ms`` (the copies' times by timing), ``rounds`` (each
        round's median by timing) and ``err`` (relative errors of u, dh and dbeta against float64).

    On a GPU::

        python -c "from regattn.bench.suites.gatedfwa import time_chunked_tiles
        for row in time_chunked_tiles(): print(row)"
    """
    from regattn.ops.gatedfwa.gate import chunked_blocks, gate_backward, gate_forward
    setup = Setup(dtype=torch.float32, device=device, backend="triton", rep_ms=rep_ms)
    shapes = shapes or [(g["B"], g["T"], g["H"]) for g in GRIDS["full"] if g.get("part") == "gate"]
    rows = []
    for B, T, H in shapes:
        h, beta = gate_inputs(setup, B, T, H, dtype=torch.float32)
        du = randn(setup, B, T, H, dtype=torch.float32)
        hd, bd = (x.double().requires_grad_(True) for x in (h, beta))
        exact = reference.gatedfwa_gate(hd, bd)
        exact = (exact, *torch.autograd.grad(exact, [hd, bd], du.double()))
        defaults = {part: chunked_blocks(H, h.numel(), part == "bwd") for part in ("fwd", "bwd")}
        blocks = list(dict.fromkeys([*defaults.values(), *chunk_blocks(H, tiles)]))
        copies = {n: peers.copy_floor(n * h.numel(), device)[0] for n in (12, 20)}
        graphs = frozenset(name for name, (_, _, graph) in CHUNK_TIMINGS.items() if graph)
        copy = Contender({name: (copies[nbytes], []) for name, (_, nbytes, _) in CHUNK_TIMINGS.items()},
                         graphs=graphs)

        def tiled(b):
            passes = dict(fwd=lambda: gate_forward(h, beta, 1e-6, blocks=b),
                          bwd=lambda: gate_backward(du, h, beta, 1e-6, blocks=b))

            def errors():
                got = (passes["fwd"](), *passes["bwd"]())
                return {name: ((a.double() - e).norm() / e.norm()).item()
                        for name, a, e in zip(("u", "dh", "dbeta"), got, exact)}
            return Contender({name: (passes[part], []) for name, (part, _, _) in CHUNK_TIMINGS.items()},
                             errors=errors, graphs=graphs)
        copy_row, *timed_rows = time_in_rounds([copy] + [tiled(b) for b in blocks], cuda=setup.cuda,
                                               rep_ms=rep_ms, rounds=rounds)
        copy_ms = {name: copy_row[f"{name}_ms"] for name in CHUNK_TIMINGS}
        for b, row in zip(blocks, timed_rows):
            of_copy = {f"{name}_of_copy": copy_ms[name] / row[f"{name}_ms"] if row[f"{name}_ms"] and copy_ms[name]
                       else None for name in CHUNK_TIMINGS}
            rows.append(dict(B=B, T=T, H=H, BLOCK_T=b[0], BLOCK_H=b[1], num_warps=b[2],
                             default=[part for part, tile in defaults.items() if tile == b], copy_ms=copy_ms,
                             **row, **of_copy))
    return rows
