"""The task model: an input map, ``layers`` blocks of (mixer, SwiGLU MLP) with pre-RMSNorm, a readout.

    h = embed(inputs)                               token embedding, or a linear map of vectors
    h = h + mixer(RMSNorm(h))                       for each block
    h = h + SwiGLU(RMSNorm(h))                      (skipped with mlp=False, as lla's in-context regression)
    out = head(RMSNorm(h))                          logits [B, T, V] or predictions [B, T, d_out]

For ``kind="autoencode"`` (MAD compression) the state at the last position is the code: the
readout adds a sinusoidal embedding of each target position to it and decodes every position
through a two-layer MLP before the head.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from regattn.layers.norm import PreNorm
from regattn.models.mixers import build_mixer


class SwiGLU(nn.Module):
    """``W_2 (silu(x W_1) * x W_3)`` with hidden width ``hidden``."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """Pre-norm residual block: mixer, then (optionally) the MLP."""

    def __init__(self, mixer: nn.Module, dim: int, mlp_hidden: int | None):
        super().__init__()
        self.mixer_norm, self.mixer = PreNorm(dim), mixer
        self.mlp_norm = PreNorm(dim) if mlp_hidden else None
        self.mlp = SwiGLU(dim, mlp_hidden) if mlp_hidden else None

    def forward(self, h):
        h = h + self.mixer(self.mixer_norm(h))
        return h if self.mlp is None else h + self.mlp(self.mlp_norm(h))


def sinusoidal(length: int, dim: int) -> torch.Tensor:
    """``[length, dim]`` sine/cosine position embedding (first half sines, second half cosines)."""
    pos = torch.arange(length, dtype=torch.float32)[:, None]
    freq = torch.exp(-math.log(10000.0) * torch.arange(dim // 2, dtype=torch.float32) / max(1, dim // 2))
    emb = torch.cat([torch.sin(pos * freq), torch.cos(pos * freq)], dim=1)
    return F.pad(emb, (0, dim - emb.shape[1]))


class MixerStack(nn.Module):
    """The task model.

    Args:
        mixer: a name of :data:`regattn.models.mixers.MIXER_NAMES`.
        kind: ``"tokens"``, ``"regression"`` or ``"autoencode"`` (see :class:`regattn.tasks.TaskData`).
        vocab_size: token tasks; dim_in, dim_out: regression.
        seq_len: the sequence length (for the windowed mixers' default and the decoder positions).
        dim: model width (128); layers: blocks (2); heads: mixer heads (2); mlp: add the SwiGLU MLP;
        mlp_ratio: MLP hidden width ``mlp_ratio * dim * 2 / 3`` (rounded up to 8).
        mixer_options: passed to the mixer (``window``, ``lam``, ``blocks``, ``rope``).
    Input ``[B, T]`` int64 (tokens) or ``[B, T, dim_in]``; output ``[B, T, vocab_size | dim_out]``.
    """

    def __init__(self, mixer: str, *, kind: str, seq_len: int, vocab_size: int = 0, dim_in: int = 0, dim_out: int = 0,
                 dim: int = 128, layers: int = 2, heads: int = 2, mlp: bool = True, mlp_ratio: float = 4.0,
                 mixer_options: dict | None = None):
        super().__init__()
        if kind not in ("tokens", "regression", "autoencode"):
            raise ValueError(f"kind: expected 'tokens', 'regression' or 'autoencode', got {kind!r}")
        self.kind, self.mixer_name = kind, mixer
        regression = kind == "regression"
        self.embed = nn.Linear(dim_in, dim) if regression else nn.Embedding(vocab_size, dim)
        hidden = 8 * math.ceil(mlp_ratio * dim * 2 / 3 / 8) if mlp else None
        self.blocks = nn.ModuleList(
            Block(build_mixer(mixer, dim, heads, seq_len=seq_len, **(mixer_options or {})), dim, hidden)
            for _ in range(layers))
        self.norm = PreNorm(dim)
        self.head = nn.Linear(dim, dim_out if regression else vocab_size, bias=regression)
        if kind == "autoencode":
            self.register_buffer("positions", sinusoidal(seq_len, dim), persistent=False)
            self.decoder = nn.Sequential(nn.RMSNorm(dim), nn.Linear(dim, dim), nn.GELU(),
                                         nn.RMSNorm(dim), nn.Linear(dim, dim), nn.GELU())
        if not regression:
            nn.init.normal_(self.embed.weight, std=0.02)

    def features(self, inputs: torch.Tensor) -> list[torch.Tensor]:
        """The residual stream after the embedding and after each block: ``layers + 1`` tensors ``[B, T, dim]``."""
        h = self.embed(inputs)
        out = [h]
        for block in self.blocks:
            h = block(h)
            out.append(h)
        return out

    def forward(self, inputs: torch.Tensor, select: torch.Tensor | None = None) -> torch.Tensor:
        """``[B, T, out]``, or ``[B, K, out]`` at the positions ``select [B, K]`` (int64 indices into ``T``):
        the readout runs at those positions only, and the shapes do not depend on the data."""
        h = self.features(inputs)[-1]
        if self.kind == "autoencode":
            positions = self.positions[: inputs.shape[1]] if select is None else self.positions[select]
            h = self.decoder(h[:, -1:] + positions.to(h.dtype))
        elif select is not None:
            h = h.gather(1, select[..., None].expand(-1, -1, h.shape[-1]))
        return self.head(self.norm(h))


def build_model(task, mixer: str, **options) -> MixerStack:
    """A :class:`MixerStack` for :class:`regattn.tasks.TaskData` ``task`` (its kind, sizes and length)."""
    return MixerStack(mixer, kind=task.kind, seq_len=task.seq_len, vocab_size=task.vocab_size, dim_in=task.dim_in,
                      dim_out=task.dim_out, **options)


def first_pass(name: str, dim: int, heads: int, device, *, batch: int, length: int, kind: str = "tokens",
               eval_batch: int | None = None, **options) -> MixerStack:
    """A one-block :class:`MixerStack` with mixer ``name`` after one forward and backward on random ``[batch,
    length]`` inputs of ``kind`` under bf16 autocast, as the trainer runs it (the mixer's window, if it has one,
    from ``length``), then with ``eval_batch`` one forward on ``[eval_batch, length]`` in eval mode without
    gradients, as its evaluation: on CUDA, what compiles and tunes its kernels at those sizes. The mixer takes its
    input from the block's norm as in a run (bf16, from fp32 token embeddings or bf16 regression embeddings), so
    Triton specializes its kernels, and the norm's, alike."""
    device = torch.device(device)
    model = MixerStack(name, kind=kind, seq_len=length, vocab_size=16, dim_in=dim, dim_out=1, dim=dim, layers=1,
                       heads=heads, mlp=False, mixer_options=options).to(device)

    def inputs(rows: int) -> torch.Tensor:
        if kind == "regression":
            return torch.randn(rows, length, dim, device=device)
        return torch.randint(16, (rows, length), device=device)

    with torch.autocast(device.type, dtype=torch.bfloat16):
        y = model(inputs(batch))
    y.float().square().mean().backward()
    if eval_batch is not None:
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
            model.eval()(inputs(eval_batch))
    return model


def first_passes(name: str, dim: int, heads: int, device, *, batch: int, inputs, eval_batch: int | None = None,
                 **options) -> None:
    """:func:`first_pass` on each ``(kind, length)`` of ``inputs``, in order."""
    for kind, length in inputs:
        first_pass(name, dim, heads, device, batch=batch, length=length, kind=kind, eval_batch=eval_batch, **options)
