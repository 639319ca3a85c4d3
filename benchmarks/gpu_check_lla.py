"""GPU check of FlashLLA: full-size correctness (forward and backward, fp32/fp16/bf16 against float64),
the CG precision table (lla Table 2), latency and peak memory against the naive materialised form over
sequence length (Figure 7), and the issue's targets against SDPA's cuDNN forward.

Run from the repository root: ``PYTHONPATH=. python3 benchmarks/gpu_check_lla.py``.
Writes ``$OUT/lla_check.json`` after every section.
"""
from __future__ import annotations

import json
import os
import time

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import regattn
from regattn.ops.lla import forward as fwd_mod
from regattn.reference.lla import heads_first, lla_output, lla_weights, ridge

OUT = os.environ.get("OUT", "/tmp/lla_out")
START = time.time()
LIMIT_S = float(os.environ.get("LIMIT_S", "285"))
DEV = "cuda"
LAM = 1.0
result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
              lam=LAM, correctness=[], cg_table=[], figure7=[], targets={}, tiles=[], notes=[])


def left() -> float:
    return LIMIT_S - (time.time() - START)


def save() -> None:
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "lla_check.json"), "w") as f:
        json.dump(result, f, indent=1)


def rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - b).norm() / b.norm()).item()


def randn(*shape, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return torch.randn(*shape, device=DEV, generator=g, dtype=torch.float32).to(dtype)


def naive_lla(q, k, v, lam, scale, window=None):
    """The materialised form (eq. 10-11): W ``[T, S]``, ``Sigma~ = W (K kron K)`` ``[T, D, D]``, LU solves."""
    B, T, HQ, D = q.shape
    w, _ = lla_weights(q, k, scale=scale, window=window)
    qh, kh, vh = q.transpose(1, 2), heads_first(k, HQ), heads_first(v, HQ)
    omega = w.sum(-1)
    mt = w @ kh
    mu = mt - omega[..., None] * qh
    kk = (kh[..., :, None] * kh[..., None, :]).flatten(-2)
    sigma = (w @ kk).view(B, HQ, T, D, D)
    sigma = (sigma - mt[..., :, None] * qh[..., None, :] - qh[..., :, None] * mt[..., None, :]
             + omega[..., None, None] * qh[..., :, None] * qh[..., None, :])
    sigma = sigma + torch.diag_embed(ridge(lam, (B, HQ, T, D), dtype=q.dtype, device=q.device))
    rho = torch.linalg.solve(sigma, mu[..., None])[..., 0]
    return lla_output(w, omega, mu, rho, qh, kh, vh)


def bench(fn, rep=50):
    return triton.testing.do_bench(fn, warmup=5, rep=rep)


def time_once(fn) -> float:
    """Milliseconds of one call after one warm-up call (for the slow naive form)."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def peak_extra(fn):
    """Peak memory (bytes) allocated during ``fn`` above what was allocated before it."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak


def sdpa_cudnn(q, k, v):
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)


CORR = dict(B=1, T=1024, HQ=4, H=2, D=128)


def correctness_inputs():
    B, T, HQ, H, D = (CORR[n] for n in ("B", "T", "HQ", "H", "D"))
    q64, k64, v64 = (randn(B, T, n, D, dtype=torch.float64, seed=s) for s, n in ((1, HQ), (2, H), (3, H)))
    lam64 = torch.rand(B, T, HQ, device=DEV, dtype=torch.float64, generator=torch.Generator(DEV).manual_seed(0)) + 0.5
    return q64, k64, v64, lam64, randn(B, T, HQ, D, dtype=torch.float64, seed=4)


