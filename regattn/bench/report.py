"""``docs/PERFORMANCE.md`` and plots, generated from ``benchmarks/results/<device>/<suite>.json`` and the
GPU check files ``benchmarks/results/<device>/<name>_check.json`` (see :mod:`regattn.bench.checks`)."""
from __future__ import annotations

from pathlib import Path

from regattn.bench import checks, results, suites

DOC = Path("docs") / "PERFORMANCE.md"
PLOTS = Path("docs") / "perf"


def groups(rows: list[dict]) -> dict:
    """``{(shape, mode): [rows]}`` in the order measured."""
    out = {}
    for r in rows:
        out.setdefault((r["shape"], r["mode"]), []).append(r)
    return out


def plot_result(result: dict, path: Path | str) -> Path:
    """One bar per op in each (shape, mode) group, milliseconds on a log axis; failed cases left out."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    grouped = groups([r for r in result["rows"] if r["ms"] is not None])
    ops = list(dict.fromkeys(r["op"] for rows in grouped.values() for r in rows))
    width = 0.8 / max(len(ops), 1)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(grouped) + 2), 4.5))
    for i, op in enumerate(ops):
        xs, ys = [], []
        for g, rows in enumerate(grouped.values()):
            for r in rows:
                if r["op"] == op:
                    xs.append(g + (i - (len(ops) - 1) / 2) * width)
                    ys.append(r["ms"])
        ax.bar(xs, ys, width, label=op)
    ax.set_xticks(range(len(grouped)))
    ax.set_xticklabels([f"{s}\n{m}" for s, m in grouped], fontsize=7, rotation=20, ha="right")
    ax.set_yscale("log")
    ax.set_ylabel("ms (lower is better)")
    m = result["machine"]
    ax.set_title(f"regattn bench {result['suite']} - {m['name']} - {result['config'].get('dtype', '')}", fontsize=9)
    if ops:
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def versions(machine: dict) -> str:
    """``NVIDIA H100 80GB HBM3 (132 SMs), torch 2.11, triton 3.6, CUDA 13.0, cuDNN 91900``; absent fields left out."""
    sms = f" ({machine['sm_count']} SMs)" if machine.get("sm_count") else ""
    fields = [f"{name} {machine[key]}" for key, name in (("torch", "torch"), ("triton", "triton"), ("cuda", "CUDA"),
                                                         ("cudnn", "cuDNN")) if machine.get(key)]
    return ", ".join([f"{machine.get('name')}{sms}", *fields])


def machine_line(result: dict) -> str:
    return f"{versions(result['machine'])}; measured {result['date']}; dtype {result['config'].get('dtype')}"


def ratio_cell(row: dict) -> str:
    if row["ms"] is None:
        return row["status"]
    ratio = "" if row["ratio"] is None else f" ({row['ratio']:.2f}x)"
    return f"{row['ms']:.4g} ms{ratio}"


def table_lines(header: list[str], rows: list[list]) -> str:
    """A markdown table; each cell through :func:`regattn.bench.checks.cell`."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(checks.cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def result_table(result: dict) -> str:
    """Rows (shape, mode), one column per op: ``ms (ratio to the best peer)`` or the status."""
    grouped = groups(result["rows"])
    ops = list(dict.fromkeys(r["op"] for rows in grouped.values() for r in rows))
    rows = []
    for (shape, mode), measured in grouped.items():
        by_op = {r["op"]: r for r in measured}
        rows.append([shape, mode, *(ratio_cell(by_op[op]) if op in by_op else "" for op in ops)])
    return table_lines(["shape", "mode", *ops], rows)


def check_section(path: Path, data: dict) -> list[str]:
    """One check file: its machine, its tables, the sections it did not record and its notes."""
    name = path.stem.removesuffix("_check")
    check = checks.CHECKS[path.stem]
    parts = [f"## {check.title} on {path.parent.name}", "",
             f"`benchmarks/gpu_check_{name}.py`, `{(results.RESULTS_DIR / path.parent.name / path.name).as_posix()}`: "
             f"{versions(checks.machine(data))}.", ""]
    for title, header, rows in check.tables(data):
        parts += [f"**{title}**", "", table_lines(header, rows), ""]
    missing = checks.unrecorded(data, check.sections)
    if missing:
        parts += ["Not recorded in this run: " + ", ".join(missing) + ".", ""]
    recorded = checks.notes(data)
    if recorded:
        parts += ["Notes recorded by the run:", "", *(f"- {note}" for note in recorded), ""]
    return parts


def suite_results(root: Path) -> list[dict]:
    """The result files named after a suite (``<device>/softmax.json``, ...); other files there are skipped."""
    return [results.read_result(p) for p in results.find_results(root) if p.stem in suites.NAMES]


def write_report(root: Path | str = ".", *, include_cpu: bool = False) -> Path:
    """Write ``docs/PERFORMANCE.md`` and ``docs/perf/<device>-<suite>.png`` under ``root``."""
    root = Path(root)
    found = [r for r in suite_results(root)
             if include_cpu or not r["config"].get("cpu_smoke", r["machine"]["device"] == "cpu")]
    checked = checks.check_files(root)
    parts = ["# Performance", "",
             "Generated by `regattn bench report` from the result files in `benchmarks/results/`; do not edit by "
             "hand.", ""]
    if not found and not checked:
        parts.append("No GPU result files yet: run `regattn bench SUITE` on a GPU, then `regattn bench report`.")
    elif not found:
        parts += ["No `regattn bench SUITE` result files yet: run one on a GPU, then `regattn bench report`.", ""]
    else:
        parts += ["In the suite tables each cell is the median time of `triton.testing.do_bench` (CUDA-graph replay "
                  "for decode) and, in brackets, its ratio to the fastest peer measured in the same process on the "
                  "same inputs (below 1.00x: faster than every peer). Our ops are `regattn:triton` (the Triton "
                  "kernels) or `regattn:torch` (the reference path, where no kernel exists yet). Peers that could "
                  "not run show why.", ""]
    for result in found:
        device, suite = result["machine"]["device"], result["suite"]
        plot = plot_result(result, root / PLOTS / f"{device}-{suite}.png")
        parts += [f"## {suite} on {device}", "", machine_line(result), "", result_table(result), "",
                  f"![{suite} on {device}]({plot.relative_to(root / DOC.parent).as_posix()})", ""]
    if checked:
        parts += ["The full-size kernel checks (`benchmarks/gpu_check_<name>.py`) follow, each from its own result "
                  "file: correctness against the float64 reference, then timings against peers run in the same "
                  "process. Numbers are as recorded, to 4 significant digits (3 below 0.01); ratios, bounds and targets appear "
                  "only where the check recorded them. Errors are relative (norm of the difference over the norm "
                  "of the reference); `–` marks a value the check did not record.", ""]
    for path, data in checked:
        parts += check_section(path, data)
    path = root / DOC
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(parts))
    return path
