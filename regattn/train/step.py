"""One training step on the device, with no host read: loss and metric, backward, clipping, a guard that
skips a non-finite update, and running sums that the trainer reads every ``log_every`` steps.

    step = TrainStep(model, "tokens", optimizer, clip=1.0, amp=True, compile="default")
    step(batch)                 # kernels only
    stats = step.read()         # one host read: means since the last read, and the skipped steps

The loss of a batch (:func:`batch_loss`) is computed at the batch's ``K`` selected positions
(:mod:`regattn.train.batches`), so its shapes are static and ``compile`` ("default" or "reduce-overhead",
``torch.compile``'s modes) compiles the model and the loss once for the run. The optimizer steps
eagerly; the guard hands it ``found_inf`` (:meth:`regattn.train.optim.Optimizers.step`), which skips the
update on the device when the loss or the gradient norm is not finite.

``cuda_graph`` (on CUDA) captures the whole step, forward, backward, clipping, guard, optimizer and sums, in one
CUDA graph after ``WARMUP_STEPS`` eager steps, and replays it: a step then costs the host a copy of the batch into
the graph's inputs and one launch. The warm-up and the capture run on the step's own stream: the current one when
the step is made, unless that is the device's default stream (then a stream of its own). Graphs captured on one
stream share that stream's cuBLAS workspace, which torch frees when any of them is destroyed; so runs side by side
(:mod:`regattn.train.interleave`) each capture on their own stream and replay there, and :meth:`TrainStep.close`
releases a run's graph when it ends, before the next run captures on that stream. Small models are bound by the
host's launches: on the H100 a step of the MAD model (softmax) took 6.9 ms of host time with
``compile="reduce-overhead"``, 4.0 ms of it the optimizer's launches, for about 1.2 ms of kernels; compiled and
captured whole it takes 1.26 ms (800 steps/s, docs/EXPERIMENTS.md). The learning rates become device tensors that
:func:`regattn.train.optim.apply_schedule` sets in place; the weight decay is held as captured.
"""
from __future__ import annotations

import functools
import math
import warnings

import torch
import torch.nn.functional as F

from regattn.tasks import IGNORE
from regattn.train.batches import Examples
from regattn.train.optim import capturable

COMPILE_MODES = ("none", "default", "reduce-overhead")
WARMUP_STEPS = 3          # eager steps before the capture: kernels tuned, optimizer states made
# models compiled in one process: each model (mixer and shapes) is an entry of forward_loss's compiled code, and
# past Dynamo's default limit of 8 a sweep's ninth model would train uncompiled, with a warning
COMPILED_MODELS = 512


def own_stream(device: torch.device) -> torch.cuda.Stream:
    """The current stream of ``device``, or a new one where that is the default stream (no capture runs there)."""
    current = torch.cuda.current_stream(device)
    return torch.cuda.Stream(device) if current == torch.cuda.default_stream(device) else current


def autocast(device: torch.device, amp: bool):
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp and device.type == "cuda")


def batch_loss(model, kind: str, inputs, select, targets, valid) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(mean loss, metric sum, count)`` over the valid selected positions of a batch.

    Token tasks: cross-entropy, and the number of correct argmax predictions. Regression: MSE (mean over
    positions and output dims), and the sum of the per-position squared errors.
    """
    out = model(inputs, select=select).float()
    n = valid.sum()
    if kind == "regression":
        err = torch.where(valid, ((out - targets.float()) ** 2).mean(-1), 0.0).sum()
        return err / n.clamp_min(1), err.detach(), n
    loss = F.cross_entropy(out.flatten(0, -2), targets.flatten(), ignore_index=IGNORE, reduction="sum")
    correct = ((out.argmax(-1) == targets) & valid).sum()
    return loss / n.clamp_min(1), correct, n


def forward_loss(model, kind: str, amp: bool, inputs, select, targets, valid):
    with autocast(inputs.device, amp):
        return batch_loss(model, kind, inputs, select, targets, valid)


def compiled(loss, mode: str):
    """``torch.compile`` of ``loss`` in ``mode``, Dynamo's limits raised to :data:`COMPILED_MODELS` models."""
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, COMPILED_MODELS)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 4 * COMPILED_MODELS)
    return torch.compile(loss, mode=None if mode == "default" else mode, dynamic=False)


