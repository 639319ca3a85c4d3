"""``regattn demo``: test-time regression on non-stationary piecewise-linear data, no training.

The experiment of lla-local-linear-attention.txt Section 4 (Figure 2, Figure 6, Appendix F):
one attention layer of each mechanism reads the raw pairs ``(k_j, v_j)`` of a sequence whose
linear map changes every ``S`` positions and predicts ``v_i`` at the query ``q_i = k_i``.
The protocol is spelled out in :data:`PROTOCOL` (also the ``--help`` text) and docs/DEMO.md.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from regattn import reference
from regattn.tasks.regression import piecewise_linear_regression

MODELS = ("LLA", "softmax", "linear", "MesaNet", "random")

SWEEP = """
the paper's full sweep on a GPU (float64 on an H100: about 1 s per 1,000 sequences at d <= 32,
2 s at d = 64, 7 s at d = 128, per S; about 14 minutes for the whole sweep):
  regattn demo --paper --device cuda --memory-gb 8 --json sweep.json --out fig2.png
"""

PROTOCOL = """\
protocol (lla-local-linear-attention.txt Section 4, Appendix F):
  data      keys on disjoint cones per segment (Appendix F.1, eq. 51), v = A_c k + noise,
            A_c ~ N(0, I) per sequence and segment; L positions, segments of S positions.
  query     q_i = k_i: each position is queried at its own key.
  context   position i reads the pairs j <= i: the paper's D_i = {(k_j, v_j)}, j = 1..i (Section 2.1),
            queried at a stored key ("exact query q = k_j as in this synthetic experiment", F.4).
            The fit contains the query's own noisy pair. --exclude-self reads the pairs j < i
            instead (keys/values one step behind the queries): v_i is then predicted from the
            past only, and position 1, which has no context, is left out of every sum.
  LLA       reference.lla, exact solve (eq. 7-8), weights exp(scale q.k - rowmax) (largest 1),
            ridge --lam on those weights (default 1).
  softmax   reference.softmax_attention, logits scale q.k (Nadaraya-Watson, Section 2.1).
  linear    reference.linear_attention: o_i = sum_j v_j k_j^T q_i (vanilla LA, H_i = I in eq. 2).
  MesaNet   reference.mesanet (eq. 2): (sum v k^T)(sum k k^T + mesa_lam I)^-1 q, unnormalised
            sums (default mesa_lam = lam). The paper gives no ridge for this experiment.
  random    a random linear map R ~ N(0, I) per sequence (the prior of A_c): v_hat_i = R k_i.
  scale     the bandwidth: scale = 1/h in exp(scale q.k), default d^-1/2 (Section 2.1).
  metric    position-wise MSE l_i = ||v_hat_i - v_i||^2 (summed over the d coordinates),
            averaged over sequences; ratio = sum_i l_i(model) / sum_i l_i(LLA).
  claims    "MesaNet best before the first shift": lowest summed MSE over positions 1..S (2..S
            with --exclude-self);
            "LLA best after the first shift": lowest summed MSE over positions S+1..L.
