"""transformers integration (the ``hf`` extra): regattn attention for stock models, conversion to Parallax.

Importing this package registers the attention implementations ``"regattn_softmax"`` and
``"regattn_elsa"`` (see :mod:`regattn.hf.attention`) and the Parallax model types
``"parallax_llama"`` / ``"parallax_qwen3"`` / ``"parallax_mistral"`` (see :mod:`regattn.hf.convert`), and
:class:`regattn.models.DecoderLM` as the transformers model type ``"regattn"`` (see :mod:`regattn.hf.modeling`)::

    import regattn.hf
    model = LlamaForCausalLM(LlamaConfig(..., attn_implementation="regattn_softmax"))
    model = regattn.convert_to_parallax(model)      # zero probe gain: same logits, then fine-tune
    model.save_pretrained(path); AutoModelForCausalLM.from_pretrained(path)
    model = RegattnForCausalLM.from_lm(decoder_lm)   # DecoderLM with save_pretrained / generate
"""
try:
    import transformers  # noqa: F401
except ImportError as error:
    raise ImportError("regattn.hf needs transformers: pip install 'regattn[hf]'") from error

from regattn.hf import attention, convert, modeling
from regattn.hf.attention import ATTENTION_FUNCTIONS, check_plain_mask
from regattn.hf.convert import (
    ParallaxAttention, ParallaxLlamaConfig, ParallaxLlamaForCausalLM, ParallaxMistralConfig, ParallaxMistralForCausalLM,
    ParallaxQwen3Config, ParallaxQwen3ForCausalLM, convert_to_parallax,
)
from regattn.hf.modeling import RegattnCache, RegattnConfig, RegattnForCausalLM

ATTENTION_NAMES = attention.register()
convert.register()
modeling.register()

__all__ = [
    "ATTENTION_FUNCTIONS", "ATTENTION_NAMES", "check_plain_mask", "convert_to_parallax",
    "ParallaxAttention", "ParallaxLlamaConfig", "ParallaxLlamaForCausalLM", "ParallaxMistralConfig",
    "ParallaxMistralForCausalLM", "ParallaxQwen3Config", "ParallaxQwen3ForCausalLM", "RegattnCache", "RegattnConfig",
    "RegattnForCausalLM",
]
