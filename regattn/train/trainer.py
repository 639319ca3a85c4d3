"""Training a task model: fixed seeds, a schedule, clipping, bf16 autocast on GPU, evaluation,
checkpoints that resume to the same parameters, and a progress bar.

    result = train(TrainConfig(task="mqar", mixer="parallax", steps=2000, lr=1e-3))

The batch of step ``s`` is a function of ``(seed, s)`` alone: the training split is shuffled per
epoch by a generator seeded from the seed and the epoch. So a run stopped after a checkpoint and
resumed from it takes the same batches, and (on the same device) ends at the same parameters, as
one that was never stopped.

A step reads nothing back to the host (:class:`regattn.train.step.TrainStep`): batches have static
shapes and are gathered on the device an epoch at a time (:mod:`regattn.train.batches`), loss and
accuracy are summed on the device and read every ``log_every`` steps, a step whose loss or gradient
norm is not finite is skipped on the device and counted, and ``compile`` compiles model and loss.
"""
from __future__ import annotations

import dataclasses
import math
import os
import time
from dataclasses import dataclass, field

import torch

from regattn.models.stack import build_model
from regattn.tasks import Split, TaskData, make_task
from regattn.train.batches import EpochBatches, static_examples
from regattn.train.checkpoints import load_data
from regattn.train.optim import apply_schedule, build_optimizer
from regattn.train.progress import Progress, Throughput
from regattn.train.schedules import lr_factor, wd_factor
from regattn.train.step import COMPILE_MODES, TrainStep, autocast, batch_loss


@dataclass
class TrainConfig:
    """Everything a run depends on.

    task / task_options: a name of :data:`regattn.tasks.TASKS` and its settings (sizes included);
    mixer / mixer_options: a name of :data:`regattn.models.mixers.MIXER_NAMES` and its options;
    dim, layers, heads, mlp: the :class:`regattn.models.stack.MixerStack`;
    optimizer ("adamw" | "muon"), lr (peak), weight_decay, betas (AdamW), clip (gradient norm; 0 = off);
    schedule ("wsd" | "cosine" | "constant"), warmup and decay_start (fractions; None = the schedule's
    defaults), wda_gamma (weight-decay annealing exponent, eq. 42);
    steps, batch_size, eval_every (steps; 0 = only at the end), eval_batch_size; epochs (when set, the
    run takes ``epochs * (num_train // batch_size)`` steps instead of ``steps``);
    seed (data and initialisation), device ("auto": CUDA when present), amp (bf16 autocast on CUDA);
    checkpoint (a path, written every checkpoint_every steps and at the end; resumed from when it exists);
    analyze_every: record the :mod:`regattn.analysis` diagnostics per layer on the first analyze_examples
    test examples every that many steps, in ``history["analysis"]`` (COR during training, parallax Figure 4a);
    log_every: read the training loss and accuracy back every that many steps (a row of ``history["train"]``:
    the means over those steps); compile: "none", or a ``torch.compile`` mode ("default", "reduce-overhead")
    for the model and the loss; cuda_graph: on CUDA, each step after the first few replays one CUDA graph of
    the whole step (:class:`regattn.train.step.TrainStep`; with compile "none" or "default", and a fixed
    weight decay: no ``wda_gamma``).
    """
    task: str = "mqar"
    task_options: dict = field(default_factory=dict)
    mixer: str = "softmax"
    mixer_options: dict = field(default_factory=dict)
    dim: int = 128
    layers: int = 2
    heads: int = 2
    mlp: bool = True
    optimizer: str = "adamw"
    lr: float = 1e-3
    weight_decay: float = 0.1
    betas: tuple = (0.9, 0.999)
    clip: float = 1.0
    schedule: str = "wsd"
    warmup: float | None = None
    decay_start: float | None = None
    wda_gamma: float = 0.0
    steps: int = 1000
    epochs: float | None = None
    batch_size: int = 64
    eval_every: int = 0
    eval_batch_size: int = 256
    seed: int = 0
    device: str = "auto"
    amp: bool = True
    checkpoint: str | None = None
    checkpoint_every: int = 0
    analyze_every: int = 0
    analyze_examples: int = 4
    progress: bool = True
    log_every: int = 100
    compile: str = "none"
    cuda_graph: bool = False


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


