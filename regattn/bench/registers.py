"""Register use of the Triton kernels, compiled for a GPU on any machine (no GPU needed).

``python -m regattn.bench.registers parallax [--head-dims 128 256] [--kinds fwd dk] [--candidates]``
``python -m regattn.bench.registers scan [--head-dims 64] [--kinds ieee tf32x3 tf32 fp16] [--candidates]``
``python -m regattn.bench.registers scan_bwd`` (the fp16 backward: fused dK/dV/dQ, and the two passes)
``python -m regattn.bench.registers gatedfwa_gate [--candidates]``
``python -m regattn.bench.registers lla [--head-dims 128] [--kinds pairs diag cg cg-g16] [--candidates]``
``python -m regattn.bench.registers lla_bwd [--head-dims 128] [--kinds pairs diag cg] [--candidates]``
``python -m regattn.bench.registers gatedfwa [--kinds fwd bwd_kv bwd_q] [--candidates]`` (``softmax``: ungated)
``python -m regattn.bench.registers mesanet [--kinds tf32x3 tf32] [--candidates]``

prints, for each kernel configuration of an op at its goal shape, what ``cuobjdump --dump-resource-usage``
reports for the cubin compiled for sm_90: ``REG`` (registers per thread, 255 at most), ``STACK`` (bytes of
stack frame per thread: spilled registers), ``LOCAL`` (local memory), ``SHARED`` (bytes of shared
memory the launch needs; an H100 has 227 KiB a block), ``SERIAL`` (1 where ``ptxas`` serialises the
warpgroup products for want of registers: each then waits for the one before) and ``HAZARD`` (copies into a
shared buffer that a loop issues while an asynchronous warpgroup product reading that buffer may still run: a race,
:func:`async_product_hazards`). A configuration with ``STACK > 0`` spills; one with ``HAZARD > 0`` must not run.
``--candidates`` screens the tile candidates of :data:`CANDIDATES` as well as the table's entry.

``scan`` screens the forward kernel of the ELSA scan (one row per autotune config of each fp32 precision, or
with ``--kinds fp16`` of fp16 inputs, ``*`` marking them; ``--candidates`` adds :data:`SCAN_CANDIDATES`) at its
goal shape B=1 H=16 T=16384 non-causal (``--causal``: causal), and reads the SASS of the hottest innermost loop:
its instruction count, how many are ``FFMA`` (and the FFMA share: the fp32 FMA pipe's density), ``MUFU`` (exp2),
``HMMA`` (tensor core), and ``LDL``/``STL`` (spill traffic inside the loop).

``gatedfwa`` screens the softmax kernels with the gate (``GATED=True``) at GatedFWA's goal shape B=1 H=16
T=32768 window 512, bf16; ``softmax`` the same kernels without the gate at that shape (the ungated sliding
window). ``--candidates`` adds the tiles of :data:`CANDIDATES` of the kernel laid out alike.

The launches are the ops' own: the op's Python wrapper runs on ``meta`` tensors with the launch of each
kernel captured instead of run, then compiled with Triton's own specialisation of those arguments.

The compile is the installed Triton's. A GPU machine may run another version (one that refuses what
this one accepts: ``tl.dot`` with K < 16 compiles with triton 3.9, not 3.6): to compile with it, install
it into a folder of its own (``pip install --no-deps --target DIR triton==3.6.0``) and run this module
with ``DIR`` first on ``PYTHONPATH``.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import os
import re
import subprocess
import sys
import tempfile
from unittest import mock

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

SM90 = GPUTarget("cuda", 90, 32)
SM90_SHARED = 232448  # bytes of shared memory a block may use on an H100 (227 KiB)
KINDS = ("fwd", "dq", "dk", "decode", "decode_split")
SCAN_KINDS = ("ieee", "tf32x3", "fp16x3", "tf32", "fp16")  # the scan's forward: fp32 precisions, fp16 inputs
MESANET_KINDS = ("tf32x3", "tf32")  # MesaNet's chunk products: the op's precision, and one TF32 product (a bound)
HEAD_DIMS = (32, 64, 128, 256)
# Tile candidates screened with --candidates: (rows of a program, streamed tile, num_warps) x num_stages. A
# program of fwd and dq holds BLOCK_M query rows and streams BLOCK_N keys; one of dk holds BLOCK_N keys and
# streams BLOCK_M query rows.
TILE_SHAPES = [(32, 32, 4), (32, 64, 4), (64, 16, 4), (64, 32, 4), (64, 64, 4), (64, 16, 8), (64, 32, 8),
               (64, 64, 8), (128, 16, 8), (128, 32, 8), (128, 64, 8), (128, 128, 8)]
CANDIDATES = {kind: [dict(zip(("BLOCK_N", "BLOCK_M") if kind == "dk" else ("BLOCK_M", "BLOCK_N"), (rows, streamed)),
                          num_warps=w, num_stages=s)
                     for (rows, streamed, w), s in itertools.product(TILE_SHAPES, (1, 2, 3))]
              for kind in ("fwd", "dq", "dk")}
DECODE_CANDIDATES = [dict(BLOCK_N=n, num_warps=w, num_stages=s)
                     for n, w, s in itertools.product((32, 64, 128), (4, 8), (2, 3))]


@contextlib.contextmanager
def captured_launches():
    """Within the block, a Triton kernel launch is recorded as ``(kernel, args, kwargs)`` instead of run."""
    launches = []
    run = JITFunction.run

    def record(self, *args, grid, warmup, **kwargs):
        launches.append((self, args, kwargs))

    JITFunction.run = record
    try:
        yield launches
    finally:
        JITFunction.run = run


def compile_launch(kernel, args, kwargs, target=SM90, floats: str = "fp32"):
    """The compiled kernel of a captured launch, specialised as Triton's launcher does for these arguments;
    ``floats="fp64"`` types its float arguments as torch.compile's launches pass them."""
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    signature = {name: floats if kind == "fp32" else kind for name, kind in signature.items()}
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target, options=options.__dict__)


