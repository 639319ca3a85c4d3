"""Throughput scaling of the decoder LM from one process to N (FSDP2).

    python -m regattn.train scaling [--mixers parallax,gatedfwa,softmax] [--nproc 2] [--resume-check] [--out PATH]
                                    [lm flags]

For each mixer, the same ``regattn.train lm`` run on 1 process and on N processes at the same batch per
rank (so N times the tokens per step), each launched by ``torch.distributed.run --standalone``: FSDP2 on
NCCL with CUDA, on gloo without. Every other flag is an ``lm`` flag and goes to both runs after the
scaling defaults, which it overrides: dim 1024, 16 layers, 8 heads of 128, 4096-token sequences,
gatedfwa's window 512 (its paper's language-model setting), 8 sequences per rank, activation
checkpointing and :data:`STEPS` steps, with lm's bf16 autocast (CUDA) and Muon.
``--tiny`` puts a model of width 32 and 2 layers on 16-token sequences for a few steps in their place
(seconds a run on the CPU). ``--mixer``, ``--compare`` and ``--checkpoint`` are not taken: the harness
sets the mixer, and a checkpoint would make the second run resume the first.

``--resume-check`` makes each N-process run two: stopped at half its steps with a checkpoint (and a
validation score there), then resumed from it on N processes; a copy of the checkpoint is also resumed on
1 process for :data:`RESUME_STEPS` steps. The N-process row then holds ``resume``: the validation NLL
saved with the checkpoint, and for each number of processes the NLL of the checkpoint as loaded there and
the mean training loss of the steps after it to the first log point.

Writes ``--out`` (default ``benchmarks/results/<device>x<N>/scaling.json``), one row per mixer and number
of processes: tokens per second (all ranks; lm's steady rate, the median over the log intervals but the
first), speedup = tokens/s(N) / tokens/s(1), efficiency = speedup / N, peak memory per rank (MiB; None on
the CPU), the final training loss, the validation perplexity and the loss curves. Beside it the table
(``.md``) and the training loss of 1 and N processes against steps and tokens, a column per mixer
(``-curves.png``). Rows of other mixers in a file already there with the same configuration are kept, so
the mixers may be run one command at a time; the files are written again after each mixer. A run that
fails is recorded with its exit status; the command then exits 1.

NVLink multicast stays off in the runs' environment (NCCL, PyTorch symmetric memory, NVSHMEM): a job that
uses it can take a shared host's GPUs out of service.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile

import torch

from regattn.bench.results import RESULTS_DIR, machine_info, make_result, write_result
from regattn.train import checks, lm
from regattn.usage import UsageError

MIXERS = ("parallax", "gatedfwa", "softmax")
STEPS = 200
RESUME_STEPS = 10
DEFAULTS = ["--dim", "1024", "--layers", "16", "--heads", "8", "--seq-len", "4096", "--window", "512",
            "--batch-size", "8", "--activation-checkpointing", "--steps", str(STEPS)]
TINY = ["--dim", "32", "--layers", "2", "--heads", "2", "--seq-len", "16", "--batch-size", "2", "--steps", "4",
        "--log-every", "1", "--eval-tokens", "256", "--max-bytes", "200000", "--window", "8", "--activation-checkpointing"]
REFUSED = {"--mixer": "it sets the mixer of each run from --mixers", "--compare": "give the mixers as --mixers",
           "--checkpoint": "the N-process run would resume the 1-process one"}
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@dataclasses.dataclass
class Plan:
    """What the command runs: the lm arguments of every run, its parsed configuration, the mixers, the
    number of processes, whether the N-process runs are stopped and resumed, and the output JSON."""
    lm_argv: list[str]
    config: lm.LMTrainConfig
    mixers: list[str]
    nproc: int
    resume_check: bool
    out: str
    machine: dict

    def identity(self) -> dict:
        """What rows of one file share: the lm configuration but the mixer, and the number of processes."""
        config = {k: v for k, v in dataclasses.asdict(self.config).items() if k != "mixer"}
        return {"lm": config, "nproc": self.nproc}


def parse_args(argv=None) -> Plan:
    p = argparse.ArgumentParser(prog="python -m regattn.train scaling", allow_abbrev=False,
                                description=__doc__.split("\n")[0], epilog="Any other flag is an lm flag "
                                "(python -m regattn.train lm --help).")
    p.add_argument("--mixers", default=",".join(MIXERS), help="comma-separated mixers, each in every layer")
    p.add_argument("--nproc", type=int, default=2, help="processes (GPUs) of the distributed runs")
    p.add_argument("--resume-check", action="store_true",
                   help="stop each N-process run at half its steps and resume its checkpoint on N and on 1 process")
    p.add_argument("--tiny", action="store_true", help="a tiny model for a few steps (checks the harness)")
    p.add_argument("--out", default=None, help="result JSON (default benchmarks/results/<device>x<N>/scaling.json)")
    args, rest = p.parse_known_args(argv)
    for flag in (arg.split("=")[0] for arg in rest):
        if flag in REFUSED:
            raise UsageError(f"{flag}: not taken by the scaling harness: {REFUSED[flag]}")
    lm_argv = (TINY if args.tiny else DEFAULTS) + rest
    config, _ = lm.parse_args(lm_argv + ["--quiet"])
    checks.at_least("--nproc", args.nproc, 2)
    if args.resume_check:
        checks.at_least("--steps", config.steps, 2)
    mixers = args.mixers.split(",")
    if len(set(mixers)) != len(mixers):
        raise UsageError(f"--mixers: expected distinct names, got {args.mixers!r}")
    for name in mixers:
        lm.check_model(dataclasses.replace(config, mixer=name), "--mixers")
    checks.at_least("--eval-tokens", config.eval_tokens, args.nproc * config.seq_len)
    cuda = torch.cuda.is_available() and (config.device == "auto" or config.device.startswith("cuda"))
    if cuda and args.nproc > torch.cuda.device_count():
        raise UsageError(f"--nproc: expected at most the {torch.cuda.device_count()} CUDA device(s) of this machine, "
                         f"got {args.nproc}")
    machine = machine_info("cuda" if cuda else "cpu")
    out = args.out or os.path.join(RESULTS_DIR, f"{machine['device']}x{args.nproc}", "scaling.json")
    plan = Plan(lm_argv, config, mixers, args.nproc, args.resume_check, out, machine)
    if os.path.exists(out) and read_rows(plan) is None:
        raise UsageError(f"--out: {out} holds results of another configuration or number of processes; "
                         "give another --out or remove it")
    return plan


def read_rows(plan: Plan) -> list[dict] | None:
    """The rows of ``plan.out`` (none when it does not exist); None when it holds another configuration."""
    if not os.path.exists(plan.out):
        return []
    with open(plan.out) as f:
        old = json.load(f)
    return old["rows"] if old.get("config") == json.loads(json.dumps(plan.identity())) else None


# ---------------------------------------------------------------------------------------------- runs
def launch(plan: Plan, mixer: str, nproc: int, folder: str, extra: tuple[str, ...] = ()) -> dict:
    """One ``lm`` run of ``mixer`` on ``nproc`` processes (``extra``: lm flags of this run alone); its
    result, or ``{"error": ...}``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "-m", "regattn.train", "lm", *plan.lm_argv, *extra, "--mixer", mixer, "--quiet", "--out", folder]
    print(f"scaling: {mixer} on {processes(nproc)}", flush=True)
    proc = subprocess.run(cmd, env={**os.environ, **NO_MULTICAST})
    if proc.returncode != 0:
        return {"error": f"lm on {processes(nproc)} exited with status {proc.returncode}"}
    with open(os.path.join(folder, f"lm-{mixer}-world{nproc}.json")) as f:
        return json.load(f)


