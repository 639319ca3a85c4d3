"""FlashLLA's key-pass products with fewer bf16 parts, emulated in float64 on the CPU against the exact solve.

The kernels (``ops/lla``) split an fp32 operand of a bf16 product into a high and a low bf16 part (two products)
where a later difference could cancel. This emulates what fewer parts would cost in accuracy, in float64 but for
the bf16 roundings, on the last 256 rows of a causal sequence (bf16 inputs, D 128), and prints the relative error
of ``o`` against the exact solve (``regattn.reference.lla.lla_blocks_uncentred``).

``cg``: Algorithm 2 on the centred system (as the kernels: Sherman-Morrison after CG), lam 1. The CG step's key pass
(``tiles.key_scatter``) takes five bf16 products a key tile: ``q k^T``, then ``p k^T`` and ``(w (k.p)) k`` each
with two parts of its fp32 operand; with one part each it would take three. ``and o1c``: the output pass too in one
part, centred (see ``w1 o1c`` below; exact weights), which full LLA's output pass would take.

``direct``: BD-LLA's direct 1 x 1 and 2 x 2 solves (``forward.moments_pass``, ``forward.output_pass``), lam 1 and
0.01, on three kinds of inputs (``problem``). Their variants, with the bf16 products a key tile in units of a
``[BM, BN] x [BN, D]`` product (the pair moments are half as wide):

- ``kernel``: as the kernels today: the moments ``mu~``, ``sum w k^2`` (and ``sum w k_2d k_2d+1``) from weights in
  two parts and squares in two (exact) parts, ``omega`` the fp32 sum; the output pass with ``w`` in one part, ``rho``
  and ``w (k.rho)`` in two. 13 units (2 x 2 blocks: 15).
- ``w1``: the moments and ``omega`` from one bf16 part of the weights, the same rounded weights for all of them (an
  exact regression with perturbed weights). 10 units (11).
- ``w1 k1``: and the squares in one part. 9 (9.5).
- ``w1 o1``: and the output pass's ``rho`` and ``w (k.rho)`` in one part. 8 (9).
- ``w1 o1c``: as ``w1 o1``, but the output pass rounds ``w (k.rho - c)``, centred on ``c = mu~.rho / omega`` from the
  moments (the same one-part ``rho`` in both), and adds ``(kbar.rho - c) sum w v`` back. 8 (9).

``bf16 floor`` is the error of the exact output rounded to bf16.

    python benchmarks/lla_parts.py cg 512 2048 8192
    python benchmarks/lla_parts.py direct 512 2048 8192
"""
import sys

import torch

from regattn.reference.lla import lla_blocks_uncentred

D, ROWS = 128, 256
FP32_EPS = 2.0 ** -23
DIRECT = {"kernel": (), "w1": ("w",), "w1 k1": ("w", "k"), "w1 o1": ("w", "o"), "w1 o1c": ("w", "o", "c")}


def bf16(x):
    return x.to(torch.bfloat16).double()


def problem(T: int, kind: str = "random"):
    """``(q rows, k, v, w)`` of the last ``ROWS`` queries, float64 from bf16 inputs. ``kind``: ``"random"`` (standard
    normal entries), ``"peaked"`` (each query 0.6 times an earlier key within 64 positions plus 0.8 times noise: a few
    keys carry most of its weight) or ``"offset"`` (keys and queries share one vector of entries 4 times standard
    normal: the second moments about 0 are some 8 times those about the query, and their differences cancel)."""
    gen = torch.Generator().manual_seed(T)
    q, k, v = (torch.randn(T, D, generator=gen, dtype=torch.float64) for _ in range(3))
    if kind == "peaked":
        earlier = torch.arange(T) - torch.randint(0, 64, (T,), generator=gen)
        q = 0.6 * k[earlier.clamp(min=0)] + 0.8 * q
    if kind == "offset":
        shared = 4 * torch.randn(D, generator=gen, dtype=torch.float64)
        q, k = q + shared, k + shared
    q, k, v = bf16(q[-ROWS:]), bf16(k), bf16(v)
    s = D ** -0.5 * q @ k.T
    s = s.masked_fill(torch.arange(T)[None, :] > torch.arange(T - ROWS, T)[:, None], float("-inf"))
    return q, k, v, torch.exp(s - s.max(1, keepdim=True).values)


def exact_output(q, k, v, lam, blocks):
    one_head = [x[None, :, None] for x in (q, k, v)]  # [1, T, 1, D]: the reference's layout
    return lla_blocks_uncentred(*one_head, lam=lam, scale=D ** -0.5, blocks=blocks)[0, :, 0]


