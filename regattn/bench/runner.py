"""Run a suite: measure each case of each shape, check it against float64, give it its ratio to the main peer.

A suite module has ``NAME``, ``PEERS`` (the peers it knows), ``QUICK_PEERS`` (those of a
``--quick`` run), ``MAIN`` (the op each mode is compared with: ``{mode: (op prefix, ...)}``, the
first one measured wins), ``GRIDS`` (``"tiny"`` for the CPU smoke mode, ``"goal"`` for the targets
every GPU run measures, ``"quick"`` a subset of it, ``"full"`` a wider sweep: lists of shape dicts)
and ``cases(shape, setup)``, which yields
``(mode, Case)`` pairs. Cases of one shape share their inputs; each case is measured before the
generator resumes, so a suite may replace its inputs between cases.
"""
from __future__ import annotations

import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch

from regattn.bench import peers
from regattn.bench.check import Check
from regattn.bench.peers import Unavailable
from regattn.ops._common.checks import resolve_backend
from regattn.bench.timing import Measurement, describe, measure
from regattn.bench.tuning import autotuned


@dataclass
class Setup:
    """What a run asks for: dtype, device, the backend of our ops and the peers to include."""
    dtype: torch.dtype = torch.bfloat16
    device: str = "cuda"
    backend: str = "auto"
    peers: tuple = ()
    rep_ms: int = 100

    @property
    def cuda(self) -> bool:
        return torch.device(self.device).type == "cuda"


@dataclass
class Case:
    """One op at one shape: ``call()`` gives the output in our layout (None when the op cannot run,
    ``status`` says why); a forward+backward mode differentiates ``leaves``, and ``grads`` maps
    their gradients to ``{"dq": ..., ...}`` in our layout (default: the check's names in order).
    ``check`` (the float64 truth of this shape and mode) is set for cases computing our function;
    ``flops`` and ``bytes`` come from :mod:`regattn.bench.counts`."""
    op: str
    call: Callable | None
    leaves: list = field(default_factory=list)
    grads: Callable | None = None
    flops: float | None = None
    bytes: float | None = None
    ours: bool = False
    status: str = "ok"
    graph: bool = False
    check: Check | None = None


def backward(mode: str) -> bool:
    """Modes ending in ``fwd+bwd`` time and check forward and backward; every other mode the forward."""
    return mode.endswith("fwd+bwd")


def timed(call, leaves, mode: str):
    """The callable to time: the forward alone (no autograd graph), or forward and backward for a
    fixed random output gradient (a case with nothing to differentiate, a copy floor, is its call)."""
    if not backward(mode) or not leaves:
        def fn():
            with torch.no_grad():
                return call()
        return fn
    state = {}

    def fn():
        out = call()
        if "grad" not in state:
            state["grad"] = torch.randn_like(out)
        return torch.autograd.grad(out, leaves, state["grad"])
    return fn


def ours_label(op, x: torch.Tensor, backend: str) -> str:
    """``"regattn:triton"`` or ``"regattn:torch"``: which path ``backend`` resolves to for this op."""
    module = sys.modules[op.__module__]
    return "regattn:" + resolve_backend(backend, x, op=op.__name__, has_triton=getattr(module, "HAS_TRITON", False))


def build(op: str, builder, *, flops=None, bytes=None, ours=False, graph=False, check=None) -> Case:
    """A Case from ``builder() -> (call, leaves[, grads])``; a builder that cannot run gives the reason as status."""
    try:
        call, leaves, *grads = builder()
    except Exception as err:
        status = str(err) if isinstance(err, Unavailable) else describe(err)
        return Case(op, None, flops=flops, bytes=bytes, ours=ours, status=status, graph=graph)
    return Case(op, call, list(leaves), grads[0] if grads else None, flops=flops, bytes=bytes, ours=ours,
                graph=graph, check=check)


def rate(count: float | None, ms: float | None, unit: float) -> float | None:
    """``count`` per second in ``unit`` (1e12 for TFLOP/s, 1e9 for GB/s)."""
    return None if count is None or ms is None else count / (ms * 1e-3) / unit


def back_to_back(mode: str, case: Case) -> bool:
    """Whether a case is timed by calls issued back to back (:func:`regattn.bench.timing.back_to_back_ms`): decode
    calls made eagerly."""
    return mode == "decode" and not case.graph


