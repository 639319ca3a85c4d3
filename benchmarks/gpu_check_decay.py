"""GPU check of the decay methods: full-size correctness, timings, HBM floor, lightning2 launch sweep,
the method='auto' table (``regattn tune decay``) and auto against the best method.

Run from the repository root: ``PYTHONPATH=. python3 benchmarks/gpu_check_decay.py``.
Writes ``$OUT/decay_check.json`` (and ``$OUT/h100.json``, the tuned table) after every section.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import time

import torch
import triton

import regattn
from regattn import reference
from regattn.ops.decay import lightning2 as l2
from regattn.ops.decay import choose, registry, tune

OUT = os.environ.get("OUT", "/tmp/decay_out")
START = time.time()
LIMIT_S = float(os.environ.get("LIMIT_S", "280"))
SHAPES = [(1, 8192), (16, 8192), (1, 100000), (16, 25600)]
H, R, D, GAMMA = 32, 128, 128, 0.99
# flash-linear-attention's best of chunk_lightning_attn / chunk_simple_gla on an H100 (issue 6's reference points)
FLA_MS = {(1, 8192): 0.35, (16, 8192): 3.95, (1, 100000): 2.99, (16, 25600): 12.86}
SLACK = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-3}
DT = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
              shape=dict(H=H, R=R, D=D, gamma=GAMMA), correctness=[], timing=[], sweep=[], auto=[])


def left() -> float:
    return LIMIT_S - (time.time() - START)


def save() -> None:
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "decay_check.json"), "w") as f:
        json.dump(result, f, indent=1)


def rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def inputs(B, T, Hh, Rr, Dd, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    b = torch.randn(B, T, Hh, Rr, device="cuda", dtype=torch.float64, generator=g) * Rr ** -0.25
    c = torch.randn(B, T, Hh, Rr, device="cuda", dtype=torch.float64, generator=g) * Rr ** -0.25
    v = torch.randn(B, T, Hh, Dd, device="cuda", dtype=torch.float64, generator=g)
    do = torch.randn(B, T, Hh, Dd, device="cuda", dtype=torch.float64, generator=g)
    return b, c, v, do


def fwd_bwd(fn, b, c, v, do, dtype, backward=True):
    x = [t.detach().to(dtype).requires_grad_(backward) for t in (b, c, v)]
    o = fn(*x)
    if not backward:
        return [o.detach()]
    return [o.detach(), *torch.autograd.grad(o, x, do.to(dtype))]


def check(method, B, T, Hh, Rr, Dd, gammas, dtypes, backward=True):
    """Kernel vs the float64 reference (torch lightning2 form); bf16/fp16 bound: 2x the torch
    reference's own error in the same dtype plus slack; fp32: 1e-5."""
    b, c, v, do = inputs(B, T, Hh, Rr, Dd, seed=T)
    g64 = None if gammas is None else torch.tensor(gammas, device="cuda", dtype=torch.float64)
    truth = fwd_bwd(lambda *x: reference.decay_linear_attention(*x, g64, method="lightning2"), b, c, v, do,
                    torch.float64, backward)
    for name in dtypes:
        dtype = DT[name]
        gk = None if g64 is None else g64.float()
        row = dict(method=method, B=B, T=T, H=Hh, R=Rr, D=Dd, gammas=gammas, dtype=name)
        try:
            got = fwd_bwd(lambda *x: regattn.decay_linear_attention(*x, gk, method=method, backend="triton"),
                          b, c, v, do, dtype, backward)
            low = None
            if dtype != torch.float32:
                glow = None if g64 is None else g64.to(dtype)
                low = fwd_bwd(lambda *x: reference.decay_linear_attention(*x, glow, method="lightning2"),
                              b, c, v, do, dtype, backward)
            ok = True
            for i, key in enumerate(("o", "db", "dc", "dv")[:len(got)]):
                err = rel(got[i], truth[i])
                bound = SLACK[dtype] if low is None else 2 * rel(low[i], truth[i]) + SLACK[dtype]
                row[key] = err
                row[key + "_bound"] = bound
                ok = ok and err <= bound
            row["pass"] = ok
        except Exception as e:  # report and go on: one failing case must not hide the rest
            row["error"] = f"{type(e).__name__}: {e}"[:300]
            row["pass"] = False
        result["correctness"].append(row)
        print("check", row, flush=True)
        torch.cuda.empty_cache()
    save()