def check_variant(inputs, window, dtype, iters, backward):
    """One (window, dtype) against float64 (naive form, autograd), beside the torch reference run on the
    same low-precision inputs (computed in fp32): flash-attn's rule compares the two errors."""
    q64, k64, v64, lam64, do64 = inputs
    scale = CORR["D"] ** -0.5
    leaves = [x.clone().requires_grad_(backward) for x in (q64, k64, v64, lam64)]
    ref = naive_lla(*leaves[:3], leaves[3], scale, window)
    low = [x.to(dtype).detach().requires_grad_(backward) for x in (q64, k64, v64)]
    lam = lam64.float().requires_grad_(backward)
    lowref = [x.detach().float().requires_grad_(backward) for x in low] + [lam.detach().clone().requires_grad_(backward)]
    out = regattn.lla(*low, lam=lam, window=window, cg_iters=iters, cg_tol=1e-6, backend="triton")
    o32 = naive_lla(*lowref[:3], lowref[3], scale, window)
    row = dict(CORR, dtype=str(dtype).split(".")[-1], window=window, cg_iters=iters,
               out=rel(out, ref), out_torch_same_inputs=rel(o32, ref))
    if backward:
        ref_g = torch.autograd.grad(ref, leaves, do64)
        grads = torch.autograd.grad(out, low + [lam], do64.to(dtype))
        g32 = torch.autograd.grad(o32, lowref, do64.float())
        for name, g, r, t in zip(("dq", "dk", "dv", "dlam"), grads, ref_g, g32):
            row[name] = rel(g, r)
            row[name + "_torch_same_inputs"] = rel(t, r)
    result["correctness"].append(row)
    print(row, flush=True)
    save()


def correctness():
    """Full LLA forward and backward, bf16 (16 CG iterations) and fp32 (128), B=1, HQ=4, H=2, T=1024, D=128."""
    inputs = correctness_inputs()
    for dtype, iters, need_s in ((torch.bfloat16, 16, 100), (torch.float32, 128, 150)):
        if left() > need_s:
            check_variant(inputs, None, dtype, iters, backward=True)


def extras():
    """fp16 forward, and the windowed (SW-LLA, w=256) bf16 forward."""
    inputs = correctness_inputs()
    for window, dtype in ((None, torch.float16), (256, torch.bfloat16)):
        if left() > 45:
            check_variant(inputs, window, dtype, 16, backward=False)


def cg_table():
    """Table 2: the bf16 CG kernel against the fp32 exact solve for 1..64 iterations."""
    B, T, H, D = 1, 2048, 4, 128
    q, k, v = (randn(B, T, H, D, seed=s) for s in (5, 6, 7))
    exact = naive_lla(q.float(), k.float(), v.float(), LAM, D ** -0.5)
    for iters in (1, 2, 4, 8, 16, 32, 64):
        out = regattn.lla(q, k, v, lam=LAM, cg_iters=iters, cg_tol=0.0, backend="triton")
        row = dict(T=iters, abs_err=(out.float() - exact).abs().mean().item(), rel_err=rel(out, exact))
        result["cg_table"].append(row)
        print("cg", row, flush=True)
    save()


def figure7():
    """Latency and peak extra memory over T at B=32, H=1, D=128: FlashLLA (bf16, 8 CG iterations) against
    the naive materialised form (fp32: torch.linalg.solve has no bf16)."""
    B, H, D = 32, 1, 128
    for T in (1024, 2048, 4096, 8192):
        if left() < 30:
            result["notes"].append(f"figure7 stopped before T={T} for time")
            break
        q, k, v = (randn(B, T, H, D, seed=s) for s in (8, 9, 10))
        row = dict(B=B, H=H, T=T, D=D, qkvo_bytes=4 * q.numel() * q.element_size())
        fn = lambda: regattn.lla(q, k, v, lam=LAM, cg_iters=8, backend="triton")  # noqa: E731
        row["flash_ms"] = bench(fn, rep=30)
        row["flash_peak_bytes"] = peak_extra(fn)
        try:
            qf, kf, vf = q.float(), k.float(), v.float()
            nfn = lambda: naive_lla(qf, kf, vf, LAM, D ** -0.5)  # noqa: E731
            row["naive_peak_bytes"] = peak_extra(nfn)
            row["naive_ms"] = time_once(nfn) if T <= 4096 else None
            if row["naive_ms"]:
                row["speedup"] = row["naive_ms"] / row["flash_ms"]
        except torch.OutOfMemoryError:
            row["naive"] = "out of memory"
        torch.cuda.empty_cache()
        result["figure7"].append(row)
        print("fig7", row, flush=True)
        save()