def row_of(shape: dict, mode: str, case: Case, m: Measurement, err: dict | None) -> dict:
    """One result row, as printed and as written to JSON."""
    return {"shape": shape_label(shape), "params": shape, "mode": mode, "op": case.op, "ours": case.ours,
            "status": m.status, "ms": m.ms, "tflops": rate(case.flops, m.ms, 1e12), "gbps": rate(case.bytes, m.ms, 1e9),
            "peak_mb": m.peak_mb, "graph": case.graph, "back_to_back": back_to_back(mode, case), "ratio": None,
            "err": err}


def main_peer(group: list[dict], prefixes) -> dict | None:
    """The fastest measured peer of this group named by the first of ``prefixes`` that names any
    (``"sdpa:cudnn"``: that backend; ``"sdpa:"``: the fastest SDPA backend)."""
    for prefix in prefixes:
        named = [r for r in group if not r["ours"] and r["ms"] is not None and r["op"].startswith(prefix)]
        if named:
            return min(named, key=lambda r: r["ms"])
    return None


def add_ratios(rows: list[dict], main: dict | None = None) -> None:
    """``ratio = ms / main peer ms`` within each ``(shape, mode, graph)``; below 1 means faster.

    The main peer is the suite's ``MAIN[mode]`` where measured, else the fastest peer. Our rows
    also get ``vs``: their time over every peer's that was measured."""
    groups = {}
    for r in rows:
        groups.setdefault((r["shape"], r["mode"], r.get("graph", False)), []).append(r)
    for (_, mode, _), group in groups.items():
        measured = [r for r in group if not r["ours"] and r["ms"] is not None]
        ref = main_peer(group, (main or {}).get(mode, ())) or min(measured, key=lambda r: r["ms"], default=None)
        for r in group:
            r["ratio"] = None if ref is None or r["ms"] is None else r["ms"] / ref["ms"]
            if r["ours"] and r["ms"] is not None:
                r["vs"] = {p["op"]: r["ms"] / p["ms"] for p in measured}


def shape_label(shape: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in shape.items() if v is not None)


def relative_diff(out, ref) -> float | None:
    """``||out - ref|| / ||ref||`` in fp32 (inf when out is not finite); None when not comparable."""
    if not isinstance(out, torch.Tensor) or not isinstance(ref, torch.Tensor) or out.shape != ref.shape:
        return None
    out, ref = out.detach().float(), ref.detach().float()
    if not bool(torch.isfinite(out).all()):
        return float("inf")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def case_errors(case: Case, mode: str) -> dict | None:
    """The case's output (and, in a forward+backward mode, gradients) against its float64 check."""
    if case.check is None or case.call is None:
        return None
    try:
        if not backward(mode):
            with torch.no_grad():
                return case.check.errors(case.call())
        out = case.call()
        grads = torch.autograd.grad(out, case.leaves, case.check.grad_out(out))
        named = case.grads(grads) if case.grads else dict(zip(("d" + n for n in case.check.grads), grads))
        return case.check.errors(out, named)
    except Exception as err:  # an error in the check is reported, never the end of a suite
        return {"status": describe(err)}


def run_suite(suite, shapes: list[dict], setup: Setup, *, on_shape=None) -> list[dict]:
    """Measure and check every case of every shape; ``on_shape(rows_so_far)`` after each shape. Each row
    records ``wall_s``: the seconds it took, compilation and a peer's autotuning included."""
    rows = []
    for shape in shapes:
        group = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                start = time.perf_counter()
                for mode, case in suite.cases(shape, setup):
                    with autotuned() as tiles:
                        if case.call is None:
                            m = Measurement(case.status)
                        else:
                            m = measure(timed(case.call, case.leaves, mode), cuda=setup.cuda, graph=case.graph,
                                        back_to_back=back_to_back(mode, case), rep_ms=setup.rep_ms)
                    err = case_errors(case, mode) if m.status == "ok" else None
                    group.append(row_of(shape, mode, case, m, err))
                    if case.ours and tiles:
                        group[-1]["tiles"] = tiles
                    now = time.perf_counter()
                    group[-1]["wall_s"] = round(now - start, 2)  # making, timing and checking the case
                    start = now
            except Exception as err:  # inputs that cannot even be made (OOM at allocation)
                group.append(row_of(shape, "-", Case("inputs", None), Measurement(describe(err)), None))
        add_ratios(group, getattr(suite, "MAIN", None))
        rows += group
        if on_shape is not None:
            on_shape(rows)
    return rows


