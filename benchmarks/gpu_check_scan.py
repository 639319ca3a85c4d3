"""ELSA scan on one GPU: timings against torch SDPA, full-size correctness per precision, error growth.

    PYTHONPATH=. python3 benchmarks/gpu_check_scan.py [--out DIR]

1. Timing (issue 8 targets): non-causal B=1, H=16, T=16384, d=64, forward, for the scan in
   ieee / tf32x3 / tf32 (fp32 inputs) and fp16 / bf16, against SDPA efficient fp32 and SDPA flash fp16
   (and cuDNN fp16), with peak memory; the timed outputs' error on 512 query rows vs float64.
   Then forward+backward for fp16 and tf32x3 against the same peers.
2. Correctness at full size (fixed tiles, no tuning): forward and backward vs float64 for every
   precision; GQA, causal, sliding window, varlen, Swin-style partitions, split-KV tree merge.
   fp16/bf16 follow the 2x-of-torch-in-the-same-precision rule.
3. Error growth over n = 1K..64K (the drift verifier's metrics) for ieee, tf32x3 and fp16.
Writes ``scan_check.json`` under ``--out`` (default ``$OUT`` or ``.``) after every section.
"""
from __future__ import annotations

import argparse
import json
import os
import time
import traceback

import torch
import triton

import regattn
from regattn.bench.peers import sdpa
from regattn.bench.results import machine_info
from regattn.bench.timing import measure
from regattn.ops.scan import kernels
from regattn.ops.scan.verify import UNIT_ROUNDOFF, depth_bound, growth_check
from regattn.ops.scan.verify import measure as drift
from regattn.reference.softmax import softmax_attention

DEV = "cuda"
T_START = time.time()
RESULT: dict = {"sections": {}}


