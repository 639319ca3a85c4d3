"""FlashLLA's CG with the key pass's products in one bf16 part against exact ones, emulated in float64 on the CPU.

The CG step's key pass (``ops/lla/tiles.key_scatter``) takes five bf16 products a key tile: ``q k^T``, then ``p k^T``
and ``(w (k.p)) k`` each with a high and a low bf16 part of its fp32 operand. With one part each it would take three.
This runs Algorithm 2 on the centred system (as the kernels: Sherman-Morrison after CG) for the last 256 rows of a
causal sequence, bf16 inputs, D 128, lam 1, with the products exact or with ``p`` and ``w (k.p)`` rounded to bf16,
and prints the relative error of ``o`` against the exact solve (``regattn.reference.lla.lla_blocks_uncentred``).

    python benchmarks/lla_cg_parts.py 512 2048 8192
"""
import sys

import torch

from regattn.reference.lla import lla_blocks_uncentred

D, ROWS, LAM = 128, 256, 1.0


def bf16(x):
    return x.to(torch.bfloat16).double()


def problem(T: int):
    """``(q rows, k, v, w, omega, mu~, mu)`` of the last ``ROWS`` queries, float64 from bf16 inputs."""
    gen = torch.Generator().manual_seed(T)
    q, k, v = (bf16(torch.randn(T, D, generator=gen, dtype=torch.float64)) for _ in range(3))
    q = q[-ROWS:]
    s = D ** -0.5 * q @ k.T
    s = s.masked_fill(torch.arange(T)[None, :] > torch.arange(T - ROWS, T)[:, None], float("-inf"))
    w = torch.exp(s - s.max(1, keepdim=True).values)
    omega, mt = w.sum(1), w @ k
    return q, k, v, w, omega, mt, mt - omega[:, None] * q


def output(rho, q, k, v, w, omega, mu):
    """``o_i = sum_j w_ij (1 - z_ij.rho_i) v_j / (omega_i - mu_i.rho_i)``."""
    a = rho @ k.T - (q * rho).sum(1, keepdim=True)
    return (w * (1 - a)) @ v / (omega - (mu * rho).sum(1))[:, None]


def cg_probe(iters, one_part, k, w, omega, mt, mu):
    """``rho`` from CG on the centred scatter ``A y = mu`` from 0, then Sherman-Morrison."""
    def matvec(p):
        scatter = bf16(w * (bf16(p) @ k.T)) @ k if one_part else (w * (p @ k.T)) @ k
        return scatter - (p * mt).sum(1, keepdim=True) * mt / omega[:, None] + LAM * p
    x, r = torch.zeros_like(mu), mu.clone()
    p, rr = r.clone(), (r * r).sum(1, keepdim=True)
    for _ in range(iters):
        ap = matvec(p)
        alpha = rr / (p * ap).sum(1, keepdim=True)
        x, r = x + alpha * p, r - alpha * ap
        rr_new = (r * r).sum(1, keepdim=True)
        p, rr = r + rr_new / rr * p, rr_new
    c = (mu * x).sum(1, keepdim=True).clamp(min=0)
    return x * omega[:, None] / (omega[:, None] + c)


def main(lengths):
    for T in lengths:
        q, k, v, w, omega, mt, mu = problem(T)
        one_head = [x[None, :, None] for x in (q, k, v)]  # [1, T, 1, D]: the reference's layout
        exact = lla_blocks_uncentred(*one_head, lam=LAM, scale=D ** -0.5, blocks=1)[0, :, 0]
        for iters in (4, 8, 16, 32):
            errors = [output(cg_probe(iters, one, k, w, omega, mt, mu), q, k, v, w, omega, mu) for one in (False, True)]
            two, one = (((o - exact).norm() / exact.norm()).item() for o in errors)
            print(f"T {T} cg={iters}: exact products {two:.3e}, one bf16 part {one:.3e}", flush=True)


if __name__ == "__main__":
    main([int(t) for t in sys.argv[1:]] or [512, 2048, 8192])
