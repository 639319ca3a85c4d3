"""In-context regression on non-stationary piecewise-linear data (lla-local-linear-attention.txt Section 4, eq. 17).

A prompt holds ``L`` input/target pairs followed by ``L'`` queries, each column ``[x; y]`` of
size ``d_x + d_y``:

    ``X = [[x_1 .. x_L x'_1 .. x'_L'], [y_1 .. y_L 0 .. 0]]``.

The ``L`` positions are cut into segments of ``S`` (``C = ceil(L / S)``); segment ``c`` has its
own input distribution ``P_c`` (a Gaussian folded into the ``c``-th cone, Appendix F.1 eq. 51, the
same cones as :mod:`regattn.tasks.regression`) and its own map ``A_c ~ N(0, I / d_x)``
(``[d_y, d_x]``): ``y_i = A_c x_i + delta * eps_i``. The pairs are shuffled. Each query draws a
segment ``c`` uniformly, ``x' ~ P_c`` and its label ``y' = A_c x'`` (noiseless). The model is
trained with MSE on the query positions; the paper uses ``delta = 0.1`` for training data and
``delta = 0`` for test data.
"""
from __future__ import annotations

import torch

from regattn.ops._common.checks import check_int, check_positive
from regattn.tasks.common import ROWS_PER_CHUNK, TEST, TRAIN, Split, TaskData, generator
from regattn.tasks.regression import cone_bits, cone_signs


def fold(z: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """eq. 51: ``x_j = s_j |z_j|`` for ``j < m``, ``z_j`` after; ``z [..., d]``, ``signs [..., m]``."""
    m = signs.shape[-1]
    return torch.cat([z[..., :m].abs() * signs, z[..., m:]], dim=-1)


def segment_maps(maps: torch.Tensor, x: torch.Tensor, segment: int) -> torch.Tensor:
    """``y_i = A_c x_i`` with ``c = i // S``: maps ``[N, C, d_y, d_x]``, x ``[N, L, d_x]`` -> ``[N, L, d_y]``,
    one matrix product per segment (no per-position copy of the maps)."""
    N, L, _ = x.shape
    C = maps.shape[1]
    padded = torch.nn.functional.pad(x, (0, 0, 0, C * segment - L)).view(N, C, segment, -1)
    return torch.einsum("ncij,ncsj->ncsi", maps, padded).reshape(N, C * segment, -1)[:, :L]


def icr_chunk(num: int, length: int, segment: int, *, dim_x: int, dim_y: int, queries: int, noise: float,
              g: torch.Generator) -> Split:
    """``num`` prompts: inputs ``[N, L + L', d_x + d_y]``, targets ``[N, L + L', d_y]``, mask on the queries."""
    C = -(-length // segment)
    signs = cone_signs(C, cone_bits(C), dtype=torch.float32)
    maps = torch.randn(num, C, dim_y, dim_x, generator=g) / dim_x ** 0.5

    seg = torch.arange(length) // segment
    x = fold(torch.randn(num, length, dim_x, generator=g), signs[seg])
    y = segment_maps(maps, x, segment) + noise * torch.randn(num, length, dim_y, generator=g)
    order = torch.rand(num, length, generator=g).argsort(dim=1)
    x, y = x.gather(1, order[..., None].expand_as(x)), y.gather(1, order[..., None].expand_as(y))

    qseg = torch.randint(0, C, (num, queries), generator=g)
    xq = fold(torch.randn(num, queries, dim_x, generator=g), signs[qseg])
    yq = torch.einsum("nqij,nqj->nqi", maps.gather(1, qseg[..., None, None].expand(-1, -1, dim_y, dim_x)), xq)

    inputs = torch.cat([torch.cat([x, y], -1), torch.cat([xq, torch.zeros_like(yq)], -1)], dim=1)
    targets = torch.cat([y, yq], dim=1)
    mask = torch.zeros(num, length + queries, dtype=torch.bool)
    mask[:, length:] = True
    return Split(inputs, targets, mask)


def icr_split(num: int, length: int, segment: int, *, dim_x: int = 32, dim_y: int = 32, queries: int = 16,
              noise: float = 0.1, g: torch.Generator) -> Split:
    """``num`` prompts drawn ``ROWS_PER_CHUNK`` at a time (see :func:`icr_chunk`)."""
    chunks = [icr_chunk(min(ROWS_PER_CHUNK, num - r), length, segment, dim_x=dim_x, dim_y=dim_y, queries=queries,
                        noise=noise, g=g) for r in range(0, num, ROWS_PER_CHUNK)]
    return Split(*(torch.cat([getattr(c, f) for c in chunks]) for f in ("inputs", "targets", "mask")))


def in_context_regression(*, length: int = 64, segment: int | None = None, segments: int | None = None,
                          dim_x: int = 32, dim_y: int = 32,
                          queries: int = 16, train_noise: float = 0.1, test_noise: float = 0.0,
                          num_train: int = 100_000, num_test: int = 1_000, seed: int = 0,
                          device="cpu") -> TaskData:
    """The task of lla eq. 17 with its two splits.

    Args:
        length: ``L`` context pairs; segment: ``S`` pairs per segment, or segments: ``C`` for
            ``S = L // C`` (the lla sweep's ``S`` in ``L/8 .. L``); neither: ``S = L``, one segment;
        dim_x, dim_y: ``d_x, d_y``; queries: ``L'``; train_noise / test_noise: ``delta`` per split;
        num_train, num_test: examples; seed: the seed of both splits.
    Returns:
        :class:`TaskData` of kind ``"regression"`` (``dim_in = d_x + d_y``, ``dim_out = d_y``).
    """
    if segment is not None and segments is not None:
        raise ValueError("segment, segments: expected at most one of them")
    if segments is not None:
        segment = max(1, length // check_int("segments", segments, minimum=1))
    segment = length if segment is None else segment
    for name, value in dict(length=length, segment=segment, dim_x=dim_x, dim_y=dim_y, queries=queries,
                            num_train=num_train, num_test=num_test).items():
        check_int(name, value, minimum=1)
    check_int("seed", seed, minimum=0)
    check_positive("train_noise", train_noise, allow_zero=True)
    check_positive("test_noise", test_noise, allow_zero=True)
    C = -(-length // segment)
    if cone_bits(C) > dim_x:
        raise ValueError(f"segment: {C} segments need {cone_bits(C)} cone coordinates, more than dim_x = {dim_x}")
    common = dict(dim_x=dim_x, dim_y=dim_y, queries=queries)
    train = icr_split(num_train, length, segment, noise=train_noise, g=generator(seed, TRAIN), **common)
    test = icr_split(num_test, length, segment, noise=test_noise, g=generator(seed, TEST), **common)
    info = dict(length=length, segment=segment, train_noise=train_noise, test_noise=test_noise, **common)
    return TaskData("icr", "regression", train, test, dim_in=dim_x + dim_y, dim_out=dim_y, info=info).to(device)