def cuobjdump(compiled, flag: str) -> str:
    """What Triton's bundled ``cuobjdump flag`` prints for the cubin of a compiled kernel."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        return subprocess.run([tool, flag, f.name], capture_output=True, text=True, check=True).stdout


def wgmma_serialized(compiled) -> int:
    """1 where Triton's bundled ``ptxas`` serialises the kernel's warpgroup products for want of registers (its
    message C7512: each ``wgmma`` then waits for the one before, so the tensor cores idle through every
    product's latency), else 0."""
    ptx = compiled.asm["ptx"]
    if "wgmma" not in ptx:
        return 0
    arch = compiled.metadata.target.arch
    tool = get_ptxas(arch).path  # the ptxas this Triton assembles with
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        done = subprocess.run([tool, "-v", f"-arch=sm_{arch}a", f.name, "-o", os.devnull], capture_output=True,
                              text=True, check=True)
    return int("C7512" in done.stdout + done.stderr)


SSA = r"%[\w.]+"
BUFFER = re.compile(rf"({SSA}) = ttg\.local_alloc : \(\) -> !ttg\.memdesc<(\d+)x\d+x")  # a pipelined tile's slots
VIEW = re.compile(rf"({SSA}) = ttg\.memdesc_\w+ ({SSA})")
ASYNC_PRODUCT = re.compile(rf"({SSA}) = ttng\.warp_group_dot (.*?) \{{.*isAsync = true")
PRODUCT_WAIT = re.compile(r"ttng\.warp_group_dot_wait .*\{pendings = (\d+)")


def loop_bodies(lines: list[str]) -> list[range]:
    """The line ranges of the bodies of the ``scf.for`` loops of a TTGIR listing (a nested loop's lie inside)."""
    bodies = []
    for start, line in enumerate(lines):
        if "scf.for" not in line or not line.rstrip().endswith("{"):
            continue
        depth, end = 1, start
        while depth > 0 and end + 1 < len(lines):
            end += 1
            depth += lines[end].count("{") - lines[end].count("}")
        bodies.append(range(start + 1, end))
    return bodies


def async_product_hazards(ttgir: str) -> int:
    """How many copies into a shared buffer a kernel's loops issue while an asynchronous warpgroup product that
    reads that buffer may still run: a race. ``warp_group_dot`` with ``isAsync`` stays in flight until a
    ``warp_group_dot_wait`` leaves fewer products pending; a loop's body is followed twice, for the products still
    in flight at its end. (Triton 3.6 leaves a product that accumulates across a loop's iterations in flight past
    the copy of the next tile into the single buffer it reads, when it is the loop's last product.) A buffer of
    ``n`` slots (a pipelined tile) takes ``n`` copies to come back to the slot a product reads."""
    lines = ttgir.splitlines()
    root, slots = {}, {}
    for line in lines:
        if match := BUFFER.search(line):
            root[match[1]], slots[match[1]] = match[1], int(match[2])
        elif match := VIEW.search(line):
            root[match[1]] = root.get(match[2])
    racy = set()
    for body in loop_bodies(lines):
        running = []  # per product in flight, in issue order: {buffer read: copies into it since}
        for index in list(body) * 2:
            line = lines[index]
            if match := ASYNC_PRODUCT.search(line):
                running.append({root[name]: 0 for name in re.findall(SSA, match[2]) if root.get(name)})
            elif match := PRODUCT_WAIT.search(line):
                running = running[len(running) - int(match[1]):] if int(match[1]) else []
            elif "copy_global_to_local" in line:
                for buffer in {root[name] for name in re.findall(SSA, line) if root.get(name)}:
                    for read in running:
                        if buffer in read:
                            read[buffer] += 1
                            if read[buffer] >= slots[buffer]:  # the copy reaches the slot being read
                                racy.add(index)
    return len(racy)


def resource_usage(compiled) -> dict:
    """``REG``, ``STACK``, ``LOCAL`` (from cuobjdump), ``SHARED`` (bytes), ``SERIAL`` (:func:`wgmma_serialized`)
    and ``HAZARD`` (:func:`async_product_hazards`) of a compiled kernel."""
    text = cuobjdump(compiled, "--dump-resource-usage")
    usage = {key: int(re.search(rf"\b{key}:(\d+)", text).group(1)) for key in ("REG", "STACK", "LOCAL")}
    usage["SHARED"] = compiled.metadata.shared
    usage["SERIAL"] = wgmma_serialized(compiled)
    usage["HAZARD"] = async_product_hazards(compiled.asm["ttgir"])
    return usage


SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);")


