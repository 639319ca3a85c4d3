"""Run a suite: measure each case of each shape, give every row its ratio to the best peer, print a table.

A suite module has ``NAME``, ``PEERS`` (the peers it knows), ``GRIDS`` (``"tiny"`` for the CPU
smoke mode, ``"default"`` and ``"full"``: lists of shape dicts) and ``cases(shape, setup)``,
which yields ``(mode, Case)`` pairs. Cases of one shape share their inputs; each case is
measured before the generator resumes, so a suite may replace its inputs between cases.
Rows of one ``(shape, mode)`` are compared with each other.
"""
from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch

from regattn.bench import peers
from regattn.bench.peers import Unavailable
from regattn.ops._common.checks import resolve_backend
from regattn.bench.timing import Measurement, describe, measure


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
    """One op at one shape: ``fn`` is the zero-argument call to time (None when it cannot run,
    ``status`` says why); ``flops`` and ``bytes`` come from :mod:`regattn.bench.counts`;
    ``err`` carries an accuracy figure for rows that report one."""
    op: str
    fn: Callable | None
    flops: float | None = None
    bytes: float | None = None
    ours: bool = False
    status: str = "ok"
    graph: bool = False
    compare: bool = True
    err: float | None = None
    extra: dict = field(default_factory=dict)


def forward(call):
    """Time the forward alone: no autograd graph is recorded."""
    def fn():
        with torch.no_grad():
            return call()
    return fn


def forward_backward(call, leaves):
    """Time forward and backward: gradients of ``leaves`` for a fixed random output gradient."""
    state = {}

    def fn():
        out = call()
        if "grad" not in state:
            state["grad"] = torch.randn_like(out)
        return torch.autograd.grad(out, leaves, state["grad"])
    return fn


def timed(call, leaves, mode: str):
    return forward_backward(call, leaves) if mode == "fwd+bwd" else forward(call)


def ours_label(op, x: torch.Tensor, backend: str) -> str:
    """``"regattn:triton"`` or ``"regattn:torch"``: which path ``backend`` resolves to for this op."""
    module = sys.modules[op.__module__]
    return "regattn:" + resolve_backend(backend, x, op=op.__name__, has_triton=getattr(module, "HAS_TRITON", False))


def build(op: str, builder, *, mode: str, flops=None, bytes=None, ours=False, graph=False, compare=True,
          **extra) -> Case:
    """A Case from ``builder() -> (call, leaves)``; a builder that cannot run gives the reason as status."""
    try:
        call, leaves = builder()
    except Unavailable as err:
        return Case(op, None, flops, bytes, ours, status=str(err))
    except Exception as err:
        return Case(op, None, flops, bytes, ours, status=describe(err))
    return Case(op, timed(call, leaves, mode), flops, bytes, ours, graph=graph, compare=compare, extra=extra)


def rate(count: float | None, ms: float | None, unit: float) -> float | None:
    """``count`` per second in ``unit`` (1e12 for TFLOP/s, 1e9 for GB/s)."""
    return None if count is None or ms is None else count / (ms * 1e-3) / unit


def row_of(suite: str, label: str, shape: dict, mode: str, case: Case, m: Measurement) -> dict:
    """One result row, as printed and as written to JSON."""
    row = {"suite": suite, "shape": label, "params": shape, "mode": mode, "op": case.op, "ours": case.ours,
           "status": m.status, "ms": m.ms, "tflops": rate(case.flops, m.ms, 1e12), "gbps": rate(case.bytes, m.ms, 1e9),
           "peak_mb": m.peak_mb, "graph": m.graph, "ratio": None}
    if case.err is not None:
        row["err"] = case.err
    row.update(case.extra)
    return row


def add_ratios(rows: list[dict]) -> None:
    """``ratio = ms / best peer ms`` within each ``(shape, mode)``; below 1 means faster than every peer."""
    best = {}
    for r in rows:
        if not r["ours"] and r["ms"] is not None:
            key = (r["shape"], r["mode"])
            best[key] = min(best.get(key, float("inf")), r["ms"])
    for r in rows:
        b = best.get((r["shape"], r["mode"]))
        r["ratio"] = None if b is None or r["ms"] is None else r["ms"] / b


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


def compare(case: Case, mode: str, first: dict) -> float | None:
    """Forward-only rows: the output's relative difference to the first of our ops in this (shape, mode)."""
    if mode == "fwd+bwd" or case.fn is None or not case.compare:
        return None
    try:
        out = case.fn()
    except Exception:
        return None
    if mode not in first:
        first[mode] = out
        return 0.0 if case.ours else None
    return relative_diff(out, first[mode])


