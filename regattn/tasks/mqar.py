"""Multi-query associative recall (MQAR; Zoology, Arora et al. 2023; lla Section 4, gatedfwa Section 4.1).

A sequence of length ``L`` opens with ``P`` key-value pairs ``k_1 v_1 ... k_P v_P`` (distinct keys
from the key alphabet ``[1, V/2)``, values from ``[V/2, V)``), followed by a query region of
``L - 2P`` positions holding the ``P`` keys again, in a random order, at distinct random even
offsets; every other query-region position is the filler token 0. The label at a query key's
position is the value paired with that key in the context; all other labels are ``IGNORE``.

The lla paper fixes ``|A_k u A_v| = 8192`` and sweeps ``P`` over ``L/16, L/8, L/4``. The query offsets
are uniform over the free even offsets, or, with ``offset_power = a``, drawn as Zoology draws them (the
MQAR both papers adopt, with ``a = 0.01``): the ``s``-th free offset with weight ``(s + 1)^(a - 1)``,
without replacement, so that most queries sit near the pairs.
"""
from __future__ import annotations

import torch

from regattn.ops._common.checks import check_int, check_positive
from regattn.tasks.common import IGNORE, TEST, TRAIN, Split, TaskData, generator, random_subsets

FILLER = 0


def mqar_split(num: int, length: int, pairs: int, vocab_size: int, *, g: torch.Generator,
               offset_power: float | None = None) -> Split:
    """``num`` sequences: inputs and targets ``[N, L]`` int64."""
    half = vocab_size // 2
    keys = random_subsets(g, num, half - 1, pairs) + 1            # distinct keys in [1, V/2)
    values = torch.randint(half, vocab_size, (num, pairs), generator=g)
    inputs = torch.full((num, length), FILLER, dtype=torch.long)
    targets = torch.full((num, length), IGNORE, dtype=torch.long)
    inputs[:, 0:2 * pairs:2], inputs[:, 1:2 * pairs:2] = keys, values

    free = (length - 2 * pairs) // 2
    weights = None if offset_power is None else torch.arange(1, free + 1, dtype=torch.float64) ** (offset_power - 1)
    slots = random_subsets(g, num, free, pairs, weights=weights)      # one distinct slot per queried key
    pos = 2 * pairs + 2 * slots
    rows = torch.arange(num)[:, None]
    inputs[rows, pos] = keys
    targets[rows, pos] = values
    return Split(inputs, targets)


def mqar(*, length: int = 64, pairs: int | None = None, pairs_per_length: int | None = None, vocab_size: int = 8192,
         num_train: int = 20_000, num_test: int = 1_000, seed: int = 0, offset_power: float | None = None,
         device="cpu") -> TaskData:
    """MQAR with its two splits.

    Args:
        length: ``L``; pairs: ``P`` key-value pairs (at most ``L // 4``), or pairs_per_length: ``r`` for
        ``P = L // r`` (the lla sweep's ``r`` in 16, 8, 4); neither: ``P = L // 8``;
        vocab_size: ``|A_k u A_v|``; num_train, num_test: examples; seed: the seed of both splits;
        offset_power: ``None`` for uniform query offsets, or Zoology's power ``a`` in ``(0, 1]`` (see the
        module's text).
    """
    check_int("length", length, minimum=4)
    if pairs is not None and pairs_per_length is not None:
        raise ValueError("pairs, pairs_per_length: expected at most one of them")
    if pairs_per_length is not None:
        pairs = length // check_int("pairs_per_length", pairs_per_length, minimum=1)
    pairs = max(1, length // 8) if pairs is None else pairs
    check_int("pairs", pairs, minimum=1)
    check_int("vocab_size", vocab_size, minimum=4)
    check_int("num_train", num_train, minimum=1)
    check_int("num_test", num_test, minimum=1)
    check_int("seed", seed, minimum=0)
    if offset_power is not None and check_positive("offset_power", offset_power) > 1:
        raise ValueError(f"offset_power: expected None or a number in (0, 1], got {offset_power!r}")
    if 4 * pairs > length:
        raise ValueError(f"pairs: expected at most length // 4 = {length // 4} key-value pairs, got {pairs}")
    if pairs > vocab_size // 2 - 1:
        raise ValueError(f"pairs: {pairs} distinct keys need vocab_size > {2 * pairs + 1}, got {vocab_size}")
    train = mqar_split(num_train, length, pairs, vocab_size, g=generator(seed, TRAIN), offset_power=offset_power)
    test = mqar_split(num_test, length, pairs, vocab_size, g=generator(seed, TEST), offset_power=offset_power)
    info = dict(length=length, pairs=pairs, vocab_size=vocab_size, offset_power=offset_power)
    return TaskData("mqar", "tokens", train, test, vocab_size=vocab_size, info=info).to(device)