@torch.no_grad()
def evaluate(model, data: TaskData, split: Split, *, batch_size: int = 256, amp: bool = True) -> dict:
    """Loss and accuracy (token tasks) or MSE (regression) over a whole split."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    examples = static_examples(split, data.kind)
    sums = torch.zeros(3, dtype=torch.float64, device=device)          # loss * count, metric, count
    for start in range(0, len(split), batch_size):
        batch = examples[start:start + batch_size].map(lambda x: x.to(device))
        with autocast(device, amp):
            loss, metric, n = batch_loss(model, data.kind, *batch.tensors().values())
        sums += torch.stack([loss.double() * n, metric.double(), n.double()])
    model.train(was_training)
    loss_sum, metric_sum, count = sums.tolist()
    key = "mse" if data.kind == "regression" else "accuracy"
    return {"loss": loss_sum / max(1.0, count), key: metric_sum / max(1.0, count)}


DEVICE_DATA_BYTES = 2 ** 31


def split_bytes(split: Split) -> int:
    return sum(x.numel() * x.element_size() for x in (split.inputs, split.targets, split.mask) if x is not None)


def build(config: TrainConfig, data: TaskData | None = None):
    """``(data, model, optimizer)`` for ``config``, seeded; ``data`` may be given to reuse a built task."""
    device = resolve_device(config.device)
    if data is None:
        data = make_task(config.task, seed=config.seed, **config.task_options)
    if split_bytes(data.train) + split_bytes(data.test) <= DEVICE_DATA_BYTES:
        data = data.to(device)                   # else the splits stay on the CPU and batches move
    torch.manual_seed(config.seed)
    model = build_model(data, config.mixer, dim=config.dim, layers=config.layers, heads=config.heads,
                        mlp=config.mlp, mixer_options=dict(config.mixer_options)).to(device)
    opt = build_optimizer(model, config.optimizer, lr=config.lr, weight_decay=config.weight_decay,
                          betas=tuple(config.betas), fused=True)
    return data, model, opt


def save_checkpoint(path: str, *, config: TrainConfig, model, optimizer, step: int, history: dict) -> None:
    """Model and optimizer states, the step reached, the history and the config as a dict (atomically
    replaced); tensors and plain data only, so that it loads with ``weights_only=True``."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    torch.save(dict(config=dataclasses.asdict(config), model=model.state_dict(), optimizer=optimizer.state_dict(),
                    step=step, history=history), tmp)
    os.replace(tmp, path)


def load_checkpoint(path: str, map_location="cpu") -> dict:
    """The checkpoint's contents, read as data (:func:`regattn.train.checkpoints.load_data`)."""
    return load_data(path, map_location)


def config_from_checkpoint(state: dict) -> TrainConfig:
    return TrainConfig(**state["config"])


def train(config: TrainConfig, *, data: TaskData | None = None, stop_at: int | None = None) -> dict:
    """Run (or resume) training: :func:`training` to its end; its result."""
    return finish(training(config, data=data, stop_at=stop_at))


def finish(steps):
    """The return value of generator ``steps``, run to its end."""
    while True:
        try:
            next(steps)
        except StopIteration as end:
            return end.value


