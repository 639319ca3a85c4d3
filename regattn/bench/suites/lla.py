"""Local Linear Attention: FlashLLA and BD-LLA against SDPA (the attention floor); latency and peak
memory over sequence length beside the naive reference (lla Figure 7: d=128, batch 32); and the
CG precision table (lla Table 2): CG in the run's dtype against the float64 exact solve. The latency shapes
also time forward and backward, the cost of training with the kernels, beside SDPA's."""
from __future__ import annotations

import regattn
from regattn import reference
from regattn.bench import counts
from regattn.bench.check import Check, Slice
from regattn.bench.runner import ours, randn, reference_case, sdpa_cases

NAME = "lla"
PEERS = ("sdpa-flash", "sdpa-cudnn", "reference")
QUICK_PEERS = ("sdpa-cudnn",)
MAIN = {"fwd": ("sdpa:cudnn",), "fwd+bwd": ("sdpa:cudnn",)}
SCALING = "fig7"  # the report plots latency and memory against T for these rows
LAM = 1.0
CG_ITERS = (1, 2, 4, 8, 16, 32, 64)
LATENCY = [dict(B=4, H=16, T=8192, D=128)]
FIGURE7 = [dict(part="fig7", B=32, H=1, T=T, D=128, cg=8) for T in (1024, 2048, 4096, 8192, 16384, 32768)]
TABLE2 = [dict(part="cg", B=1, H=4, T=T, D=128) for T in (512, 8192)]
GRIDS = {
    "tiny": [dict(B=1, H=2, T=24, D=8), dict(part="fig7", B=1, H=2, T=24, D=8, cg=4),
             dict(part="cg", B=1, H=2, T=24, D=8)],
    "goal": LATENCY + FIGURE7 + TABLE2,
    "quick": [dict(LATENCY[0], cg=8)] + FIGURE7[:3] + TABLE2[1:],
    "full": [dict(B=4, H=16, T=T, D=128) for T in (1024, 2048, 4096, 8192, 16384)] + FIGURE7 + TABLE2,
}
CHECK_ROWS = 256


def cases(shape: dict, setup):
    """Latency shapes: B, H, T, D, window, cg (optional). Figure 7: part="fig7", B, H, T, D, cg.
    CG table: part="cg", B, H, T, D."""
    part = shape.get("part")
    yield from {"fig7": scaling_cases, "cg": precision_cases}.get(part, latency_cases)(shape, setup)


def qkv(shape, setup):
    B, H, T, D = shape["B"], shape["H"], shape["T"], shape["D"]
    return randn(setup, B, T, H, D), randn(setup, B, T, H, D), randn(setup, B, T, H, D)


def truth(q, k, v, w=None, grads=False, **solve) -> Check:
    """The float64 reference of one solve (``cg_iters`` / ``blocks``) on the last rows of head 0, or with
    ``grads`` on the first rows (their own problem), differentiated for q, k and v."""
    where = Slice(kv_heads=k.shape[2], rows=min(q.shape[1], CHECK_ROWS), last=not grads)
    return Check(lambda q, k, v: reference.lla(q, k, v, lam=LAM, window=w, **solve), dict(q=q, k=k, v=v), where,
                 grads=("q", "k", "v") if grads else ())


def solve_tag(D: int, blocks=None, cg_iters=None, cg_precondition=False) -> str:
    """``[BD g=D/2]``, ``[cg=8]``, ``[cg=8][pre]``, ``[BD g=D/8][cg=8]``: which solve a row ran (``[pre]``: full
    LLA's CG with its preconditioner)."""
    tag = "" if not blocks else "[BD g=D]" if blocks == D else f"[BD g=D/{D // blocks}]"
    return tag + (f"[cg={cg_iters}]" if cg_iters else "") + ("[pre]" if cg_precondition else "")


def lla_case(q, k, v, setup, w=None, n=None, check=None, leaves=(), **solve):
    """Our op with one solve (``cg_iters``, ``blocks`` or both), checked against the same solve in
    float64 unless another ``check`` is given; ``leaves`` are differentiated in a forward+backward mode."""
    return ours(regattn.lla, q, setup, lambda: regattn.lla(q, k, v, lam=LAM, window=w, backend=setup.backend, **solve),
                list(leaves), tag=solve_tag(q.shape[-1], **solve),
                check=check or truth(q, k, v, w, grads=bool(leaves), **solve), **n)


