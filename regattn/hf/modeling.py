""":class:`regattn.models.DecoderLM` as a transformers model: ``model_type = "regattn"``.

``import regattn.hf`` registers :class:`RegattnConfig` with ``AutoConfig`` and
:class:`RegattnForCausalLM` with ``AutoModelForCausalLM``, so that ``save_pretrained`` /
``from_pretrained`` and transformers' ``generate`` work::

    config = RegattnConfig(lm=dict(vocab_size=257, dim=256, layers=4, heads=4, mixer="parallax"))
    model = RegattnForCausalLM(config)                 # or RegattnForCausalLM.from_lm(decoder_lm)
    model.save_pretrained(path); AutoModelForCausalLM.from_pretrained(path)
    model.generate(input_ids, attention_mask=mask, max_new_tokens=20, do_sample=False)

Generation runs on the model's own per-layer caches (:class:`RegattnCache`, passed through
``past_key_values``), the ones :meth:`DecoderLM.generate` uses. ``attention_mask`` may left-pad the
prompt (as transformers pads for generation) for the softmax, swa, elsa, parallax and gatedfwa mixers:
the outputs at the real positions, and what is generated, equal each row run alone.
"""
from __future__ import annotations

import contextlib
from dataclasses import asdict

import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM, GenerationMixin, PreTrainedConfig, PreTrainedModel
from transformers.cache_utils import Cache
from transformers.modeling_outputs import CausalLMOutputWithPast

from regattn.layers.rope import RotaryEmbedding
from regattn.models.lm import DecoderLM, LMConfig

# the output's cache field: ``cache`` from transformers 5.24 on, ``past_key_values`` before
CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
PADDED_MIXERS = ("softmax", "swa", "elsa", "parallax", "gatedfwa")


class RegattnConfig(PreTrainedConfig):
    """transformers config of :class:`RegattnForCausalLM`: ``lm`` holds the :class:`LMConfig` fields
    (defaults filled in); ``vocab_size`` and ``tie_word_embeddings`` follow it; ``use_cache``: the
    forward's default."""
    model_type = "regattn"
    keys_to_ignore_at_inference = ["past_key_values"]
    lm: dict | None = None
    use_cache: bool = True

    def __post_init__(self, **kwargs):
        if self.lm is not None and not isinstance(self.lm, dict):
            raise TypeError(f"lm: expected a dict of LMConfig fields, got {type(self.lm).__name__}")
        self.lm = asdict(LMConfig(**(self.lm or {})))
        self.vocab_size = self.lm["vocab_size"]
        kwargs["tie_word_embeddings"] = self.lm["tie_embeddings"]
        super().__post_init__(**kwargs)

    def lm_config(self) -> LMConfig:
        """The :class:`LMConfig` that builds the model."""
        return LMConfig(**self.lm)


class RegattnCache(Cache):
    """The per-layer generation caches of a :class:`DecoderLM` (``states``, one per block) and the
    number of tokens they have seen, behind transformers' ``Cache`` interface (no cropping or
    reordering: greedy search and sampling, not beam search or assisted decoding)."""
    is_compileable = False
    is_croppable = False

    def __init__(self):
        super().__init__(layers=[])
        self.states, self.seen = None, 0

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    def reorder_cache(self, beam_idx):
        raise NotImplementedError("RegattnCache: beam search is not supported")

    def crop(self, max_length: int):
        raise NotImplementedError("RegattnCache: cropping (assisted decoding) is not supported")


def prompt_padding(attention_mask, input_ids: torch.Tensor) -> torch.Tensor | None:
    """``start: [B]``, the padding tokens that open each row, from a ``[B, T]`` mask of left-padded rows;
    None without a mask or padding. Other masks (right padding, holes) raise ValueError."""
    if attention_mask is None:
        return None
    B, T = input_ids.shape
    if not isinstance(attention_mask, torch.Tensor) or tuple(attention_mask.shape) != (B, T):
        shape = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask)
        raise ValueError(f"attention_mask: expected a [B, T] = {(B, T)} tensor of ones and zeros, got {shape}")
    real = attention_mask.bool()
    start = T - real.sum(-1)
    if not bool((real == (torch.arange(T, device=real.device) >= start[:, None])).all()) or bool((start == T).any()):
        raise ValueError("attention_mask: expected left padding (each row's zeros before its ones, at least one "
                         "real token per row)")
    return start if bool(start.any()) else None