def elapsed() -> float:
    return time.time() - T_START


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def make(B, T, S, HQ, H, D, dtype, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(B, T, HQ, D, device=DEV, generator=g, dtype=torch.float32).to(dtype)
    k = torch.randn(B, S, H, D, device=DEV, generator=g, dtype=torch.float32).to(dtype)
    v = torch.randn(B, S, H, D, device=DEV, generator=g, dtype=torch.float32).to(dtype)
    return q, k, v


def save(out_dir):
    RESULT["elapsed_s"] = round(elapsed(), 1)
    with open(os.path.join(out_dir, "scan_check.json"), "w") as f:
        json.dump(RESULT, f, indent=1, default=str)


# ---------------------------------------------------------------------------------------------- 1. timing

B, H, T, D = 1, 16, 16384, 64
FLOPS = 4 * B * H * T * T * D  # non-causal forward: QK^T and PV
OURS = [("ieee", torch.float32, "ieee"), ("tf32x3", torch.float32, "tf32x3"), ("tf32", torch.float32, "tf32"),
        ("fp16", torch.float16, "ieee"), ("bf16", torch.bfloat16, "ieee")]


def timing():
    kernels.AUTOTUNE = True
    rows = {}
    base = {dt: make(B, T, T, H, H, D, dt) for dt in (torch.float32, torch.float16, torch.bfloat16)}
    q32, k32, v32 = base[torch.float32]
    with torch.no_grad():
        ref = softmax_attention(q32[:, -512:].double(), k32.double(), v32.double(), causal=False)  # last 512 rows
    for peer, dt in (("sdpa-efficient fp32", torch.float32), ("sdpa-flash fp16", torch.float16),
                     ("sdpa-cudnn fp16", torch.float16), ("sdpa-efficient fp16", torch.float16)):
        call, _ = sdpa(*base[dt], backend=peer.split()[0].split("-")[1], causal=False)
        m = measure(call, cuda=True)
        rows[peer] = {"status": m.status, "ms": m.ms, "peak_mb": m.peak_mb}
        if m.status == "ok":
            rows[peer]["rel_err_f64"] = rel(call()[:, -512:], ref)
        print(peer, rows[peer], flush=True)
    for name, dt, prec in OURS:
        q, k, v = base[dt]
        call = (lambda q=q, k=k, v=v, prec=prec: regattn.scan_attention(q, k, v, precision=prec, backend="triton"))
        t0 = time.time()
        try:
            with torch.no_grad():
                call()  # tunes
        except Exception as err:
            rows[f"scan {name}"] = {"status": f"error: {err}"[:300]}
            traceback.print_exc()
            continue
        m = measure(call, cuda=True)
        row = {"status": m.status, "ms": m.ms, "peak_mb": m.peak_mb, "tune_s": round(time.time() - t0, 1)}
        if m.status == "ok":
            with torch.no_grad():
                row["rel_err_f64"] = rel(call()[:, -512:], ref)
            row["tflops"] = FLOPS / m.ms / 1e9
            cfg = kernels._FWD_TUNED[kernels._family(dt, prec)].best_config
            row["config"] = str(cfg)
        rows[f"scan {name}"] = row
        print(name, row, flush=True)
    eff = rows["sdpa-efficient fp32"].get("ms")
    flash = rows["sdpa-flash fp16"].get("ms")
    targets = {}

    def ratio(a, b):
        return (a / b) if (a and b) else None

    for name, need in (("ieee", 1.3), ("tf32x3", 3.0), ("tf32", 4.0)):
        r = rows.get(f"scan {name}", {})
        sp = ratio(eff, r.get("ms"))
        bound = 1e-3 if name == "tf32" else 1e-5
        targets[name] = {"speedup_vs_sdpa_efficient_fp32": sp, "target": need,
                         "speed_ok": bool(sp and sp >= need), "rel_err": r.get("rel_err_f64"),
                         "err_ok": bool(r.get("rel_err_f64") is not None and r["rel_err_f64"] <= bound)}
    r16 = rows.get("scan fp16", {})
    targets["fp16"] = {"time_ratio_vs_sdpa_flash_fp16": ratio(r16.get("ms"), flash), "target": 1.3,
                       "speed_ok": bool(ratio(r16.get("ms"), flash) and ratio(r16.get("ms"), flash) <= 1.3),
                       "peak_mb": r16.get("peak_mb"), "flash_peak_mb": rows["sdpa-flash fp16"].get("peak_mb"),
                       "memory_ok": bool(r16.get("peak_mb") is not None and rows["sdpa-flash fp16"].get("peak_mb")
                                         is not None and r16["peak_mb"] <= rows["sdpa-flash fp16"]["peak_mb"])}
    return {"shape": dict(B=B, H=H, T=T, D=D, causal=False), "flops": FLOPS, "rows": rows, "targets": targets}


def timing_backward():
    kernels.AUTOTUNE = True
    rows = {}
    for label, dt, prec, peer in (("fp16", torch.float16, "ieee", "flash"), ("tf32x3", torch.float32, "tf32x3",
                                                                            "efficient")):
        q, k, v = (x.requires_grad_() for x in make(B, T, T, H, H, D, dt))
        do = torch.randn(B, T, H, D, device=DEV, dtype=dt)

        def ours(q=q, k=k, v=v, do=do, prec=prec):
            o = regattn.scan_attention(q, k, v, precision=prec, backend="triton")
            return torch.autograd.grad(o, (q, k, v), do)

        call, leaves = sdpa(q, k, v, backend=peer, causal=False)

        def theirs(call=call, leaves=leaves, do=do):
            o = call()
            return torch.autograd.grad(o, leaves, do)

        for name, fn in ((f"scan {label}", ours), (f"sdpa-{peer} {str(dt).split('.')[1]}", theirs)):
            m = measure(fn, cuda=True)
            rows[name] = {"status": m.status, "ms": m.ms, "peak_mb": m.peak_mb}
            print("fwd+bwd", name, rows[name], flush=True)
        del q, k, v, do
    return {"shape": dict(B=B, H=H, T=T, D=D, causal=False), "rows": rows}


# ---------------------------------------------------------------------------------------------- 2. correctness

FP32_BOUND = {"ieee": 1e-5, "tf32x3": 1e-5, "tf32": 3e-3}
CASES = [
    # name, dtype, precision, (B, T, HQ, H, D), kwargs, backward
    ("ieee gqa d64", torch.float32, "ieee", (2, 4096, 8, 4, 64), {}, True),
    ("ieee d128 causal window varlen", torch.float32, "ieee", (1, 4096, 4, 2, 128),
     {"causal": True, "window": 700, "cu_seqlens": [0, 1, 1000, 1000, 3001, 4096]}, True),
    ("ieee swin partition 49", torch.float32, "ieee", (16, 49 * 16, 4, 4, 32), {"partition": 49}, True),
    ("ieee split-kv 8", torch.float32, "ieee", (1, 2048, 4, 4, 64), {"num_splits": 8}, False),
    ("tf32x3 gqa d64", torch.float32, "tf32x3", (2, 4096, 8, 4, 64), {}, True),
    ("tf32x3 d128 causal", torch.float32, "tf32x3", (1, 4096, 4, 4, 128), {"causal": True}, True),
    ("tf32 gqa d64", torch.float32, "tf32", (2, 4096, 8, 4, 64), {}, True),
    ("fp16 gqa d64", torch.float16, "ieee", (2, 4096, 8, 4, 64), {}, True),
    ("fp16 d128 causal window varlen", torch.float16, "ieee", (1, 4096, 4, 2, 128),
     {"causal": True, "window": 700, "cu_seqlens": [0, 1, 1000, 1000, 3001, 4096]}, True),
    ("bf16 gqa d64", torch.bfloat16, "ieee", (2, 4096, 8, 4, 64), {}, True),
]


def reference(q, k, v, kw):
    """The float64 (or same-precision) softmax reference; partitions via the torch backend."""
    if "partition" in kw:
        return regattn.scan_attention(q, k, v, partition=kw["partition"], backend="torch")
    kw = {key: val for key, val in kw.items() if key != "num_splits"}
    return softmax_attention(q, k, v, causal=kw.pop("causal", False), **kw)


def check_case(name, dtype, prec, shape, kw, backward):
    Bc, Tc, HQc, Hc, Dc = shape
    kw = dict(kw)
    if "cu_seqlens" in kw:
        kw["cu_seqlens"] = torch.tensor(kw["cu_seqlens"], device=DEV, dtype=torch.int32)
    q, k, v = (x.requires_grad_(backward) for x in make(Bc, Tc, Tc, HQc, Hc, Dc, dtype, seed=1))
    o = regattn.scan_attention(q, k, v, precision=prec, backend="triton", **kw)
    x64 = [x.detach().double().requires_grad_(backward) for x in (q, k, v)]
    r64 = reference(*x64, kw)
    row = {"o": rel(o, r64)}
    low = dtype != torch.float32
    if low:
        xl = [x.detach().clone().requires_grad_(backward) for x in (q, k, v)]
        rl = reference(*xl, kw)
        row["o_torch_same_precision"] = rel(rl, r64)
    if backward:
        do = torch.randn_like(r64)
        grads = torch.autograd.grad(o, (q, k, v), do.to(dtype))
        g64 = torch.autograd.grad(r64, x64, do)
        for n, a, b in zip(("dq", "dk", "dv"), grads, g64):
            row[n] = rel(a, b)
        if low:
            gl = torch.autograd.grad(rl, xl, do.to(dtype))
            for n, a, b in zip(("dq", "dk", "dv"), gl, g64):
                row[f"{n}_torch_same_precision"] = rel(a, b)
    keys = [n for n in ("o", "dq", "dk", "dv") if n in row]
    if low:
        row["ok"] = all(row[n] <= 2 * row[f"{n}_torch_same_precision"] + 1e-3 for n in keys)
    else:
        row["ok"] = all(row[n] <= FP32_BOUND[prec] for n in keys)
    return row


def correctness():
    kernels.AUTOTUNE = False
    rows = {}
    for name, dtype, prec, shape, kw, bwd in CASES:
        if elapsed() > 230:
            rows[name] = {"status": "skipped (time)"}
            continue
        try:
            rows[name] = check_case(name, dtype, prec, shape, kw, bwd)
        except Exception as err:
            traceback.print_exc()
            rows[name] = {"status": f"error: {type(err).__name__}: {err}"[:300], "ok": False}
        print("check", name, rows[name], flush=True)
        torch.cuda.empty_cache()
    return rows


# ---------------------------------------------------------------------------------------------- 3. growth

def growth():
    kernels.AUTOTUNE = False
    ns = [1024, 2048, 4096, 8192, 16384, 32768, 65536]
    out = {}
    for label, dtype, prec, probs in (("ieee", torch.float32, "ieee", True),
                                      ("tf32x3", torch.float32, "tf32x3", False),
                                      ("fp16", torch.float16, "ieee", False)):
        res = []
        for n in ns:
            if elapsed() > 270:
                break
            res.append(drift(n, heads=2, dim=64, rows=256, dtype=dtype, precision=prec, backend="triton",
                             device=DEV, seed=0, input_scale=1.0, probabilities=probs))
            print("growth", label, res[-1], flush=True)
        u = UNIT_ROUNDOFF[prec if dtype == torch.float32 else "float16"]
        out[label] = {"results": res, "check": growth_check(res, u) if len(res) > 1 else None,
                      "L(n)u": {r["n"]: depth_bound(r["n"]) * u for r in res}}
    return out


def table(res) -> str:
    lines = []
    t = res["sections"].get("timing", {})
    if "rows" in t:
        lines.append(f"forward, non-causal B={B} H={H} T={T} d={D} ({res['device']})")
        lines.append(f"{'kernel':<22}{'ms':>9}{'TFLOP/s':>9}{'peak MB':>10}{'rel err f64':>13}")
        for name, r in t["rows"].items():
            ms, peak, err = r.get("ms"), r.get("peak_mb"), r.get("rel_err_f64")
            lines.append(f"{name:<22}" + (f"{ms:>9.2f}{FLOPS / ms / 1e9:>9.0f}" if ms else f"{r.get('status', ''):>18}")
                         + (f"{peak:>10.0f}" if peak is not None else " " * 10)
                         + (f"{err:>13.1e}" if err is not None else ""))
        for name, tg in t.get("targets", {}).items():
            lines.append(f"target {name}: {json.dumps(tg, default=str)}")
    for name, r in res["sections"].get("timing_backward", {}).get("rows", {}).items():
        lines.append(f"fwd+bwd {name:<24}{r.get('ms') or r.get('status')}")
    for name, r in res["sections"].get("correctness", {}).items():
        errs = " ".join(f"{k}={v:.1e}" for k, v in r.items() if isinstance(v, float) and "torch" not in k)
        lines.append(f"check {name:<34} {'ok' if r.get('ok') else 'FAIL'} {errs} {r.get('status', '')}")
    for label, g in res["sections"].get("growth", {}).items():
        errs = " ".join(f"{r['n']}:{r['rel_dY']:.1e}" for r in g["results"])
        lines.append(f"growth {label}: {errs} check={g['check']}")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--skip", default="", help="comma-separated sections to skip")
    args = ap.parse_args()
    RESULT.update(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                  machine=machine_info())
    skip = set(filter(None, args.skip.split(",")))
    for name, fn in (("timing", timing), ("correctness", correctness), ("growth", growth),
                     ("timing_backward", timing_backward)):
        if name in skip or elapsed() > 250:
            continue
        try:
            RESULT["sections"][name] = fn()
        except Exception as err:
            traceback.print_exc()
            RESULT["sections"][name] = {"status": f"error: {type(err).__name__}: {err}"[:400]}
        save(args.out)
        torch.cuda.empty_cache()
    try:
        print(table(RESULT))
    except Exception:
        traceback.print_exc()


if __name__ == "__main__":
    main()
