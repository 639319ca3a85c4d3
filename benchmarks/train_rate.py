"""Optimizer steps per second of the task trainer on parallax's MAD configuration: mad_recall (length 128,
12800 examples), the 2-layer d=128 model, batch 128, Muon, WSD without warm-up.

    PYTHONPATH=. python benchmarks/train_rate.py --mixer softmax --epochs 5 [--compile default] [--cuda-graph]

Prints one JSON line: ``run_steps_per_second``, the run's steps over the trainer's own ``seconds`` (its loop:
the first steps, any compilation and the final evaluation included; every version of the trainer reports
it, so it compares versions), and ``steps_per_second`` where the trainer measures it (from the first log
point to the end, evaluations left out).
"""
import argparse
import dataclasses
import json

import torch

from regattn.train.trainer import TrainConfig, train


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mixer", default="softmax")
    p.add_argument("--epochs", type=float, default=5)
    p.add_argument("--num-train", type=int, default=12_800)
    p.add_argument("--compile", default=None, help="none, default or reduce-overhead (trainers that have it)")
    p.add_argument("--cuda-graph", action="store_true", help="replay each step as one CUDA graph (trainers that have it)")
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    extra = {} if args.compile is None else {"compile": args.compile}
    if args.cuda_graph:
        extra["cuda_graph"] = True
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    for name in extra:
        if name not in known:
            p.error(f"--{name.replace('_', '-')}: this trainer has no {name} option")
    config = TrainConfig(task="mad_recall", task_options=dict(num_train=args.num_train), mixer=args.mixer,
                         optimizer="muon", schedule="wsd", warmup=0.0, decay_start=0.8, epochs=args.epochs,
                         batch_size=128, device=args.device, progress=False, **extra)
    r = train(config)
    device = torch.cuda.get_device_name() if config.device.startswith("cuda") else config.device
    print(json.dumps(dict(mixer=args.mixer, compile=args.compile or "none", cuda_graph=args.cuda_graph, steps=r["steps"],
                          seconds=round(r["seconds"], 2), run_steps_per_second=round(r["steps"] / r["seconds"], 1),
                          steps_per_second=r.get("steps_per_second") and round(r["steps_per_second"], 1),
                          test_accuracy=round(r["final"]["accuracy"], 4), device=device)))


if __name__ == "__main__":
    main()
