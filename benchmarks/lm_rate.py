"""LM training throughput of softmax against Parallax (issue configuration: dim 512, 8 layers, 8/4 heads, T 1024,
batch 16, bf16 autocast, Muon), eager and compiled, in one process, with a torch profile of three eager steps:

    PYTHONPATH=. python benchmarks/lm_rate.py --out benchmarks/results/h100/experiments

writes ``lm-throughput.json`` and ``lm-profile-<mixer>.txt`` there.
"""
import argparse
import json
import os
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from regattn.bench.results import machine_info
from regattn.data import stdlib_corpus
from regattn.train.lm import LMTrainConfig, Runtime, build_model, train_step
from regattn.train.optim import build_optimizer

SHAPE = dict(dim=512, layers=8, heads=8, kv_heads=4, seq_len=1024, batch_size=16)
WARMUP, BURST, ROUNDS = 15, 10, 12
CLI = "regattn lm --mixer M --dim 512 --layers 8 --heads 8 --kv-heads 4 --seq-len 1024 --batch-size 16 --compile C"


def trainer(mixer: str, compile: str, rt: Runtime):
    config = LMTrainConfig(mixer=mixer, steps=1000, device="cuda", compile=compile, **SHAPE)
    model = build_model(config, rt)
    return config, model, build_optimizer(model, config.optimizer, lr=config.lr, weight_decay=config.weight_decay,
                                          fused=True)


def throughput(mixers: list[str], compile: str, corpus, rounds: int = ROUNDS) -> list[dict]:
    """Tokens/s (median) and last loss of each mixer over ``rounds`` bursts of :data:`BURST` steps, the mixers'
    bursts interleaved (the host's speed drifts within a run: interleaving gives both mixers the same
    conditions), after :data:`WARMUP` steps (that compile)."""
    rt = Runtime(rank=0, world=1, device=torch.device("cuda"))
    runs = {m: trainer(m, compile, rt) for m in mixers}
    steps = dict.fromkeys(mixers, 0)
    for m, (config, model, opt) in runs.items():
        for _ in range(WARMUP):
            train_step(model, opt, config, corpus, steps[m], rt)
            steps[m] += 1
    rates, last_loss = {m: [] for m in mixers}, {}
    for _ in range(rounds):
        for m, (config, model, opt) in runs.items():
            torch.cuda.synchronize()
            start = time.perf_counter()
            losses = [train_step(model, opt, config, corpus, steps[m] + i, rt) for i in range(BURST)]
            torch.cuda.synchronize()
            rates[m].append(BURST * config.batch_size * config.seq_len / (time.perf_counter() - start))
            steps[m] += BURST
            last_loss[m] = losses[-1].item()
    return [dict(mixer=m, compile=compile, tokens_per_second=statistics.median(rates[m]), rounds=rates[m],
                 loss=last_loss[m]) for m in mixers]


def kernel_profile(mixer: str, corpus) -> str:
    """The torch profile's table of three eager steps after ten warm-up steps, by CUDA time."""
    rt = Runtime(rank=0, world=1, device=torch.device("cuda"))
    config, model, opt = trainer(mixer, "none", rt)
    for step in range(10):
        train_step(model, opt, config, corpus, step, rt)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for step in range(10, 13):
            train_step(model, opt, config, corpus, step, rt)
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=70)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--mixers", default="softmax,parallax")
    p.add_argument("--compile", default="none,default")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    corpus = stdlib_corpus(None)
    mixers = args.mixers.split(",")
    runs = [run for c in args.compile.split(",") for run in throughput(mixers, c, corpus)]
    for run in runs:
        print(json.dumps({k: v for k, v in run.items() if k != "rounds"}), flush=True)
    with open(os.path.join(args.out, "lm-throughput.json"), "w") as f:
        json.dump(dict(experiment="LM training throughput, softmax against Parallax, eager and compiled",
                       machine=machine_info("cuda"), command="PYTHONPATH=. python benchmarks/lm_rate.py --out DIR",
                       training=CLI, tokens_per_second=f"median over {ROUNDS} bursts of {BURST} optimizer steps, the "
                       f"mixers' bursts interleaved, after {WARMUP} warm-up steps", runs=runs), f, indent=1)
    for mixer in mixers:
        with open(os.path.join(args.out, f"lm-profile-{mixer}.txt"), "w") as f:
            f.write(kernel_profile(mixer, corpus))


if __name__ == "__main__":
    main()