"""


@dataclass
class Config:
    """Everything one run of the demo depends on (the command line, parsed)."""
    length: int = 512
    dims: tuple = (8, 16, 32)
    segments: tuple = (32, 128, 512)
    sequences: int = 48
    noise: float = 0.1
    lam: float = 1.0
    mesa_lam: float | None = None
    scale: float | None = None
    include_self: bool = True
    device: str = "cpu"
    dtype: str = "float64"
    seed: int = 0
    batch: int | None = None
    chunk: int = 64
    memory_gb: float = 1.0
    plot_dim: int | None = None
    plot_segments: tuple | None = None
    out: str = "regattn-demo.png"
    json: str | None = None
    quiet: bool = False

    @property
    def torch_dtype(self) -> torch.dtype:
        return {"float64": torch.float64, "float32": torch.float32}[self.dtype]

    @property
    def first(self) -> int:
        """The first scored position (0-based): 1 when the context is the pairs j < i (position 1 has none)."""
        return 0 if self.include_self else 1


@dataclass
class Result:
    """One (d, S): ``mse[model]`` is the position-wise MSE ``[L]`` (NaN where unscored)."""
    dim: int
    segment: int
    mse: dict
    seconds: float
    ratio: dict = field(default_factory=dict)
    before: dict = field(default_factory=dict)
    after: dict | None = None


# ----------------------------------------------------------------------------- the mechanisms

def by_query_chunks(fn, q, k, v, chunk: int):
    """Run ``fn(q, k, v)`` on blocks of ``chunk`` queries; block ``[a, b)`` reads keys up to its last query.

    q ``[B, T, 1, d]``; k, v ``[B, T + off, 1, d]`` with queries aligned to the end of the keys.
    """
    T, off = q.shape[1], k.shape[1] - q.shape[1]
    parts = [fn(q[:, a:a + chunk], k[:, :min(T, a + chunk) + off], v[:, :min(T, a + chunk) + off])
             for a in range(0, T, chunk)]
    return torch.cat(parts, dim=1)


def predict(model: str, q, k, v, *, cfg: Config, dim: int, rng: torch.Generator | None = None):
    """Predictions ``[B, T, 1, d]`` of one mechanism at queries ``q [B, T, 1, d]`` from pairs ``k, v``."""
    scale = dim ** -0.5 if cfg.scale is None else cfg.scale
    mesa_lam = cfg.lam if cfg.mesa_lam is None else cfg.mesa_lam
    if model == "LLA":
        return by_query_chunks(lambda q, k, v: reference.lla(q, k, v, lam=cfg.lam, scale=scale), q, k, v, cfg.chunk)
    if model == "softmax":
        return by_query_chunks(lambda q, k, v: reference.softmax_attention(q, k, v, scale=scale),
                               q, k, v, cfg.chunk)
    if model == "linear":
        return by_query_chunks(reference.linear_attention, q, k, v, cfg.chunk)
    if model == "MesaNet":
        return reference.mesanet(q, k, v, lam=mesa_lam)
    if model == "random":
        R = torch.randn(q.shape[0], dim, dim, generator=rng, device=q.device, dtype=q.dtype)
        return torch.einsum("bij,bthj->bthi", R, q)
    raise ValueError(f"model: expected one of {MODELS}, got {model!r}")


def split_context(keys, values, include_self: bool):
    """Queries and the pairs they read, ``[B, T, 1, d]`` each, for the aligned-to-the-end ops.

    ``include_self``: ``q = k`` and pairs ``j <= i``. Otherwise the queries are positions
    ``2..L`` and the pairs are positions ``1..L-1``: query ``i`` reads exactly ``j < i``.
    """
    q, k, v = keys[:, :, None], keys[:, :, None], values[:, :, None]
    if include_self:
        return q, k, v
    return q[:, 1:], k[:, :-1], v[:, :-1]


# ----------------------------------------------------------------------------- evaluation

def seed_for(*parts: int) -> int:
    """A well-mixed 63-bit seed from integers (independent streams per run, config and batch)."""
    return int(np.random.SeedSequence(list(parts)).generate_state(2, dtype=np.uint64)[0] >> np.uint64(1))


def batch_size(cfg: Config, dim: int) -> int:
    """Sequences per forward pass so the largest intermediates stay near ``memory_gb``.

    MesaNet's running moments are ``[B, L, d, d]``; LLA's centred keys ``[B, chunk, L, d]``.
    """
    if cfg.batch is not None:
        return cfg.batch
    item = torch.finfo(cfg.torch_dtype).bits // 8
    per_sequence = 4 * item * cfg.length * dim * max(dim, cfg.chunk)
    return max(1, min(cfg.sequences, int(cfg.memory_gb * 2 ** 30 // per_sequence)))


@torch.inference_mode()
def evaluate(cfg: Config, dim: int, segment: int) -> Result:
    """Position-wise MSE ``[L]`` of every model, averaged over ``cfg.sequences`` sequences."""
    start = time.perf_counter()
    L, first = cfg.length, cfg.first
    sums = {m: torch.zeros(L - first, dtype=torch.float64) for m in MODELS}
    B = batch_size(cfg, dim)
    done = 0
    for b in range(math.ceil(cfg.sequences / B)):
        n = min(B, cfg.sequences - done)
        data = piecewise_linear_regression(n, L, dim, segment, noise=cfg.noise,
                                           seed=seed_for(cfg.seed, dim, segment, b),
                                           device=cfg.device, dtype=cfg.torch_dtype)
        q, k, v = split_context(data.keys, data.values, cfg.include_self)
        target = data.values[:, first:]
        rng = torch.Generator(device=cfg.device)
        rng.manual_seed(seed_for(cfg.seed, dim, segment, b, 1))
        for m in MODELS:
            pred = predict(m, q, k, v, cfg=cfg, dim=dim, rng=rng)[:, :, 0]
            sums[m] += ((pred - target) ** 2).sum(-1).sum(0).double().cpu()
        done += n
    nan = torch.full((first,), float("nan"), dtype=torch.float64)
    mse = {m: torch.cat([nan, s / cfg.sequences]) for m, s in sums.items()}
    result = Result(dim, segment, mse, time.perf_counter() - start)
    score(result, cfg)
    return result


def best(totals: dict) -> tuple[str, float]:
    """The model with the lowest total and its margin: its total over the runner-up's (< 1 means it leads)."""
    order = sorted(totals, key=totals.get)
    return order[0], totals[order[0]] / totals[order[1]]