def run_suite(suite, shapes: list[dict], setup: Setup, *, on_shape=None) -> list[dict]:
    """Measure every case of every shape; ``on_shape(rows_so_far)`` after each shape (to print, to save).

    Forward rows also carry ``diff``: the output's relative difference to our op's output at the
    same shape, so a peer set up differently (another mask, another scale) shows at once.
    """
    rows = []
    for shape in shapes:
        label, group, first = shape_label(shape), [], {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                for mode, case in suite.cases(shape, setup):
                    m = (measure(case.fn, cuda=setup.cuda, graph=case.graph, rep_ms=setup.rep_ms)
                         if case.fn is not None else Measurement(case.status))
                    row = row_of(suite.NAME, label, shape, mode, case, m)
                    if m.status == "ok" and (case.ours or first.get(mode) is not None):
                        row["diff"] = compare(case, mode, first)
                    group.append(row)
            except Exception as err:  # inputs that cannot even be made (OOM at allocation)
                group.append(row_of(suite.NAME, label, shape, "-", Case("inputs", None), Measurement(describe(err))))
        add_ratios(group)
        rows += group
        if on_shape is not None:
            on_shape(rows)
    return rows


COLUMNS = (("shape", "shape"), ("mode", "mode"), ("op", "op"), ("ms", "ms"), ("tflops", "TFLOP/s"),
           ("gbps", "GB/s"), ("peak_mb", "peak MB"), ("ratio", "ratio"), ("diff", "diff"), ("err", "err"))


def cell(row: dict, key: str) -> str:
    """One table cell: the status in place of ms when the case did not run."""
    if key == "ms" and row["status"] != "ok":
        return row["status"] if len(row["status"]) <= 48 else row["status"][:45] + "..."
    value = row.get(key)
    if value is None:
        return "" if key in ("diff", "err") else "-"
    if key in ("diff", "err"):
        return f"{value:.2e}"
    if key == "ratio":
        return f"{value:.2f}x"
    if key in ("peak_mb", "gbps"):
        return f"{value:.0f}"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def format_table(rows: list[dict]) -> str:
    """The printed table: shape, mode, op, ms (or the status), TFLOP/s, GB/s, peak MB, ratio to the best
    peer, and where measured the difference to our output and an error figure."""
    cols = [(k, h) for k, h in COLUMNS if k not in ("diff", "err") or any(r.get(k) is not None for r in rows)]
    cells = [[h for _, h in cols]] + [[cell(r, k) for k, _ in cols] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(cols))]
    lines = ["  ".join(c[i].ljust(widths[i]) for i in range(len(cols))).rstrip() for c in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def randn(setup: Setup, *shape, dtype=None, grad: bool = False, scale: float = 1.0) -> torch.Tensor:
    """Fresh standard-normal input on the run's device, in the run's dtype unless given."""
    x = torch.randn(*shape, device=setup.device, dtype=dtype or setup.dtype) * scale
    return x.requires_grad_(grad)


def ours(op, x: torch.Tensor, setup: Setup, call, leaves, *, mode: str, tag: str = "", **counts) -> Case:
    """Our public op through ``setup.backend``, named by the path it takes (``regattn:triton``)."""
    try:
        label = ours_label(op, x, setup.backend) + tag
    except Exception as err:  # backend="triton" where the op has no kernel yet
        return Case(f"regattn:{setup.backend}{tag}", None, ours=True, status=describe(err), **counts)
    return build(label, lambda: (call, leaves), mode=mode, ours=True, **counts)


def for_mode(mode: str, *xs):
    """Inputs as a peer should see them: detached for a forward alone (no autograd state kept)."""
    return xs if mode == "fwd+bwd" else tuple(None if x is None else x.detach() for x in xs)


def sdpa_cases(setup: Setup, mode: str, q, k, v, *, causal=True, window=None, backends=None, tag="", **counts):
    """``(mode, Case)`` for each SDPA backend asked for (all four unless ``backends`` narrows them).

    A ``tag`` marks SDPA standing in for another op (a floor, not the same numbers): no diff then."""
    q, k, v = for_mode(mode, q, k, v)
    for name in backends or peers.SDPA_BACKENDS:
        if peers.wanted(setup.peers, f"sdpa-{name}"):
            yield mode, build(f"sdpa:{name}{tag}", lambda: peers.sdpa(q, k, v, backend=name, causal=causal,
                                                                      window=window),
                              mode=mode, compare=not tag, **counts)


def flex_case(setup: Setup, mode: str, q, k, v, *, causal=True, window=None, gate=None, **counts):
    """FlexAttention (compiled on CUDA, eager in the CPU smoke mode) when asked for."""
    q, k, v, gate = for_mode(mode, q, k, v, gate)
    if peers.wanted(setup.peers, "flex"):
        yield mode, build("flex", lambda: peers.flex(q, k, v, causal=causal, window=window, gate=gate,
                                                     compiled=setup.cuda), mode=mode, **counts)


def reference_case(setup: Setup, mode: str, call, leaves, **counts):
    """Our plain-torch reference (the executable spec) when asked for."""
    if peers.wanted(setup.peers, "reference"):
        yield mode, build("reference", lambda: (call, leaves), mode=mode, **counts)