def latency_solves(D: int, cg: int | None) -> list[dict]:
    """FlashLLA with 8 and 16 CG iterations (8 also preconditioned), BD-LLA by direct solves
    (g = D/2, D) and with CG (g = D/8); with ``cg`` given, FlashLLA with ``cg`` iterations and BD-LLA's direct
    solve of g = D alone."""
    if cg:
        return [dict(cg_iters=cg), dict(blocks=D)]
    return [dict(cg_iters=8), dict(cg_iters=8, cg_precondition=True), dict(cg_iters=16), dict(blocks=D // 2),
            dict(blocks=D), dict(blocks=max(D // 8, 1), cg_iters=8)]


def training_solves(D: int, cg: int | None) -> list[dict]:
    """The kernels' solves timed forward and backward: FlashLLA with ``cg`` (default 8) CG iterations and
    BD-LLA's direct solves (g = D, and D/2 without ``cg``)."""
    return [dict(cg_iters=cg or 8), dict(blocks=D)] + ([] if cg else [dict(blocks=D // 2)])


def latency_cases(shape, setup):
    """The solves of :func:`latency_solves` (``cg``: optional) against SDPA, and those of :func:`training_solves`
    forward and backward (no FLOP count: the backward's passes depend on the solve)."""
    B, H, T, D, w = shape["B"], shape["H"], shape["T"], shape["D"], shape.get("window")
    q, k, v = (x.requires_grad_() for x in qkv(shape, setup))
    for mode in ("fwd", "fwd+bwd"):
        bwd = mode == "fwd+bwd"
        n_bytes = counts.attention_bytes(B, T, T, H, H, D, D, q.element_size(), backward=bwd)
        for solve in training_solves(D, shape.get("cg")) if bwd else latency_solves(D, shape.get("cg")):
            solved = dict(cg_iters=solve.get("cg_iters"), blocks=solve.get("blocks"))
            flops = None if bwd else counts.lla_flops(B, T, T, H, D, D, window=w, **solved)
            leaves = (q, k, v) if bwd else ()
            yield mode, lla_case(q, k, v, setup, w, dict(flops=flops, bytes=n_bytes), leaves=leaves, **solve)
        yield from sdpa_cases(setup, mode, q, k, v, window=w, backends=("cudnn", "flash"), tag=" (attention)",
                              flops=counts.attention_flops(B, T, T, H, D, D, window=w, backward=bwd), bytes=n_bytes)


def scaling_cases(shape, setup):
    """lla Figure 7: FlashLLA and the naive reference (both with ``cg`` iterations) and SDPA."""
    B, H, T, D, cg = shape["B"], shape["H"], shape["T"], shape["D"], shape["cg"]
    q, k, v = qkv(shape, setup)
    n = dict(flops=counts.lla_flops(B, T, T, H, D, D, cg_iters=cg),
             bytes=counts.attention_bytes(B, T, T, H, H, D, D, q.element_size()))
    case = lla_case(q, k, v, setup, n=n, cg_iters=cg)
    yield "fwd", case
    yield from sdpa_cases(setup, "fwd", q, k, v, backends=("cudnn",), tag=" (attention)", **n)
    yield from reference_case(setup, "fwd", lambda: reference.lla(q, k, v, lam=LAM, cg_iters=cg), [],
                              check=case.check, **n)


def precision_cases(shape, setup):
    """Each CG iteration count against the float64 exact solve (lla Table 2's relative error), with and
    without the preconditioner."""
    B, H, T, D = shape["B"], shape["H"], shape["T"], shape["D"]
    q, k, v = qkv(shape, setup)
    exact = truth(q, k, v)
    for precondition in (False, True):
        for iters in (i for i in CG_ITERS if i <= D):
            n = dict(flops=counts.lla_flops(B, T, T, H, D, D, cg_iters=iters),
                     bytes=counts.attention_bytes(B, T, T, H, H, D, D, q.element_size()))
            yield "cg", lla_case(q, k, v, setup, n=n, check=exact, cg_iters=iters, cg_precondition=precondition)
