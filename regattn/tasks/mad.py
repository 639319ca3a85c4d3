"""The six MAD tasks (Poli et al. 2024, "Mechanistic Design and Scaling of Hybrid Architectures";
parallax.txt Section 4.1 and Appendix E), generated locally and seeded.

* ``recall`` (in-context recall): ``L/2`` key-value pairs from a per-sequence random map (keys from
  the first half of the vocabulary, values from the second); a key may repeat, with its value.
  Trained on next-token prediction; tested on the values of keys already seen in the sequence.
* ``noisy_recall``: the same with each pair replaced, with probability ``frac_noise``, by two
  tokens of a separate noise vocabulary.
* ``fuzzy_recall``: keys and values are motifs of 1..3 distinct tokens; test keys have the
  largest motif size; sequences are left-padded.
* ``selective_copy``: ``n`` tokens scattered among blanks, a copy token, then ``n`` blanks at
  which the ``n`` tokens must be reproduced in order.
* ``compression``: ``L - 1`` random tokens and a compression token; the whole sequence is
  reconstructed from the model's state at the last position (kind ``"autoencode"``).
* ``memorization``: pairs ``(key, insert)`` whose label at ``insert`` is the value of a fixed,
  dataset-wide map (seeded by ``map_seed``), learned from the training set.

Every generator draws from a seeded generator and returns one :class:`Split`: the recall tasks'
inputs are the first ``L - 1`` tokens of a length-``L`` sequence (as in the original release),
the other tasks' inputs have length ``L``. :data:`MAD_TASKS` holds each task's baseline setting
and the difficulty changes of the benchmark; :func:`mad_benchmark_settings` lists them and
:func:`mad_hard_settings` the harder sweep of parallax Figure 1b (vocabulary up to 512, context up
to 2048 on recall, noisy recall and selective copying).
"""
from __future__ import annotations

import numpy as np
import torch

from regattn.ops._common.checks import check_int
from regattn.tasks.common import IGNORE, TEST, TRAIN, Split, TaskData, generator, random_subsets


def recall_split(num: int, *, vocab_size: int, seq_len: int, noise_vocab_size: int = 0, frac_noise: float = 0.0,
                 training: bool, g: torch.Generator) -> Split:
    """In-context recall (multi-query), optionally noisy. inputs / targets ``[num, seq_len - 1]``."""
    clean = vocab_size - noise_vocab_size
    n_keys = clean // 2
    P = seq_len // 2
    value_of = torch.randint(n_keys, clean, (num, n_keys), generator=g)
    keys = torch.randint(0, n_keys, (num, P), generator=g)
    noise = torch.rand(num, P, generator=g) < frac_noise
    keep = torch.randint(0, P - 1, (num,), generator=g)                  # one guaranteed pair before the probe
    noise[torch.arange(num), keep] = False
    noise[:, -1] = False
    probe = torch.multinomial((~noise[:, :-1]).float(), 1, generator=g)  # the last pair repeats a seen key
    keys[:, -1] = keys.gather(1, probe)[:, 0]
    values = value_of.gather(1, keys)

    pairs = torch.stack([keys, values], dim=-1)
    if frac_noise > 0:
        junk = torch.randint(clean, vocab_size, (num, P, 2), generator=g)
        pairs = torch.where(noise[..., None], junk, pairs)
    tokens = pairs.reshape(num, 2 * P)
    if training:
        return Split(tokens[:, :-1], tokens[:, 1:])
    seen = (keys[:, :, None] == keys[:, None, :]) & ~noise[:, None, :] & torch.ones(P, P).tril(-1).bool()
    asked = seen.any(-1) & ~noise
    labels = torch.full((num, P, 2), IGNORE, dtype=torch.long)
    labels[..., 1] = torch.where(asked, values, IGNORE)
    return Split(tokens[:, :-1], labels.reshape(num, 2 * P)[:, 1:])


