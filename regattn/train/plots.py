"""Plots of training results: curves per mixer, the sweep's metric against the varied setting, and the loss
curves of the scaling runs."""
from __future__ import annotations

import numpy as np


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _save(plt, fig, path: str) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _mean_curve(runs: list[dict], part: str, key: str) -> tuple[np.ndarray, np.ndarray]:
    """Steps and the seed-mean of ``history[part][*][key]`` (runs share their step grid)."""
    curves = [[row[key] for row in r["history"][part]] for r in runs]
    n = min(len(c) for c in curves)
    steps = np.array([row["step"] for row in runs[0]["history"][part][:n]])
    return steps, np.mean([c[:n] for c in curves], axis=0)


def plot_curves(runs_by_label: dict[str, list[dict]], path: str, *, title: str = "") -> None:
    """Training loss and test metric against the step, one line per label (mean over its runs)."""
    plt = _pyplot()
    fig, (ax_loss, ax_test) = plt.subplots(1, 2, figsize=(10, 3.6))
    for label, runs in runs_by_label.items():
        if not runs:
            continue
        metric = runs[0]["metric"]
        steps, loss = _mean_curve(runs, "train", "loss")
        width = max(1, len(loss) // 50)
        smooth = np.convolve(loss, np.ones(width) / width, mode="valid")
        ax_loss.plot(steps[width - 1:], smooth, label=label)
        if runs[0]["history"]["eval"]:
            steps, test = _mean_curve(runs, "eval", metric)
            ax_test.plot(steps, test, marker=".", label=label)
        ax_test.set_ylabel(f"test {metric}")
    ax_loss.set_ylabel("train loss")
    for ax in (ax_loss, ax_test):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    if runs_by_label and next(iter(runs_by_label.values()))[0]["metric"] == "mse":
        ax_test.set_yscale("log")
    ax_test.legend(fontsize=8)
    fig.suptitle(title)
    _save(plt, fig, path)


def plot_scaling(rows: list[dict], path: str, *, seq_len: int, title: str = "") -> None:
    """Training loss of each scaling row (:mod:`regattn.train.scaling`), a column per mixer and a line per
    number of processes: against the step (top) and against the tokens trained on (bottom; N processes
    take N times the sequences a step)."""
    from regattn.train.scaling import processes

    plt = _pyplot()
    mixers = list(dict.fromkeys(r["mixer"] for r in rows))
    fig, axes = plt.subplots(2, max(1, len(mixers)), figsize=(4 * max(1, len(mixers)), 6.4), squeeze=False)
    for column, mixer in enumerate(mixers):
        for r in rows:
            if r["mixer"] != mixer or "history" not in r:
                continue
            train = r["history"]["train"]
            per_step = r["batch_size_per_rank"] * r["world_size"] * seq_len / 1e6
            losses = [t["loss"] for t in train]
            axes[0, column].plot([t["step"] for t in train], losses, label=processes(r["world_size"]))
            axes[1, column].plot([t["step"] * per_step for t in train], losses, label=processes(r["world_size"]))
        axes[0, column].set_title(mixer)
        for ax, xlabel in zip(axes[:, column], ("step", "tokens (millions)")):
            ax.set_xlabel(xlabel)
            ax.set_ylabel("train loss")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle(title)
    _save(plt, fig, path)


def x_order(xs: list) -> list[str]:
    """The sweep's points as labels, one each, in the plots' order: ascending where all are numbers, else in the
    order they first appear (a mixer without some points keeps its place on the shared axis)."""
    labels = list(dict.fromkeys(str(x) for x in xs))
    try:
        return sorted(labels, key=float)
    except ValueError:
        return labels


def plot_sweep(summary: dict, path: str, *, xlabel: str, metric: str, title: str = "") -> None:
    """``summary[mixer][point] = {"x": value, "mean": m, "std": s}``: metric against x, one line per mixer."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    widest_first = sorted(summary.values(), key=len, reverse=True)   # its points in the sweep's order
    order = x_order([r["x"] for points in widest_first for r in points.values()])
    place = {x: i for i, x in enumerate(order)}
    for mixer, points in summary.items():
        rows = sorted(points.values(), key=lambda r: place[str(r["x"])])
        at = [place[str(r["x"])] for r in rows]
        means = np.array([np.nan if r["mean"] is None else r["mean"] for r in rows])
        stds = np.array([0.0 if r["std"] is None else r["std"] for r in rows])
        ax.errorbar(at, means, yerr=stds, marker="o", capsize=3, label=mixer)
    ax.set_xticks(range(len(order)), order)
    ax.set_xlabel(xlabel)
    if max((len(str(x)) for points in summary.values() for x in points), default=0) > 8:
        ax.tick_params(axis="x", labelrotation=30)           # task names: keep them apart
    ax.set_ylabel(f"test {metric} (best lr, mean over seeds)")
    if metric == "mse":
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title)
    _save(plt, fig, path)


def plot_diagnostics(run: dict, path: str, *, title: str = "") -> list[str]:
    """Each recorded diagnostic (COR, probe norm, ...) against the step, one line per layer; returns the keys drawn."""
    rows = run["history"].get("analysis") or []
    if not rows:
        return []
    keys = [k for k in ("cor", "corr_f", "cpa", "probe_norm", "score_range", "entropy", "sink_base", "density")
            if k in rows[0]["layers"][0]]
    if not keys:
        return []
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(keys), figsize=(3.2 * len(keys), 3), squeeze=False)
    steps = [r["step"] for r in rows]
    for ax, key in zip(axes[0], keys):
        for layer in range(len(rows[0]["layers"])):
            ax.plot(steps, [r["layers"][layer][key] for r in rows], marker=".", label=f"layer {layer}")
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(title)
    _save(plt, fig, path)
    return keys