def inner_loop(sass: str, nested: bool = False) -> dict:
    """Instruction mix of the hottest loop of a kernel's SASS: of the loops (a backward ``BRA`` to its
    head) that hold no other loop, the one of most instructions (with ``nested``, of those inside another loop
    where there are any: the key loop of an iterative solver, run once per iteration). ``loop``: its instruction
    count; ``FFMA``, ``MUFU`` (the special-function unit: exp2, 16 a cycle per SM against 128 FFMAs), ``MMA``
    (``HMMA`` and ``HGMMA``: tensor core), ``LDS``, ``LDL``/``STL`` (local memory: spills): how many of each;
    ``FFMA%``: the FFMA share; ``FFMA/w``: FFMAs per 4-byte word read from shared memory (an SM reads 32 words a
    cycle and retires 128 FFMAs: below 4 the loop waits on shared memory, not on the FMA pipe)."""
    code = [(int(a, 16), op, args) for a, op, args in SASS_LINE.findall(sass)]
    loops = [(int(args.split()[-1], 16), addr) for addr, op, args in code
             if op == "BRA" and args and int(args.split()[-1], 16) < addr]
    innermost = [(a, b) for a, b in loops if not any(a <= c and d <= b and (c, d) != (a, b) for c, d in loops)]
    inside = [(a, b) for a, b in innermost if any(c <= a and b <= d and (c, d) != (a, b) for c, d in loops)]
    innermost = inside if nested and inside else innermost
    if not innermost:
        return {}
    body = max(([op for addr, op, _ in code if a <= addr <= b] for a, b in innermost), key=len)
    base = [op.split(".")[0] for op in body]
    mix = {op: base.count(op) for op in ("FFMA", "MUFU", "LDS", "LDL", "STL")}
    mix["MMA"] = base.count("HMMA") + base.count("HGMMA")
    words = sum({"64": 2, "128": 4}.get(op.split(".")[-1], 1) for op in body if op.startswith("LDS"))
    return dict(loop=len(body), **mix, **{"FFMA%": round(100 * mix["FFMA"] / len(body)),
                                          "FFMA/w": round(mix["FFMA"] / max(words, 1), 1)})


def parallax_launch(kind: str, head_dim: int, config: dict | None = None, *, B=4, T=8192, HQ=None, H=None,
                    dtype=torch.bfloat16):
    """The captured launch of the Parallax kernel ``kind`` (``fwd``, ``dq``, ``dk``, ``decode``: the key loop
    whole, ``decode_split``: split 4 ways) at a shape, with ``config`` overriding the tile table's entry. By
    default the goal shapes: prefill B=4 T=8192 with 16 heads; decode one new token of 32 query heads over 8
    key/value heads and a cache of T keys."""
    decode = kind.startswith("decode")
    HQ = HQ or (32 if decode else 16)
    H = H or (8 if decode else 16)
    from regattn.ops.parallax.backward import parallax_bwd
    from regattn.ops.parallax.decode import parallax_decode_fwd
    from regattn.ops.parallax.forward import parallax_fwd

    def meta(*shape, dt=dtype):
        return torch.empty(*shape, device="meta", dtype=dt)

    D = head_dim
    with captured_launches() as launches:
        if kind == "fwd":
            q, k = meta(B, T, HQ, D), meta(B, T, H, D)
            parallax_fwd(q, q, k, k, causal=True, window=None, scale=D ** -0.5, config=config)
        elif kind in ("dq", "dk"):
            q, k = meta(B, T, HQ, D), meta(B, T, H, D)
            stats = meta(B, HQ, T, dt=torch.float32)
            parallax_bwd(q, q, q, k, k, q, q, stats, stats, stats, causal=True, window=None, scale=D ** -0.5,
                         config={kind: config or {}})
        elif decode:
            q, k = meta(B, 1, HQ, D), meta(B, T, H, D)
            parallax_decode_fwd(q, q, k, k, scale=D ** -0.5, num_splits=4 if kind == "decode_split" else 1,
                                config=config)
        else:
            raise ValueError(f"kind: expected one of {', '.join(KINDS)}, got {kind!r}")
    name = {"fwd": "_parallax_fwd_kernel", "dq": "_parallax_bwd_dq_kernel", "dk": "_parallax_bwd_dk_kernel"}.get(
        kind, "_parallax_decode_kernel")
    return next(launch for launch in launches if launch[0].__name__ == name)


def launch_usage(kernel, args, kwargs, *, loop: bool = False, nested: bool = False) -> dict:
    """:func:`resource_usage` of a captured launch (with ``loop``, also the :func:`inner_loop` mix, ``nested`` as
    there), or ``error`` when it does not compile (e.g. out of shared memory: reported, not fatal to the screen)."""
    try:
        compiled = compile_launch(kernel, args, kwargs)
        mix = inner_loop(cuobjdump(compiled, "-sass"), nested) if loop else {}
        return dict(**resource_usage(compiled), **mix)
    except Exception as error:
        return dict(error=str(error).splitlines()[0][:80])


