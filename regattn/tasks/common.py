"""What every synthetic task shares: the data container, the seeded generator and the split rule.

A task is a pair of fixed splits (train and test), each ``(inputs, targets)``:

* token tasks: ``inputs [N, T]`` int64, ``targets [N, T]`` int64 where ``IGNORE`` (-100) marks
  positions without a label; the model predicts ``targets[:, t]`` from ``inputs[:, :t + 1]``;
* regression tasks: ``inputs [N, T, d_in]`` float, ``targets [N, T, d_out]`` float and a
  ``mask [N, T]`` bool of the positions the loss and the error are measured on.

Everything is drawn from ``torch.Generator`` objects seeded from the task seed, on the CPU, and
then moved to the requested device, so the same seed gives the same tensors on every device.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

IGNORE = -100


@dataclass
class Split:
    """One split: ``inputs``, ``targets`` and, for regression, ``mask`` (None for token tasks)."""
    inputs: torch.Tensor
    targets: torch.Tensor
    mask: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.inputs.shape[0]

    def to(self, device) -> "Split":
        move = (lambda x: None if x is None else x.to(device))
        return Split(move(self.inputs), move(self.targets), move(self.mask))

    def batch(self, index: torch.Tensor) -> "Split":
        """The examples ``index`` (a 1-D LongTensor on the split's device)."""
        pick = (lambda x: None if x is None else x[index])
        return Split(pick(self.inputs), pick(self.targets), pick(self.mask))


@dataclass
class TaskData:
    """A task's two splits and what a model needs to read it.

    kind: ``"tokens"`` (next-token style classification), ``"regression"`` (MSE on ``mask``) or
    ``"autoencode"`` (tokens reconstructed from the last position's state, MAD compression).
    vocab_size: token tasks; dim_in / dim_out: regression tasks. info: the generator's settings.
    """
    name: str
    kind: str
    train: Split
    test: Split
    vocab_size: int = 0
    dim_in: int = 0
    dim_out: int = 0
    info: dict = field(default_factory=dict)

    @property
    def seq_len(self) -> int:
        return self.train.inputs.shape[1]

    def to(self, device) -> "TaskData":
        return TaskData(self.name, self.kind, self.train.to(device), self.test.to(device), self.vocab_size,
                        self.dim_in, self.dim_out, dict(self.info))


def generator(seed: int, stream: int = 0) -> torch.Generator:
    """A CPU generator for ``(seed, stream)``; streams keep the train and test draws independent."""
    g = torch.Generator(device="cpu")
    g.manual_seed(int(seed) * 1_000_003 + int(stream))
    return g


TRAIN, TEST = 0, 1


def randint(g: torch.Generator, low: int, high: int, shape) -> torch.Tensor:
    """Uniform int64 in ``[low, high)`` of ``shape``."""
    return torch.randint(low, high, tuple(shape), generator=g)


ROWS_PER_CHUNK = 1024


def random_subsets(g: torch.Generator, rows: int, n: int, k: int, *, sort: bool = False,
                   weights: torch.Tensor | None = None) -> torch.Tensor:
    """``[rows, k]`` distinct indices in ``[0, n)`` per row (uniform k-subsets, random order unless sort).

    The ``k`` largest of ``n`` random keys per row, drawn ``ROWS_PER_CHUNK`` rows at a time so that
    memory stays ``O(ROWS_PER_CHUNK * n)``. With ``weights`` (``[n]``, positive) the keys are
    ``log(u) / w``: index ``i`` is drawn in proportion to ``weights[i]``, one after another without
    replacement (Efraimidis and Spirakis); without them the subsets are uniform.
    """
    if k > n:
        raise ValueError(f"k: cannot draw {k} distinct items from {n}")

    def keys(m):
        u = torch.rand(m, n, generator=g)
        return u if weights is None else u.log() / weights
    parts = [keys(min(ROWS_PER_CHUNK, rows - r)).topk(k, dim=1).indices for r in range(0, rows, ROWS_PER_CHUNK)]
    idx = torch.cat(parts) if parts else torch.empty(0, k, dtype=torch.long)
    return idx.sort(dim=1).values if sort else idx
