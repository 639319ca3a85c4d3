"""Convert a pretrained Llama / Qwen3 / Mistral transformers model to Parallax (parallax.txt Section 5, Appendix F.1).

Every attention layer gets the probe projection ``W_R`` (``r_proj``, normally initialised like the
model's other projections; it shares the query head dim and head grouping), an RMSNorm on rho
(``r_norm``) whose learnable gain starts at zero and, by default, the model's own RoPE on rho (same
cos/sin as q and k, hence the same base). With a zero gain the probe is zero and Parallax is exactly
softmax attention, so the converted model computes the same logits. The output is linear in rho, so
training moves the gain smoothly away from zero, and neither the gain's gradient nor ``W_R``'s is
inflated: a zero ``W_R`` under the RMSNorm instead makes rho jump from 0 to unit scale at the first
nonzero entry and amplifies ``W_R``'s gradient by ``1 / sqrt(eps)``.

Left-padded batches (``attention_mask`` with zeros first, as transformers pads for generation) run
without a per-key mask: each row is rolled so that its real tokens come first (:mod:`regattn.layers.padding`);
with a cache the real keys are then a prefix of ``cache_seqlens`` keys for :func:`regattn.parallax_decode`.

Design (save / load). :func:`convert_to_parallax` works in place: each ``self_attn`` becomes a
:class:`ParallaxAttention` that keeps the original projections under their original names (a
pretrained state dict still loads) and adds ``r_proj`` and ``r_norm``; the model and its config are
re-classed to registered subclasses — ``ParallaxLlamaForCausalLM`` / ``ParallaxLlamaConfig``
(``model_type = "parallax_llama"``), the Qwen3 pair (``"parallax_qwen3"``) and the Mistral pair
(``"parallax_mistral"``) — the way
``torch.nn.utils.parametrize`` re-classes a module. ``save_pretrained`` then writes that
``model_type`` and the flag ``parallax_rope_probe``; after ``import regattn.hf``,
``AutoModelForCausalLM.from_pretrained`` builds the Parallax class, whose constructor adds the same
probes before the weights load. The subclasses change nothing else, so ``isinstance(model,
LlamaForCausalLM)`` still holds and generation, caches and training work as before.
"""
from __future__ import annotations

import torch
from torch import nn
from transformers import (
    AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen3Config,
    Qwen3ForCausalLM,
)