def launch_settings(kwargs) -> dict:
    keys = ("BLOCK_M", "BLOCK_N", "TMA", "num_warps", "num_stages")
    return {key: kwargs[key] for key in keys if key in kwargs}


def parallax_rows(head_dims=HEAD_DIMS, kinds=KINDS, candidates=False):
    """One row per (head dim, kernel, configuration): the table's entry first, then the candidates."""
    for D, kind in itertools.product(head_dims, kinds):
        configs = [None]
        if candidates:
            configs += DECODE_CANDIDATES if kind.startswith("decode") else CANDIDATES[kind]
        for config in configs:
            kernel, args, kwargs = parallax_launch(kind, D, config)
            usage = launch_usage(kernel, args, kwargs)
            yield dict(head_dim=D, kind=kind, table=config is None, **launch_settings(kwargs), **usage)


# Forward tiles screened for the scan with --candidates: (BLOCK_M, BLOCK_N, num_warps) x num_stages. Fewer
# threads per tile give each thread more outputs of a dot, so more FFMAs per operand read from shared memory.
SCAN_CANDIDATES = [(m, n, w, s) for (m, n, w), s in itertools.product(
    [(16, 64, 4), (16, 128, 4), (32, 32, 2), (32, 32, 4), (32, 64, 4), (32, 128, 4), (32, 64, 8), (32, 128, 8),
     (64, 32, 2), (64, 64, 2), (128, 32, 4), (128, 64, 4), (64, 128, 4), (256, 64, 8)], (2, 3))]


def scan_dtype(kind: str) -> tuple[torch.dtype, str]:
    """``(input dtype, precision)`` of a scan kind: an fp32 precision of :data:`SCAN_KINDS`, or ``fp16``."""
    return (torch.float16, "ieee") if kind == "fp16" else (torch.float32, kind)


def scan_launch(kind: str, config, *, B=1, T=16384, H=16, D=64, causal=False, masked=False):
    """The captured launch of the scan's forward kernel (non-causal by default, no lse: the benchmark's call;
    ``kind``: see :func:`scan_dtype`) with ``config`` (a ``triton.Config``) as its only tile choice. A causal
    strict fp32 fold launches it twice: the whole tiles, then (``masked``) the masked ones at ``MASKED_CONFIGS``."""
    from regattn.ops.scan import kernels

    dtype, precision = scan_dtype(kind)
    family = kernels._family(dtype, precision)
    saved = kernels.FWD_CONFIGS, kernels.AUTOTUNE
    kernels.FWD_CONFIGS, kernels.AUTOTUNE = {family: [config]}, False
    try:
        q = torch.empty(B, T, H, D, device="meta", dtype=dtype)
        with captured_launches() as launches:
            kernels.forward(q, q, q, causal=causal, window=None, scale=D ** -0.5, precision=precision,
                            cu_seqlens=None, num_splits=1, need_lse=False)
    finally:
        kernels.FWD_CONFIGS, kernels.AUTOTUNE = saved
    forward = [launch for launch in launches if launch[0].__name__ == "_fwd_kernel"]
    return forward[-1 if masked else 0]


def scan_rows(head_dims=(64,), kinds=("ieee", "tf32x3"), candidates=False, causal=False):
    """One row per (head dim, kind, forward configuration): the autotune list's, then the candidates."""
    from regattn.ops._common.attention_tiles import tile_configs
    from regattn.ops.scan import kernels

    for D, kind in itertools.product(head_dims, kinds):
        configs = [(c, True) for c in kernels.FWD_CONFIGS[kernels._family(*scan_dtype(kind))]]
        if candidates:
            configs += [(tile_configs([c])[0], False) for c in SCAN_CANDIDATES]
        for config, listed in configs:
            if causal and kind == "ieee" and not kernels.usable([config], dict(WHOLE_ROWS=kernels.WHOLE_ROWS)):
                continue  # a tile the causal strict fp32 fold does not take
            kernel, args, kwargs = scan_launch(kind, config, D=D, causal=causal)
            usage = launch_usage(kernel, args, kwargs, loop=True)
            yield dict(head_dim=D, kind=kind, table=listed, **launch_settings(kwargs), **usage)


def scan_backward_launches(config, fused: bool, *, B=1, T=16384, H=16, D=64, causal=False):
    """The captured launches of the scan's fp16 backward (non-causal by default: the benchmark's call) with
    ``config`` as its only tile: the fused dK/dV/dQ kernel (``fused``), or the dK/dV and dQ passes."""
    from regattn.ops.scan import kernels

    q = torch.empty(B, T, H, D, device="meta", dtype=torch.float16)
    lse = torch.empty(B * H * T, device="meta", dtype=torch.float32)
    tiles = dict(FUSED_CONFIGS=[config], BWD_CONFIGS=dict(kernels.BWD_CONFIGS, half=[config]))
    with captured_launches() as launches, mock.patch.multiple(kernels, FUSED_DQ=fused, AUTOTUNE=False, **tiles):
        kernels.backward(q, q, q, q, q, lse, causal=causal, window=None, scale=D ** -0.5, precision="ieee",
                         cu_seqlens=None)
    return [launch for launch in launches if launch[0].__name__.startswith("_bwd")]


