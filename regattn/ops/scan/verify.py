"""``regattn verify scan``: the drift of the ELSA scan against float64 (elsa-supplementary.txt C.2, A.3).

For each sequence length ``n`` it measures, on a sample of query rows, the six drift metrics of
Appendix C.2 between the scan and a float64 softmax:

1. ``max_dP``   max absolute probability drift ``||dP||_inf``
2. ``rel_dP``   relative L2 probability error ``||dP|| / ||P_ref||``
3. ``js``       mean Jensen-Shannon divergence of the attention rows
4. ``argmax``   argmax disagreement rate of the rows
5. ``max_dY``   max absolute output drift ``||dY||_inf``
6. ``rel_dY``   relative L2 output error ``||dY|| / ||Y_ref||``

The scan's probabilities are read through the kernel itself: with one-hot values ``v_j = e_j`` the
output row of query ``i`` is ``P_ij``. Then it checks Theorem 1 (A.3): the output error stays below
``L(n, B) u`` with ``L = ceil(log2 B) + 2 ceil(log2(n / B)) + 1`` and grows at most logarithmically in n.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import sys

import torch

from regattn.bench.results import machine_info
from regattn.ops.scan.api import PRECISIONS, scan_attention
from regattn.reference.softmax import softmax_attention
from regattn.usage import device

UNIT_ROUNDOFF = {"ieee": 2.0 ** -24, "tf32x3": 2.0 ** -24, "fp16x3": 2.0 ** -24, "tf32": 2.0 ** -11,
                 "float16": 2.0 ** -11, "bfloat16": 2.0 ** -8, "float64": 2.0 ** -53}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


def js_divergence(p: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """Jensen-Shannon divergence (nats) of each row of ``p, r: [..., n]``, in float64."""
    p, r = p.double().clamp_min(0), r.double().clamp_min(0)
    m = 0.5 * (p + r)
    return 0.5 * (torch.special.xlogy(p, p) - torch.special.xlogy(p, m)).sum(-1) + \
        0.5 * (torch.special.xlogy(r, r) - torch.special.xlogy(r, m)).sum(-1)


def drift_metrics(p_hat, p_ref, y_hat, y_ref) -> dict:
    """The six metrics of Appendix C.2 for probabilities ``[..., T, n]`` and outputs ``[..., T, Dv]``."""
    dp = p_hat.double() - p_ref
    dy = y_hat.double() - y_ref
    return {
        "max_dP": dp.abs().max().item(),
        "rel_dP": (dp.norm() / p_ref.norm()).item(),
        "js": js_divergence(p_hat, p_ref).mean().item(),
        "argmax": (p_hat.double().argmax(-1) != p_ref.argmax(-1)).double().mean().item(),
        "max_dY": dy.abs().max().item(),
        "rel_dY": (dy.norm() / y_ref.norm()).item(),
    }


def scan_probabilities(q, k, *, chunk: int = 64, **kwargs) -> torch.Tensor:
    """``P [B, T, HQ, S]`` as the scan computes it: the outputs for one-hot values, ``chunk`` keys at a time."""
    B, S, H, _ = k.shape
    cols = []
    for a in range(0, S, chunk):
        w = min(chunk, S - a)
        onehot = torch.zeros(B, S, H, w, dtype=q.dtype, device=q.device)
        onehot[:, a:a + w] = torch.eye(w, dtype=q.dtype, device=q.device)[:, None, :]
        cols.append(scan_attention(q, k, onehot, **kwargs))
    return torch.cat(cols, -1)


def depth_bound(n: int, block: int = 128) -> int:
    """``L(n, B) = ceil(log2 B) + 2 ceil(log2(n / B)) + 1`` (A.3, eq. 11)."""
    return math.ceil(math.log2(block)) + 2 * max(0, math.ceil(math.log2(n / block))) + 1


def measure(n: int, *, heads: int, dim: int, rows: int, dtype, precision: str, backend: str, device,
            seed: int, input_scale: float, num_splits=None, probabilities: bool = True) -> dict:
    """Drift of one sequence length: ``rows`` sampled queries against ``n`` keys, non-causal."""
    g = torch.Generator(device="cpu").manual_seed(seed + n)
    T = min(rows, n)
    q = torch.randn(1, T, heads, dim, generator=g, dtype=torch.float64) * input_scale
    k = torch.randn(1, n, heads, dim, generator=g, dtype=torch.float64) * input_scale
    v = torch.randn(1, n, heads, dim, generator=g, dtype=torch.float64)
    q, k, v = (x.to(device=device, dtype=dtype) for x in (q, k, v))
    kwargs = dict(causal=False, precision=precision, backend=backend, num_splits=num_splits)
    with torch.no_grad():
        y_hat = scan_attention(q, k, v, **kwargs)
        qd, kd, vd = (x.double() for x in (q, k, v))
        y_ref = softmax_attention(qd, kd, vd, causal=False)
        if probabilities:
            p_hat = scan_probabilities(q, k, **kwargs)
            logits = torch.einsum("bthd,bshd->bths", qd, kd) * dim ** -0.5
            p_ref = torch.softmax(logits, -1)
        else:
            p_hat = p_ref = torch.ones(1, 1, dtype=torch.float64, device=device)
    out = {"n": n, **drift_metrics(p_hat, p_ref, y_hat, y_ref)}
    if not probabilities:
        for key in ("max_dP", "rel_dP", "js", "argmax"):
            out[key] = float("nan")
    return out


def growth_check(results, unit_roundoff: float, block: int = 128, slack: float = 2.0) -> dict:
    """Theorem 1: ``rel_dY <= L(n, B) u`` at every n, and growth from the shortest to the longest
    n at most ``slack`` times the growth of ``log2 n`` (logarithmic or better)."""
    bound_ok = all(r["rel_dY"] <= depth_bound(r["n"], block) * unit_roundoff for r in results)
    first, last = results[0], results[-1]
    growth = last["rel_dY"] / max(first["rel_dY"], 1e-300)
    log_growth = math.log2(max(last["n"], 2)) / math.log2(max(first["n"], 2))
    return {"bound_ok": bound_ok, "growth": growth, "log_growth": log_growth,
            "growth_ok": growth <= slack * log_growth, "unit_roundoff": unit_roundoff}


def format_table(results, unit_roundoff: float, block: int = 128) -> str:
    head = f"{'n':>7} {'max|dP|':>10} {'rel dP':>10} {'JS mean':>10} {'argmax':>8} {'max|dY|':>10} " \
           f"{'rel dY':>10} {'L(n)u':>10}"
    lines = [head, "-" * len(head)]
    for r in results:
        lines.append(f"{r['n']:>7} {r['max_dP']:>10.2e} {r['rel_dP']:>10.2e} {r['js']:>10.2e} {r['argmax']:>8.4f} "
                     f"{r['max_dY']:>10.2e} {r['rel_dY']:>10.2e} {depth_bound(r['n'], block) * unit_roundoff:>10.2e}")
    return "\n".join(lines)


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="regattn verify scan", description=__doc__.split("\n")[0])
    ap.add_argument("what", nargs="?", default="scan", choices=["scan"], help="the op to verify")
    ap.add_argument("--n", default=None, help="comma-separated sequence lengths (default by device)")
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--rows", type=int, default=128, help="query rows sampled per n")
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    ap.add_argument("--precision", default="ieee", choices=PRECISIONS)
    ap.add_argument("--backend", default="auto", choices=["auto", "torch", "triton"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--input-scale", type=float, default=1.0, help="scale of q and k (larger: sharper rows)")
    ap.add_argument("--splits", type=int, default=None, help="key slices merged by the tree kernel")
    ap.add_argument("--no-probabilities", action="store_true", help="skip the four P metrics (faster)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the table and checks here")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    device("--device", args.device)
    default = "1024,2048,4096,8192,16384" if args.device.startswith("cuda") else "64,128,256,512,1024"
    ns = [int(x) for x in (args.n or default).split(",")]
    dtype = DTYPES[args.dtype]
    u = UNIT_ROUNDOFF[args.precision if dtype == torch.float32 else args.dtype]
    results = [measure(n, heads=args.heads, dim=args.dim, rows=args.rows, dtype=dtype, precision=args.precision,
                       backend=args.backend, device=args.device, seed=args.seed, input_scale=args.input_scale,
                       num_splits=args.splits, probabilities=not args.no_probabilities) for n in ns]
    check = growth_check(results, u)
    report = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "machine": machine_info(args.device), "args": vars(args), "results": results, "check": check}
    print(summary(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if check["bound_ok"] and check["growth_ok"] else 1


def summary(report: dict) -> str:
    """The drift table of one run (as :func:`main` writes it to JSON) and its two checks, as printed."""
    args, results, check = report["args"], report["results"], report["check"]
    u = check["unit_roundoff"]
    return "\n".join([
        f"ELSA scan drift vs float64: dtype={args['dtype']} precision={args['precision']} backend={args['backend']} "
        f"device={args['device']} heads={args['heads']} d={args['dim']} rows={args['rows']}",
        format_table(results, u),
        f"Theorem 1 bound rel dY <= L(n, 128) u (u = {u:.2e}): {'PASS' if check['bound_ok'] else 'FAIL'}",
        f"growth {results[0]['n']} -> {results[-1]['n']}: x{check['growth']:.2f} vs log2 n x{check['log_growth']:.2f}"
        f" -> {'logarithmic or better: PASS' if check['growth_ok'] else 'faster than logarithmic: FAIL'}"])


if __name__ == "__main__":
    sys.exit(main())