from regattn.hf.attention import config_backend, op_options
from regattn.hf.padding import left_padding
from regattn.layers.padding import attend_left_padded, ragged_cache
from regattn.ops.parallax.api import parallax, parallax_decode


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on ``x: [B, T, H, D]`` with the model's ``cos, sin: [B, T, D]`` (halves ``(x1, x2)`` rotated)."""
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class ParallaxAttention(nn.Module):
    """Parallax in place of a transformers attention layer: ``hidden_states: [B, T, d] -> [B, T, d]``.

    ``q = rope(q_norm?(x W_Q))``, ``k = rope(k_norm?(x W_K))``, ``v = x W_V``,
    ``rho = rope?(r_norm(x W_R))``, ``o = parallax(q, rho, k, v)`` (eq. 14, with the layer's sliding
    window and scaling, ``backend`` from ``config.regattn_backend``), ``y = o W_O``. Takes over
    ``attn``'s projections (and Qwen3's q/k norms) under their names; ``r_norm``'s gain starts at zero,
    so the layer starts as ``attn``.

    Args:
        attn: the model's attention module (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``head_dim``,
            ``scaling``, ``layer_idx``, ``config``; optional ``q_norm``, ``k_norm``, ``sliding_window``;
            without ``sliding_window``, ``config.sliding_window`` as Mistral).
        rope_probe: rotate rho with the model's RoPE (Appendix F.1).
    """

    def __init__(self, attn: nn.Module, *, rope_probe: bool = True):
        super().__init__()
        config = attn.config
        self.config, self.layer_idx = config, attn.layer_idx
        self.head_dim, self.scaling = attn.head_dim, attn.scaling
        self.sliding_window = getattr(attn, "sliding_window", getattr(config, "sliding_window", None))
        self.is_causal = getattr(attn, "is_causal", True)
        self.rope_probe = rope_probe
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj
        self.q_norm = getattr(attn, "q_norm", None)
        self.k_norm = getattr(attn, "k_norm", None)
        weight = attn.q_proj.weight
        self.r_proj = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device,
                                dtype=weight.dtype)                                   # W_R, like W_Q
        self.r_norm = nn.RMSNorm(self.head_dim, eps=config.rms_norm_eps, device=weight.device, dtype=weight.dtype)
        nn.init.normal_(self.r_proj.weight, std=getattr(config, "initializer_range", 0.02))
        nn.init.zeros_(self.r_norm.weight)                                            # the probe's gain

    def _heads(self, proj: nn.Linear, x: torch.Tensor, norm: nn.Module | None) -> torch.Tensor:
        """``x: [B, T, d] -> [B, T, heads, head_dim]``, normed per head when ``norm`` is given."""
        y = proj(x).unflatten(-1, (-1, self.head_dim))
        return y if norm is None else norm(y)

    def forward(self, hidden_states, position_embeddings, attention_mask=None, cache=None, **kwargs):
        """As the attention it replaces; returns ``(out: [B, T, d], None)``."""
        q = self._heads(self.q_proj, hidden_states, self.q_norm)
        k = self._heads(self.k_proj, hidden_states, self.k_norm)
        v = self._heads(self.v_proj, hidden_states, None)
        rho = self._heads(self.r_proj, hidden_states, self.r_norm)
        cos, sin = position_embeddings
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        if self.rope_probe:
            rho = _rotate(rho, cos, sin)
        if cache is None:  # named past_key_values (or past_key_value) before transformers 5.24
            cache = kwargs.get("past_key_values", kwargs.get("past_key_value"))
        if cache is not None:
            cache_kwargs = {"cache_position": kwargs["cache_position"]} if "cache_position" in kwargs else None
            k, v = (x.transpose(1, 2) for x in cache.update(k.transpose(1, 2), v.transpose(1, 2), self.layer_idx,
                                                            cache_kwargs))
        window = self.sliding_window or None
        start = left_padding(attention_mask, q.shape[1], k.shape[1], window=window) if self.is_causal else None
        if start is not None:
            return self.o_proj(self._attend_padded(q, rho, k, v, start, window).flatten(-2)), None
        options = op_options(attention_mask, q, k, causal=self.is_causal, window=window,
                             position_ids=kwargs.get("position_ids"))
        return self.o_proj(self._attend(q, rho, k, v, options).flatten(-2)), None

    def _attend(self, q, rho, k, v, options):
        """Parallax of ``q, rho: [B, T, HQ, D]`` on ``k, v: [B, S, H, D]`` (queries are the last ``T`` keys).

        Cached decoding without autograd (``S > T``, as in ``generate``) runs the decode kernel.
        """
        kwargs = dict(scale=self.scaling, backend=config_backend(self))
        if options["causal"] and k.shape[1] > q.shape[1] and not torch.is_grad_enabled():
            return parallax_decode(q, rho, k, v, window=options["window"], **kwargs)
        return parallax(q, rho, k, v, **options, **kwargs)

    def _attend_padded(self, q, rho, k, v, start, window):
        """Parallax of left-padded rows whose real keys start at ``start: [B]`` (see :mod:`regattn.layers.padding`).

        Without a cache (``T == S``) the rolled rows run the differentiable op; with one, the rolled
        cache holds ``S - start`` real keys for the decode kernel (no gradient).
        """
        kwargs = dict(window=window, scale=self.scaling, backend=config_backend(self))
        if q.shape[1] == k.shape[1]:
            return attend_left_padded(parallax, start, q, rho, k, v, **kwargs)
        k, v, lengths = ragged_cache(k, v, start)
        return parallax_decode(q, rho, k, v, cache_seqlens=lengths, **kwargs)


def add_probes(model: nn.Module, *, rope_probe: bool) -> None:
    """Replace every decoder layer's ``self_attn`` of ``model`` (a ``*ForCausalLM``) by :class:`ParallaxAttention`."""
    for layer in model.model.layers:
        if not isinstance(layer.self_attn, ParallaxAttention):
            layer.self_attn = ParallaxAttention(layer.self_attn, rope_probe=rope_probe)


def _rope_probe(config) -> bool:
    return getattr(config, "parallax_rope_probe", True)