def scan_backward_rows(head_dims=(64,), kinds=None, candidates=False):
    """One row per (head dim, kernel, tile) of the scan's fp16 backward: the fused kernel's autotune list
    (through pointers and, TMA, with dq added by the tensor-memory reduction), then the two passes' tiles."""
    from regattn.ops.scan import kernels

    for D in head_dims:
        runs = [(c, True) for c in kernels.FUSED_CONFIGS] + [(c, False) for c in kernels.BWD_CONFIGS["half"]]
        for config, fused in runs:
            for kernel, args, kwargs in scan_backward_launches(config, fused, D=D):
                name = "fused" if kwargs.get("FUSED") else kernel.__name__.removeprefix("_bwd_").removesuffix("_kernel")
                yield dict(head_dim=D, kind=name, table=True, **launch_settings(kwargs),
                           **launch_usage(kernel, args, kwargs, loop=True))


# kind -> blocks at D = 128 (scaled with D); cg-pre: cg with the preconditioner
LLA_KINDS = {"pairs": 64, "diag": 128, "cg": None, "cg-pre": None, "cg-g16": 16}
LLA_TILES = [(16, 32, 4), (32, 16, 8), (32, 32, 4), (32, 32, 8), (32, 64, 8), (64, 32, 4), (64, 64, 4), (64, 64, 8),
             (128, 32, 8), (128, 64, 8)]
LLA_CANDIDATES = [dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=2) for m, n, w in LLA_TILES]


def lla_blocks(kind: str, D: int) -> int | None:
    """``blocks`` of an :data:`LLA_KINDS` solver at head dim ``D`` (its count at 128, scaled with D)."""
    return LLA_KINDS[kind] and LLA_KINDS[kind] * D // 128


def lla_rows(head_dims=(128,), kinds=tuple(LLA_KINDS), candidates=False, *, B=4, T=8192, H=16):
    """One row per (head dim, solver, tiles) of the LLA forward at the bench's shape, bf16, cg_iters=8: direct solves
    of 2 x 2 (``pairs``) and 1 x 1 blocks (``diag``) and CG over 16 feature blocks (``cg-g16``) in the one-launch
    kernel; full LLA's CG (``cg``, ``cg-pre`` preconditioned) a row per launch (``cg/begin``, ``cg/step``,
    ``cg/end``, see ``forward.CG_TILES``); the autotune lists' tiles, then :data:`LLA_CANDIDATES`; with the
    instruction mix (as for ``scan``) of the key loop, or of the hottest loop for the direct solves."""
    from regattn.ops.lla import forward

    for D, kind in itertools.product(head_dims, kinds):
        blocks = lla_blocks(kind, D)
        solver, G = forward.solver_for(blocks, D)
        names = list(forward.CG_TILES) if solver == forward.SOLVER_CG and G == 1 else [None]
        for name in names:
            listed = (forward.FORWARD_TILES[forward.tile_family(torch.bfloat16, solver, G)] if name is None
                      else forward.CG_TILES[name][False])
            listed = [dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=st) for m, n, w, st in listed]
            configs = [(c, True) for c in listed] + [(c, False) for c in (LLA_CANDIDATES if candidates else [])]
            for config, table in configs:
                kernel, args, kwargs = lla_forward_launch(config, name, B, T, H, D, blocks, kind == "cg-pre")
                usage = launch_usage(kernel, args, kwargs, loop=True, nested=name is None and solver == 0)
                yield dict(head_dim=D, kind=kind if name is None else f"{kind}/{name}", table=table,
                           **launch_settings(kwargs), **usage)


def lla_forward_launch(config, name, B, T, H, D, blocks, precondition):
    """The captured launch of the LLA forward with ``config`` as its tile: the CG launch ``name`` (``begin``,
    ``step``, ``end``), or with ``name=None`` the one-launch kernel."""
    from regattn.ops.lla import forward

    q = torch.empty(B, T, H, D, device="meta", dtype=torch.bfloat16)
    fixed = lambda n, *a, c=config: (forward.CG_KERNELS[n], dict(c))  # noqa: E731
    rows = T if name else T + 1  # full LLA's CG in iters + 2 launches, or in one
    with captured_launches() as launches, mock.patch.multiple(forward, AUTOTUNE=False, CG_LAUNCH_ROWS=rows,
                                                              forward_blocks=lambda *a: dict(config), cg_launch=fixed):
        forward.lla_forward(q, q, q, 0.5, scale=D ** -0.5, window=None, blocks=blocks, cg_iters=8, cg_tol=1e-6,
                            cg_precondition=precondition)
    return launches[0] if name is None else next(launch for launch in launches
                                                 if launch[0] is forward.CG_KERNELS[name])


# the solvers of the LLA backward's kernels (cg: full LLA, whose q kernel runs the adjoint CG)
LLA_BACKWARD_KINDS = ("pairs", "diag", "cg")