def fuzzy_recall_split(num: int, *, vocab_size: int, seq_len: int, k_motif_size: int = 3, v_motif_size: int = 3,
                       training: bool, seed: int) -> Split:
    """Fuzzy in-context recall (multi-query): motif keys and values, left-padded. ``[num, seq_len]``."""
    rng = np.random.default_rng(seed)
    pad = vocab_size - 1
    clean = vocab_size - 1
    key_vocab, value_vocab = np.arange(clean // 2), np.arange(clean // 2, clean)
    width = k_motif_size + v_motif_size
    inputs = np.full((num, seq_len + 1), pad, dtype=np.int64)
    labels = np.full((num, seq_len + 1), IGNORE, dtype=np.int64)
    for n in range(num):
        table, seq, lab = {}, [], []
        while len(seq) + width <= seq_len + 1 - width:   # leave room for the final probe
            k_size = rng.integers(1, k_motif_size + 1) if training else k_motif_size
            key = tuple(rng.permutation(key_vocab)[:k_size])
            fresh = key not in table
            if fresh:
                table[key] = tuple(rng.permutation(value_vocab)[:rng.integers(1, v_motif_size + 1)])
            seq += key + table[key]
            lab += [IGNORE] * len(key) + ([IGNORE] * len(table[key]) if fresh else list(table[key]))
        keys = list(table)
        key = keys[rng.integers(len(keys))]
        seq += key + table[key]
        lab += [IGNORE] * len(key) + list(table[key])
        inputs[n, seq_len + 1 - len(seq):] = seq
        labels[n, seq_len + 1 - len(lab):] = lab
    inputs, labels = torch.from_numpy(inputs), torch.from_numpy(labels)
    return Split(inputs[:, :-1], inputs[:, 1:] if training else labels[:, 1:])


def selective_copy_split(num: int, *, vocab_size: int, seq_len: int, num_tokens_to_copy: int,
                         g: torch.Generator) -> Split:
    """Selective copying: ``n`` tokens among blanks, a copy token, ``n`` blanks to fill. ``[num, seq_len]``."""
    n = num_tokens_to_copy
    blank, copy = vocab_size - 2, vocab_size - 1
    content = torch.randint(0, vocab_size - 2, (num, n), generator=g)
    where = random_subsets(g, num, seq_len - n - 1, n, sort=True)
    inputs = torch.full((num, seq_len), blank, dtype=torch.long)
    inputs[torch.arange(num)[:, None], where] = content
    inputs[:, seq_len - n - 1] = copy
    targets = torch.full((num, seq_len), IGNORE, dtype=torch.long)
    targets[:, seq_len - n:] = content
    return Split(inputs, targets)


def compression_split(num: int, *, vocab_size: int, seq_len: int, g: torch.Generator) -> Split:
    """Compression: ``L - 1`` random tokens and the compression token; targets are the inputs."""
    body = torch.randint(0, vocab_size - 1, (num, seq_len - 1), generator=g)
    inputs = torch.cat([body, torch.full((num, 1), vocab_size - 1, dtype=torch.long)], dim=1)
    return Split(inputs, inputs.clone())


def memorization_map(vocab_size: int, map_seed: int) -> torch.Tensor:
    """The fixed map ``key -> value`` (``[(V - 1) // 2]``): distinct values from ``[(V-1)//2, V-1)``."""
    clean = vocab_size - 1
    values = torch.arange(clean // 2, clean)[torch.randperm(clean - clean // 2, generator=generator(map_seed, 7))]
    return values[:clean // 2]


def memorization_split(num: int, *, vocab_size: int, seq_len: int, map_seed: int, g: torch.Generator) -> Split:
    """Memorization: pairs ``(key, insert)``; the label at ``insert`` is the fixed map's value."""
    table = memorization_map(vocab_size, map_seed)
    keys = torch.randint(0, table.numel(), (num, seq_len // 2), generator=g)
    inputs = torch.stack([keys, torch.full_like(keys, vocab_size - 1)], dim=-1).reshape(num, -1)
    targets = torch.stack([torch.full_like(keys, IGNORE), table[keys]], dim=-1).reshape(num, -1)
    return Split(inputs, targets)


def _recall(noisy: bool):
    def build(num, *, training, seed, stream, vocab_size, seq_len, noise_vocab_size=0, frac_noise=0.0):
        if noisy and not 0 < frac_noise < 1:
            raise ValueError(f"frac_noise: expected a value in (0, 1) for noisy recall, got {frac_noise}")
        if vocab_size - noise_vocab_size < 4:
            raise ValueError(f"vocab_size: expected at least noise_vocab_size + 4 = {noise_vocab_size + 4}, "
                             f"got {vocab_size}")
        return recall_split(num, vocab_size=vocab_size, seq_len=seq_len, noise_vocab_size=noise_vocab_size,
                            frac_noise=frac_noise, training=training, g=generator(seed, stream))
    return build


def _fuzzy(num, *, training, seed, stream, vocab_size, seq_len, k_motif_size=3, v_motif_size=3):
    if (vocab_size - 1) // 2 < max(k_motif_size, v_motif_size):
        raise ValueError(f"vocab_size: too small for motifs of {max(k_motif_size, v_motif_size)} distinct tokens")
    return fuzzy_recall_split(num, vocab_size=vocab_size, seq_len=seq_len, k_motif_size=k_motif_size,
                              v_motif_size=v_motif_size, training=training, seed=seed * 1_000_003 + stream)


def _copy(num, *, training, seed, stream, vocab_size, seq_len, num_tokens_to_copy=16):
    if seq_len <= 2 * num_tokens_to_copy + 1:
        raise ValueError(f"seq_len: expected more than 2 * num_tokens_to_copy + 1 = {2 * num_tokens_to_copy + 1}, "
                         f"got {seq_len}")
    return selective_copy_split(num, vocab_size=vocab_size, seq_len=seq_len, num_tokens_to_copy=num_tokens_to_copy,
                                g=generator(seed, stream))


def _compress(num, *, training, seed, stream, vocab_size, seq_len):
    return compression_split(num, vocab_size=vocab_size, seq_len=seq_len, g=generator(seed, stream))


def _memorize(num, *, training, seed, stream, vocab_size, seq_len, map_seed=12345):
    return memorization_split(num, vocab_size=vocab_size, seq_len=seq_len, map_seed=map_seed, g=generator(seed, stream))


# name: (builder, kind, baseline setting, benchmark changes — each varied alone from the baseline)
MAD_TASKS = {
    "recall": (_recall(False), "tokens", dict(vocab_size=16, seq_len=128),
               dict(vocab_size=[32, 64, 128], seq_len=[256, 512, 1024], num_train=[6400, 3200, 1600, 800])),
    "fuzzy_recall": (_fuzzy, "tokens", dict(vocab_size=16, seq_len=128, k_motif_size=3, v_motif_size=3),
                     dict(vocab_size=[32, 64, 128], seq_len=[256, 512, 1024],
                          num_train=[6400, 3200, 1600, 800])),
    "noisy_recall": (_recall(True), "tokens", dict(vocab_size=32, seq_len=128, noise_vocab_size=16, frac_noise=0.2),
                     dict(vocab_size=[48, 80, 144], seq_len=[256, 512, 1024], num_train=[6400, 3200, 1600, 800],
                          frac_noise=[0.4, 0.6, 0.8])),
    "selective_copy": (_copy, "tokens", dict(vocab_size=16, seq_len=256, num_tokens_to_copy=16),
                       dict(vocab_size=[32, 64, 128], seq_len=[512, 1024], num_train=[6400, 3200, 1600, 800],
                            num_tokens_to_copy=[32, 64, 96])),
    "compression": (_compress, "autoencode", dict(vocab_size=16, seq_len=32),
                    dict(vocab_size=[32, 64, 128], seq_len=[64, 128, 256], num_train=[6400, 3200, 1600, 800])),
    "memorization": (_memorize, "tokens", dict(vocab_size=256, seq_len=32, num_train=256),
                     dict(vocab_size=[512, 1024, 2048, 4096, 8192])),
}


def mad_task(task: str, *, num_train: int | None = None, num_test: int = 1280, seed: int = 0, device="cpu",
             **setting) -> TaskData:
    """One MAD task at its baseline setting updated by ``setting`` (e.g. ``vocab_size=64``).

    num_train defaults to 12800 (256 for memorization, as the baseline says); num_test to 1280.
    """
    if task not in MAD_TASKS:
        raise ValueError(f"task: expected one of {sorted(MAD_TASKS)}, got {task!r}")
    build, kind, baseline, _ = MAD_TASKS[task]
    setting = {**baseline, **setting}
    num_train = setting.pop("num_train", 12_800) if num_train is None else num_train
    setting.pop("num_train", None)
    check_int("num_train", num_train, minimum=1)
    check_int("num_test", num_test, minimum=1)
    check_int("seed", seed, minimum=0)
    check_int("vocab_size", setting["vocab_size"], minimum=4)
    check_int("seq_len", setting["seq_len"], minimum=4)
    train = build(num_train, training=True, seed=seed, stream=TRAIN, **setting)
    test = build(num_test, training=False, seed=seed, stream=TEST, **setting)
    return TaskData(f"mad_{task}", kind, train, test, vocab_size=setting["vocab_size"],
                    info=dict(num_train=num_train, **setting)).to(device)


def mad_benchmark_settings() -> list[tuple[str, dict]]:
    """Every ``(task, setting)`` of the benchmark: each baseline and each change varied alone."""
    out = []
    for task, (_, _, _, changes) in MAD_TASKS.items():
        out.append((task, {}))
        out += [(task, {key: value}) for key, values in changes.items() for value in values]
    return out


def mad_hard_settings() -> list[tuple[str, dict]]:
    """The harder sweep: recall, noisy recall and selective copying at vocabulary 128..512 and
    context 512..2048 (selective copying copies ``seq_len / 16`` tokens; noisy recall keeps its 16
    noise tokens on top of the vocabulary)."""
    out = []
    for vocab, seq_len in [(128, 512), (256, 1024), (512, 2048)]:
        out.append(("recall", dict(vocab_size=vocab, seq_len=seq_len)))
        out.append(("noisy_recall", dict(vocab_size=vocab + 16, seq_len=seq_len)))
        out.append(("selective_copy", dict(vocab_size=vocab, seq_len=seq_len, num_tokens_to_copy=seq_len // 16)))
    return out