def training(config: TrainConfig, *, data: TaskData | None = None, stop_at: int | None = None):
    """A run (or its resumption) as a generator: each ``next()`` issues one optimizer step (the first also builds
    the model; log points, evaluations and checkpoints come with the step they follow), so that several runs can
    go on side by side in one process (:mod:`regattn.train.interleave`). Its return value (``StopIteration.value``) is
    the result: config, final and best evaluation, history, and
    ``steps_per_second`` (optimizer steps per second from the first log point to the end, evaluations
    left out: the first steps, which compile, are not counted; None with a single log point), and
    ``captured`` (whether the steps replayed a CUDA graph), ``resumed_from`` (the checkpoint's step, 0 for a fresh
    run; ``seconds`` and ``steps_per_second`` cover the steps after it).

    stop_at: leave after that many steps in total (for a checkpoint to be resumed later).
    A step whose training loss or gradient norm is not finite makes no update (``result["skipped_steps"]``
    counts them); a run whose steps since the last log point were all skipped stops there
    (``result["diverged"]``).
    """
    if config.compile not in COMPILE_MODES:
        raise ValueError(f"compile: expected one of {COMPILE_MODES}, got {config.compile!r}")
    if config.log_every < 1:
        raise ValueError(f"log_every: expected a value >= 1, got {config.log_every}")
    if config.cuda_graph and config.wda_gamma:
        raise ValueError(f"wda_gamma: a CUDA graph holds the weight decay it was captured with; expected 0 with "
                         f"cuda_graph, got {config.wda_gamma}")
    data, model, opt = build(config, data)
    device = next(model.parameters()).device
    history = {"train": [], "eval": []}
    step = 0
    if config.checkpoint and os.path.exists(config.checkpoint):
        state = load_checkpoint(config.checkpoint, map_location=device)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step, history = state["step"], state["history"]
    resumed_from = step
    total = total_steps(config, len(data.train))
    end = total if stop_at is None else min(stop_at, total)
    sched = dict(warmup=config.warmup, decay_start=config.decay_start)
    batches = EpochBatches(static_examples(data.train, data.kind), config.batch_size, config.seed, device)
    train_step = TrainStep(model, data.kind, opt, clip=config.clip, amp=config.amp, compile=config.compile,
                           cuda_graph=config.cuda_graph)
    log = TrainLog(history, "mse" if data.kind == "regression" else "accuracy",
                   Progress(total, start=step, enabled=config.progress, label=f"{config.task}/{config.mixer}"))
    sync = (lambda: torch.cuda.current_stream(device).synchronize()) if device.type == "cuda" else None
    started, clock = time.time(), Throughput(sync=sync)
    diverged = False
    model.train()
    try:
        while step < end:
            lr_scale = lr_factor(config.schedule, step, total, **sched)
            apply_schedule(opt, lr_scale, wd_factor(config.schedule, step, total, gamma=config.wda_gamma, **sched))
            train_step(batches(step))
            step += 1
            checkpoint_now = config.checkpoint and ((config.checkpoint_every and step % config.checkpoint_every == 0)
                                                    or step == end)
            if checkpoint_now or step % config.log_every == 0 or step == end:
                stats = train_step.read()
                clock.mark(step)
                if not log.add(step, config.lr * lr_scale, stats):
                    diverged = True
                    break
            evaluate_now = (config.eval_every and step % config.eval_every == 0) or step == total
            analyze_now = config.analyze_every and (step % config.analyze_every == 0 or step == total)
            if evaluate_now or analyze_now or checkpoint_now:
                with clock.paused():
                    if evaluate_now:
                        log.evaluation(step, evaluate(model, data, data.test, batch_size=config.eval_batch_size,
                                                      amp=config.amp))
                    if analyze_now:
                        history.setdefault("analysis", []).append(diagnose(model, data, config.analyze_examples, step))
                    if checkpoint_now:
                        save_checkpoint(config.checkpoint, config=config, model=model, optimizer=opt, step=step,
                                        history=history)
            yield
    finally:
        train_step.close()             # its graph released before another run captures on its stream
    log.close()
    result = summarize(config, data, model, history, step, time.time() - started)
    result.update(diverged=diverged, steps_per_second=clock.rate(), captured=train_step.captured,
                  resumed_from=resumed_from, skipped_steps=sum(row.get("skipped", 0) for row in history["train"]))
    return result


def diagnose(model, data: TaskData, examples: int, step: int) -> dict:
    """The per-layer diagnostics on the first ``examples`` test inputs, the model left in training mode."""
    from regattn.analysis.diagnostics import analyze
    device = next(model.parameters()).device
    layers = analyze(model, data.test.inputs[:examples].to(device))
    model.train()
    return {"step": step, "layers": layers}


def total_steps(config: TrainConfig, num_train: int) -> int:
    """``steps``, or ``epochs`` passes over ``num_train`` examples in whole batches."""
    if config.epochs is None:
        return config.steps
    return max(1, round(config.epochs * max(1, num_train // config.batch_size)))


class TrainLog:
    """The rows of ``history["train"]``, one per log point (the means over the steps since the last one, the
    learning rate at the log point, and the steps skipped), shown on the progress bar."""

    def __init__(self, history: dict, key: str, bar: Progress):
        self.history, self.key, self.bar = history, key, bar

    def add(self, step: int, lr: float, stats: dict) -> bool:
        """Append a row of :meth:`regattn.train.step.TrainStep.read`'s ``stats``; False when every step since
        the last row was skipped."""
        row = {"step": step, "loss": stats["loss"], self.key: stats["metric"], "grad_norm": stats["grad_norm"],
               "lr": lr, "skipped": stats["skipped"]}
        self.history["train"].append(row)
        evals = self.history["eval"]
        extra = {f"test_{self.key}": evals[-1][self.key]} if evals else {}
        self.bar.update(step, loss=row["loss"], **{self.key: row[self.key]}, **extra)
        return stats["skipped"] < stats["steps"]

    def evaluation(self, step: int, result: dict) -> None:
        self.history["eval"].append({"step": step, **result})

    def close(self) -> None:
        self.bar.close()


def score(metric: str, value: float | None) -> float:
    """Larger is better: accuracy as is, MSE negated; NaN or missing is the worst score."""
    if value is None or not math.isfinite(value):
        return -math.inf
    return -value if metric == "mse" else value


def summarize(config: TrainConfig, data: TaskData, model, history: dict, step: int, seconds: float) -> dict:
    """The result record of a run."""
    key = "mse" if data.kind == "regression" else "accuracy"
    evals = history["eval"]
    best = max(evals, key=lambda e: score(key, e[key])) if evals else None
    return dict(config=dataclasses.asdict(config), task_info=data.info, metric=key, steps=step, seconds=seconds,
                parameters=sum(p.numel() for p in model.parameters()), final=evals[-1] if evals else None,
                best=best, history=history, model=model)