class ParallaxLlamaConfig(LlamaConfig):
    """``LlamaConfig`` of a Parallax model; ``parallax_rope_probe`` (default True) rotates rho."""
    model_type = "parallax_llama"


class ParallaxLlamaForCausalLM(LlamaForCausalLM):
    """``LlamaForCausalLM`` whose attention layers are :class:`ParallaxAttention`."""
    config_class = ParallaxLlamaConfig

    def __init__(self, config):
        super().__init__(config)
        add_probes(self, rope_probe=_rope_probe(config))


class ParallaxMistralConfig(MistralConfig):
    """``MistralConfig`` of a Parallax model; ``parallax_rope_probe`` (default True) rotates rho."""
    model_type = "parallax_mistral"


class ParallaxMistralForCausalLM(MistralForCausalLM):
    """``MistralForCausalLM`` whose attention layers are :class:`ParallaxAttention`."""
    config_class = ParallaxMistralConfig

    def __init__(self, config):
        super().__init__(config)
        add_probes(self, rope_probe=_rope_probe(config))


class ParallaxQwen3Config(Qwen3Config):
    """``Qwen3Config`` of a Parallax model; ``parallax_rope_probe`` (default True) rotates rho."""
    model_type = "parallax_qwen3"


class ParallaxQwen3ForCausalLM(Qwen3ForCausalLM):
    """``Qwen3ForCausalLM`` whose attention layers are :class:`ParallaxAttention`."""
    config_class = ParallaxQwen3Config

    def __init__(self, config):
        super().__init__(config)
        add_probes(self, rope_probe=_rope_probe(config))


_PARALLAX_CLASSES = {
    LlamaForCausalLM: (ParallaxLlamaConfig, ParallaxLlamaForCausalLM),
    Qwen3ForCausalLM: (ParallaxQwen3Config, ParallaxQwen3ForCausalLM),
    MistralForCausalLM: (ParallaxMistralConfig, ParallaxMistralForCausalLM),
}


def register() -> None:
    """Let ``AutoConfig`` / ``AutoModelForCausalLM`` build the Parallax classes from their ``model_type``."""
    for config_cls, model_cls in _PARALLAX_CLASSES.values():
        AutoConfig.register(config_cls.model_type, config_cls, exist_ok=True)
        AutoModelForCausalLM.register(config_cls, model_cls, exist_ok=True)


def convert_to_parallax(model: nn.Module, *, rope_probe: bool = True) -> nn.Module:
    """Turn a Llama, Qwen3 or Mistral ``*ForCausalLM`` into Parallax in place; returns ``model``.

    Every attention layer gets ``r_proj`` (``W_R``, shaped as ``W_Q``, normal with the model's
    ``initializer_range``), ``r_norm`` (RMSNorm on rho, the model's ``rms_norm_eps``, its gain zero)
    and, when ``rope_probe``, the model's RoPE on rho. The logits are unchanged until the gain is
    trained. The model becomes a ``ParallaxLlamaForCausalLM``, ``ParallaxQwen3ForCausalLM`` or
    ``ParallaxMistralForCausalLM`` (subclasses of the originals) whose ``save_pretrained`` output loads
    back through ``AutoModelForCausalLM.from_pretrained`` once ``regattn.hf`` is imported.

    Raises:
        TypeError: ``model`` is not a ``LlamaForCausalLM`` / ``Qwen3ForCausalLM`` / ``MistralForCausalLM``
            (or is already converted), or ``rope_probe`` is not a bool.
        ValueError: the model uses attention dropout (Parallax has none).
    """
    if not isinstance(rope_probe, bool):
        raise TypeError(f"rope_probe: expected a bool, got {type(rope_probe).__name__}")
    classes = _PARALLAX_CLASSES.get(type(model))
    if classes is None:
        names = ", ".join(c.__name__ for c in _PARALLAX_CLASSES)
        raise TypeError(f"model: expected one of {names} (not yet converted), got {type(model).__name__}")
    dropout = getattr(model.config, "attention_dropout", 0.0) or 0.0
    if dropout:
        raise ValueError(f"model: Parallax has no attention dropout; expected config.attention_dropout = 0, "
                         f"got {dropout}")
    model.config.__class__, model.__class__ = classes
    model.config.parallax_rope_probe = rope_probe
    add_probes(model, rope_probe=rope_probe)
    return model
