"""``regattn analyze CHECKPOINT [--examples N] [--seq-len T] [--json PATH]``: the mechanism diagnostics of a
trained model, per layer: a task model saved by ``regattn train --checkpoint`` (on the first test examples
of its task) or a language model saved by ``regattn lm --checkpoint`` (on the first validation windows of
its corpus)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os

from regattn.analysis.diagnostics import analyze
from regattn.train import checks
from regattn.train.checkpoints import UnsafeCheckpointError
from regattn.usage import UsageError

LM_SEQ_LEN = 128         # default window of an LM analysis: the diagnostics hold [B, H, T, T, D] in float64


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


def task_model(path: str, examples: int):
    """``(header, model, inputs)`` of a ``regattn train`` checkpoint: its first ``examples`` test inputs."""
    from regattn.train.trainer import build, config_from_checkpoint, load_checkpoint
    state = load_checkpoint(path)
    config = dataclasses.replace(config_from_checkpoint(state), device="cpu")
    data, model, _ = build(dataclasses.replace(config, task_options=dict(config.task_options, num_test=examples)))
    model.load_state_dict(state["model"])
    inputs = data.test.inputs[:examples]
    inputs = inputs.double() if data.kind == "regression" else inputs
    header = dict(task=config.task, mixer=config.mixer, step=state["step"])
    return header, model, inputs


def lm_model(path: str, examples: int, seq_len: int | None):
    """``(header, model, inputs)`` of a ``regattn lm`` checkpoint folder: its first ``examples`` validation
    windows of ``seq_len`` tokens (default: the run's, at most :data:`LM_SEQ_LEN`)."""
    from regattn.data.text import ByteTokenizer, stdlib_corpus
    from regattn.models import DecoderLM
    from regattn.train.lm import LMTrainConfig, load_checkpoint, model_config
    with open(os.path.join(path, "meta.json")) as f:
        config = LMTrainConfig(**json.load(f)["config"])
    model = DecoderLM(model_config(config, ByteTokenizer.vocab_size))
    meta = load_checkpoint(path, model)
    seq_len = seq_len or min(config.seq_len, LM_SEQ_LEN)
    inputs, _ = stdlib_corpus(config.max_bytes).windows("val", seq_len, examples * seq_len)
    return dict(task="lm", mixer=config.mixer, step=meta["step"]), model, inputs


def load(args):
    """The checkpoint's model and inputs; a file is a task checkpoint, a folder with meta.json an LM's."""
    checks.existing_file("checkpoint", args.checkpoint)
    if os.path.isdir(args.checkpoint) and not os.path.exists(os.path.join(args.checkpoint, "meta.json")):
        raise UsageError(f"checkpoint: {args.checkpoint!r} is a folder without meta.json (not a regattn lm checkpoint)")
    try:
        if os.path.isdir(args.checkpoint):
            return lm_model(args.checkpoint, args.examples, args.seq_len)
        return task_model(args.checkpoint, args.examples)
    except UnsafeCheckpointError as e:
        raise UsageError(str(e)) from None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="regattn analyze", description=__doc__.split("\n")[0])
    p.add_argument("checkpoint", help="a regattn train checkpoint file or a regattn lm checkpoint folder")
    p.add_argument("--examples", type=int, default=8, help="test examples or validation windows (default 8)")
    p.add_argument("--seq-len", type=int, default=None,
                   help=f"LM checkpoints: tokens per window (default: the run's, at most {LM_SEQ_LEN})")
    p.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = p.parse_args(argv)
    checks.at_least("--examples", args.examples, 1)
    if args.seq_len is not None:
        checks.at_least("--seq-len", args.seq_len, 1)
    header, model, inputs = load(args)
    rows = analyze(model.double(), inputs)
    mixer = header["mixer"] if isinstance(header["mixer"], str) else ",".join(header["mixer"])
    print(f"{header['task']} / {mixer}, step {header['step']}, {len(inputs)} examples of {inputs.shape[1]} positions")
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(header, layers=rows), f, indent=1)
    return 0
