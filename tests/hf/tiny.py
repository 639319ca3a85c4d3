"""Tiny randomly initialised Llama / Qwen3 / Mistral models (no downloads) for the transformers integration
tests, and the left-padding check they share."""
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen3Config, Qwen3ForCausalLM

from tests.helpers import rel_err

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


def left_padded(lengths, T, seed=1):
    """Tokens ``[B, T]`` with row ``b`` holding ``lengths[b]`` real tokens at the end (pad id 0 first) and its mask."""
    x = tokens(B=len(lengths), T=T, seed=seed)
    mask = torch.stack([torch.arange(T) >= T - n for n in lengths]).long()
    return x * mask, mask


def check_left_padding(model, lengths=(9, 2, 6), T=9, new=6):
    """Logits of a left-padded batch at the real positions, and greedy ``generate`` on it (tokens and
    per-step logits), equal each row run alone without padding."""
    x, mask = left_padded(lengths, T)
    kwargs = dict(max_new_tokens=new, do_sample=False, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        padded = model(x, attention_mask=mask).logits
        batch = model.generate(x, attention_mask=mask, **kwargs)
    for b, n in enumerate(lengths):
        row = x[b:b + 1, T - n:]
        with torch.no_grad():
            alone = model.generate(row, attention_mask=torch.ones_like(row), **kwargs)
            assert rel_err(padded[b, T - n:], model(row).logits[0]) < 1e-5
        assert torch.equal(batch.sequences[b, T - n:], alone.sequences[0])
        assert rel_err(torch.stack(batch.logits)[:, b], torch.stack(alone.logits)[:, 0]) < 1e-5
