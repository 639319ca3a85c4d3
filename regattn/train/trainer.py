"""Training a task model: fixed seeds, a schedule, clipping, bf16 autocast on GPU, evaluation,
checkpoints that resume to the same parameters, and a progress bar.

    result = train(TrainConfig(task="mqar", mixer="parallax", steps=2000, lr=1e-3))

The batch of step ``s`` is a function of ``(seed, s)`` alone: the training split is shuffled per
epoch by a generator seeded from the seed and the epoch. So a run stopped after a checkpoint and
resumed from it takes the same batches, and (on the same device) ends at the same parameters, as
one that was never stopped.
"""
from __future__ import annotations

import dataclasses
import math
import os
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from regattn.models.stack import build_model
from regattn.tasks import IGNORE, Split, TaskData, make_task
from regattn.train.checkpoints import load_data
from regattn.train.optim import apply_schedule, build_optimizer
from regattn.train.progress import Progress
from regattn.train.schedules import lr_factor, wd_factor


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
    test examples every that many steps, in ``history["analysis"]`` (COR during training, parallax Figure 4a).
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


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


class BatchOrder:
    """The examples of each step: epoch ``e = step // (n // batch_size)`` is a permutation of the split
    seeded by ``(seed, e)``; the permutation of the current epoch is kept. Indices are on the CPU."""

    def __init__(self, n: int, batch_size: int, seed: int):
        self.n, self.batch_size, self.seed = n, batch_size, seed
        self.per_epoch = max(1, n // batch_size)
        self.epoch, self.perm = None, None

    def __call__(self, step: int) -> torch.Tensor:
        epoch, i = divmod(step, self.per_epoch)
        if epoch != self.epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + 7919 * epoch + 1)
            self.epoch, self.perm = epoch, torch.randperm(self.n, generator=g)
        return self.perm[i * self.batch_size: (i + 1) * self.batch_size]


def loss_and_counts(model, kind: str, batch: Split) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run ``model`` on a batch: ``(mean loss, correct or squared-error sum, count)``.

    Token tasks: cross-entropy and accuracy over the labelled positions, whose logits alone are
    computed (MQAR labels a few positions of a long sequence over an 8192-token vocabulary).
    Regression: MSE (mean over the masked positions and output dims).
    """
    if kind == "regression":
        err = ((model(batch.inputs).float() - batch.targets.float()) ** 2).mean(-1)[batch.mask]
        return err.mean(), err.sum().detach(), torch.tensor(err.numel(), device=err.device)
    labelled = batch.targets != IGNORE
    logits = model(batch.inputs, select=labelled).float()
    targets = batch.targets[labelled]
    n = labelled.sum()
    loss = F.cross_entropy(logits, targets, reduction="sum") / n.clamp_min(1)
    correct = (logits.argmax(-1) == targets).sum()
    return loss, correct.detach(), n


def autocast(device: torch.device, amp: bool):
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp and device.type == "cuda")


@torch.no_grad()
def evaluate(model, data: TaskData, split: Split, *, batch_size: int = 256, amp: bool = True) -> dict:
    """Loss and accuracy (token tasks) or MSE (regression) over a whole split."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    sums = torch.zeros(3, dtype=torch.float64, device=device)          # loss * count, metric, count
    for start in range(0, len(split), batch_size):
        batch = split.batch(torch.arange(start, min(start + batch_size, len(split)),
                                         device=split.inputs.device)).to(device)
        with autocast(device, amp):
            loss, metric, n = loss_and_counts(model, data.kind, batch)
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
                          betas=tuple(config.betas))
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
    """Run (or resume) training; returns the result: config, final and best evaluation, history.

    stop_at: leave after that many steps in total (for a checkpoint to be resumed later).
    A run whose training loss or gradient norm is not finite at some step stops at the next log point
    (``result["diverged"]``); that step's update is dropped (:func:`drop_nonfinite_update`), so the steps up
    to the log point run on finite parameters.
    """
    data, model, opt = build(config, data)
    device = next(model.parameters()).device
    history = {"train": [], "eval": []}
    step = 0
    if config.checkpoint and os.path.exists(config.checkpoint):
        state = load_checkpoint(config.checkpoint, map_location=device)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step, history = state["step"], state["history"]
    total = total_steps(config, len(data.train))
    end = total if stop_at is None else min(stop_at, total)
    sched = dict(warmup=config.warmup, decay_start=config.decay_start)
    order = BatchOrder(len(data.train), config.batch_size, config.seed)
    log = TrainLog(history, "mse" if data.kind == "regression" else "accuracy",
                   Progress(total, start=step, enabled=config.progress, label=f"{config.task}/{config.mixer}"))
    started = time.time()
    diverged = False
    model.train()
    while step < end:
        apply_schedule(opt, lr_factor(config.schedule, step, total, **sched),
                       wd_factor(config.schedule, step, total, gamma=config.wda_gamma, **sched))
        batch = data.train.batch(order(step).to(data.train.inputs.device)).to(device)
        with autocast(device, config.amp):
            loss, metric, n = loss_and_counts(model, data.kind, batch)
        opt.zero_grad()
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config.clip if config.clip > 0 else math.inf)
        drop_nonfinite_update(model, grad_norm)
        opt.step()
        step += 1
        log.add(step, opt.param_groups[0]["lr"], loss.detach(), metric / n.clamp_min(1), grad_norm)
        if (config.eval_every and step % config.eval_every == 0) or step == total:
            log.evaluation(step, evaluate(model, data, data.test, batch_size=config.eval_batch_size, amp=config.amp))
        if config.analyze_every and (step % config.analyze_every == 0 or step == total):
            history.setdefault("analysis", []).append(diagnose(model, data, config.analyze_examples, step))
        checkpoint_now = config.checkpoint and ((config.checkpoint_every and step % config.checkpoint_every == 0)
                                                or step == end)
        if checkpoint_now or step % LOG_EVERY == 0 or step == end:
            if not log.flush():
                diverged = True
                break
        if checkpoint_now:
            save_checkpoint(config.checkpoint, config=config, model=model, optimizer=opt, step=step, history=history)
    log.close()
    result = summarize(config, data, model, history, step, time.time() - started)
    result["diverged"] = diverged
    return result


