"""``regattn analyze CHECKPOINT [--examples N] [--json PATH]``: the mechanism diagnostics of a model
saved by ``regattn train --checkpoint``, per layer, on the first test examples of its task."""
from __future__ import annotations

import argparse
import dataclasses
import json

from regattn.analysis.diagnostics import analyze
from regattn.train import checks
from regattn.train.checkpoints import UnsafeCheckpointError
from regattn.train.trainer import build, config_from_checkpoint, load_checkpoint
from regattn.usage import UsageError


def table(rows: list[dict]) -> str:
    """Metrics down, layers across, and their mean over layers (Table 4 averages across layers)."""
    keys = [k for k in dict.fromkeys(k for r in rows for k in r) if k != "layer"]
    head = f"{'':>12}" + "".join(f"{'layer ' + str(r['layer']):>12}" for r in rows) + f"{'mean':>12}"
    lines = [head]
    for k in keys:
        values = [r[k] for r in rows if k in r]
        cells = "".join(f"{r[k]:>12.4g}" if k in r else f"{'-':>12}" for r in rows)
        lines.append(f"{k:>12}" + cells + f"{sum(values) / len(values):>12.4g}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="regattn analyze", description=__doc__.split("\n")[0])
    p.add_argument("checkpoint")
    p.add_argument("--examples", type=int, default=8, help="test examples to analyse (default 8)")
    p.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = p.parse_args(argv)
    checks.existing_file("checkpoint", args.checkpoint)
    checks.at_least("--examples", args.examples, 1)
    try:
        state = load_checkpoint(args.checkpoint)
    except UnsafeCheckpointError as e:
        raise UsageError(str(e)) from None
    config = dataclasses.replace(config_from_checkpoint(state), device="cpu")
    task_options = dict(config.task_options, num_test=args.examples)
    data, model, _ = build(dataclasses.replace(config, task_options=task_options))
    model.load_state_dict(state["model"])
    model = model.double()
    inputs = data.test.inputs if data.kind != "regression" else data.test.inputs.double()
    rows = analyze(model, inputs[: args.examples])
    print(f"{config.task} / {config.mixer}, step {state['step']}, {len(inputs[: args.examples])} test examples")
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(task=config.task, mixer=config.mixer, step=state["step"], layers=rows), f, indent=1)
    return 0
