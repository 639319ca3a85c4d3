"""Tiny randomly initialised Llama / Qwen3 models (no downloads) for the transformers integration tests."""
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen3Config, Qwen3ForCausalLM

VOCAB = 97
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, initializer_range=0.1, pad_token_id=0)


def config(arch: str, attn_implementation: str = "sdpa", **overrides):
    """``arch``: ``"llama"``, ``"qwen3"``, ``"qwen3_sliding"`` (layer 1 with a 5-token sliding window) or
    ``"mistral"`` (every layer with a 5-token sliding window)."""
    kwargs = {**COMMON, **overrides, "attn_implementation": attn_implementation}
    if arch == "llama":
        return LlamaConfig(**kwargs)
    if arch == "qwen3":
        return Qwen3Config(**kwargs)
    if arch == "qwen3_sliding":
        return Qwen3Config(**kwargs, use_sliding_window=True, sliding_window=5,
                           layer_types=["full_attention", "sliding_attention"])
    if arch == "mistral":
        return MistralConfig(**{"sliding_window": 5, **kwargs})
    raise ValueError(arch)


def model(arch: str, attn_implementation: str = "sdpa", seed: int = 0, **overrides):
    """A fresh fp32 ``*ForCausalLM`` in eval mode; the same ``seed`` gives the same weights."""
    torch.manual_seed(seed)
    cfg = config(arch, attn_implementation, **overrides)
    classes = {"llama": LlamaForCausalLM, "mistral": MistralForCausalLM}
    return classes.get(arch, Qwen3ForCausalLM)(cfg).eval()


def tokens(B: int = 2, T: int = 13, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (B, T), generator=g)