def score(result: Result, cfg: Config) -> None:
    """Fill the ratios to LLA and the before/after-shift totals of ``result``."""
    first, S, L = cfg.first, result.segment, cfg.length

    def total(lo, hi):
        return {m: e[lo:hi].sum().item() for m, e in result.mse.items()}

    whole = total(first, L)
    result.ratio = {m: whole[m] / whole["LLA"] for m in MODELS}
    result.before = total(first, min(S, L))
    result.after = total(S, L) if S < L else None


# ----------------------------------------------------------------------------- reporting

def format_table(results: list, cfg: Config) -> str:
    """The MSE ratio to LLA per (d, S), and the best model before and after the first shift."""
    head = (f"{'d':>4} {'S':>5} |" + "".join(f"{m:>10}" for m in MODELS)
            + " | best before 1st shift | best after 1st shift")
    lines = [head, "-" * len(head)]
    for r in results:
        cells = "".join(f"{r.ratio[m]:>10.3g}" for m in MODELS)
        b, bm = best(r.before)
        before = f"{b} ({bm:.2f}x next)"
        if r.after is None:
            after = "no shift (S >= L)"
        else:
            a, am = best(r.after)
            after = f"{a} ({am:.2f}x next)"
        lines.append(f"{r.dim:>4} {r.segment:>5} |{cells} | {before:<21} | {after}")
    return "\n".join(lines)


def claims(results: list) -> dict:
    """Whether each of the paper's two claims held, per (d, S): ``{claim: [(d, S, held, winner)]}``."""
    out = {"MesaNet best before the first shift": [], "LLA best after the first shift": []}
    for r in results:
        b, _ = best(r.before)
        out["MesaNet best before the first shift"].append((r.dim, r.segment, b == "MesaNet", b))
        if r.after is not None:
            a, _ = best(r.after)
            out["LLA best after the first shift"].append((r.dim, r.segment, a == "LLA", a))
    return out


def format_claims(verdicts: dict) -> str:
    lines = []
    for claim, rows in verdicts.items():
        if not rows:
            lines.append(f"{claim}: not tested (no configuration has a shift)")
            continue
        held = sum(h for _, _, h, _ in rows)
        status = "HELD" if held == len(rows) else ("DID NOT HOLD" if held == 0 else "HELD PARTLY")
        lines.append(f"{claim}: {status} in {held}/{len(rows)} configurations")
        lines += [f"    failed at d={d}, S={S}: {w} was best" for d, S, h, w in rows if not h]
    return "\n".join(lines)


