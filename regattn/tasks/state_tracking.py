"""Permutation state tracking (lla-local-linear-attention.txt Section 4, Appendix F.2).

Each example reads

    ``p_1 = a_1 , ... , p_N = a_N , # i_1 j_1 , ... , i_S j_S , # q_1 = o_1 , ... , q_Q = o_Q ,``

an initial assignment of ``N`` distinct items to positions, ``S ~ U{ceil(N/6) .. floor(N/3)}``
swap instructions (``i_s != j_s``, exchanging the items at two positions), then ``Q`` queries of
distinct positions. The label at each query's ``=`` token is ``o``, the item at position ``q``
after all swaps; every other label is ``IGNORE``. Examples with fewer swaps are padded at the end
with ``PAD`` to the common length ``4N + 2 + 3 floor(N/3) + 4Q``.

Vocabulary: ``PAD, #, =, ,`` (0-3), then ``N`` position tokens, then the ``|A|`` items
(the paper uses ``|A| = 8192`` and ``Q = 8``).
"""
from __future__ import annotations

import torch

from regattn.ops._common.checks import check_int
from regattn.tasks.common import IGNORE, TEST, TRAIN, Split, TaskData, generator, random_subsets

PAD, HASH, EQ, COMMA = 0, 1, 2, 3
SPECIAL = 4


def swap_range(positions: int) -> tuple[int, int]:
    """The inclusive range ``[ceil(N/6), floor(N/3)]`` of the swap count (at least 1)."""
    low = max(1, -(-positions // 6))
    return low, max(low, positions // 3)


def apply_swaps(state: torch.Tensor, swaps: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Apply the first ``count[n]`` swaps of ``swaps [N, S, 2]`` to ``state [N, P]`` (item per position)."""
    state = state.clone()
    rows = torch.arange(state.shape[0])
    for s in range(swaps.shape[1]):
        i, j = swaps[:, s, 0], swaps[:, s, 1]
        live = s < count
        a, b = state[rows, i], state[rows, j]
        state[rows, i] = torch.where(live, b, a)
        state[rows, j] = torch.where(live, a, b)
    return state


def state_tracking_split(num: int, positions: int, items: int, queries: int, *, g: torch.Generator) -> Split:
    """``num`` examples: inputs and targets ``[num, 4N + 2 + 3 floor(N/3) + 4Q]`` int64."""
    N, Q = positions, queries
    low, high = swap_range(N)
    count = torch.randint(low, high + 1, (num,), generator=g)
    start = random_subsets(g, num, items, N)                        # item index at each position
    i = torch.randint(0, N, (num, high), generator=g)
    j = (i + torch.randint(1, N, (num, high), generator=g)) % N      # i != j
    swaps = torch.stack([i, j], dim=-1)
    final = apply_swaps(start, swaps, count)
    asked = random_subsets(g, num, N, Q) if Q <= N else torch.randint(0, N, (num, Q), generator=g)
    answer = final.gather(1, asked)

    pos_tok, item_tok = SPECIAL, SPECIAL + N
    col = lambda value: torch.full((num, 1), value, dtype=torch.long)  # noqa: E731
    init = torch.stack([pos_tok + torch.arange(N).expand(num, N), col(EQ).expand(num, N),
                        item_tok + start, col(COMMA).expand(num, N)], dim=-1).reshape(num, 4 * N)
    swap_tok = torch.cat([pos_tok + swaps, col(COMMA).expand(num, high)[..., None]], dim=-1).reshape(num, 3 * high)
    query_tok = torch.stack([pos_tok + asked, col(EQ).expand(num, Q), item_tok + answer,
                             col(COMMA).expand(num, Q)], dim=-1).reshape(num, 4 * Q)
    labels = torch.full((num, 4 * Q), IGNORE, dtype=torch.long)
    labels[:, 1::4] = item_tok + answer                              # predicted at each query's '='

    tokens = torch.cat([init, col(HASH), swap_tok, col(HASH), query_tok], dim=1)
    targets = torch.full_like(tokens, IGNORE)
    targets[:, -4 * Q:] = labels
    # drop the unused swap triples of examples with fewer than `high` swaps, pad at the end
    k = torch.arange(tokens.shape[1])
    first_unused = 4 * N + 1 + 3 * count[:, None]
    drop = (k >= first_unused) & (k < 4 * N + 1 + 3 * high)
    order = drop.to(torch.int8).argsort(dim=1, stable=True)
    tokens, targets = tokens.gather(1, order), targets.gather(1, order)
    tail = k[None, :] >= tokens.shape[1] - 3 * (high - count[:, None])
    return Split(tokens.masked_fill(tail, PAD), targets.masked_fill(tail, IGNORE))


def state_tracking(*, positions: int = 16, items: int = 8192, queries: int = 8, num_train: int = 100_000,
                   num_test: int = 1_000, seed: int = 0, device="cpu") -> TaskData:
    """Permutation state tracking with its two splits.

    Args:
        positions: ``N``; items: ``|A|`` (at least ``N``, the initial items are distinct);
        queries: ``Q`` per example; num_train, num_test: examples; seed: the seed of both splits.
    """
    check_int("positions", positions, minimum=2)
    check_int("items", items, minimum=positions)
    check_int("queries", queries, minimum=1)
    check_int("num_train", num_train, minimum=1)
    check_int("num_test", num_test, minimum=1)
    check_int("seed", seed, minimum=0)
    train = state_tracking_split(num_train, positions, items, queries, g=generator(seed, TRAIN))
    test = state_tracking_split(num_test, positions, items, queries, g=generator(seed, TEST))
    info = dict(positions=positions, items=items, queries=queries, swaps=swap_range(positions))
    return TaskData("state", "tokens", train, test, vocab_size=SPECIAL + positions + items, info=info).to(device)