def lla_backward_launches(config, B, T, H, D, bd, deterministic=False):
    """The captured launches of the LLA backward (bf16, cg_iters=8) with ``config`` as the tile of each kernel: the
    q kernel (the block-diagonal one's part 1, and part 2 where ``deterministic``), then the kv kernel (the
    block-diagonal one's two parts), without ``centred_key_tiles``."""
    from regattn.ops.lla import backward

    q = torch.empty(B, T, H, D, device="meta", dtype=torch.bfloat16)
    vec = torch.empty(B, T, H, D, device="meta")
    stat = torch.empty(B, H, T, device="meta")
    with captured_launches() as launches, mock.patch.object(backward, "AUTOTUNE", False), \
            mock.patch.object(backward, "backward_blocks", lambda *a: (dict(config), dict(config))), \
            mock.patch.object(backward, "row_max_path", lambda *a: None), \
            mock.patch.object(torch, "are_deterministic_algorithms_enabled", lambda: deterministic):
        backward.lla_backward(q, q, q, q, 0.5, vec, stat, stat, stat, stat, vec, scale=D ** -0.5,
                              window=None, cg_iters=8, cg_tol=1e-6, lam_grad=False, bd=bd)
    return [launch for launch in launches if launch[0] is not backward.centred_key_tiles_kernel]


def lla_backward_rows(head_dims=(128,), kinds=LLA_BACKWARD_KINDS, candidates=False, *, B=4, T=8192, H=16):
    """Rows of the LLA backward's kernels at the bench's shape, bf16, cg_iters=8: the q kernel (``cg/q``; the
    block-diagonal one's first part ``diag/q1``) at each tile of its autotune list (``backward.BACKWARD_TILES``),
    the block-diagonal q kernel's second part (``diag/q2``, as the deterministic backward runs it) at each of
    its own (``backward.PASS_B_TILES``), then the kv kernel (``cg/kv``; the block-diagonal one's parts
    ``diag/kv1``, ``diag/kv2``, the first adding dq by atomics) at each of its own (``backward.BLOCKS_KV_TILES``),
    then :data:`LLA_CANDIDATES` on one stage for each; with the hottest loop's instruction mix (for cg's q kernel,
    the adjoint CG's key loop)."""
    from regattn.ops.lla import backward, forward

    extra = [dict(c, num_stages=1) for c in LLA_CANDIDATES] if candidates else []
    for D, kind in itertools.product(head_dims, kinds):
        bd = forward.direct_solver(lla_blocks(kind, D), D)
        kv_names = ("kv1", "kv2") if bd else ("kv",)
        lists = [("q1", backward.BACKWARD_TILES[bd]), ("q2", backward.PASS_B_TILES[bd])] if bd else [
            ("q", backward.BACKWARD_TILES[0])]
        lists.append(("kv", backward.BLOCKS_KV_TILES if bd else backward.BACKWARD_TILES[0]))
        for kernel_name, listed in lists:
            listed = [dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=st) for m, n, w, st in listed]
            for config, table in [(c, True) for c in listed] + [(c, False) for c in extra]:
                if kernel_name.startswith("q"):
                    launches = lla_backward_launches(config, B, T, H, D, bd, deterministic=kernel_name == "q2")
                    named = [(launches[1 if kernel_name == "q2" else 0], kernel_name)]
                else:
                    named = zip(lla_backward_launches(config, B, T, H, D, bd)[1:], kv_names)
                for (kernel, args, kwargs), name in named:
                    usage = launch_usage(kernel, args, kwargs, loop=True, nested=not bd and name == "q")
                    yield dict(head_dim=D, kind=f"{kind}/{name}", table=table, **launch_settings(kwargs), **usage)


COLUMNS = ("head_dim", "kind", "BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "REG", "STACK", "LOCAL", "SHARED",
           "SERIAL", "HAZARD")


# The tile kinds of the softmax kernels (see attention_blocks), and the Parallax kernel laid out alike: the
# dK/dV program holds BLOCK_N keys and streams BLOCK_M query rows, as Parallax's dk does.
ATTENTION_KINDS = ("fwd", "bwd_kv", "bwd_q")
ATTENTION_LAYOUT = {"fwd": "fwd", "bwd_kv": "dk", "bwd_q": "dq"}
ATTENTION_KERNELS = {"fwd": "_fwd_kernel", "bwd_kv": "_bwd_kv_kernel", "bwd_q": "_bwd_q_kernel"}