class RegattnForCausalLM(PreTrainedModel, GenerationMixin):
    """A :class:`DecoderLM` (``self.lm``) with transformers' interface: ``forward(input_ids,
    attention_mask, past_key_values, labels)`` returns ``CausalLMOutputWithPast``; ``generate`` works."""
    config_class = RegattnConfig
    base_model_prefix = "lm"
    main_input_name = "input_ids"
    _tied_weights_keys = {"lm.head.weight": "lm.embed.weight"}
    _is_stateful = True                      # its caches cannot be cropped: no assisted decoding

    def __init__(self, config: RegattnConfig):
        super().__init__(config)
        # from_pretrained builds on the meta device; the layers check their initial values (e.g. the
        # retention decays), which meta tensors do not hold, so the model is built on the CPU then.
        meta = torch.get_default_device().type == "meta"
        with torch.device("cpu") if meta else contextlib.nullcontext():
            self.lm = DecoderLM(config.lm_config())
        self.post_init()

    @classmethod
    def from_lm(cls, lm: DecoderLM) -> "RegattnForCausalLM":
        """The transformers model holding a copy of ``lm``'s weights."""
        model = cls(RegattnConfig(lm=asdict(lm.config)))
        model.lm.load_state_dict(lm.state_dict())
        return model

    def _init_weights(self, module):
        """Only RoPE's frequencies (a buffer that is not saved): :class:`DecoderLM` initialises its
        parameters itself (gate biases, probe gains, ...), and loading replaces them."""
        if isinstance(module, RotaryEmbedding):
            fresh = RotaryEmbedding(2 * module.inv_freq.numel(), base=self.config.lm["rope_base"])
            with torch.no_grad():
                module.inv_freq.copy_(fresh.inv_freq)

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False                         # generate() leaves the cache to forward()

    def get_input_embeddings(self):
        return self.lm.embed

    def set_input_embeddings(self, value):
        self.lm.embed = value

    def get_output_embeddings(self):
        return self.lm.head

    def set_output_embeddings(self, value):
        self.lm.head = value

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                cache: RegattnCache | None = None, labels: torch.Tensor | None = None,
                use_cache: bool | None = None, logits_to_keep: int = 0, past_key_values: RegattnCache | None = None,
                **kwargs) -> CausalLMOutputWithPast:
        """``input_ids: [B, T]`` -> logits ``[B, T, V]`` (the last ``logits_to_keep`` positions when > 0).

        ``labels: [B, T]`` gives the mean next-token cross-entropy (labels shifted inside, -100 ignored).
        ``use_cache`` returns a :class:`RegattnCache`; given one in ``cache`` (``past_key_values`` before
        transformers 5.24), the tokens follow it (``attention_mask`` then covers the cached tokens too: left
        padding is read at the prefill).
        """
        for name, given in (("cache", cache), ("past_key_values", past_key_values)):
            if given is not None and not isinstance(given, RegattnCache):
                raise TypeError(f"{name}: expected a RegattnCache, got {type(given).__name__}")
        cache = cache if cache is not None else past_key_values
        use_cache = self.config.use_cache if use_cache is None else use_cache
        cache = cache if cache is not None else RegattnCache() if use_cache else None
        keep = (lambda x: x[:, -logits_to_keep:]) if logits_to_keep else (lambda x: x)
        if cache is not None and cache.states is not None:
            self._check_step_mask(attention_mask, input_ids, cache.seen)
            h, states = self.lm.run(input_ids, cache.states)
            logits = self.lm.head(keep(h))
        else:
            start = self._prompt_padding(attention_mask, input_ids)
            if cache is None and start is None:
                logits = keep(self.lm(input_ids))          # the plain forward (activation checkpointing)
            else:
                h, states = self.lm.run(input_ids, None, start)
                logits = self.lm.head(keep(h))
        if cache is not None:
            cache.states, cache.seen = states, cache.seen + input_ids.shape[1]
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{CACHE_FIELD: cache})

    def _prompt_padding(self, attention_mask, input_ids) -> torch.Tensor | None:
        """:func:`prompt_padding`, refused for the mixers that take no left padding."""
        start = prompt_padding(attention_mask, input_ids)
        unsupported = sorted(set(self.config.lm_config().mixers()) - set(PADDED_MIXERS))
        if start is not None and unsupported:
            raise ValueError(f"attention_mask: left padding is supported for the mixers {PADDED_MIXERS}; "
                             f"this model has {unsupported}")
        return start

    @staticmethod
    def _check_step_mask(attention_mask, input_ids, seen: int) -> None:
        """After a prefill the mask covers the cached and the new tokens (its values were read then)."""
        if attention_mask is not None and attention_mask.shape[-1] != seen + input_ids.shape[1]:
            raise ValueError(f"attention_mask: expected {seen + input_ids.shape[1]} columns (the {seen} cached "
                             f"tokens and the {input_ids.shape[1]} new ones), got shape {tuple(attention_mask.shape)}")


def register() -> None:
    """Let ``AutoConfig`` / ``AutoModelForCausalLM`` build :class:`RegattnForCausalLM` from its ``model_type``."""
    AutoConfig.register(RegattnConfig.model_type, RegattnConfig, exist_ok=True)
    AutoModelForCausalLM.register(RegattnConfig, RegattnForCausalLM, exist_ok=True)
