"""The GPU check files as tables: ``benchmarks/results/<device>/<name>_check.json``, written by
``benchmarks/gpu_check_<name>.py``, one layout per script.

Each adapter turns one layout into tables ``(title, header, rows)``. The cells hold the recorded
numbers, only formatted: ratios, bounds and targets appear where the file records them and are
never recomputed. ``regattn.bench.report`` writes the tables into ``docs/PERFORMANCE.md``.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Callable, NamedTuple

from regattn.bench import results

Table = tuple[str, list[str], list[list]]


# ---------------------------------------------------------------------------------------------- cells
def cell(value) -> str:
    """A recorded value as text: floats to 4 significant digits (3 in e-notation below 0.01)."""
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "**no**"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return f"{value:.2e}" if 0 < abs(value) < 1e-2 else f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        return ", ".join(cell(v) for v in value)
    return str(value)


def dims(shape: list) -> str:
    """``[1, 4096, 16]`` -> ``1×4096×16``."""
    return "×".join(cell(n) for n in shape)


def error(err, reference=None) -> str:
    """``err (reference)``: an error beside the bound or peer error it was judged against."""
    return cell(err) if reference is None else f"{cell(err)} ({cell(reference)})"


def timed(ms, ratio=None) -> str:
    """``ms (ratio x)``, or the recorded status where ``ms`` is not a number."""
    return cell(ms) if ratio is None else f"{cell(ms)} ({cell(ratio)}x)"


def label(shape: dict) -> str:
    """``{"B": 4, "T": 8192, "dtype": "bfloat16", "causal": True}`` -> ``B=4 T=8192, bfloat16, causal``."""
    sizes = " ".join(f"{k}={cell(v)}" for k, v in shape.items() if k not in ("dtype", "causal"))
    extra = [shape["dtype"]] if "dtype" in shape else []
    if "causal" in shape:
        extra.append("causal" if shape["causal"] else "non-causal")
    return ", ".join([sizes, *extra])


def settings(cfg) -> str:
    """Launch settings as recorded: ``BLOCK_M=64 num_warps=4``; a backward pair as ``kv: ... / q: ...``."""
    if isinstance(cfg, list):
        return " / ".join(f"{name}: {settings(c)}" for name, c in zip(("kv", "q"), cfg))
    return " ".join(f"{k}={cell(v)}" for k, v in cfg.items())


def pivot(rows: list[dict], row_of: Callable, column_of: Callable, value_of: Callable) -> tuple[list, list[list]]:
    """``(columns, [[row label, cell per column]])``: ``value_of(r)`` at ``(row_of(r), column_of(r))``."""
    columns = list(dict.fromkeys(column_of(r) for r in rows))
    grid: dict = {}
    for r in rows:
        grid.setdefault(row_of(r), {})[column_of(r)] = value_of(r)
    return columns, [[name, *(cells.get(c, "–") for c in columns)] for name, cells in grid.items()]


def nested_errors(case: dict, fields, err: str, reference: str) -> list[str]:
    """Cells of fields stored as ``{field: {err: e, reference: r}}``."""
    return [error(case[f].get(err), case[f].get(reference)) if f in case else "–" for f in fields]


def flat_errors(case: dict, fields, suffix: str) -> list[str]:
    """Cells of fields stored as ``{field: e, field + suffix: r}``."""
    return [error(case[f], case.get(f + suffix)) if f in case else "–" for f in fields]


def window(value) -> str:
    """A recorded window; None is full (causal) attention."""
    return "full" if value is None else cell(value)


# ---------------------------------------------------------------------------------------------- gatedfwa
def gatedfwa_tables(data: dict) -> list[Table]:
    cases = data.get("correctness", [])
    attention, gate = [c for c in cases if "dtype" in c], [c for c in cases if "dtype" not in c]
    fields, gate_fields = ("o", "dq", "dk", "dv", "du"), ("u", "dh", "dbeta")
    tables = [
        ("Correctness of the attention kernels: relative error against float64 (in brackets: the torch "
         "reference in the same dtype; pass also needs the fixed dtype bound)",
         ["case", "dtype", "B×T×HQ×H×D", "window", *fields, "pass"],
         [[c["case"], c["dtype"], dims(c["shape"]), window(c.get("window")),
           *nested_errors(c, fields, "kernel", "torch_same_dtype"), c.get("pass")] for c in attention]),
        ("Correctness of the gate preprocessing (fp32 inputs): relative error against float64 (in brackets: "
         "the torch reference in fp32)",
         ["case", "B×T×H", *gate_fields, "pass"],
         [[c["case"], dims(c["shape"]), *nested_errors(c, gate_fields, "kernel", "torch_fp32"), c.get("pass")]
          for c in gate]),
    ]
    runs = data.get("attention", [])
    if runs:
        first = runs[0]
        columns, rows = pivot(runs, lambda r: r["impl"], lambda r: r["T"],
                              lambda r: f"{cell(r['fwd_ms'])} / {cell(r['fwd_bwd_ms'])}")
        tables.append((f"Timings, ms, forward / forward+backward: {first['dtype']}, B={first['B']} H={first['H']} "
                       f"D={first['D']}, window {first['window']} (the full causal rows have none)",
                       ["implementation", *(f"T={T}" for T in columns)], rows))
    sweep = data.get("sweep", [])
    if sweep:
        tables.append(("Tile settings of the gated window kernels (bf16, same shape), ms",
                       ["pass", "T", "settings", "ms"],
                       [[s["kind"], s["T"], settings(s["cfg"]), s.get("ms", s.get("error"))] for s in sweep]))
    return [t for t in tables if t[2]]


# ---------------------------------------------------------------------------------------------- parallax
FLA_RATIO = re.compile(r"ratio_(fwd|fwdbwd)_vs_fla_issue_([\d.]+)ms")


def parallax_tables(data: dict) -> list[Table]:
    fields = ("o", "dq", "dr", "dk", "dv")
    tables = [("Correctness: relative error against float64 (in brackets: the bound, 2 x the torch reference "
               "in the same dtype + 1e-3, or 2e-5 in fp32)",
               ["case", "dtype", "shape (B×T×HQ×H×D; decode B×T_new×S×HQ×H×D)", "window", *fields, "pass"],
               [[c["case"], c.get("dtype"), dims(c.get("shape", [])), window(c.get("window")),
                 *nested_errors(c, fields, "err", "bound"), c.get("pass")] for c in data.get("correctness", [])])]
    p = data.get("prefill", {})
    if "shape" in p:
        fla = {m.group(1): (float(m.group(2)), ratio) for key, ratio in p.items() if (m := FLA_RATIO.fullmatch(key))}
        rows = [["regattn.parallax (best backward tiles)", p.get("parallax_fwd_ms"), p.get("parallax_fwdbwd_ms")],
                ["regattn.parallax (default backward tiles)", "–", p.get("parallax_fwdbwd_default_tiles_ms")],
                ["SDPA cuDNN", p.get("sdpa_cudnn_fwd_ms"), p.get("sdpa_cudnn_fwdbwd_ms")],
                ["SDPA flash", p.get("sdpa_flash_fwd_ms"), p.get("sdpa_flash_fwdbwd_ms")],
                ["ratio regattn / SDPA cuDNN", p.get("ratio_fwd_vs_cudnn"), p.get("ratio_fwdbwd_vs_cudnn")]]
        if fla:
            rows += [["flash-linear-attention, the issue's H100 numbers (not run here)",
                      *(fla.get(m, (None,))[0] for m in ("fwd", "fwdbwd"))],
                     ["ratio regattn / flash-linear-attention", *(fla.get(m, (0, None))[1] for m in ("fwd", "fwdbwd"))]]
        tables.append((f"Prefill, ms: {label(p['shape'])}; forward {cell(p.get('parallax_fwd_tflops'))} TFLOP/s",
                       ["", "fwd", "fwd+bwd"], rows))
        variants = [[name, ms] for name, ms in p.get("variants_ms", {}).items()]
        variants.append(["bwd, best tiles of each pass: " + ", ".join(f"{kind} {settings(cfg)}" for kind, cfg
                                                                       in p.get("best_bwd_config", {}).items()),
                         p.get("bwd_best_ms")])
        variants += [[f"kernel {name} (profiler, best tiles)", ms] for name, ms in p.get("bwd_kernels_ms", {}).items()]
        tables.append((f"Prefill tile settings, ms: {label(p['shape'])}", ["setting", "ms"], variants))
    decode = data.get("decode", [])
    if isinstance(decode, list) and decode:
        d = decode[0]
        tables.append((f"Decode of one token, ms, CUDA-graph replay: HQ={d['HQ']} H={d['H']} D={d['D']} (bf16 as "
                       f"the script sets it); copy bandwidth {cell(data.get('copy_GBps'))} GB/s",
                       ["B", "S", "regattn.parallax_decode", "SDPA flash", "SDPA cuDNN", "SDPA efficient",
                        "ratio to best SDPA", "K/V GB/s", "fraction of copy", "best setting (ms)"],
                       [[r["B"], r["S"], r.get("parallax_ms"), r.get("sdpa_flash_ms"), r.get("sdpa_cudnn_ms"),
                         r.get("sdpa_efficient_ms"), r.get("ratio_vs_sdpa"), r.get("parallax_kv_GBps"),
                         r.get("kv_bandwidth_fraction_of_copy"),
                         f"{r.get('best_variant')} ({cell(r.get('best_variant_ms'))})"] for r in decode]))
    return [t for t in tables if t[2]]


# ---------------------------------------------------------------------------------------------- lla
def lla_tables(data: dict) -> list[Table]:
    tables = [(f"CG precision (lla Table 2): the bf16 CG kernel against the fp32 exact solve, "
               f"lam={cell(data.get('lam'))}",
               ["CG iterations", "mean abs error", "relative error"],
               [[r["T"], r["abs_err"], r["rel_err"]] for r in data.get("cg_table", [])])]
    targets = data.get("targets", {})
    if targets:
        tables.append((f"Targets, ms: {label(targets.get('shape', {}))}", ["quantity", "value"],
                       [[key, value] for key, value in targets.items() if not key.endswith("shape")]))
    return [t for t in tables if t[2]]


# ---------------------------------------------------------------------------------------------- decay
def decay_tables(data: dict) -> list[Table]:
    fields = ("o", "db", "dc", "dv")
    shape = data.get("shape", {})
    tables = [("Correctness: relative error against float64 (in brackets: the bound, 2 x the torch reference in "
               "the same dtype + slack, or 1e-5 in fp32; large offsets: 2e-2)",
               ["method", "dtype", "B×T×H×R×D", "gammas", *fields, "pass"],
               [[c["method"] + (f" ({c['check']})" if "check" in c else ""), c["dtype"],
                 dims([c[n] for n in ("B", "T", "H", "R", "D")]), "none" if c["gammas"] is None else cell(c["gammas"]),
                 *flat_errors(c, fields, "_bound"), c.get("pass")] for c in data.get("correctness", [])])]
    timing = data.get("timing", [])
    if timing:
        columns, rows = pivot(timing, lambda r: (r["B"], r["T"], r["fla_ms"], r["hbm_floor_ms"]),
                              lambda r: r["method"], lambda r: timed(r["ms"], r.get("vs_fla")))
        tables.append((f"Forward, ms (in brackets: over flash-linear-attention's time in the issue, measured on an "
                       f"H100): bf16, {label(shape)}",
                       ["B", "T", "flash-linear-attention (issue)", "HBM floor", *columns],
                       [[*key, *cells] for key, *cells in rows]))
    auto = data.get("auto", [])
    if auto:
        tables.append(("method='auto' at the timed shapes, ms",
                       ["B", "T", "auto", "chosen", "best", "best ms", "auto / best", "auto / FLA",
                        "HBM floor fraction"],
                       [[r["B"], r["T"], r["auto_ms"], r["chosen"], r["best"], r["best_ms"], r.get("auto_over_best"),
                         r.get("vs_fla"), r.get("floor_fraction")] for r in auto]))
    grid = data.get("auto_grid", [])
    if grid:
        tables.append(("method='auto' against the best method of the tuned table, ms",
                       ["B", "T", "dtype", "auto", "best", "best ms (table)", "auto / best"],
                       [[r["B"], r["T"], r["dtype"], r["auto_ms"], r["best"], r["best_ms_in_table"],
                         r.get("auto_over_best")] for r in grid]))
    sweep = data.get("sweep", [])
    if sweep:
        columns, rows = pivot(sweep, lambda r: settings(r["cfg"]), lambda r: f"B={r['B']} T={r['T']}",
                              lambda r: cell(r["ms"]))
        tables.append(("lightning2 launch settings, ms", ["settings", *columns], rows))
    return [t for t in tables if t[2]]


# ---------------------------------------------------------------------------------------------- scan
def scan_tables(data: dict) -> list[Table]:
    sections = data.get("sections", {})
    fields = ("o", "dq", "dk", "dv")
    tables = [("Correctness: relative error against float64 (in brackets: torch in the same precision)",
               ["case", *fields, "pass"],
               [[name + (f" ({c['status']})" if "status" in c else ""),
                 *flat_errors(c, fields, "_torch_same_precision"), c.get("ok")]
                for name, c in sections.get("correctness", {}).items()])]
    timing = sections.get("timing", {})
    if "rows" in timing:
        tables.append((f"Forward, ms: {label(timing['shape'])}",
                       ["kernel", "ms", "TFLOP/s", "peak MB", "relative error vs float64"],
                       [[name, r.get("ms") if r.get("status") == "ok" else r.get("status"), r.get("tflops"),
                         r.get("peak_mb"), r.get("rel_err_f64")] for name, r in timing["rows"].items()]))
        tables.append(("Targets of the forward timing above",
                       ["precision", "ratio", "value", "target", "speed met", "other checks"],
                       [scan_target(name, t) for name, t in timing.get("targets", {}).items()]))
    backward = sections.get("timing_backward", {})
    if "rows" in backward:
        tables.append((f"Forward+backward, ms: {label(backward['shape'])}", ["kernel", "ms", "peak MB"],
                       [[name, r.get("ms") if r.get("status") == "ok" else r.get("status"), r.get("peak_mb")]
                        for name, r in backward["rows"].items()]))
    growth = sections.get("growth", {})
    if growth:
        runs = [dict(r, precision=p, bound=g["L(n)u"].get(str(r["n"])))
                for p, g in growth.items() for r in g["results"]]
        _, rows = pivot(runs, lambda r: r["n"], lambda r: r["precision"], lambda r: error(r["rel_dY"], r["bound"]))
        for key, name in (("growth", "growth, first to last n"), ("bound_ok", "bound met"),
                          ("growth_ok", "growth met")):
            rows.append([name, *(cell((g["check"] or {}).get(key)) for g in growth.values())])
        tables.append(("Error growth: relative output error against float64 over n (in brackets: the bound L(n)u)",
                       ["n", *growth], rows))
    return [t for t in tables if t[2]]


def scan_target(precision: str, target: dict) -> list:
    """One precision's recorded target: the ratio, whether the speed and error (or memory) targets were met."""
    ratio = next(k for k in target if k.startswith(("speedup", "time_ratio")))
    bound = "≥" if ratio.startswith("speedup") else "≤"
    if "err_ok" in target:
        other = f"relative error {cell(target['rel_err'])}, met: {cell(target['err_ok'])}"
    else:
        other = (f"peak {cell(target['peak_mb'])} MB vs SDPA flash {cell(target['flash_peak_mb'])} MB, "
                 f"met: {cell(target['memory_ok'])}")
    return [precision, ratio.replace("_", " "), target[ratio], f"{bound} {cell(target['target'])}",
            target["speed_ok"], other]


