"""A Qwen3-style decoder language model whose sequence mixer is chosen per layer.

    h = embed(tokens)                                   [B, T, dim]
    h = h + mixer_l(RMSNorm(h))                         for each layer l
    h = h + SwiGLU(RMSNorm(h))
    logits = RMSNorm(h) embed^T                         tied input and output embeddings

The attention mixers follow Qwen3 (parallax.txt Section 4.2 and Appendix F.1): GQA, a per-head
RMSNorm on q and k, RoPE with base 10^6 (given to every mixer that rotates), no biases.

| name         | mixer                                            | generation cache                                  |
|--------------|--------------------------------------------------|---------------------------------------------------|
| softmax      | softmax attention (regattn.softmax_attention)    | keys and values                                   |
| swa          | sliding-window softmax attention                 | the last ``window`` keys and values               |
| elsa         | exact softmax as a scan (regattn.scan_attention) | keys and values                                   |
| parallax     | regattn.layers.Parallax (RMSNorm, RoPE on rho)   | keys and values (the last ``window``)             |
| gatedfwa     | regattn.layers.GatedFWA                          | last ``window`` keys, values, gates; running gate |
| gatedfwa_nsa | regattn.layers.GatedFWANSA                       | keys, values, compressed blocks; gatedfwa's cache |
| lla          | regattn.layers.LLA (learned ridge)               | keys and values                                   |
| decay        | regattn.layers.Retention (RetNet decays)         | the recurrent state ``[B, H, R, D]``              |
| mamba2       | fla.layers.Mamba2 (regattn.models.baselines)     | its inputs (no decode cache: a step reruns it)    |
| gdn          | fla.layers.GatedDeltaNet                         | its inputs (no decode cache: a step reruns it)    |
| gla          | fla.layers.GatedLinearAttention                  | its inputs (no decode cache: a step reruns it)    |
| deltanet     | fla.layers.DeltaNet                              | its inputs (no decode cache: a step reruns it)    |

Every mixer here maps ``x [B, T, dim] -> [B, T, dim]`` and has ``prefill(x) -> (y, cache)`` and
``step(x [B, 1, dim], cache) -> (y, cache)``; :meth:`DecoderLM.generate` runs on them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import regattn
from regattn.layers import LLA, GatedFWA, GatedFWANSA, Parallax, Retention, RotaryEmbedding
from regattn.layers.norm import RMSNorm
from regattn.layers.rope import norm_rope
from regattn.layers.padding import attend_left_padded, softmax_decode_left_padded, trimmed_start
from regattn.models.baselines import BASELINES, build_baseline
from regattn.models.stack import SwiGLU

LM_MIXERS = ("softmax", "swa", "elsa", "parallax", "gatedfwa", "gatedfwa_nsa", "lla", "decay")
WINDOWED = ("swa", "gatedfwa", "gatedfwa_nsa")


@dataclass
class LMArchitecture:
    """The decoder's widths and mixers (the fields :class:`LMConfig` shares with the LM training config).

    mixer: one name of :data:`LM_MIXERS` or of the baselines (``mamba2``, ``gdn``, ``gla``, ``deltanet``:
    the ``baselines`` extra) for every layer, or a list with one name per layer;
    dim (model width); layers; heads (query heads) and kv_heads (GQA; None = heads);
    head_dim (None = dim // heads); ffn (SwiGLU hidden width; None = 3 * dim, as Qwen3-0.6B);
    window: the sliding window of swa, gatedfwa and gatedfwa_nsa (the others take one through
    mixer_options);
    mixer_options: extra keyword options per mixer name, e.g. ``{"parallax": {"window": 256}}``. LLA
    solves exactly unless given ``{"lla": {"cg_iters": k}}`` (FlashLLA's truncated CG), which carries the
    rounding of the path that ran it, so cached and uncached generation can part (a tiny random model on CPU,
    head_dim 16: the prefill's and the cached steps' logits 0.3 % apart at 8 iterations, 0.04 % at 16).
    """
    mixer: str | list = "softmax"
    dim: int = 256
    layers: int = 4
    heads: int = 4
    kv_heads: int | None = None
    head_dim: int | None = None
    ffn: int | None = None
    window: int | None = None
    mixer_options: dict = field(default_factory=dict)


@dataclass
class LMConfig(LMArchitecture):
    """The decoder: the :class:`LMArchitecture` fields and vocab_size; rope_base (10^6); norm_eps;
    tie_embeddings; checkpointing (recompute each block in backward).
    """
    vocab_size: int = 256
    rope_base: float = 1e6
    norm_eps: float = 1e-6
    tie_embeddings: bool = True
    checkpointing: bool = False

    def __post_init__(self):
        for name in ("vocab_size", "dim", "layers", "heads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {value!r}")

    def mixers(self) -> list[str]:
        """The mixer name of each layer."""
        names = [self.mixer] * self.layers if isinstance(self.mixer, str) else list(self.mixer)
        if len(names) != self.layers:
            raise ValueError(f"mixer: expected {self.layers} names (one per layer), got {len(names)}")
        for name in names:
            if name not in LM_MIXERS + BASELINES:
                raise ValueError(f"mixer: expected names from {LM_MIXERS + BASELINES}, got {name!r}")
            if name in WINDOWED and self.window is None:
                raise ValueError(f"window: mixer {name!r} needs a window, got None")
        return names


# ---------------------------------------------------------------------------------------------- attention
@dataclass
class KVCache:
    """Keys ``[B, n, H, D]`` and values ``[B, n, H, D]`` a new token sees; ``pos`` tokens seen so far;
    ``start: [B]`` the padding slots that open each row of a left-padded batch (None: no padding)."""
    k: torch.Tensor
    v: torch.Tensor
    pos: int
    start: torch.Tensor | None = None


class SelfAttention(nn.Module):
    """Qwen3 attention: ``q = rope(norm(x W_q))``, ``k = rope(norm(x W_k))``, ``v = x W_v``; GQA;
    softmax over the keys (the last ``window`` with a window); ``y = concat_h o W_o``.

    ``elsa=True`` computes the same softmax attention as a monoid scan (:func:`regattn.scan_attention`).
    """

    def __init__(self, dim: int, heads: int, *, kv_heads: int | None = None, head_dim: int | None = None,
                 window: int | None = None, rope_base: float = 1e6, norm_eps: float = 1e-6, elsa: bool = False):
        super().__init__()
        self.heads, self.kv_heads = heads, kv_heads or heads
        if heads % self.kv_heads:
            raise ValueError(f"kv_heads: expected a divisor of heads = {heads}, got {self.kv_heads}")
        self.head_dim = head_dim or dim // heads
        self.window, self.elsa = window, elsa
        HQ, H, D = self.heads, self.kv_heads, self.head_dim
        self.q_proj = nn.Linear(dim, HQ * D, bias=False)
        self.k_proj = nn.Linear(dim, H * D, bias=False)
        self.v_proj = nn.Linear(dim, H * D, bias=False)
        self.o_proj = nn.Linear(HQ * D, dim, bias=False)
        self.q_norm = RMSNorm(D, eps=norm_eps)
        self.k_norm = RMSNorm(D, eps=norm_eps)
        self.rotary = RotaryEmbedding(D, base=rope_base)

    def _qkv(self, x, offset: int):
        B, T, _ = x.shape
        angles = self.rotary.angles(T, offset, x.device)
        q = norm_rope(self.q_proj(x).view(B, T, self.heads, self.head_dim), self.q_norm, angles)
        k = norm_rope(self.k_proj(x).view(B, T, self.kv_heads, self.head_dim), self.k_norm, angles)
        return q, k, self.v_proj(x).view(B, T, self.kv_heads, self.head_dim)

    def _attend(self, q, k, v):
        """Queries ``[B, T, HQ, D]`` at the last ``T`` positions of the keys ``[B, S, H, D]``."""
        if self.elsa:
            return regattn.scan_attention(q, k, v, causal=True, window=self.window)
        return regattn.softmax_attention(q, k, v, causal=True, window=self.window)

    def _out(self, o):
        return self.o_proj(o.flatten(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.prefill(x)[0]

    def prefill(self, x: torch.Tensor, start: torch.Tensor | None = None) -> tuple[torch.Tensor, KVCache]:
        """``start: [B]``: rows left-padded with ``start[b]`` slots, whose outputs are to be ignored."""
        q, k, v = self._qkv(x, 0)
        return self._out(attend_left_padded(self._attend, start, q, k, v)), self._keep(k, v, x.shape[1], start)

    def step(self, x: torch.Tensor, cache: KVCache) -> tuple[torch.Tensor, KVCache]:
        q, k, v = self._qkv(x, cache.pos)
        keys, values = torch.cat([cache.k, k], 1), torch.cat([cache.v, v], 1)
        if cache.start is None:
            o = self._attend(q, keys, values)
        else:
            o = softmax_decode_left_padded(q, keys, values, cache.start, window=self.window)
        return self._out(o), self._keep(keys, values, cache.pos + x.shape[1], cache.start)

    def _keep(self, k, v, pos, start=None):
        n = k.shape[1]
        if self.window is not None:
            k, v = k[:, -self.window:], v[:, -self.window:]
        return KVCache(k=k, v=v, pos=pos, start=trimmed_start(start, n, k.shape[1]))


# ---------------------------------------------------------------------------------------------- adapters
class LayerStep(nn.Module):
    """A layer of :mod:`regattn.layers` with ``prefill`` / ``step`` where ``step`` also takes no cache."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        return self.layer(x)

    def prefill(self, x, start=None):
        return self.layer.prefill(x) if start is None else self.layer.prefill(x, start=start)

    def step(self, x, cache):
        return self.layer.prefill(x) if cache is None else self.layer.step(x, cache)


class RetentionStep(LayerStep):
    """:class:`regattn.layers.Retention` whose cache is its recurrent state ``[B, H, R, D]``."""

    def prefill(self, x):
        return self.layer(x, return_state=True)

    def step(self, x, state):
        y, state = self.layer.step(x[:, 0], state)
        return y[:, None], state


class RecomputeStep(LayerStep):
    """A layer without a decode path (the FLA baselines): the cache holds the layer's inputs and a step
    runs the layer on all of them, returning the new positions' outputs."""

    def prefill(self, x):
        return self.layer(x), x

    def step(self, x, inputs):
        inputs = x if inputs is None else torch.cat([inputs, x], 1)
        return self.layer(inputs)[:, -x.shape[1]:], inputs


def with_rope_base(layer: nn.Module, base: float) -> nn.Module:
    """Give ``layer``'s RoPE (built with the layers' default base) the model's base."""
    if layer.rotary is not None:
        layer.rotary = RotaryEmbedding(layer.head_dim, base=base)
    return layer


def build_lm_mixer(name: str, config: LMConfig) -> nn.Module:
    """The mixer ``name`` at the sizes of ``config`` (options from ``config.mixer_options[name]``)."""
    c, opts = config, dict(config.mixer_options.get(name, {}))
    heads = dict(num_kv_heads=c.kv_heads, head_dim=c.head_dim)
    if name in ("softmax", "swa", "elsa"):
        window = opts.pop("window", c.window if name == "swa" else None)
        return SelfAttention(c.dim, c.heads, kv_heads=c.kv_heads, head_dim=c.head_dim, window=window,
                             rope_base=c.rope_base, norm_eps=c.norm_eps, elsa=name == "elsa", **opts)
    if name == "parallax":
        return LayerStep(Parallax(c.dim, c.heads, rope_base=c.rope_base, norm_eps=c.norm_eps, **heads, **opts))
    if name == "gatedfwa":
        return LayerStep(with_rope_base(GatedFWA(c.dim, c.heads, c.window, rope=True, **heads, **opts), c.rope_base))
    if name == "gatedfwa_nsa":
        nsa = GatedFWANSA(c.dim, c.heads, c.window, rope=True, **heads, **opts)
        return LayerStep(with_rope_base(nsa, c.rope_base))
    if name == "lla":
        opts.setdefault("cg_iters", None)      # the exact solve; see LMConfig
        return LayerStep(with_rope_base(LLA(c.dim, c.heads, rope=True, **heads, **opts), c.rope_base))
    if name in ("decay",) + BASELINES and c.kv_heads not in (None, c.heads):
        raise ValueError(f"kv_heads: mixer {name!r} has no GQA; expected None or {c.heads}, got {c.kv_heads}")
    if name in BASELINES:
        return RecomputeStep(build_baseline(name, c.dim, c.heads, head_dim=c.head_dim, **opts))
    if name == "decay":
        D = c.head_dim or c.dim // c.heads
        return RetentionStep(Retention(c.dim, c.heads, key_dim=D, head_dim=D, eps=c.norm_eps, **opts))
    raise ValueError(f"mixer: expected one of {LM_MIXERS + BASELINES}, got {name!r}")


# ---------------------------------------------------------------------------------------------- sampling
EOS_CHECK_EVERY = 16      # generate reads back "every row has ended" once per this many steps (one host sync)


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """``logits [B, V]`` with all but the ``k`` largest per row set to -inf (ties at the k-th kept)."""
    kth = logits.topk(min(k, logits.shape[-1]), dim=-1).values[:, -1:]
    return logits.masked_fill(logits < kth, -math.inf)


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus filtering: per row, keep the smallest set of most likely tokens whose probability sums to
    at least ``p`` (the most likely token always), the others set to -inf; ``p = 1`` keeps every token."""
    if p >= 1:
        return logits
    probs, order = torch.softmax(logits.float(), -1).sort(-1, descending=True)
    mass_before = probs.cumsum(-1) - probs
    drop_sorted = mass_before >= p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, -math.inf)


# ---------------------------------------------------------------------------------------------- model
class DecoderBlock(nn.Module):
    """Pre-norm residual block: ``h + mixer(norm(h))``, then ``h + SwiGLU(norm(h))``."""

    def __init__(self, mixer: nn.Module, dim: int, ffn: int, eps: float):
        super().__init__()
        self.mixer_norm, self.mixer = nn.RMSNorm(dim, eps=eps), mixer
        self.mlp_norm, self.mlp = nn.RMSNorm(dim, eps=eps), SwiGLU(dim, ffn)

    def forward(self, h):
        h = h + self.mixer(self.mixer_norm(h))
        return h + self.mlp(self.mlp_norm(h))

    def step(self, h, cache, first: bool, start=None):
        """Prefill (``first``; ``start: [B]`` the left padding of each row, or None) or decode ``h: [B, n, dim]``;
        returns ``(h, cache)``."""
        x = self.mixer_norm(h)
        if first:
            y, cache = self.mixer.prefill(x) if start is None else self.mixer.prefill(x, start=start)
        else:
            y, cache = self.mixer.step(x, cache)
        h = h + y
        return h + self.mlp(self.mlp_norm(h)), cache


class DecoderLM(nn.Module):
    """Decoder LM: ``tokens [B, T] -> logits [B, T, vocab_size]``; see the module text.

    ``forward(tokens, targets)`` returns the mean cross-entropy over the targets that are not -100
    instead of the logits. ``generate`` decodes with each mixer's own cache.
    """

    def __init__(self, config: LMConfig):
        super().__init__()
        self.config = config
        ffn = config.ffn or 3 * config.dim
        self.embed = nn.Embedding(config.vocab_size, config.dim)
        self.blocks = nn.ModuleList(DecoderBlock(build_lm_mixer(name, config), config.dim, ffn, config.norm_eps)
                                    for name in config.mixers())
        self.norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.head = nn.Linear(config.dim, config.vocab_size, bias=False)
        nn.init.normal_(self.embed.weight, std=0.02)
        if config.tie_embeddings:
            self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            if self.config.checkpointing and self.training and torch.is_grad_enabled():
                h = checkpoint(block, h, use_reentrant=False)
            else:
                h = block(h)
        logits = self.head(self.norm(h))
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100)

    # ------------------------------------------------------------------------------------------ generation
    def run(self, tokens, caches, start=None):
        """The final (normed) hidden states ``[B, n, dim]`` of ``tokens [B, n]`` and the new caches: a
        prefill when ``caches`` is None (``start: [B]``: rows left-padded with ``start[b]`` tokens,
        whose outputs are to be ignored; softmax, swa, elsa, parallax and gatedfwa mixers), else a
        decode step after them."""
        h = self.embed(tokens)
        first = caches is None
        caches = [None] * len(self.blocks) if first else caches
        out = []
        for block, cache in zip(self.blocks, caches):
            h, cache = block.step(h, cache, first, start)
            out.append(cache)
        return self.norm(h), out

    def _run(self, tokens, caches):
        """Logits of the last position of ``tokens [B, n]`` and the new caches (prefill when None)."""
        h, caches = self.run(tokens, caches)
        return self.head(h[:, -1]), caches

    @staticmethod
    def pick(logits: torch.Tensor, temperature: float, top_k: int | None, generator,
             top_p: float | None = None) -> torch.Tensor:
        """The next tokens ``[B]`` from ``logits [B, V]``: argmax at ``temperature == 0``, else a sample
        (from the ``top_k`` most likely, then from their nucleus of mass ``top_p``)."""
        if temperature == 0:
            return logits.argmax(-1)
        logits = logits.float() / temperature
        if top_k is not None:
            logits = top_k_filter(logits, top_k)
        if top_p is not None:
            logits = top_p_filter(logits, top_p)
        return torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)[:, 0]

    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, max_new_tokens: int, *, temperature: float = 0.0,
                 top_k: int | None = None, top_p: float | None = None, eos_token_id: int | None = None,
                 generator: torch.Generator | None = None, use_cache: bool = True) -> torch.Tensor:
        """``prompt [B, T]`` (int token ids) followed by up to ``max_new_tokens`` new tokens.

        Greedy at ``temperature == 0``; else sampled, from the ``top_k`` most likely tokens when given,
        then from the nucleus of probability ``top_p`` (:func:`top_p_filter`).
        ``eos_token_id``: a row that produced it emits it from then on; generation ends once every row
        has, read back every :data:`EOS_CHECK_EVERY` steps (so the output may end in a few columns of
        ``eos_token_id``, and is ``[B, T + n]`` with ``n <= max_new_tokens``). Without it, ``n = max_new_tokens``.
        ``use_cache=False`` reruns the whole sequence for every token (the reference for the cache).
        The prompt's ids are checked against the vocabulary once, before the first step.
        """
        self.check_generation(prompt, max_new_tokens, temperature, top_k, top_p, eos_token_id)
        was_training = self.training
        self.eval()
        tokens, caches, new = prompt, None, prompt
        done = torch.zeros(prompt.shape[0], dtype=torch.bool, device=prompt.device)
        for step in range(max_new_tokens):
            if use_cache:
                logits, caches = self._run(new, caches)
            else:
                logits = self(tokens)[:, -1]
            new = self.pick(logits, temperature, top_k, generator, top_p)
            if eos_token_id is not None:
                new = new.masked_fill(done, eos_token_id)
                done = done | (new == eos_token_id)
            new = new[:, None]
            tokens = torch.cat([tokens, new], 1)
            if eos_token_id is not None and (step + 1) % EOS_CHECK_EVERY == 0 and bool(done.all()):
                break
        self.train(was_training)
        return tokens

    def check_generation(self, prompt, max_new_tokens, temperature, top_k, top_p, eos_token_id) -> None:
        """The arguments of :meth:`generate`; one host sync for the prompt's range."""
        V = self.config.vocab_size
        if not torch.is_tensor(prompt) or prompt.dtype.is_floating_point or prompt.dtype.is_complex \
                or prompt.dtype == torch.bool:
            raise TypeError(f"prompt: expected a tensor of integer token ids, got "
                            f"{prompt.dtype if torch.is_tensor(prompt) else type(prompt).__name__}")
        if prompt.ndim != 2 or prompt.numel() == 0:
            raise ValueError(f"prompt: expected [B, T] with B, T >= 1, got shape {tuple(prompt.shape)}")
        if not is_int(max_new_tokens) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens: expected an int >= 0, got {max_new_tokens!r}")
        if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature >= 0):
            raise ValueError(f"temperature: expected a finite value > 0 (or 0 for greedy), got {temperature!r}")
        if top_k is not None and (not is_int(top_k) or top_k < 1):
            raise ValueError(f"top_k: expected None or an int >= 1, got {top_k!r}")
        if top_p is not None and not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
            raise ValueError(f"top_p: expected None or a value in (0, 1], got {top_p!r}")
        if eos_token_id is not None and (not is_int(eos_token_id) or not 0 <= eos_token_id < V):
            raise ValueError(f"eos_token_id: expected None or an int in [0, {V}), got {eos_token_id!r}")
        low, high = torch.stack([prompt.min(), prompt.max()]).tolist()
        if low < 0 or high >= V:
            raise ValueError(f"prompt: expected token ids in [0, {V}), got ids in [{low}, {high}]")

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