class TrainStep:
    """``step(batch)`` runs one optimizer step on :class:`Examples` ``batch``; ``read()`` returns the means of
    the loss, metric (accuracy, or MSE) and gradient norm over the finite steps since the last read, the
    number of those steps, and of the skipped ones (non-finite loss or gradient norm: no update)."""

    def __init__(self, model, kind: str, optimizer, *, clip: float, amp: bool = True, compile: str = "none",
                 cuda_graph: bool = False):
        if compile not in COMPILE_MODES:
            raise ValueError(f"compile: expected one of {COMPILE_MODES}, got {compile!r}")
        self.optimizer, self.kind = optimizer, kind
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.max_norm = clip if clip > 0 else math.inf
        loss = functools.partial(forward_loss, model, kind, amp)
        self.graphs = compile == "reduce-overhead" and self.params[0].is_cuda
        if cuda_graph and compile == "reduce-overhead":
            raise ValueError("cuda_graph: captures the whole step itself; expected compile 'none' or 'default', "
                             "got 'reduce-overhead'")
        self.capture = cuda_graph and self.params[0].is_cuda
        self.loss = loss if compile == "none" else compiled(loss, compile)
        device = self.params[0].device
        self.totals = torch.zeros(3, device=device)     # loss, metric, grad norm summed over the finite steps
        self.skipped = torch.zeros((), device=device)
        self.steps = 0
        self.graph, self.inputs = None, None            # the captured step and the batch it reads
        self.captured = False                           # whether the steps replay a graph (kept after close)
        self.warmed = 0                                 # eager steps run before the capture
        self.stream = own_stream(device) if self.capture else None    # where warm-up and capture run

    def __call__(self, batch: Examples) -> None:
        if not self.capture:
            self.step(batch)
        elif self.graph is not None:
            for into, value in zip(self.inputs.tensors().values(), batch.tensors().values()):
                if into is not None:
                    into.copy_(value)
            self.graph.replay()
        elif self.warmed < WARMUP_STEPS:
            self.on_own_stream(self.step, batch)
            self.warmed += 1
        else:
            self.capture_step(batch)
        self.steps += 1

    def step(self, batch: Examples) -> None:
        """The device work of one step (what a captured step holds)."""
        if self.graphs:
            torch.compiler.cudagraph_mark_step_begin()
        loss, metric, n = self.loss(batch.inputs, batch.select, batch.targets, batch.valid)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.max_norm, foreach=True)
        bad = ~(torch.isfinite(loss) & torch.isfinite(norm))
        self.optimizer.step(found_inf=bad.float())
        values = torch.stack([loss.detach(), metric / n.clamp_min(1), norm]).float()
        self.totals += torch.where(bad, 0.0, values)
        self.skipped += bad

    def on_own_stream(self, fn, *args) -> None:
        """``fn(*args)`` on the step's stream, ordered after and before the current one."""
        current = torch.cuda.current_stream(self.stream.device)
        if current == self.stream:
            fn(*args)
            return
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            fn(*args)
        current.wait_stream(self.stream)

    def capture_step(self, batch: Examples) -> None:
        """Capture :meth:`step` on a copy of ``batch`` (the graph's inputs from now on) and run it. A model
        whose step cannot be captured (an operation that reads back to the host) trains eagerly, with a
        warning."""
        capturable(self.optimizer, self.params[0].device)
        self.inputs = batch.map(torch.clone)
        self.optimizer.zero_grad(set_to_none=True)      # the gradients are made in the graph's memory
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, stream=self.stream):
                self.step(self.inputs)
        except RuntimeError as error:                   # nothing ran: the parameters are as they were
            if "captur" not in str(error):
                raise
            warnings.warn(f"cuda_graph: the training step could not be captured, it runs eagerly ({error})",
                          stacklevel=3)
            self.capture, self.inputs = False, None
            self.step(batch)
            return
        self.graph, self.captured = graph, True
        graph.replay()

    def close(self) -> None:
        """Release the captured graph: its memory, and its stream's cuBLAS workspace (torch frees it as the graph
        goes), now rather than whenever the step is collected. Later calls step eagerly."""
        if self.graph is not None:
            torch.cuda.synchronize(self.stream.device)          # no replay still running on its memory
            self.graph.reset()
        self.graph, self.inputs, self.capture = None, None, False

    def read(self) -> dict:
        """The sums since the last read as means (one host read), and zero them."""
        loss, metric, norm, skipped = torch.cat([self.totals, self.skipped[None]]).tolist()
        steps, skipped = self.steps, int(skipped)
        self.totals.zero_()
        self.skipped.zero_()
        self.steps = 0
        finite = steps - skipped
        mean = (lambda total: total / finite if finite else math.nan)
        return dict(loss=mean(loss), metric=mean(metric), grad_norm=mean(norm), steps=steps, skipped=skipped)
