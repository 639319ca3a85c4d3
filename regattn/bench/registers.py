"""Register use of the Triton kernels, compiled for a GPU on any machine (no GPU needed).

``python -m regattn.bench.registers parallax [--head-dims 128 256] [--kinds fwd dk] [--candidates]``
``python -m regattn.bench.registers gatedfwa_gate``

prints, for each kernel configuration of an op at its goal shape, what ``cuobjdump --dump-resource-usage``
reports for the cubin compiled for sm_90: ``REG`` (registers per thread, 255 at most), ``STACK`` (bytes of
stack frame per thread: spilled registers), ``LOCAL`` (local memory) and ``SHARED`` (bytes of shared
memory the launch needs; an H100 has 227 KiB a block). A configuration with ``STACK > 0`` spills.
``--candidates`` screens the tile candidates of :data:`CANDIDATES` as well as the table's entry.

The launches are the ops' own: the op's Python wrapper runs on ``meta`` tensors with the launch of each
kernel captured instead of run, then compiled with Triton's own specialisation of those arguments.
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

SM90 = GPUTarget("cuda", 90, 32)
SM90_SHARED = 232448  # bytes of shared memory a block may use on an H100 (227 KiB)
KINDS = ("fwd", "dq", "dk", "decode")
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


def compile_launch(kernel, args, kwargs, target=SM90):
    """The compiled kernel of a captured launch, specialised as Triton's launcher does for these arguments."""
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target, options=options.__dict__)


def resource_usage(compiled) -> dict:
    """``REG``, ``STACK``, ``LOCAL`` (from cuobjdump) and ``SHARED`` (bytes) of a compiled kernel."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        text = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True,
                              check=True).stdout
    usage = {key: int(re.search(rf"\b{key}:(\d+)", text).group(1)) for key in ("REG", "STACK", "LOCAL")}
    usage["SHARED"] = compiled.metadata.shared
    return usage


def parallax_launch(kind: str, head_dim: int, config: dict | None = None, *, B=4, T=8192, HQ=None, H=None,
                    dtype=torch.bfloat16):
    """The captured launch of the Parallax kernel ``kind`` (``fwd``, ``dq``, ``dk``, ``decode``) at a shape,
    with ``config`` overriding the tile table's entry. By default the goal shapes: prefill B=4 T=8192 with 16
    heads; decode one new token of 32 query heads over 8 key/value heads and a cache of T keys."""
    HQ = HQ or (32 if kind == "decode" else 16)
    H = H or (8 if kind == "decode" else 16)
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
        elif kind == "decode":
            q, k = meta(B, 1, HQ, D), meta(B, T, H, D)
            parallax_decode_fwd(q, q, k, k, scale=D ** -0.5, num_splits=4, config=config)
        else:
            raise ValueError(f"kind: expected one of {', '.join(KINDS)}, got {kind!r}")
    name = {"fwd": "_parallax_fwd_kernel", "dq": "_parallax_bwd_dq_kernel", "dk": "_parallax_bwd_dk_kernel",
            "decode": "_parallax_decode_kernel"}[kind]
    return next(launch for launch in launches if launch[0].__name__ == name)


def launch_settings(kwargs) -> dict:
    keys = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")
    return {key: kwargs[key] for key in keys if key in kwargs}


def parallax_rows(head_dims=HEAD_DIMS, kinds=KINDS, candidates=False):
    """One row per (head dim, kernel, configuration): the table's entry first, then the candidates."""
    for D, kind in itertools.product(head_dims, kinds):
        configs = [None]
        if candidates:
            configs += DECODE_CANDIDATES if kind == "decode" else CANDIDATES[kind]
        for config in configs:
            kernel, args, kwargs = parallax_launch(kind, D, config)
            try:
                usage = resource_usage(compile_launch(kernel, args, kwargs))
            except Exception as error:  # e.g. out of shared memory: reported, not fatal to the screen
                usage = dict(error=str(error).splitlines()[0][:80])
            yield dict(head_dim=D, kind=kind, table=config is None, **launch_settings(kwargs), **usage)


# fp32 (B, T, H) of the gate scans: the bench's gate shapes, and heads fewer than a block.
GATE_SHAPES = [(1, 8192, 16), (1, 65536, 64), (1, 65536, 128), (1, 8192, 3)]


def gate_rows(head_dims=None, kinds=None, candidates=False, *, shapes=GATE_SHAPES, scans=None):
    """One row per (shape, scan, kernel) of the GatedFWA gate scans, launched by ``gate_forward`` and
    ``gate_backward`` as the op launches them (``head_dims``, ``kinds``, ``candidates`` do not apply)."""
    from regattn.ops.gatedfwa.gate import SCANS, gate_backward, gate_forward
    for (B, T, H), scan in itertools.product(shapes, scans or SCANS):
        x = torch.empty(B, T, H, device="meta")
        with captured_launches() as launches:
            gate_forward(x, x, 1e-6, scan)
            gate_backward(x, x, x, 1e-6, scan=scan)
        for kernel, args, kwargs in launches:
            usage = resource_usage(compile_launch(kernel, args, kwargs))
            yield dict(shape=f"T={T},H={H}", scan=scan, kernel=kernel.__name__.strip("_").removesuffix("_kernel"),
                       BLOCK_T=kwargs["BLOCK_T"], BLOCK_H=kwargs["BLOCK_H"], num_warps=kwargs.get("num_warps", 4),
                       table=True, **usage)


OPS = {"parallax": parallax_rows, "gatedfwa_gate": gate_rows}
COLUMNS = {"parallax": ("head_dim", "kind", "BLOCK_M", "BLOCK_N", "num_warps", "num_stages"),
           "gatedfwa_gate": ("shape", "scan", "kernel", "BLOCK_T", "BLOCK_H", "num_warps")}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m regattn.bench.registers", description=__doc__.split("\n")[0])
    parser.add_argument("op", choices=sorted(OPS))
    parser.add_argument("--head-dims", type=int, nargs="+", default=list(HEAD_DIMS))
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    parser.add_argument("--candidates", action="store_true", help="screen the tile candidates too")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("unset TRITON_INTERPRET: the kernels are compiled, not interpreted")
    columns = COLUMNS[args.op] + ("REG", "STACK", "LOCAL", "SHARED")
    print(" ".join(f"{c:>10}" for c in columns), " table")
    for row in OPS[args.op](args.head_dims, args.kinds, args.candidates):
        cells = [f"{row.get(c, '-'):>10}" for c in columns]
        note = " *" if row["table"] else "  "
        if row.get("SHARED", 0) > SM90_SHARED:
            note += " shared memory over 227 KiB: cannot launch on an H100"
        print(" ".join(cells), note, row.get("error", ""), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