def correctness():
    mix = [0.99, 1.0, 0.9, 1e-4]
    check("lightning2", 2, 4133, 4, 128, 128, mix, ["bfloat16", "float32"])
    check("lightning2", 1, 3001, 4, 64, 96, mix, ["bfloat16", "float32"])
    check("lightning2", 1, 20000, 2, 128, 128, [0.999, 1.0], ["bfloat16", "float32"])   # sequence-parallel path
    check("lightning2", 2, 1, 4, 128, 128, mix, ["bfloat16", "float32"])
    check("lightning2", 1, 4133, 4, 128, 128, None, ["bfloat16"])
    check("fleet", 1, 2111, 4, 128, 128, mix, ["bfloat16", "float32"])
    check("causal_dot_product", 1, 2111, 4, 128, 128, mix, ["bfloat16", "float32"])
    for method in ("lightning2", "fleet", "causal_dot_product"):                       # long, no decay: finite
        if left() > 200:
            check(method, 1, 100000, 2, 128, 128, [1.0, 1.0], ["bfloat16"], backward=method == "lightning2")
    if left() > 150:
        large_offsets()


def large_offsets():
    """B*T*H*R past 2^31 elements (B=6, T=100000, H=32, R=D=128, bf16): the last (batch, head) slice
    of every kernel (lightning2 also backward) against the float64 reference of that slice."""
    B, T = 6, 100000
    g = torch.Generator(device="cuda").manual_seed(1)
    b, c, v, do = (torch.randn(B, T, H, n, device="cuda", dtype=torch.bfloat16, generator=g) * s
                   for n, s in ((R, R ** -0.25), (R, R ** -0.25), (D, 1.0), (D, 1.0)))
    gam = torch.full((H,), GAMMA, device="cuda")
    sl = lambda x: x[-1:, :, -1:].double()
    truth = fwd_bwd(lambda *x: reference.decay_linear_attention(*x, gam[-1:].double(), method="lightning2"),
                    sl(b), sl(c), sl(v), sl(do), torch.float64)
    for method in ("lightning2", "fleet", "causal_dot_product"):
        row = dict(method=method, B=B, T=T, H=H, R=R, D=D, gammas=GAMMA, dtype="bfloat16", check="large offsets")
        try:
            backward = method == "lightning2"
            x = [t.detach().requires_grad_(backward) for t in (b, c, v)]
            o = regattn.decay_linear_attention(*x, gam, method=method, backend="triton")
            got = [o.detach()]
            if backward:
                got += list(torch.autograd.grad(o, x, do))
            del o, x
            for i, key in enumerate(("o", "db", "dc", "dv")[:len(got)]):
                row[key] = rel(sl(got[i]), truth[i])
            row["pass"] = all(row[k] <= 2e-2 for k in ("o", "db", "dc", "dv") if k in row)
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"[:300]
            row["pass"] = False
        got = None
        torch.cuda.empty_cache()
        result["correctness"].append(row)
        print("check", row, flush=True)
    del b, c, v, do
    torch.cuda.empty_cache()
    save()