def rel(o, exact):
    return ((o - exact).norm() / exact.norm()).item()


def output_pass(rho, delta, k, v, w, mt, omega, one_part=False, centred=False):
    """``o_i = sum_j w_ij v_j / omega_i - sum_j w_ij (k_j.rho_i - kbar_i.rho_i) v_j / delta_i`` as the kernels'
    output pass forms it (``forward.output_pass``); ``one_part``: ``rho`` and ``w (k.rho - c)`` in one bf16 part,
    ``centred``: ``c = mu~.rho / omega`` from the moments, else 0."""
    if one_part:
        rho = bf16(rho)
    c = (mt * rho).sum(1) / omega if centred else torch.zeros_like(omega)
    a = w * (rho @ k.T - c[:, None])
    wsum, wv = w.sum(1), w @ v
    return wv / wsum[:, None] - ((bf16(a) if one_part else a) @ v - (a.sum(1) / wsum)[:, None] * wv) / delta[:, None]


def cg_probe(iters, one_part, k, w, omega, mt, mu, lam):
    """``rho`` from CG on the centred scatter ``A y = mu`` from 0, then Sherman-Morrison."""
    def matvec(p):
        scatter = bf16(w * (bf16(p) @ k.T)) @ k if one_part else (w * (p @ k.T)) @ k
        return scatter - (p * mt).sum(1, keepdim=True) * mt / omega[:, None] + lam * p
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


def cg_study(lengths, lam=1.0):
    for T in lengths:
        q, k, v, w = problem(T)
        omega, mt = w.sum(1), w @ k
        mu = mt - omega[:, None] * q
        exact = exact_output(q, k, v, lam, blocks=1)
        for iters in (4, 8, 16, 32):
            line = []
            for name, one_step, one_output in (("exact products", False, False), ("one bf16 part", True, False),
                                               ("and o1c", True, True)):
                rho = cg_probe(iters, one_step, k, w, omega, mt, mu, lam)
                o = output_pass(rho, omega - (mu * rho).sum(1), k, v, w, mt, omega, one_output, one_output)
                line.append(f"{name} {rel(o, exact):.3e}")
            print(f"T {T} cg={iters}: " + ", ".join(line), flush=True)


def direct_output(q, k, v, w, lam, width, one):
    """``o`` of the direct solves with blocks of ``width`` (1 or 2) features, the parts in ``one`` taken in one bf16
    part (see the module's text)."""
    wm = bf16(w) if "w" in one else w
    square = bf16 if "k" in one else (lambda x: x)
    omega = wm.sum(1)
    mt = wm @ k
    mu = mt - omega[:, None] * q
    sdiag = wm @ square(k * k) - 2 * q * mt + omega[:, None] * q * q + lam
    if width == 1:
        rho = mu / sdiag
    else:
        e, o = slice(0, None, 2), slice(1, None, 2)
        c = (wm @ square(k[:, e] * k[:, o]) - q[:, e] * mt[:, o] - q[:, o] * mt[:, e]
             + omega[:, None] * q[:, e] * q[:, o])
        a, b = sdiag[:, e], sdiag[:, o]
        det = a * b - c * c
        rho = torch.stack([(b * mu[:, e] - c * mu[:, o]) / det, (a * mu[:, o] - c * mu[:, e]) / det], -1).flatten(1)
    delta = omega - (mu * rho).sum(1)
    delta = torch.where(delta < 0, -1.0, 1.0) * delta.abs().clamp(min=FP32_EPS * omega)
    return output_pass(rho, delta, k, v, bf16(w), mt, omega, "o" in one, "c" in one)


def direct_study(lengths):
    for kind in ("random", "peaked", "offset"):
        for T in lengths:
            q, k, v, w = problem(T, kind)
            for lam in (1.0, 0.01):
                for width in (1, 2):
                    exact = exact_output(q, k, v, lam, blocks=D // width)
                    line = [f"{name} {rel(direct_output(q, k, v, w, lam, width, one), exact):.2e}"
                            for name, one in DIRECT.items()]
                    print(f"{kind} T {T} lam {lam} {width}x{width}: " + ", ".join(line)
                          + f", bf16 floor {rel(bf16(exact), exact):.2e}", flush=True)


if __name__ == "__main__":
    study, lengths = sys.argv[1], [int(t) for t in sys.argv[2:]] or [512, 2048, 8192]
    {"cg": cg_study, "direct": direct_study}[study](lengths)
