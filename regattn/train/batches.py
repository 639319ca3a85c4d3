"""Training batches of static shape, gathered on the device an epoch at a time.

A split becomes :class:`Examples`: the inputs and, per example, ``K`` positions where the loss is
measured (``select [N, K]``, int64 indices into the sequence), their targets ``[N, K]`` (``[N, K, d_out]``
for regression) and ``valid [N, K]``. ``K`` is the largest number of labelled positions of any example
(a token task's targets other than ``IGNORE``, a regression task's ``mask``); an example with fewer is
padded with unlabelled positions (``valid`` false, target ``IGNORE`` or 0). When every position of every
example is labelled (next-token training), ``select`` is None and the targets are the split's own. So a
batch's shapes depend on the batch size alone, and the model computes its readout at the ``K`` positions.

:class:`EpochBatches` gives the batch of step ``s``: epoch ``e = s // steps_per_epoch`` takes the examples
in the order of a permutation seeded by ``(seed, e)`` (:func:`epoch_permutation`), in whole batches. At
the first step of an epoch, the epoch's batches are gathered at once (on the device when the split is
there, else on the host into pinned memory and copied without blocking); a step then takes a view.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from regattn.tasks import IGNORE, Split


@dataclass
class Examples:
    """``inputs [N, T(, d_in)]``, ``select [N, K]`` or None, ``targets [N, K(, d_out)]``, ``valid [N, K]``
    (any leading dims: a stack of batches is ``[steps, B, ...]``)."""
    inputs: torch.Tensor
    select: torch.Tensor | None
    targets: torch.Tensor
    valid: torch.Tensor

    def tensors(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def map(self, fn) -> "Examples":
        return Examples(**{k: None if v is None else fn(v) for k, v in self.tensors().items()})

    def __len__(self) -> int:
        return self.inputs.shape[0]

    def __getitem__(self, index) -> "Examples":
        return self.map(lambda x: x[index])


def static_examples(split: Split, kind: str) -> Examples:
    """The split with ``K`` labelled positions per example (see the module text); one host read, of ``K``."""
    valid = split.mask if kind == "regression" else split.targets != IGNORE
    if bool(valid.all()):
        return Examples(split.inputs, None, split.targets, valid)
    K = int(valid.sum(1).max())
    # labelled positions first (in order), then unlabelled ones as padding
    select = torch.sort((~valid).to(torch.uint8), dim=1, stable=True).indices[:, :K].contiguous()
    at = select if split.targets.ndim == 2 else select[..., None].expand(-1, -1, split.targets.shape[-1])
    valid = valid.gather(1, select)
    targets = split.targets.gather(1, at)
    pad = IGNORE if kind != "regression" else 0
    targets = targets.masked_fill(~(valid if targets.ndim == 2 else valid[..., None]), pad)
    return Examples(split.inputs, select, targets, valid)


def epoch_permutation(n: int, seed: int, epoch: int) -> torch.Tensor:
    """The order of the ``n`` training examples in ``epoch`` (a CPU tensor)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + 7919 * epoch + 1)
    return torch.randperm(n, generator=g)


class EpochBatches:
    """``batches(step)``: the :class:`Examples` of training step ``step`` (``[B, ...]``, a view).

    Batches have ``min(batch_size, N)`` examples; an epoch has ``max(1, N // batch_size)`` of them (the
    remainder of the permutation is left out). ``device``: where the batches go.
    """

    def __init__(self, examples: Examples, batch_size: int, seed: int, device: torch.device):
        self.examples, self.seed, self.device = examples, seed, torch.device(device)
        self.rows = min(batch_size, len(examples))
        self.steps_per_epoch = max(1, len(examples) // batch_size)
        self.epoch, self.batches = None, None

    def gather(self, epoch: int) -> Examples:
        """All the batches of ``epoch``: ``[steps_per_epoch, B, ...]`` on the device."""
        index = epoch_permutation(len(self.examples), self.seed, epoch)[: self.steps_per_epoch * self.rows]
        if self.examples.inputs.device.type == self.device.type:  # cuda:0 is the trainer's cuda
            picked = self.examples[to_device(index, self.device)]
        else:
            picked = self.examples[index].map(lambda x: to_device(x, self.device))
        return picked.map(lambda x: x.view(self.steps_per_epoch, self.rows, *x.shape[1:]))

    def __call__(self, step: int) -> Examples:
        epoch, i = divmod(step, self.steps_per_epoch)
        if epoch != self.epoch:
            self.epoch, self.batches = epoch, self.gather(epoch)
        return self.batches[i]


def to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``x`` (on the host) on ``device``; to CUDA through pinned memory and without blocking the host (a copy
    from pageable memory would wait for the device's queue)."""
    if x.device == device:
        return x
    if device.type == "cuda" and x.device.type == "cpu":
        return x.pin_memory().to(device, non_blocking=True)
    return x.to(device)