def attention_launch(kind: str, head_dim: int, config: dict | None = None, *, gated=True, B=1, T=32768, H=16,
                     window=512, dtype=torch.bfloat16):
    """The captured launch of the softmax kernel ``kind`` (``fwd``, ``bwd_kv``, ``bwd_q``), with the gate or
    without, causal over a sliding window, with ``config`` in place of :func:`attention_blocks`' entry. By
    default GatedFWA's goal shape B=1 H=16 T=32768 window 512."""
    from regattn.ops._common.attention_tiles import overridden_blocks
    from regattn.ops.softmax import kernels

    if kind not in ATTENTION_KERNELS:
        raise ValueError(f"kind: expected one of {', '.join(ATTENTION_KINDS)}, got {kind!r}")
    x = torch.empty(B, T, H, head_dim, device="meta", dtype=dtype)
    stats = torch.empty(B, T, H, device="meta", dtype=torch.float32)
    u = stats if gated else None
    options = dict(causal=True, window=window, scale=head_dim ** -0.5, cu_seqlens=None)
    with overridden_blocks({kind: config} if config else {}), captured_launches() as launches:
        if kind == "fwd":
            kernels.attention_forward(x, x, x, u, **options)
        else:
            kernels.attention_backward(x, x, x, x, u, x, stats, **options)
    return next(launch for launch in launches if launch[0].__name__ == ATTENTION_KERNELS[kind])


def attention_rows(head_dims=(128,), kinds=ATTENTION_KINDS, candidates=False, *, gated=True):
    """One row per (head dim, kernel, configuration) of the softmax kernels at GatedFWA's goal shape, with the
    gate or without: the entry of :func:`attention_blocks` first, then the candidates."""
    for D, kind in itertools.product(head_dims, kinds):
        configs = [None] + (CANDIDATES[ATTENTION_LAYOUT[kind]] if candidates else [])
        for config in configs:
            kernel, args, kwargs = attention_launch(kind, D, config, gated=gated)
            usage = launch_usage(kernel, args, kwargs, loop=True)
            yield dict(head_dim=D, kind=kind, table=config is None, **launch_settings(kwargs), **usage)


# fp32 (B, T, H) of the gate scans: the bench's gate shapes, and heads fewer than a block.
GATE_SHAPES = [(1, 8192, 16), (1, 65536, 64), (1, 65536, 128), (1, 8192, 3)]


def gate_rows(head_dims=None, kinds=None, candidates=False, *, shapes=GATE_SHAPES):
    """One row per (shape, tile, kernel) of the GatedFWA gate scan, launched by ``gate_forward`` and
    ``gate_backward`` as the op launches them; with ``candidates``, also with each tile of
    :data:`regattn.bench.suites.gatedfwa.CHUNK_TILES` (``head_dims`` and ``kinds`` do not apply)."""
    from regattn.bench.suites.gatedfwa import chunk_blocks
    from regattn.ops.gatedfwa.gate import gate_backward, gate_forward
    for B, T, H in shapes:
        for blocks in [None] + (chunk_blocks(H) if candidates else []):
            x = torch.empty(B, T, H, device="meta")
            with captured_launches() as launches:
                gate_forward(x, x, 1e-6, blocks=blocks)
                gate_backward(x, x, x, 1e-6, blocks=blocks)
            for kernel, args, kwargs in launches:
                yield dict(shape=f"T={T},H={H}", kernel=kernel.__name__.strip("_").removesuffix("_kernel"),
                           BLOCK_T=kwargs["BLOCK_T"], BLOCK_H=kwargs["BLOCK_H"], num_warps=kwargs.get("num_warps", 4),
                           table=blocks is None, **launch_usage(kernel, args, kwargs))