def stopped_and_resumed(plan: Plan, mixer: str, folder: str) -> tuple[dict, dict | None]:
    """The N-process run of ``mixer`` stopped at half its steps with a checkpoint, then resumed from it on N
    processes, and a copy resumed on 1 process for :data:`RESUME_STEPS` steps: the N-process result and
    the resume check (None when the first half failed)."""
    half = plan.config.steps // 2
    saved, copy = os.path.join(folder, f"checkpoint-{mixer}"), os.path.join(folder, f"checkpoint-{mixer}-copy")
    scored = ("--eval-every", str(half))
    first = launch(plan, mixer, plan.nproc, folder, (*scored, "--checkpoint", saved, "--stop-at", str(half)))
    if "error" in first:
        return first, None
    shutil.copytree(saved, copy)
    runs = {plan.nproc: launch(plan, mixer, plan.nproc, folder, (*scored, "--checkpoint", saved)),
            1: launch(plan, mixer, 1, folder, (*scored, "--checkpoint", copy, "--stop-at", str(half + RESUME_STEPS)))}
    check = {"step": half, "saved_nll": first["history"]["eval"][-1]["nll"],
             "runs": [resumed(n, result, half) for n, result in runs.items()]}
    return runs[plan.nproc], check


def resumed(nproc: int, result: dict, step: int) -> dict:
    """One resumed run of the check: the loaded checkpoint's validation NLL and the mean training loss
    from ``step`` to the first log point after it."""
    if "error" in result:
        return {"world_size": nproc, "error": result["error"]}
    after = next(r for r in result["history"]["train"] if r["step"] > step)
    return {"world_size": nproc, "loaded_nll": result["loaded"]["nll"], "to_step": after["step"], "loss": after["loss"]}


def processes(n: int) -> str:
    return f"{n} process" if n == 1 else f"{n} processes"