def copy_bandwidth() -> float:
    """GB/s of a 4 GiB device-to-device copy (read + write)."""
    x = torch.empty(2 ** 31, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    ms = triton.testing.do_bench(lambda: y.copy_(x), warmup=10, rep=50)
    del x, y
    torch.cuda.empty_cache()
    return 2 * 2 ** 31 * 2 / ms / 1e6


def io_bytes(B, T) -> int:
    return B * T * H * (2 * R + 2 * D) * 2


def timing(bw):
    for B, T in SHAPES:
        floor = io_bytes(B, T) / bw / 1e6
        for m in registry.method_names():
            if left() < 90:
                break
            try:
                ms = tune.time_method(m, dtype="bfloat16", batch_size=B, seqlen=T, heads=H, rank=R, dim=D,
                                      gamma=GAMMA)
            except Exception as e:
                ms = f"{type(e).__name__}: {e}"[:200]
            row = dict(B=B, T=T, method=m, ms=ms, hbm_floor_ms=floor, fla_ms=FLA_MS[(B, T)])
            if isinstance(ms, float):
                row.update(vs_fla=ms / FLA_MS[(B, T)], floor_fraction=floor / ms, gbps=io_bytes(B, T) / ms / 1e6)
            result["timing"].append(row)
            print("time", row, flush=True)
        save()


SWEEP = [dict(waves=4), dict(waves=8), dict(waves=2), dict(BD=128, num_warps=8, waves=4),
         dict(num_stages=3, waves=4), dict(num_stages=3, waves=8)]


def sweep():
    for cfg in SWEEP:
        for B, T in SHAPES:
            if left() < 8:
                return
            l2.OVERRIDE.clear()
            l2.OVERRIDE.update(cfg)
            try:
                ms = tune.time_method("lightning2", dtype="bfloat16", batch_size=B, seqlen=T, heads=H, rank=R, dim=D,
                                      gamma=GAMMA, backend="triton")
            except Exception as e:
                ms = f"{type(e).__name__}: {e}"[:200]
            result["sweep"].append(dict(cfg=cfg, B=B, T=T, ms=ms))
            print("sweep", cfg, B, T, ms, flush=True)
    l2.OVERRIDE.clear()
    save()


def tune_and_auto():
    from regattn import cli
    path = tune.TABLES / f"{tune.gpu_kind(result['device'])}.json"
    cli.main(["tune", "decay", "--budget-ms", "150"])
    shutil.copy(path, os.path.join(OUT, path.name))
    best = {}
    for row in result["timing"]:
        if isinstance(row["ms"], float):
            key = (row["B"], row["T"])
            best[key] = min(best.get(key, (math.inf, "")), (row["ms"], row["method"]))
    for B, T in SHAPES:
        try:
            ms = tune.time_method("auto", dtype="bfloat16", batch_size=B, seqlen=T, heads=H, rank=R, dim=D,
                                  gamma=GAMMA)
        except Exception as e:
            ms = f"{type(e).__name__}: {e}"[:200]
        chosen = choose.choose_method(B, T, H, R, D, torch.bfloat16, True, torch.device("cuda"))
        row = dict(B=B, T=T, auto_ms=ms, chosen=chosen, best=best.get((B, T), (None, None))[1],
                   best_ms=best.get((B, T), (None, None))[0], fla_ms=FLA_MS[(B, T)])
        if isinstance(ms, float) and row["best_ms"]:
            row.update(auto_over_best=ms / row["best_ms"], vs_fla=ms / FLA_MS[(B, T)],
                       floor_fraction=io_bytes(B, T) / result["copy_GBps"] / 1e6 / ms)
        result["auto"].append(row)
        print("auto", row, flush=True)
    save()
    table = json.loads(path.read_text())
    for e in table["entries"]:
        timed = {m: ms for m, ms in e["ms"].items() if isinstance(ms, float)}
        if not timed or left() < 10:
            continue
        try:
            ms = tune.time_method("auto", dtype=e["dtype"], batch_size=e["B"], seqlen=e["T"], heads=e["H"],
                                  rank=e["R"], dim=e["D"], gamma=GAMMA if e["decay"] else None)
        except Exception as err:
            ms = f"{type(err).__name__}: {err}"[:200]
        best_m = min(timed, key=timed.get)
        row = dict(B=e["B"], T=e["T"], dtype=e["dtype"], auto_ms=ms, best=best_m, best_ms_in_table=timed[best_m])
        if isinstance(ms, float):
            row["auto_over_best"] = ms / timed[best_m]
        result.setdefault("auto_grid", []).append(row)
        print("auto grid", row, flush=True)
    save()


def main():
    torch.backends.cuda.matmul.allow_tf32 = False
    correctness()
    result["copy_GBps"] = copy_bandwidth()
    print("copy GB/s", result["copy_GBps"], flush=True)
    timing(result["copy_GBps"])
    if left() > 45:
        try:
            tune_and_auto()
        except Exception as e:
            result["tune_error"] = f"{type(e).__name__}: {e}"[:300]
    sweep()
    result["wall_s"] = time.time() - START
    save()
    print("\nmethod              B   T       ms        vs FLA   HBM floor fraction")
    for row in result["timing"]:
        ms = row["ms"]
        if isinstance(ms, float):
            print(f"{row['method']:<19s} {row['B']:<3d} {row['T']:<7d} {ms:<9.3f} {row['vs_fla']:<8.2f} "
                  f"{row['floor_fraction']:.2f}")
        else:
            print(f"{row['method']:<19s} {row['B']:<3d} {row['T']:<7d} {ms}")
    for row in result["auto"]:
        print("auto", row)
    for row in result.get("auto_grid", []):
        print("auto grid", row["B"], row["T"], row["auto_ms"], row["best"], row["best_ms_in_table"],
              row.get("auto_over_best"))
    print("correctness failures:", [r for r in result["correctness"] if not r["pass"]])


if __name__ == "__main__":
    main()