def plot(results: list, cfg: Config, path: str) -> None:
    """Position-wise MSE (log scale) per model, one panel per S, like the paper's Figure 2."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(results)
    fig, axes = plt.subplots(1, n, figsize=(4.2 * n, 3.6), squeeze=False)
    pos = np.arange(1, cfg.length + 1)
    for ax, r in zip(axes[0], results):
        for m in MODELS:
            ax.plot(pos, r.mse[m].numpy(), label=m, linewidth=1.0)
        for c in range(r.segment, cfg.length, r.segment):
            ax.axvline(c + 0.5, color="0.8", linewidth=0.6, zorder=0)
        ax.set_yscale("log")
        ax.set_title(f"d = {r.dim}, S = {r.segment}")
        ax.set_xlabel("position i")
    axes[0][0].set_ylabel("MSE  ||v_hat_i - v_i||^2")
    axes[0][-1].legend(fontsize=8)
    context = "j <= i" if cfg.include_self else "j < i"
    fig.suptitle(f"test-time regression, L = {cfg.length}, {cfg.sequences} sequences, context {context}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_json(results: list, cfg: Config, verdicts: dict, path: str) -> None:
    payload = {
        "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(cfg).items()},
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if cfg.device.startswith("cuda") else "cpu",
        "results": [{"d": r.dim, "S": r.segment, "seconds": r.seconds, "ratio_to_lla": r.ratio,
                     "before_first_shift": r.before, "after_first_shift": r.after,
                     "position_mse": {m: [None if math.isnan(x) else float(f"{x:.6g}") for x in e.tolist()]
                                      for m, e in r.mse.items()}} for r in results],
        "claims": {c: [{"d": d, "S": S, "held": h, "best": w} for d, S, h, w in rows]
                   for c, rows in verdicts.items()},
    }
    with open(path, "w") as f:
        json.dump(payload, f)


# ----------------------------------------------------------------------------- command line

PAPER = dict(length=1024, dims=(8, 16, 32, 64, 128), segments=(8, 16, 32, 64, 128, 256, 512, 1024),
             sequences=10000, plot_dim=64, plot_segments=(64, 256, 512, 1024))


def ints(text: str) -> tuple:
    return tuple(int(x) for x in text.split(","))


def build_parser() -> argparse.ArgumentParser:
    d = Config()
    p = argparse.ArgumentParser(
        prog="regattn demo", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Test-time regression on non-stationary piecewise-linear data (LLA paper, Section 4): "
                    "LLA, softmax attention, linear attention, MesaNet and a random predictor, no training.",
        epilog=PROTOCOL + SWEEP)
    p.add_argument("--length", "-L", type=int, default=d.length, help="positions per sequence (default %(default)s)")
    p.add_argument("--dims", type=ints, default=d.dims, help="comma-separated d values (default 8,16,32)")
    p.add_argument("--segments", type=ints, default=d.segments, help="comma-separated S values (default 32,128,512)")
    p.add_argument("--sequences", "-n", type=int, default=d.sequences,
                   help="sequences per (d, S) (default %(default)s)")
    p.add_argument("--noise", type=float, default=d.noise, help="value noise std delta (default %(default)s)")
    p.add_argument("--lam", type=float, default=d.lam,
                   help="LLA ridge, on weights whose largest is 1 (default %(default)s)")
    p.add_argument("--mesa-lam", type=float, default=None,
                   help="MesaNet ridge on the unnormalised sums (default: --lam)")
    p.add_argument("--scale", type=float, default=None, help="scale = 1/h in exp(scale q.k) (default d^-1/2)")
    p.add_argument("--exclude-self", dest="include_self", action="store_false",
                   help="position i reads the pairs j < i (default: j <= i, the paper's D_i)")
    p.add_argument("--device", default=d.device, help="cpu or cuda (default %(default)s)")
    p.add_argument("--dtype", choices=("float64", "float32"), default=d.dtype, help="(default %(default)s)")
    p.add_argument("--seed", type=int, default=d.seed, help="(default %(default)s)")
    p.add_argument("--batch", type=int, default=None, help="sequences per forward pass (default: from --memory-gb)")
    p.add_argument("--memory-gb", type=float, default=d.memory_gb, help="target size of the largest intermediates")
    p.add_argument("--chunk", type=int, default=d.chunk, help="queries per LLA/softmax block (default %(default)s)")
    p.add_argument("--plot-dim", type=int, default=None, help="the d drawn in the figure (default: the largest)")
    p.add_argument("--plot-segments", type=ints, default=None, help="the S drawn in the figure (default: all)")
    p.add_argument("--out", default=d.out, help="PNG of the position-wise MSE; '' for none (default %(default)s)")
    p.add_argument("--json", default=None, help="also write the table, verdicts and curves as JSON")
    p.add_argument("--paper", action="store_true",
                   help="the paper's sweep: L=1024, d in 8..128, S in 8..1024, 10,000 sequences (use a GPU)")
    p.add_argument("--quiet", action="store_true", help="print only the table and the verdicts")
    return p


def parse_config(argv) -> Config:
    """The :class:`Config` of a command line; ``--paper`` sets the sweep's defaults, other flags still apply."""
    parser = build_parser()
    if parser.parse_args(argv).paper:
        parser.set_defaults(**PAPER)
    values = {k: v for k, v in vars(parser.parse_args(argv)).items() if k != "paper"}
    cfg = Config(**values)
    validate(cfg, parser)
    return cfg