def nsa_rows(head_dims=(128,), kinds=None, candidates=False, *, B=1, T=32768, HQ=16, H=4, block_slc=64, topk=16):
    """One row per (head dim, kernel) of NSA's block selection and selected attention, forward and backward,
    bf16, at the bench's shape (a group of 4 query heads, compressed blocks of 32 with stride 16, selection
    blocks of 64; ``kinds`` and ``candidates`` do not apply)."""
    from regattn.ops.nsa.compression import selected_blocks
    from regattn.ops.nsa.kernels import selected_backward, selected_forward
    for D in head_dims:
        q = torch.empty(B, T, HQ, D, device="meta", dtype=torch.bfloat16)
        kv = torch.empty(B, T, H, D, device="meta", dtype=torch.bfloat16)
        kc = torch.empty(B, T // 16, H, D, device="meta", dtype=torch.bfloat16)
        blocks = torch.empty(B, H, T, topk, device="meta", dtype=torch.int32)
        lse = torch.empty(B, HQ, T, device="meta")
        with captured_launches() as launches, mock.patch("regattn.ops.nsa.kernels.row_dot", lambda o, do, **_: lse):
            selected_blocks(q, kc, lse.transpose(1, 2), T, offset=0, block_cmp=32, stride_cmp=16, block_slc=block_slc,
                            topk=topk, scale=D ** -0.5)
            selected_forward(q, kv, kv, blocks, block_slc=block_slc, offset=0, scale=D ** -0.5)
            selected_backward(q, q, kv, kv, blocks, q, lse, block_slc=block_slc, offset=0, scale=D ** -0.5)
        for kernel, args, kwargs in launches:
            yield dict(head_dim=D, kind=kernel.__name__.removesuffix("_kernel"), table=True,
                       **launch_settings(kwargs), **launch_usage(kernel, args, kwargs))


def mesanet_rows(head_dims=(64,), kinds=MESANET_KINDS, candidates=False, *, N=512, C=64):
    """One row per (head dim, precision, kernel, warps) of MesaNet's chunk kernels, forward and backward, at the
    MAD model's shape (batch 128, 2 heads, 2 chunks of 64); ``candidates``: 8 warps as well as the table's."""
    from regattn.ops.mesanet import kernels as mesanet
    for D, precision in itertools.product(head_dims, kinds):
        x = torch.empty(N, C, D, device="meta")
        s, im = torch.empty(N, D, D, device="meta"), torch.empty(N, C, C, device="meta")
        with captured_launches() as launches:
            mesanet.sums_forward(x, x, 1.0, 2, precision)
            mesanet.sums_backward(x, x, s, s, 2, precision)
            mesanet.precondition_forward(x, x, s, precision)
            mesanet.precondition_backward(x, x, s, x, x, im, precision)
            mesanet.chunk_output_forward(x, x, x, x, s, im, precision)
            mesanet.chunk_output_backward(x, x, x, x, s, im, x, im, im, im, x, precision)
            mesanet.inverse_factor_backward(im, im, im, precision)
            mesanet.lower_inverse(im, precision)
        for (kernel, args, kwargs), warps in itertools.product(launches, [mesanet.WARPS] + [8] * candidates):
            name = kernel.__name__.strip("_").removesuffix("_kernel").removeprefix("backward_")
            kwargs = {**kwargs, "num_warps": warps}
            yield dict(head_dim=D, kind=f"{precision}/{name}", table=warps == mesanet.WARPS,
                       **launch_settings(kwargs), **launch_usage(kernel, args, kwargs))


USAGE = ("REG", "STACK", "LOCAL", "SHARED")
TMA_COLUMNS = COLUMNS[:4] + ("TMA",) + COLUMNS[4:]  # TMA: tiles loaded through tensor descriptors
ATTENTION_COLUMNS = COLUMNS + ("loop", "FFMA", "MUFU", "MMA")
OPS = {"parallax": (parallax_rows, KINDS, TMA_COLUMNS),
       "gatedfwa": (functools.partial(attention_rows, gated=True), ATTENTION_KINDS, ATTENTION_COLUMNS),
       "softmax": (functools.partial(attention_rows, gated=False), ATTENTION_KINDS, ATTENTION_COLUMNS),
       "scan": (scan_rows, ("ieee", "tf32x3"),
                TMA_COLUMNS + ("loop", "FFMA", "FFMA%", "FFMA/w", "MUFU", "LDS", "MMA", "LDL", "STL")),
       "scan_bwd": (scan_backward_rows, (), TMA_COLUMNS + ("loop", "MUFU", "MMA", "LDL", "STL")),
       "lla": (lla_rows, tuple(LLA_KINDS), COLUMNS + ("loop", "MMA", "LDL", "STL")),
       "lla_bwd": (lla_backward_rows, LLA_BACKWARD_KINDS, COLUMNS + ("loop", "MMA", "LDL", "STL")),
       "nsa": (nsa_rows, (), COLUMNS),
       "mesanet": (mesanet_rows, MESANET_KINDS, COLUMNS),
       "gatedfwa_gate": (gate_rows, (), ("shape", "kernel", "BLOCK_T", "BLOCK_H", "num_warps") + USAGE)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m regattn.bench.registers", description=__doc__.split("\n")[0])
    parser.add_argument("op", choices=sorted(OPS))
    parser.add_argument("--head-dims", type=int, nargs="+", help="parallax: 32 64 128 256 by default; scan: 64; lla: 128")
    parser.add_argument("--kinds", nargs="+", choices=KINDS + ATTENTION_KINDS[1:] + SCAN_KINDS + tuple(LLA_KINDS),
                        help=f"parallax: {', '.join(KINDS)} (all by default); scan: {', '.join(SCAN_KINDS)} "
                             f"(ieee and tf32x3 by default); lla: {', '.join(LLA_KINDS)} (all by default); gatedfwa "
                             f"and softmax: {', '.join(ATTENTION_KINDS)} (all by default)")
    parser.add_argument("--candidates", action="store_true", help="screen the tile candidates too")
    parser.add_argument("--causal", action="store_true", help="scan: the causal forward")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("unset TRITON_INTERPRET: the kernels are compiled, not interpreted")
    rows, kinds, columns = OPS[args.op]
    if args.causal and args.op != "scan":
        parser.error("--causal: scan only")
    if args.kinds and not set(args.kinds) <= set(kinds if args.op != "scan" else SCAN_KINDS):
        parser.error(f"--kinds: not kernels of {args.op}: {args.kinds}")
    print(" ".join(f"{c:>12}" for c in columns), " table")
    head_dims = args.head_dims or {"parallax": list(HEAD_DIMS), "lla": [128], "lla_bwd": [128], "gatedfwa": [128],
                                   "softmax": [128], "nsa": [128]}.get(args.op, [64])
    extra = {"causal": True} if args.causal else {}
    for row in rows(head_dims, args.kinds or kinds, args.candidates, **extra):
        cells = [f"{row.get(c, '-'):>12}" for c in columns]
        note = " *" if row["table"] else "  "
        if row.get("SHARED", 0) > SM90_SHARED:
            note += " shared memory over 227 KiB: cannot launch on an H100"
        print(" ".join(cells), note, row.get("error", ""), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