def targets():
    """B=4, H=16, T=8192, D=128, bf16: 8 CG iterations and BD-LLA g=D/2 against SDPA cuDNN's forward;
    forward + backward at B=1, T=4096."""
    B, H, T, D = 4, 16, 8192, 128
    q, k, v = (randn(B, T, H, D, seed=s) for s in (11, 12, 13))
    t = result["targets"]
    t["shape"] = dict(B=B, H=H, T=T, D=D, dtype="bfloat16")
    t["sdpa_cudnn_ms"] = bench(lambda: sdpa_cudnn(q, k, v))
    save()
    if left() > 60:
        t["cg8_fwd_ms"] = bench(lambda: regattn.lla(q, k, v, lam=LAM, cg_iters=8, backend="triton"), rep=100)
        t["cg8_ratio_to_cudnn"] = t["cg8_fwd_ms"] / t["sdpa_cudnn_ms"]
        save()
    if left() > 40:
        t["bd_pairs_fwd_ms"] = bench(lambda: regattn.lla(q, k, v, lam=LAM, blocks=D // 2, backend="triton"))
        t["bd_pairs_ratio_to_cudnn"] = t["bd_pairs_fwd_ms"] / t["sdpa_cudnn_ms"]
        save()
    if left() > 40:
        qs, ks, vs = (x[:1, :4096].detach().requires_grad_(True) for x in (q, k, v))
        o = regattn.lla(qs, ks, vs, lam=LAM, cg_iters=8, backend="triton")
        do = torch.randn_like(o)
        t["bwd_shape"] = dict(B=1, H=H, T=4096, D=D)
        t["cg8_fwd_bwd_ms"] = bench(lambda: torch.autograd.grad(
            regattn.lla(qs, ks, vs, lam=LAM, cg_iters=8, backend="triton"), (qs, ks, vs), do), rep=30)
        save()
    print("targets", t, flush=True)


def tiles():
    """Other tile configurations of the CG forward at the target shape (the default is 64 x 64, 8 warps)."""
    B, H, T, D = 4, 16, 8192, 128
    q, k, v = (randn(B, T, H, D, seed=s) for s in (11, 12, 13))
    default = fwd_mod.forward_blocks
    for cfg in (dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2),
                dict(BLOCK_M=128, BLOCK_N=32, num_warps=8, num_stages=2)):
        if left() < 40:
            break
        fwd_mod.forward_blocks = lambda T, D, dtype, cfg=cfg: dict(cfg)
        try:
            ms = bench(lambda: regattn.lla(q, k, v, lam=LAM, cg_iters=8, backend="triton"), rep=100)
            result["tiles"].append(dict(cfg, cg8_ms=ms))
        except Exception as e:  # a configuration that does not fit is recorded, not fatal
            result["tiles"].append(dict(cfg, error=f"{type(e).__name__}: {str(e)[:200]}"))
        finally:
            fwd_mod.forward_blocks = default
        print("tiles", result["tiles"][-1], flush=True)
        save()


SECTIONS = dict(correctness=correctness, cg_table=cg_table, targets=targets, figure7=figure7, extras=extras,
                tiles=tiles)

if __name__ == "__main__":
    import sys
    torch.backends.cuda.matmul.allow_tf32 = False
    for name in (sys.argv[1:] or list(SECTIONS)):
        t0 = time.time()
        try:
            SECTIONS[name]()
        except Exception as e:
            result["notes"].append(f"{name}: {type(e).__name__}: {str(e)[:300]}")
            print("FAILED", name, e, flush=True)
        result.setdefault("section_s", {})[name] = time.time() - t0
        save()
    print(json.dumps({k: result[k] for k in ("targets", "cg_table", "section_s")}, indent=1))