def validate(cfg: Config, parser: argparse.ArgumentParser) -> None:
    """Reject settings the protocol cannot score, with the flag named."""
    for name, value, low in (("--length", cfg.length, 2), ("--sequences", cfg.sequences, 1),
                             ("--chunk", cfg.chunk, 1), ("--batch", cfg.batch or 1, 1)):
        if value < low:
            parser.error(f"{name}: expected an int >= {low}, got {value}")
    if min(cfg.dims) < 1 or min(cfg.segments) < 2:
        parser.error(f"--dims/--segments: expected d >= 1 and S >= 2, got {cfg.dims} and {cfg.segments}")
    if not (cfg.lam > 0 and math.isfinite(cfg.lam)) or (cfg.mesa_lam is not None and not cfg.mesa_lam > 0):
        parser.error("--lam/--mesa-lam: expected finite values > 0")
    if cfg.noise < 0:
        parser.error(f"--noise: expected >= 0, got {cfg.noise}")
    if cfg.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")


def run(cfg: Config, log=print) -> tuple[list, dict]:
    """Evaluate every (d, S), draw the figure, write JSON if asked; returns ``(results, verdicts)``."""
    results = []
    for dim in cfg.dims:
        for segment in cfg.segments:
            r = evaluate(cfg, dim, segment)
            results.append(r)
            if cfg.json:                                   # rewritten after each (d, S): a long sweep keeps its part
                write_json(results, cfg, claims(results), cfg.json)
            if not cfg.quiet:
                log(f"  d={dim:<4} S={segment:<5} {r.seconds:6.1f} s", flush=True)
    verdicts = claims(results)
    if cfg.out:
        plot_dim = cfg.plot_dim if cfg.plot_dim in cfg.dims else max(cfg.dims)
        mine = [r for r in results if r.dim == plot_dim]
        plot([r for r in mine if cfg.plot_segments is None or r.segment in cfg.plot_segments] or mine, cfg, cfg.out)
    return results, verdicts


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    cfg = parse_config(argv)
    context = "pairs j <= i (own pair included)" if cfg.include_self else "pairs j < i (own pair held out)"
    print(f"regattn demo: test-time regression, L={cfg.length}, {cfg.sequences} sequences per (d, S), "
          f"noise {cfg.noise}, lam {cfg.lam}, MesaNet lam {cfg.lam if cfg.mesa_lam is None else cfg.mesa_lam}, "
          f"scale {'d^-1/2' if cfg.scale is None else cfg.scale}, context {context}, {cfg.device} {cfg.dtype}")
    results, verdicts = run(cfg)
    print("\nMSE ratio to LLA (sum over scored positions of the model's MSE / LLA's):")
    print(format_table(results, cfg))
    print("\nThe paper's claims (Section 4, Figure 2), as this run shows them:")
    print(format_claims(verdicts))
    written = [f"figure {cfg.out}"] * bool(cfg.out) + [f"JSON {cfg.json}"] * bool(cfg.json)
    print(f"\nwritten: {', '.join(written) or 'nothing'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
