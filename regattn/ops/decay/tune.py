"""``regattn tune decay``: time every decay method on this GPU and write the ``method="auto"`` table.

The table is read by ``choose.py`` (the lookup ``auto`` runs); this module only measures.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from regattn.ops.decay import registry
from regattn.ops.decay.api import decay_linear_attention
from regattn.ops.decay.choose import TABLES, fastest, forget_tables, gpu_kind
from regattn.usage import UsageError

GRID_T = (128, 512, 2048, 8192, 12800, 25600, 100000)
GRID_B = (1, 16)
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def _inputs(B, T, H, R, D, dtype, device, gamma):
    g = torch.Generator(device=device).manual_seed(0)
    b = torch.randn(B, T, H, R, device=device, dtype=dtype, generator=g) * R ** -0.5
    c = torch.randn(B, T, H, R, device=device, dtype=dtype, generator=g) * R ** -0.5
    v = torch.randn(B, T, H, D, device=device, dtype=dtype, generator=g)
    gam = None if gamma is None else torch.full((H,), float(gamma), device=device)
    return b, c, v, gam


def bench_ms(fn, rep_ms: float = 25.0) -> float:
    """Median milliseconds of ``fn()`` after a warm-up call: ``triton.testing.do_bench`` for calls
    under 50 ms, the median of three timed calls above."""
    import triton.testing
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    first = start.elapsed_time(end)
    if first < 50.0:
        return triton.testing.do_bench(fn, warmup=min(rep_ms, 5 * first + 1), rep=rep_ms)
    times = [first]
    for _ in range(2):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[1]


def time_method(method, *, device="cuda", dtype="bfloat16", batch_size=1, seqlen=2048, heads=32, rank=128,
                dim=128, gamma=0.99, backend="auto", rep_ms=25.0):
    """Median milliseconds of one call of ``method`` (a registered name or ``fn(b, c, v, gamma)``)
    on random inputs, ``gamma=None`` for no decay; ``"OOM"`` when it runs out of memory."""
    dt = DTYPES[dtype] if isinstance(dtype, str) else dtype
    try:
        b, c, v, gam = _inputs(batch_size, seqlen, heads, rank, dim, dt, torch.device(device), gamma)
        if callable(method):
            fn = lambda: method(b, c, v, gam)
        else:
            fn = lambda: decay_linear_attention(b, c, v, gam, method=method, backend=backend)
        return bench_ms(fn, rep_ms)
    except torch.OutOfMemoryError:
        return "OOM"
    finally:
        b = c = v = fn = None
        torch.cuda.empty_cache()


def measure(methods, Bs, Ts, H, R, D, dtypes, gamma, budget_ms=300.0, log=print):
    """Time every method at every (dtype, B, T); a method that ran out of memory or failed at a shorter T, or
    whose previous time scaled by the growth in T passes ``budget_ms``, is ``"skipped"`` there."""
    entries = []
    for dtype in dtypes:
        for B in Bs:
            last = {}
            for T in Ts:
                ms = {}
                for m in methods:
                    prev = last.get(m)
                    if isinstance(prev, str) or (isinstance(prev, tuple) and prev[0] * (T / prev[1]) > budget_ms):
                        ms[m] = "skipped"
                        continue
                    try:
                        t = time_method(m, dtype=dtype, batch_size=B, seqlen=T, heads=H, rank=R, dim=D, gamma=gamma)
                    except Exception as e:  # a user's method may fail on some shapes: record it, time the rest
                        log(f"{m}: {type(e).__name__}: {e}")
                        t = "error"
                    ms[m] = t
                    last[m] = t if isinstance(t, str) else (t, T)
                entry = dict(B=B, T=T, H=H, R=R, D=D, dtype=dtype, decay=gamma is not None, ms=ms)
                entry["best"] = fastest(entry)
                entries.append(entry)
                log(f"{dtype:9s} B={B:<3d} T={T:<7d} best={str(entry['best']):<19s} " + " ".join(
                    f"{m}={v:.3f}" if isinstance(v, float) else f"{m}={v}" for m, v in ms.items()))
    return entries


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="regattn tune decay",
                                description="time every decay method on this GPU and write the method='auto' table")
    p.add_argument("what", choices=["decay"])
    p.add_argument("--B", type=int, nargs="+", default=list(GRID_B))
    p.add_argument("--T", type=int, nargs="+", default=list(GRID_T))
    p.add_argument("--H", type=int, default=32)
    p.add_argument("--R", type=int, default=128)
    p.add_argument("--D", type=int, default=128)
    p.add_argument("--dtype", nargs="+", default=["bfloat16"], choices=list(DTYPES))
    p.add_argument("--gamma", type=float, default=0.99, help="decay for every head; 1 times without decay")
    p.add_argument("--methods", nargs="+", default=None, help="default: every registered method")
    p.add_argument("--budget-ms", type=float, default=300.0, help="skip a method once its predicted time passes this")
    p.add_argument("--out", default=None, help="default: the package table for this GPU kind")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise UsageError("regattn tune decay measures the methods on a CUDA device: none is available")
    import triton
    name = torch.cuda.get_device_name()
    methods = args.methods or list(registry.method_names())
    gamma = None if args.gamma == 1.0 else args.gamma
    entries = measure(methods, args.B, args.T, args.H, args.R, args.D, args.dtype, gamma, args.budget_ms)
    out = Path(args.out) if args.out else TABLES / f"{gpu_kind(name)}.json"
    old = json.loads(out.read_text()) if out.exists() else {"entries": []}
    keys = {(e["B"], e["T"], e["H"], e["R"], e["D"], e["dtype"], e["decay"]) for e in entries}
    kept = [e for e in old["entries"] if (e["B"], e["T"], e["H"], e["R"], e["D"], e["dtype"], e["decay"]) not in keys]
    table = dict(device=name, kind=gpu_kind(name), torch=torch.__version__, triton=triton.__version__,
                 entries=kept + entries)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(table, indent=1))
    forget_tables()
    print(f"wrote {out} ({len(table['entries'])} points)")
    return 0
