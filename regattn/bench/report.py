"""``docs/PERFORMANCE.md`` and its plots, generated from the result files alone: ``benchmarks/results/<device>/``
``<suite>.json`` (a suite's run; ``<suite>-<part>.json``: a run of some of its shapes) and ``verify/scan-*.json``
(the drift of ``regattn verify scan --json``)."""
from __future__ import annotations

import json
from pathlib import Path

from regattn.bench import results, suites
from regattn.bench.runner import worst_error

DOC = Path("docs") / "PERFORMANCE.md"
PLOTS = Path("docs") / "perf"


def groups(rows: list[dict]) -> dict:
    """``{(shape, mode, graph): [rows]}`` in the order measured."""
    out = {}
    for r in rows:
        out.setdefault((r["shape"], r["mode"], r.get("graph", False)), []).append(r)
    return out


def group_label(shape: str, mode: str, graph: bool) -> str:
    return f"{shape}\n{mode}{' graph' if graph else ''}"


def new_figure(width: float, ncols: int = 1):
    """``(pyplot, figure, axes)`` drawn off-screen."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt, *plt.subplots(1, ncols, figsize=(width, 4.5))


def save_figure(plt, fig, path: Path | str) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def title(result: dict, what: str = "") -> str:
    return f"regattn bench {result['suite']}{what} - {result['machine']['name']} - {result['config'].get('dtype', '')}"


def plot_result(result: dict, path: Path | str) -> Path:
    """One bar per op in each (shape, mode) group, milliseconds on a log axis; failed cases left out."""
    grouped = groups([r for r in result["rows"] if r["ms"] is not None])
    ops = list(dict.fromkeys(r["op"] for rows in grouped.values() for r in rows))
    width = 0.8 / max(len(ops), 1)
    plt, fig, ax = new_figure(max(6.0, 1.2 * len(grouped) + 2))
    for i, op in enumerate(ops):
        xs, ys = [], []
        for g, rows in enumerate(grouped.values()):
            for r in rows:
                if r["op"] == op:
                    xs.append(g + (i - (len(ops) - 1) / 2) * width)
                    ys.append(r["ms"])
        ax.bar(xs, ys, width, label=op)
    ax.set_xticks(range(len(grouped)))
    ax.set_xticklabels([group_label(*key) for key in grouped], fontsize=7, rotation=20, ha="right")
    ax.set_yscale("log")
    ax.set_ylabel("ms (lower is better)")
    ax.set_title(title(result), fontsize=9)
    if ops:
        ax.legend(fontsize=7, ncol=2)
    return save_figure(plt, fig, path)


def plot_scaling(result: dict, part: str, path: Path | str) -> Path:
    """Latency and peak memory against T (log-log) for the rows of ``part`` (lla Figure 7)."""
    rows = [r for r in result["rows"] if r["params"].get("part") == part and r["ms"] is not None]
    ops = list(dict.fromkeys(r["op"] for r in rows))
    plt, fig, axes = new_figure(10.0, ncols=2)
    for key, ax, label in (("ms", axes[0], "ms"), ("peak_mb", axes[1], "peak MiB")):
        for op in ops:
            points = [(r["params"]["T"], r[key]) for r in rows if r["op"] == op and r.get(key) is not None]
            if points:
                ax.plot(*zip(*points), marker="o", label=op)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("T")
        ax.set_ylabel(label)
        ax.legend(fontsize=7)
    fig.suptitle(title(result, f" ({part})"), fontsize=9)
    return save_figure(plt, fig, path)


def versions(machine: dict) -> str:
    """``NVIDIA H100 80GB HBM3 (132 SMs), torch 2.11, triton 3.6, CUDA 13.0, cuDNN 91900``; absent fields left out."""
    sms = f" ({machine['sm_count']} SMs)" if machine.get("sm_count") else ""
    fields = [f"{name} {machine[key]}" for key, name in (("torch", "torch"), ("triton", "triton"), ("cuda", "CUDA"),
                                                         ("cudnn", "cuDNN")) if machine.get(key)]
    return ", ".join([f"{machine.get('name')}{sms}", *fields])


def machine_line(result: dict) -> str:
    cfg = result["config"]
    seconds = f"; the run took {cfg['seconds']} s" if cfg.get("seconds") is not None else ""
    return (f"{versions(result['machine'])}; measured {result['date']}; dtype {cfg.get('dtype')}; "
            f"shapes: {cfg.get('grid', 'custom')}{seconds}")


def number(value, fmt: str) -> str:
    return "–" if value is None else format(value, fmt)


def row_cells(row: dict, first: bool, again: str | None = None) -> list[str]:
    """One table line; the shape and mode only on the first line of their group; ``again``: the later file that
    measured the row again."""
    timing = " (graph)" if row.get("graph") else " (back to back)" if row.get("back_to_back") else ""
    shape, mode = (row["shape"], row["mode"] + timing) if first else ("", "")
    ms = number(row["ms"], ".4g") if row["status"] == "ok" else row["status"]
    ratio = number(row.get("ratio"), ".2f") + ("x" if row.get("ratio") is not None else "")
    op = row["op"] + (f" (measured again: `{again}`)" if again else "")
    return [shape, mode, op, ms, ratio, number(row.get("tflops"), ".3g"), number(row.get("gbps"), ".0f"),
            number(row.get("peak_mb"), ".0f"), worst_error(row.get("err")) or "–"]


def row_key(device: str, row: dict) -> tuple:
    """What a row measured, to find it in another file: the device, mode, timing, op and shape parameters (a
    precision in the shape is also in the op's name; a false flag is the default)."""
    params = {k: v for k, v in row["params"].items() if k != "precision" and v is not False}
    return (device, row["mode"], bool(row.get("graph")), bool(row.get("back_to_back")), row["op"],
            tuple(sorted(params.items())))


def latest_runs(found: list[tuple[str, dict]]) -> dict:
    """``{row_key: name}``: the file of the latest run that measured each row of our ops."""
    latest = {}
    for name, result in sorted(found, key=lambda item: item[1]["date"]):
        for row in result["rows"]:
            if row["ours"]:
                latest[row_key(result["machine"]["device"], row)] = name
    return latest


def result_table(result: dict, name: str, latest: dict) -> str:
    """Every row as measured: time, ratio to the suite's main peer, rate, peak memory and the largest
    relative error against the float64 reference (with what it is of). A row of ours that a later run measured
    again (``latest``: :func:`latest_runs`; ``name``: this file's) names that run's file."""
    lines = ["| shape | mode | op | ms | ratio | TFLOP/s | GB/s | peak MiB | error vs float64 |", "|" + "---|" * 9]
    device = result["machine"]["device"]
    for rows in groups(result["rows"]).values():
        for i, r in enumerate(rows):
            later = latest.get(row_key(device, r)) if r["ours"] else None
            cells = row_cells(r, i == 0, later if later != name else None)
            lines.append("| " + " | ".join(cells).replace("\n", " ") + " |")
    return "\n".join(lines)


def suite_results(root: Path) -> list[tuple[str, dict]]:
    """``(name, result)`` of the files named after a suite (``<device>/softmax.json``) or a part of one
    (``<device>/scan-varlen.json``); other files there are skipped."""
    paths = [p for p in results.find_results(root) if p.stem.split("-")[0] in suites.NAMES]
    return [(p.stem, results.read_result(p)) for p in sorted(paths, key=lambda p: (p.parent, p.stem.split("-")[0],
                                                                                    p.stem))]


def drift_section(device: str, reports: list[dict]) -> list[str]:
    """The drift tables of the ``regattn verify scan`` runs on one device."""
    from regattn.ops.scan.verify import summary

    lines = [f"## scan drift on {device}", "", DRIFT_INTRO, ""]
    for r in reports:
        lines += [f"{versions(r['machine'])}; measured {r['date']}", "", "```", summary(r), "```", ""]
    return lines


def drift_reports(root: Path) -> dict:
    """``{device: [report]}`` of ``benchmarks/results/<device>/verify/scan-*.json``."""
    found = {}
    for path in sorted((root / results.RESULTS_DIR).glob("*/verify/scan-*.json")):
        found.setdefault(path.parent.parent.name, []).append(json.loads(path.read_text()))
    return found


INTRO = ("Each table lists what one `regattn bench SUITE` run measured, rows in the order run (the goal shapes "
         "first): the median time of `triton.testing.do_bench` (decode and the gate scan also inside a CUDA graph: "
         "`do_bench_cudagraph`; eager decode rows marked \"back to back\": the time per call of calls issued "
         "back to back, `regattn.bench.timing.back_to_back_ms`), the ratio to the suite's main peer measured in the "
         "same process on the same inputs (below 1.00x: faster), TFLOP/s and GB/s by the problem's counts "
         "(`regattn.bench.counts`), the peak memory of one call above its inputs, and the largest relative error "
         "of the output and every gradient against the float64 reference on a slice of the problem "
         "(`regattn.bench.check`; all errors are in the JSON). Our ops are `regattn:triton` (the Triton kernels) "
         "or `regattn:torch`. Peers that could not run show why. A row of ours that a later run measured again "
         "names that run's file, whose row is the current one.")


DRIFT_INTRO = ("`regattn verify scan --n 1024,...,65536 --dtype D --precision P --backend triton --json FILE`: the "
               "drift of the scan's output and probabilities against float64 softmax on 128 sampled query rows "
               "(elsa-supplementary C.2), and Theorem 1's bound `L(n, 128) u` on the relative output error.")


def write_report(root: Path | str = ".", *, include_cpu: bool = False) -> Path:
    """Write ``docs/PERFORMANCE.md`` and ``docs/perf/<device>-<suite>.png`` under ``root``."""
    root = Path(root)
    found = [(name, r) for name, r in suite_results(root)
             if include_cpu or not r["config"].get("cpu_smoke", r["machine"]["device"] == "cpu")]
    parts = ["# Performance", "",
             "Generated by `regattn bench report` from the result files in `benchmarks/results/`; do not edit by "
             "hand. `regattn bench all` on a GPU measures every suite at its goal shapes and rewrites them.", ""]
    parts.append(INTRO if found else "No GPU result files yet: run `regattn bench all` on a GPU, then "
                                     "`regattn bench report`.")
    parts.append("")
    drift = drift_reports(root)
    last_scan = {r["machine"]["device"]: i for i, (_, r) in enumerate(found) if r["suite"] == "scan"}
    latest = latest_runs(found)
    for i, (name, result) in enumerate(found):
        device, suite = result["machine"]["device"], result["suite"]
        parts += [f"## {name} on {device}", "", machine_line(result), "", result_table(result, name, latest), ""]
        plots = [plot_result(result, root / PLOTS / f"{device}-{name}.png")]
        part = getattr(suites.get(suite), "SCALING", None)
        if part and any(r["params"].get("part") == part for r in result["rows"]):
            plots.append(plot_scaling(result, part, root / PLOTS / f"{device}-{suite}-{part}.png"))
        parts += [f"![{p.stem}]({p.relative_to(root / DOC.parent).as_posix()})" for p in plots] + [""]
        if last_scan.get(device) == i and device in drift:
            parts += drift_section(device, drift.pop(device))  # after the device's last scan table
    for device, reports in drift.items():
        parts += drift_section(device, reports)
    path = root / DOC
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(parts))
    return path