# ---------------------------------------------------------------------------------------------- files
class Check(NamedTuple):
    title: str
    tables: Callable[[dict], list[Table]]
    sections: tuple[str, ...]


CHECKS = {
    "gatedfwa_check": Check("GatedFWA and sliding-window attention", gatedfwa_tables,
                            ("correctness", "attention", "sweep", "scaling", "gate")),
    "parallax_check": Check("Parallax", parallax_tables, ("correctness", "prefill", "decode")),
    "lla_check": Check("LLA", lla_tables, ("correctness", "cg_table", "figure7", "targets", "tiles")),
    "decay_check": Check("Decaying linear attention", decay_tables,
                         ("correctness", "timing", "auto", "auto_grid", "sweep")),
    "scan_check": Check("ELSA exact scan", scan_tables, ("timing", "correctness", "growth", "timing_backward")),
}


def check_files(root: Path | str = ".") -> list[tuple[Path, dict]]:
    """``(path, parsed JSON)`` of every result file named after a check (``<device>/<name>_check.json``)."""
    return [(p, json.loads(p.read_text())) for p in results.find_results(root) if p.stem in CHECKS]


def machine(data: dict) -> dict:
    """The machine fields of a check file: its ``machine`` record, or the top-level device and versions."""
    return {"name": data.get("device"), "torch": data.get("torch"), "triton": data.get("triton"),
            **data.get("machine", {})}


def unrecorded(data: dict, names) -> list[str]:
    """The sections of ``names`` that the file holds empty or not at all."""
    found = {**data.get("sections", {}), **data}
    return [n for n in names if not found.get(n)]


def notes(data: dict) -> list[str]:
    """The run's own notes, and any top-level ``*error`` field, verbatim."""
    return [*data.get("notes", []), *(f"{k}: {v}" for k, v in data.items() if k.endswith("error"))]
