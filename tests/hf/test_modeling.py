"""DecoderLM as a transformers model: registration, save/load, transformers' generate, left padding."""
import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

import regattn.hf  # noqa: E402  (registers model_type "regattn")
from regattn.hf import RegattnCache, RegattnConfig, RegattnForCausalLM  # noqa: E402
from regattn.models import LM_MIXERS, DecoderLM, LMConfig  # noqa: E402
from tests.helpers import rel_err  # noqa: E402

VOCAB = 61
PADDED = ["softmax", "swa", "elsa", "parallax", "gatedfwa"]


def _model(mixer, layers=2, **options) -> RegattnForCausalLM:
    """A tiny model with random weights (embeddings at unit scale so that tokens differ); GQA unless
    a layer is ``decay`` (which has none)."""
    kv_heads = None if "decay" in mixer else 2
    lm = DecoderLM(LMConfig(vocab_size=VOCAB, dim=32, layers=layers, heads=4, kv_heads=kv_heads, mixer=mixer,
                            window=4, **options))
    with torch.no_grad():
        lm.embed.weight.normal_()
    return RegattnForCausalLM.from_lm(lm).eval()


def _tokens(B, T):
    return torch.randint(1, VOCAB, (B, T))


def test_registered_with_auto_classes():
    config = AutoConfig.for_model("regattn", lm=dict(vocab_size=VOCAB, dim=32, layers=1, heads=4))
    assert isinstance(config, RegattnConfig) and config.lm_config().dim == 32 and config.vocab_size == VOCAB
    assert isinstance(AutoModelForCausalLM.from_config(config), RegattnForCausalLM)


def test_save_load_gives_identical_logits(tmp_path):
    """Every mixer, one per layer; the tied head stays tied."""
    model = _model(list(LM_MIXERS), layers=len(LM_MIXERS))
    x = _tokens(2, 9)
    with torch.no_grad():
        expected = model(x).logits
    model.save_pretrained(tmp_path)
    loaded, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert type(loaded) is RegattnForCausalLM and loaded.config.lm == model.config.lm
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert loaded.lm.head.weight is loaded.lm.embed.weight
    with torch.no_grad():
        assert torch.equal(loaded.eval()(x).logits, expected)


@pytest.mark.parametrize("mixer", LM_MIXERS)
def test_transformers_generate_equals_decoder_lm_generate(mixer):
    model = _model(mixer)
    prompt = _tokens(2, 6)
    out = model.generate(prompt, max_new_tokens=7, do_sample=False, return_dict_in_generate=True)
    assert isinstance(out.past_key_values, RegattnCache) and out.past_key_values.get_seq_length() == 12
    assert torch.equal(out.sequences, model.lm.generate(prompt, 7))


def test_forward_loss_and_cache():
    """Labels give the shifted mean cross-entropy of DecoderLM; a cached step equals the full forward."""
    model = _model(["gatedfwa", "parallax"])
    x = _tokens(2, 9)
    out = model(x, labels=x)
    assert rel_err(out.loss, model.lm(x[:, :-1], x[:, 1:])) < 1e-6
    with torch.no_grad():
        first = model(x[:, :6], use_cache=True)
        step = model(x[:, 6:7], past_key_values=first.past_key_values)
        assert step.past_key_values is first.past_key_values and step.past_key_values.get_seq_length() == 7
        assert rel_err(step.logits[:, -1], model(x[:, :7]).logits[:, -1]) < 1e-5
        assert rel_err(model(x, logits_to_keep=1).logits, out.logits[:, -1:]) < 1e-5


def _left_padded(lengths, T):
    x = _tokens(len(lengths), T)
    mask = torch.stack([torch.arange(T) >= T - n for n in lengths]).long()
    return x * mask, mask


@pytest.mark.parametrize("mixer", PADDED)
def test_left_padding_equals_rows_alone(mixer):
    """Logits at the real positions (with and without the cache) and greedy generation (tokens and
    per-step logits) of a left-padded batch equal each row run alone; rows shorter and longer than
    the window of swa and gatedfwa (4)."""
    model = _model(mixer)
    lengths, T, new = (8, 2, 5), 8, 6
    x, mask = _left_padded(lengths, T)
    kwargs = dict(max_new_tokens=new, do_sample=False, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        padded = model(x, attention_mask=mask, use_cache=False).logits
        cached = model(x, attention_mask=mask, use_cache=True).logits
    batch = model.generate(x, attention_mask=mask, **kwargs)
    for b, n in enumerate(lengths):
        row = x[b:b + 1, T - n:]
        with torch.no_grad():
            alone = model(row).logits[0]
        assert rel_err(padded[b, T - n:], alone) < 1e-5 and rel_err(cached[b, T - n:], alone) < 1e-5
        single = model.generate(row, **kwargs)
        assert torch.equal(batch.sequences[b, T - n:], single.sequences[0])
        assert torch.equal(single.sequences[0], model.lm.generate(row, new)[0])
        assert rel_err(torch.stack(batch.logits)[:, b], torch.stack(single.logits)[:, 0]) < 1e-5


def test_bad_inputs():
    model = _model(["softmax", "lla"])
    x = _tokens(2, 5)
    right = torch.ones_like(x)
    right[1, 3:] = 0
    with pytest.raises(ValueError, match="attention_mask: expected left padding"):
        model(x, attention_mask=right)
    with pytest.raises(ValueError, match="attention_mask: expected a"):
        model(x, attention_mask=torch.ones(2, 4, dtype=torch.long))
    left = torch.ones_like(x)
    left[1, :2] = 0
    with pytest.raises(ValueError, match="attention_mask: left padding is supported"):
        model(x, attention_mask=left)
    with pytest.raises(TypeError, match="past_key_values"):
        model(x, past_key_values=object())
    cache = model(x, use_cache=True).past_key_values
    with pytest.raises(ValueError, match="attention_mask: expected 6 columns"):
        model(x[:, :1], past_key_values=cache, attention_mask=torch.ones(2, 3, dtype=torch.long))
    with pytest.raises(TypeError, match="lm"):
        RegattnConfig(lm=[1, 2])


def test_left_padding_on_the_kernels(interpret):
    """Through the Triton kernels (the interpreter on CPU): the padded prefill of the Parallax and
    GatedFWA kernels and the Parallax decode kernel with ragged cache lengths give the torch backend's
    generation."""
    model = _model(["parallax", "gatedfwa"])
    x, mask = _left_padded((6, 3), 6)
    kwargs = dict(attention_mask=mask, max_new_tokens=3, do_sample=False, output_logits=True,
                  return_dict_in_generate=True)
    expected = model.generate(x, **kwargs)
    for block in model.lm.blocks:
        block.mixer.layer.backend = "triton"
    out = model.generate(x, **kwargs)
    assert torch.equal(out.sequences, expected.sequences)
    assert rel_err(torch.stack(out.logits), torch.stack(expected.logits)) < 1e-5
