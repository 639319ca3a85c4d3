"""Local Linear Attention: latency and peak memory over sequence length, the blockwise op
against the naive materialized form (lla Figure 7), BD-LLA, SDPA as the floor; and the CG
precision table (Table 2): the CG solve in the run's dtype against the fp32 exact solve."""
from __future__ import annotations

import regattn
from regattn import reference
from regattn.bench import counts
from regattn.bench.runner import ours, randn, reference_case, relative_diff, sdpa_cases

NAME = "lla"
PEERS = ("sdpa-flash", "sdpa-cudnn", "reference")
LAM = 1.0
CG_ITERS = (1, 2, 4, 8, 16, 32, 64)
GRIDS = {
    "tiny": [dict(B=1, H=2, T=24, D=8, cg=4), dict(part="cg", B=1, H=2, T=24, D=8)],
    "default": [dict(B=4, H=16, T=T, D=128, cg=8) for T in (1024, 4096, 8192)]
    + [dict(B=32, H=1, T=8192, D=128, cg=8), dict(part="cg", B=1, H=4, T=512, D=128)],
    "full": [dict(B=4, H=16, T=T, D=128, cg=8) for T in (512, 1024, 2048, 4096, 8192, 16384)]
    + [dict(B=32, H=1, T=T, D=128, cg=8) for T in (1024, 2048, 4096, 8192)]
    + [dict(part="cg", B=1, H=4, T=T, D=128) for T in (512, 2048)],
}


def cases(shape: dict, setup):
    """Latency shapes: B, H, T, D, cg (CG iterations), window. CG table: part="cg", B, H, T, D."""
    yield from (precision_cases if shape.get("part") == "cg" else latency_cases)(shape, setup)


def qkv(shape, setup, **kw):
    B, H, T, D = shape["B"], shape["H"], shape["T"], shape["D"]
    return randn(setup, B, T, H, D, **kw), randn(setup, B, T, H, D, **kw), randn(setup, B, T, H, D, **kw)


def latency_cases(shape, setup):
    B, H, T, D, cg, w = shape["B"], shape["H"], shape["T"], shape["D"], shape["cg"], shape.get("window")
    q, k, v = qkv(shape, setup)
    elt = q.element_size()
    n_bytes = counts.attention_bytes(B, T, T, H, H, D, D, elt)
    n_cg = dict(flops=counts.lla_flops(B, T, T, H, D, D, window=w, cg_iters=cg), bytes=n_bytes)
    n_exact = dict(flops=counts.lla_flops(B, T, T, H, D, D, window=w), bytes=n_bytes)
    yield "fwd", ours(regattn.lla, q, setup, lambda: regattn.lla(q, k, v, lam=LAM, window=w, cg_iters=cg,
                                                                 backend=setup.backend),
                      [], mode="fwd", tag=f"[cg={cg}]", compare=False, **n_cg)
    yield "fwd", ours(regattn.lla, q, setup, lambda: regattn.lla(q, k, v, lam=LAM, window=w, blocks=D // 2,
                                                                 backend=setup.backend),
                      [], mode="fwd", tag="[BD g=D/2]", compare=False, **n_exact)
    yield from sdpa_cases(setup, "fwd", q, k, v, window=w, backends=("flash", "cudnn"), tag=" (attention)",
                          flops=counts.attention_flops(B, T, T, H, D, D, window=w), bytes=n_bytes)
    yield from reference_case(setup, "fwd", lambda: reference.lla(q, k, v, lam=LAM, window=w), [], **n_exact)


def precision_cases(shape, setup):
    """Each CG iteration count against the fp32 exact solve; ``err`` is the relative error."""
    B, H, T, D = shape["B"], shape["H"], shape["T"], shape["D"]
    q, k, v = qkv(shape, setup)
    exact = reference.lla(q.float(), k.float(), v.float(), lam=LAM)
    for iters in (i for i in CG_ITERS if i <= D):
        n = dict(flops=counts.lla_flops(B, T, T, H, D, D, cg_iters=iters),
                 bytes=counts.attention_bytes(B, T, T, H, H, D, D, q.element_size()))
        case = ours(regattn.lla, q, setup,
                    lambda iters=iters: regattn.lla(q, k, v, lam=LAM, cg_iters=iters, backend=setup.backend),
                    [], mode="cg", tag=f"[cg={iters}]", compare=False, **n)
        if case.fn is not None:
            try:
                case.err = relative_diff(case.fn(), exact)
            except Exception:
                case.err = None
        yield "cg", case
