"""GatedFWA on one GPU: correctness at full size, then timings against peers in the same process.

    PYTHONPATH=. python3 benchmarks/gpu_check_gatedfwa.py [--out DIR] [--quick]

1. Correctness, forward and backward, fp32 / fp16 / bf16 against the float64 reference, with
   flash-attn's rule for low precision: kernel error <= 2 x (torch reference in the same dtype) + slack.
2. Attention timings (bf16, B=1, H=16, d=128, w=512, T in {8192, 32768}): our gated window, our ungated
   sliding window, FlexAttention compiled (score_mod for the gate, mask_mod for the window), SDPA full
   causal (flash and cuDNN: they have no sliding window), a tile-size sweep, and T from 4K to 128K.
3. Gate preprocessing at T=65536, H in {64, 128}: one-pass and scan-then-propagate kernels against the
   two-kernel torch path (softplus then cumsum), and the device's copy bandwidth.

Writes ``gatedfwa_check.json`` after each section (so a cut-off run still leaves its numbers) and prints
a short table last.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
import triton
import triton.testing

import regattn
from regattn import reference
from regattn.bench import peers
from regattn.bench.results import machine_info
from regattn.ops._common import attention_tiles
from regattn.ops.gatedfwa.gate import gate_backward, gate_forward

DEV = "cuda"
ABS_BOUND = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
RESULT = {"suite": "gatedfwa_check", "machine": None, "correctness": [], "attention": [], "sweep": [],
          "scaling": [], "gate": [], "notes": []}


def save(out_dir):
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "gatedfwa_check.json"), "w") as f:
        json.dump(RESULT, f, indent=1, default=str)


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def bench(fn, rep=60):
    return triton.testing.do_bench(fn, warmup=15, rep=rep, return_mode="median")


def randn(*shape, dtype, scale=1.0):
    return (torch.randn(*shape, device=DEV, dtype=torch.float32) * scale).to(dtype)


def gate_u(B, T, H, rate=0.05):
    """A cumulative log-gate ``u = -cumsum(alpha)`` with ``alpha`` uniform in ``[0, 2 rate]``, fp32."""
    return -torch.cumsum(torch.rand(B, T, H, device=DEV) * (2 * rate), dim=1)


# ----------------------------------------------------------------------------------------------- correctness
def outputs(fn, leaves, do):
    o = fn(*leaves)
    return [o, *torch.autograd.grad(o, leaves, do)]


def check_attention(name, dtype, B, T, HQ, H, D, window, gated, cu=None):
    torch.manual_seed(0)
    q, k, v = randn(B, T, HQ, D, dtype=dtype), randn(B, T, H, D, dtype=dtype), randn(B, T, H, D, dtype=dtype)
    u = gate_u(B, T, HQ) if gated else None
    do = randn(B, T, HQ, D, dtype=dtype)
    leaves = [x for x in (q, k, v, u) if x is not None]

    def run(backend, xs):
        xs = [x.detach().clone().requires_grad_(True) for x in xs]
        fn = lambda q, k, v, *u: regattn.softmax_attention(q, k, v, window=window, gate=u[0] if u else None,
                                                           cu_seqlens=cu, backend=backend)
        return outputs(fn, xs, do if xs[0].dtype == dtype else do.double())

    got = run("triton", leaves)
    exact = run("torch", [x.double() for x in leaves])
    same = run("torch", leaves)
    names = ["o", "dq", "dk", "dv", "du"]
    row = {"case": name, "dtype": str(dtype).split(".")[-1], "shape": [B, T, HQ, H, D], "window": window,
           "gated": gated, "varlen": cu is not None}
    ok = True
    for n, a, b, c in zip(names, got, exact, same):
        e, es = rel(a, b), rel(c, b)
        slack = 1e-5 if dtype == torch.float32 else 1e-3
        # The torch reference casts u to the inputs' dtype, which ruins bf16/fp16 with a gate: the fixed
        # dtype bound keeps the check meaningful there.
        row[n] = {"kernel": e, "torch_same_dtype": es, "pass": e <= 2 * es + slack and e <= ABS_BOUND[dtype]}
        ok &= row[n]["pass"]
    if cu is not None:
        bounds = cu.tolist()
        row["per_sequence_rel_err"] = {
            n: [rel(a[:, s:e], b[:, s:e]) for s, e in zip(bounds[:-1], bounds[1:]) if e - s > 1]
            for n, a, b in zip(names, got, exact)}
    row["pass"] = ok
    RESULT["correctness"].append(row)
    del got, exact, same
    torch.cuda.empty_cache()


def check_gate(scan, B, T, H):
    h = torch.randn(B, T, H, device=DEV) * 3
    beta = 1 + F.elu(torch.randn(B, T, H, device=DEV))
    du = torch.randn(B, T, H, device=DEV)
    hx, bx = h.clone().requires_grad_(True), beta.clone().requires_grad_(True)
    u = regattn.gatedfwa_gate(hx, bx, scan=scan, backend="triton")
    dh, db = torch.autograd.grad(u, [hx, bx], du)
    hd, bd = h.double().requires_grad_(True), beta.double().requires_grad_(True)
    ud = reference.gatedfwa_gate(hd, bd)
    rh, rb = torch.autograd.grad(ud, [hd, bd], du.double())
    hf, bf = h.clone().requires_grad_(True), beta.clone().requires_grad_(True)
    uf = reference.gatedfwa_gate(hf, bf)
    fh, fb = torch.autograd.grad(uf, [hf, bf], du)
    row = {"case": f"gate {scan}", "shape": [B, T, H]}
    for n, a, b, c in (("u", u, ud, uf), ("dh", dh, rh, fh), ("dbeta", db, rb, fb)):
        e, es = rel(a, b), rel(c, b)
        row[n] = {"kernel": e, "torch_fp32": es, "pass": e <= 2 * es + 1e-5}
    row["pass"] = all(row[n]["pass"] for n in ("u", "dh", "dbeta"))
    RESULT["correctness"].append(row)


# ----------------------------------------------------------------------------------------------- attention
def attention_inputs(T, H=16, D=128, B=1, dtype=torch.bfloat16):
    torch.manual_seed(1)
    q, k, v = (randn(B, T, H, D, dtype=dtype).requires_grad_(True) for _ in range(3))
    u = gate_u(B, T, H).requires_grad_(True)
    do = randn(B, T, H, D, dtype=dtype)
    return q, k, v, u, do


def time_call(call, leaves, do):
    """(forward ms, forward+backward ms) of a zero-argument call whose output depends on ``leaves``."""
    fwd = bench(call)
    both = bench(lambda: torch.autograd.grad(call(), leaves, do))
    return fwd, both


def time_ours(q, k, v, u, do, window, gated=True):
    leaves = [q, k, v, u] if gated else [q, k, v]
    call = lambda: regattn.softmax_attention(q, k, v, window=window, gate=u if gated else None, backend="triton")
    return time_call(call, leaves, do)


def flex_gated(q, k, v, u, window):
    """FlexAttention with the gate as a score_mod: ``u_i`` and ``u_j`` read from two leaves (FlexAttention
    cannot differentiate two reads of one captured tensor); their gradients add up to d(u)."""
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b, h, i, j):
        return (j <= i) & (i - j < window)

    T = q.shape[1]
    block_mask = create_block_mask(mask_mod, None, None, T, T, device=q.device)
    qt, kt, vt = (peers.leaf(x, peers.heads_first) for x in (q, k, v))
    uq = peers.leaf(u, lambda g: g.float().transpose(1, 2))
    uk = peers.leaf(u, lambda g: g.float().transpose(1, 2))

    def score_mod(score, b, h, i, j):
        return score + uq[b, h, i] - uk[b, h, j]
    fn = peers.compiled_flex()
    call = lambda: fn(qt, kt, vt, score_mod=score_mod, block_mask=block_mask).transpose(1, 2)
    return call, [qt, kt, vt, uq, uk]


def time_flex(q, k, v, u, do, window, gated=True):
    if gated:
        call, leaves = flex_gated(q, k, v, u, window)
    else:
        call, leaves = peers.flex(q, k, v, window=window)
    note = None
    try:
        fwd, both = time_call(call, leaves, do)
    except Exception as err:  # a gradient through the captured gate may be unsupported: time without it
        note = f"flex fwd+bwd with d(u) failed ({type(err).__name__}: {str(err)[:120]}); timed without d(u)"
        leaves = leaves[:3]
        fwd, both = time_call(call, leaves, do)
    return fwd, both, note


def time_sdpa(q, k, v, do, backend):
    call, leaves = peers.sdpa(q, k, v, backend=backend, causal=True, window=None)
    return time_call(call, leaves, do)


def attention_section(Ts, window):
    for T in Ts:
        q, k, v, u, do = attention_inputs(T)
        rows = {}
        rows["ours gated window"] = time_ours(q, k, v, u, do, window)
        rows["ours sliding window (ungated)"] = time_ours(q, k, v, u, do, window, gated=False)
        rows["ours full causal (ungated)"] = time_ours(q, k, v, u, do, None, gated=False)
        for label, gated in (("flex gated window", True), ("flex sliding window (ungated)", False)):
            try:
                fwd, both, note = time_flex(q, k, v, u, do, window, gated)
                rows[label] = (fwd, both)
                if note:
                    RESULT["notes"].append(f"T={T} {label}: {note}")
            except Exception as err:
                RESULT["notes"].append(f"T={T} {label}: {type(err).__name__}: {str(err)[:200]}")
        for backend in ("flash", "cudnn"):
            try:
                rows[f"sdpa-{backend} full causal"] = time_sdpa(q, k, v, do, backend)
            except Exception as err:
                RESULT["notes"].append(f"T={T} sdpa-{backend}: {type(err).__name__}: {str(err)[:200]}")
        for label, (fwd, both) in rows.items():
            RESULT["attention"].append({"impl": label, "T": T, "B": 1, "H": 16, "D": 128, "window": window,
                                        "dtype": "bf16", "fwd_ms": fwd, "fwd_bwd_ms": both})
        del q, k, v, u, do
        torch.cuda.empty_cache()


def sweep_section(T, window):
    """A few tile configurations of the three attention kernels (gated window, bf16)."""
    q, k, v, u, do = attention_inputs(T)
    fwd_cfgs = [dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),
                dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=4),
                dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=3),
                dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=2),
                dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3)]
    def tiles(m, n, warps, stages):
        return dict(BLOCK_M=m, BLOCK_N=n, num_warps=warps, num_stages=stages)
    bwd_cfgs = [(tiles(64, 64, 4, 2), tiles(64, 64, 4, 2)), (tiles(32, 128, 4, 3), tiles(128, 32, 4, 3)),
                (tiles(64, 128, 8, 2), tiles(128, 64, 8, 2)), (tiles(32, 64, 4, 3), tiles(64, 32, 4, 3)),
                (tiles(64, 64, 4, 3), tiles(64, 64, 4, 3))]
    call = lambda: regattn.gatedfwa(q, k, v, u, window=window, backend="triton")
    for cfg in fwd_cfgs:
        attention_tiles.BLOCK_OVERRIDES["fwd"] = cfg
        try:
            RESULT["sweep"].append({"kind": "fwd", "cfg": cfg, "T": T, "ms": bench(call)})
        except Exception as err:
            RESULT["sweep"].append({"kind": "fwd", "cfg": cfg, "T": T, "error": str(err)[:200]})
    attention_tiles.BLOCK_OVERRIDES.clear()
    o = call()
    for kv, qq in bwd_cfgs:
        attention_tiles.BLOCK_OVERRIDES.update(bwd_kv=kv, bwd_q=qq)
        try:
            ms = bench(lambda: torch.autograd.grad(o, [q, k, v, u], do, retain_graph=True))
            RESULT["sweep"].append({"kind": "bwd", "cfg": [kv, qq], "T": T, "ms": ms})
        except Exception as err:
            RESULT["sweep"].append({"kind": "bwd", "cfg": [kv, qq], "T": T, "error": str(err)[:200]})
    attention_tiles.BLOCK_OVERRIDES.clear()


def scaling_section(Ts, window):
    for T in Ts:
        q, k, v, u, do = attention_inputs(T)
        fwd, both = time_ours(q, k, v, u, do, window)
        RESULT["scaling"].append({"T": T, "window": window, "fwd_ms": fwd, "fwd_bwd_ms": both,
                                  "fwd_ns_per_token": fwd * 1e6 / T, "fwd_bwd_ns_per_token": both * 1e6 / T})
        del q, k, v, u, do
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------------- gate
def torch_gate(h, beta, eps=1e-6):
    """The two-kernel torch path: elementwise alpha, then cumsum."""
    alpha = F.softplus(beta * h) / (beta + eps)
    return -torch.cumsum(alpha, dim=1)


def gate_section(T, Hs):
    x = torch.empty(64 * 2**20, device=DEV)  # 256 MiB
    copy_ms = bench(lambda: x.clone())
    copy_gbs = 2 * x.numel() * 4 / copy_ms / 1e6
    RESULT["gate"].append({"impl": "copy (clone of 256 MiB)", "ms": copy_ms, "GB/s": copy_gbs})
    del x
    for H in Hs:
        h = torch.randn(1, T, H, device=DEV)
        beta = 1 + F.elu(torch.randn(1, T, H, device=DEV))
        du = torch.randn(1, T, H, device=DEV)
        nbytes = 3 * h.numel() * 4

        def add(impl, ms, extra=None):
            row = {"impl": impl, "T": T, "H": H, "ms": ms, "GB/s": nbytes / ms / 1e6,
                   "fraction_of_copy": nbytes / ms / 1e6 / copy_gbs}
            row.update(extra or {})
            RESULT["gate"].append(row)

        add("torch two-kernel", bench(lambda: torch_gate(h, beta)))
        for bt, bh in ((1024, 1), (1024, 2), (1024, 4), (4096, 2)):
            add(f"one_pass BT={bt} BH={bh}", bench(lambda: gate_forward(h, beta, 1e-6, "one_pass", (bt, bh))))
        for bt in (1024, 2048):
            for bh in (8, 32):
                add(f"scan_then_propagate BT={bt} BH={bh}",
                    bench(lambda: gate_forward(h, beta, 1e-6, "scan_then_propagate", (bt, bh))))
        add("default (regattn.gatedfwa_gate)", bench(lambda: regattn.gatedfwa_gate(h, beta, backend="triton")))
        hx, bx = h.clone().requires_grad_(True), beta.clone().requires_grad_(True)
        ut = torch_gate(hx, bx)
        add("torch backward (autograd)", bench(lambda: torch.autograd.grad(ut, [hx, bx], du, retain_graph=True)),
            {"bytes_note": "backward moves 5 arrays; GB/s counts 3"})
        for bh in (2, 4):
            add(f"kernel backward BT=1024 BH={bh}", bench(lambda: gate_backward(du, h, beta, 1e-6, (1024, bh))),
                {"bytes_note": "backward moves 5 arrays; GB/s counts 3"})


# ----------------------------------------------------------------------------------------------- report
def table():
    lines = []
    for r in RESULT["correctness"]:
        worst = {k: round(v["kernel"] / max(2 * v.get("torch_same_dtype", v.get("torch_fp32", 0)), 1e-12), 2)
                 for k, v in r.items() if isinstance(v, dict) and "kernel" in v}
        lines.append(f"check {r['case']:<28} {r.get('dtype', 'fp32'):<9} pass={r['pass']}  err/(2*torch): {worst}")
        if "per_sequence_rel_err" in r:
            lines.append(f"      per sequence: {r['per_sequence_rel_err']}")
    for r in RESULT["attention"]:
        lines.append(f"T={r['T']:<6} {r['impl']:<32} fwd {r['fwd_ms']:8.3f} ms   fwd+bwd {r['fwd_bwd_ms']:8.3f} ms")
    for r in RESULT["sweep"]:
        lines.append(f"sweep {r['kind']} {r.get('ms', r.get('error'))} {r['cfg']}")
    for r in RESULT["scaling"]:
        lines.append(f"scale T={r['T']:<7} fwd {r['fwd_ms']:8.3f} ms  fwd+bwd {r['fwd_bwd_ms']:8.3f} ms  "
                     f"({r['fwd_bwd_ns_per_token']:.2f} ns/token)")
    for r in RESULT["gate"]:
        lines.append(f"gate {r['impl']:<36} H={r.get('H', '-'):<4} {r['ms']:8.4f} ms  {r['GB/s']:7.0f} GB/s "
                     f"{r.get('fraction_of_copy', 1):.2f} of copy")
    lines += RESULT["notes"]
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results/h100"))
    ap.add_argument("--quick", action="store_true", help="skip the tile-size sweep")
    args = ap.parse_args()
    RESULT["machine"] = machine_info()
    t0 = time.time()
    sections = [
        ("correctness", lambda: [
            check_attention("gated window GQA", torch.bfloat16, 1, 4096, 16, 4, 128, 512, True),
            check_attention("gated window GQA", torch.float16, 1, 2048, 16, 4, 128, 512, True),
            check_attention("gated window GQA", torch.float32, 1, 2048, 16, 4, 128, 512, True),
            check_attention("gated full causal T=3000", torch.bfloat16, 1, 3000, 16, 16, 64, None, True),
            check_attention("sliding window d=64", torch.bfloat16, 2, 2048, 8, 8, 64, 300, False),
            check_attention("gated window varlen", torch.bfloat16, 1, 4096, 8, 8, 128, 512, True,
                            cu=torch.tensor([0, 1000, 1001, 3333, 4096], device=DEV, dtype=torch.int32)),
            check_attention("gated window varlen", torch.float16, 1, 4096, 8, 8, 128, 512, True,
                            cu=torch.tensor([0, 1000, 1001, 3333, 4096], device=DEV, dtype=torch.int32)),
            check_gate("one_pass", 2, 65536, 64),
            check_gate("scan_then_propagate", 2, 65536, 64)]),
        ("attention", lambda: attention_section((8192, 32768), 512)),
        ("sweep", lambda: None if args.quick else sweep_section(32768, 512)),
        ("gate", lambda: gate_section(65536, (64, 128))),
        ("scaling", lambda: scaling_section((4096, 8192, 16384, 32768, 65536, 131072), 512)),
    ]
    for name, fn in sections:
        s = time.time()
        try:
            fn()
        except Exception as err:
            RESULT["notes"].append(f"section {name} failed: {type(err).__name__}: {str(err)[:300]}")
        RESULT.setdefault("section_seconds", {})[name] = round(time.time() - s, 1)
        save(args.out)
        print(f"[{time.time() - t0:6.1f} s] {name} done", file=sys.stderr, flush=True)
    print(table())


if __name__ == "__main__":
    main()