LOG_EVERY = 25


def drop_nonfinite_update(model, grad_norm: torch.Tensor) -> None:
    """Zero every gradient when their norm is not finite (an overflowed backward), without a host sync.

    The optimizer then steps on zeros, which leaves the parameters finite; the step's non-finite norm, read
    back at the next log point, marks the run diverged. Without this, NaN parameters would reach the next
    forward, where a mechanism that validates its inputs (LLA's ridge) raises before the log point.
    """
    bad = ~torch.isfinite(grad_norm)
    for p in model.parameters():
        if p.grad is not None:
            p.grad.masked_fill_(bad, 0.0)


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
    """Per-step training rows kept as device tensors and read back every ``LOG_EVERY`` steps (one sync),
    then appended to ``history["train"]`` and shown on the progress bar."""

    def __init__(self, history: dict, key: str, bar: Progress):
        self.history, self.key, self.bar, self.pending = history, key, bar, []

    def add(self, step: int, lr: float, loss, metric, grad_norm) -> None:
        self.pending.append((step, lr, torch.stack([loss.float(), metric.float(), grad_norm.float()])))

    def evaluation(self, step: int, result: dict) -> None:
        self.history["eval"].append({"step": step, **result})

    def flush(self) -> bool:
        """Append the pending rows; False when one of them has a non-finite loss or gradient norm."""
        if not self.pending:
            return True
        values = torch.stack([v for _, _, v in self.pending]).tolist()
        for (step, lr, _), (loss, metric, grad_norm) in zip(self.pending, values):
            self.history["train"].append({"step": step, "loss": loss, self.key: metric, "grad_norm": grad_norm, "lr": lr})
        self.pending = []
        row, evals = self.history["train"][-1], self.history["eval"]
        extra = {f"test_{self.key}": evals[-1][self.key]} if evals else {}
        self.bar.update(row["step"], loss=row["loss"], **{self.key: row[self.key]}, **extra)
        return all(math.isfinite(loss) and math.isfinite(grad_norm) for loss, _, grad_norm in values)

    def close(self) -> None:
        self.flush()
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