COLUMNS = (("shape", "shape"), ("mode", "mode"), ("graph", "graph"), ("op", "op"), ("ms", "ms"),
           ("tflops", "TFLOP/s"), ("gbps", "GB/s"), ("peak_mb", "peak MB"), ("ratio", "ratio"), ("err", "error"))


def worst_error(err: dict | None) -> str:
    """The largest relative error of a row and what it is of (``"dk 3.10e-03"``), or the check's status."""
    if not err:
        return ""
    if "status" in err:
        return f"check {err['status']}"
    name = max(err, key=lambda n: err[n])
    return f"{name} {err[name]:.2e}"


def cell(row: dict, key: str) -> str:
    """One table cell: the status in place of ms when the case did not run."""
    if key == "ms" and row["status"] != "ok":
        return row["status"] if len(row["status"]) <= 48 else row["status"][:45] + "..."
    value = row.get(key)
    if key == "err":
        return worst_error(value)
    if key == "graph":
        return "graph" if value else "back to back" if row.get("back_to_back") else ""
    if value is None:
        return "-"
    if key == "ratio":
        return f"{value:.2f}x"
    if key in ("peak_mb", "gbps"):
        return f"{value:.0f}"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def format_table(rows: list[dict]) -> str:
    """The printed table: shape, mode, op, ms (or the status), TFLOP/s, GB/s, peak MB, ratio to the main
    peer, and the largest error against float64 where checked."""
    cols = [(k, h) for k, h in COLUMNS if k not in ("graph", "err") or any(r.get(k) for r in rows)]
    cells = [[h for _, h in cols]] + [[cell(r, k) for k, _ in cols] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(cols))]
    lines = ["  ".join(c[i].ljust(widths[i]) for i in range(len(cols))).rstrip() for c in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def randn(setup: Setup, *shape, dtype=None, grad: bool = False, scale: float = 1.0) -> torch.Tensor:
    """Fresh standard-normal input on the run's device, in the run's dtype unless given."""
    x = torch.randn(*shape, device=setup.device, dtype=dtype or setup.dtype) * scale
    return x.requires_grad_(grad)


def ours(op, x: torch.Tensor, setup: Setup, call, leaves, *, tag: str = "", **kw) -> Case:
    """Our public op through ``setup.backend``, named by the path it takes (``regattn:triton``)."""
    try:
        label = ours_label(op, x, setup.backend) + tag
    except Exception as err:  # backend="triton" where the op has no kernel yet
        return Case(f"regattn:{setup.backend}{tag}", None, ours=True, status=describe(err))
    return build(label, lambda: (call, leaves), ours=True, **kw)


def for_mode(mode: str, *xs):
    """Inputs as a peer should see them: detached for a forward alone (no autograd state kept)."""
    return xs if backward(mode) else tuple(None if x is None else x.detach() for x in xs)


def sdpa_cases(setup: Setup, mode: str, q, k, v, *, causal=True, window=None, backends=None, tag="", check=None,
               **counts):
    """``(mode, Case)`` for each SDPA backend asked for (all four unless ``backends`` narrows them).

    A ``tag`` marks SDPA standing in for another op (a floor, not the same function): no check then."""
    q, k, v = for_mode(mode, q, k, v)
    for name in backends or peers.SDPA_BACKENDS:
        if peers.wanted(setup.peers, f"sdpa-{name}"):
            yield mode, build(f"sdpa:{name}{tag}", lambda: peers.sdpa(q, k, v, backend=name, causal=causal,
                                                                      window=window),
                              check=None if tag else check, **counts)


def flex_case(setup: Setup, mode: str, q, k, v, *, causal=True, window=None, gate=None, **kw):
    """FlexAttention (compiled on CUDA, eager in the CPU smoke mode) when asked for."""
    q, k, v, gate = for_mode(mode, q, k, v, gate)
    if peers.wanted(setup.peers, "flex"):
        yield mode, build("flex", lambda: peers.flex(q, k, v, causal=causal, window=window, gate=gate,
                                                     compiled=setup.cuda), **kw)


def reference_case(setup: Setup, mode: str, call, leaves, **kw):
    """Our plain-torch reference (the executable spec) when asked for."""
    if peers.wanted(setup.peers, "reference"):
        yield mode, build("reference", lambda: (call, leaves), **kw)