def row(mixer: str, nproc: int, result: dict, check: dict | None = None) -> dict:
    """The scaling row of one run, with its resume check if any (the speedup is set by :func:`add_speedups`)."""
    if "error" in result:
        return {"mixer": mixer, "world_size": nproc, "error": result["error"]}
    train = result["history"]["train"]
    return {"mixer": mixer, "world_size": result["world_size"], "batch_size_per_rank": result["batch_size_per_rank"],
            "tokens_per_second": result["tokens_per_second"], "peak_memory_mib": result["peak_memory_mib"],
            "final_loss": train[-1]["loss"] if train else None, "final": result["final"],
            "parameters": result["parameters"], "steps": result["steps"], "device": result["device"],
            "history": result["history"], **({"resume": check} if check else {})}


def add_speedups(rows: list[dict]) -> None:
    """Each row's speedup over its mixer's 1-process row and efficiency = speedup / processes (None when
    either run failed)."""
    one = {r["mixer"]: r.get("tokens_per_second") for r in rows if r["world_size"] == 1}
    for r in rows:
        base, rate = one.get(r["mixer"]), r.get("tokens_per_second")
        r["speedup"] = rate / base if base and rate else None
        r["efficiency"] = r["speedup"] / r["world_size"] if r["speedup"] is not None else None


# ---------------------------------------------------------------------------------------------- outputs
def table(result: dict) -> str:
    """The markdown table of a scaling result."""
    def number(value, digits):
        return "-" if value is None else f"{value:.{digits}f}"

    lines = ["| mixer | processes | batch per rank | tokens/s | speedup | efficiency | peak memory per rank (MiB) "
             "| final train loss | val ppl |", "|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"| {r['mixer']} | {r['world_size']} | failed: {r['error']} |||||||")
            continue
        peak = "-" if r["peak_memory_mib"] is None else ", ".join(f"{m:.0f}" for m in r["peak_memory_mib"])
        ppl = r["final"]["ppl"] if r["final"] else None
        lines.append(f"| {r['mixer']} | {r['world_size']} | {r['batch_size_per_rank']} | "
                     f"{number(r['tokens_per_second'], 0)} | {number(r['speedup'], 2)} | {number(r['efficiency'], 2)} | "
                     f"{peak} | {number(r['final_loss'], 4)} | {number(ppl, 3)} |")
    lines += [resume_line(r) for r in result["rows"] if r.get("resume")]
    lm_config = result["config"]["lm"]
    return (f"Scaling of the decoder LM on {result['machine']['name']} ({result['date']}): dim {lm_config['dim']}, "
            f"{lm_config['layers']} layers, {lm_config['seq_len']}-token sequences, {lm_config['steps']} steps, "
            f"optimizer {lm_config['optimizer']}, activation checkpointing "
            f"{'on' if lm_config['activation_checkpointing'] else 'off'}.\n\n" + "\n".join(lines) + "\n")


def resume_line(r: dict) -> str:
    """The resume check of a row, as a sentence under the table."""
    check = r["resume"]
    runs = "; ".join(f"on {processes(run['world_size'])} failed: {run['error']}" if "error" in run else
                     f"on {processes(run['world_size'])} loaded at {run['loaded_nll']:.5f}, mean training loss to "
                     f"step {run['to_step']} {run['loss']:.4f}" for run in check["runs"])
    return (f"\n{r['mixer']}: the checkpoint of {processes(r['world_size'])} at step {check['step']} "
            f"(validation NLL {check['saved_nll']:.5f}) resumed {runs}.")


def write_outputs(result: dict, out: str) -> list[str]:
    """The JSON, the table (``.md``) and the curves (``-curves.png``) of ``result``; their paths."""
    from regattn.train.plots import plot_scaling

    stem = os.path.splitext(out)[0]
    write_result(out, result)
    with open(stem + ".md", "w") as f:
        f.write(table(result))
    plot_scaling(result["rows"], stem + "-curves.png", seq_len=result["config"]["lm"]["seq_len"],
                 title=f"decoder LM, training loss on 1 and {result['config']['nproc']} processes "
                       f"({result['machine']['name']})")
    return [out, stem + ".md", stem + "-curves.png"]


def main(argv=None) -> int:
    plan = parse_args(argv)
    rows = [r for r in read_rows(plan) if r["mixer"] not in plan.mixers]
    with tempfile.TemporaryDirectory() as folder:
        for mixer in plan.mixers:                 # written after each mixer: a stopped command keeps those done
            single = launch(plan, mixer, 1, folder)
            if plan.resume_check:
                several, check = stopped_and_resumed(plan, mixer, folder)
            else:
                several, check = launch(plan, mixer, plan.nproc, folder), None
            rows += [row(mixer, 1, single), row(mixer, plan.nproc, several, check)]
            add_speedups(rows)
            result = make_result("scaling", plan.machine, plan.identity(), rows)
            paths = write_outputs(result, plan.out)
    print(table(result))
    for path in paths:
        print(f"wrote {path}")
    return 1 if any("error" in r for r in rows) else 0
