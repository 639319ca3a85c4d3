"""Stock Llama / Qwen3 models on regattn attention match transformers' sdpa and eager attention."""
import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

import regattn.hf  # noqa: E402  (registers the attention implementations)
from tests.helpers import rel_err  # noqa: E402
from tests.hf import tiny  # noqa: E402

IMPLS = ["regattn_softmax", "regattn_elsa"]


def _pair(arch, impl, peer="sdpa", **overrides):
    """The same weights under transformers' ``peer`` attention and under ``impl``."""
    return tiny.model(arch, peer, **overrides), tiny.model(arch, impl, **overrides)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_sliding"])
@pytest.mark.parametrize("impl", IMPLS)
def test_logits_match_sdpa_and_eager(arch, impl):
    x = tiny.tokens(T=13)
    ours = tiny.model(arch, impl)(x).logits
    for peer in ("sdpa", "eager"):
        theirs = tiny.model(arch, peer)(x).logits
        assert rel_err(ours, theirs) < 1e-5, peer


def test_sliding_window_is_applied():
    """The windowed layer really differs from full attention at T > window (so the match above means something)."""
    x = tiny.tokens(T=13)
    windowed = tiny.model("qwen3_sliding", "regattn_softmax")(x).logits
    full = tiny.model("qwen3", "regattn_softmax")(x).logits
    assert rel_err(windowed, full) > 1e-3


@pytest.mark.parametrize("impl", IMPLS)
def test_gradients_match_sdpa(impl):
    x = tiny.tokens(T=11)
    grads = []
    for model in _pair("qwen3", impl):
        model(x, labels=x).loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.model.layers[0].self_attn.parameters()]))
    assert rel_err(grads[1], grads[0]) < 1e-5


@pytest.mark.parametrize("arch", ["llama", "qwen3_sliding"])
def test_cached_generation_matches_sdpa(arch):
    """Greedy generation through the KV cache (queries aligned to the end of the keys; sliding caches)."""
    x = tiny.tokens(B=2, T=6)
    kwargs = dict(max_new_tokens=9, do_sample=False, attention_mask=torch.ones_like(x), output_logits=True,
                  return_dict_in_generate=True)
    ref, ours = (model.generate(x, **kwargs) for model in _pair(arch, "regattn_softmax"))
    assert torch.equal(ours.sequences, ref.sequences)
    assert rel_err(torch.stack(ours.logits), torch.stack(ref.logits)) < 1e-5


@pytest.mark.parametrize("arch", ["llama", "qwen3_sliding", "mistral"])
@pytest.mark.parametrize("impl", IMPLS)
def test_left_padding(arch, impl):
    """A left-padded batch (prefill and greedy generation) equals each row alone."""
    tiny.check_left_padding(tiny.model(arch, impl))


def test_right_padding_is_refused():
    model = tiny.model("llama", "regattn_softmax")
    x = tiny.tokens(B=2, T=7)
    mask = torch.ones_like(x)
    mask[0, 5:] = 0
    with pytest.raises(ValueError, match="attention_mask"):
        model(x, attention_mask=mask)
    model(x, attention_mask=torch.ones_like(x))   # a mask without padding is fine


def packed_check(model, lengths=(5, 3, 6)):
    """One row of packed sequences (restarting position ids, no cache) equals each sequence on its own."""
    x = tiny.tokens(B=1, T=sum(lengths))
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    packed = model(x, position_ids=position_ids, use_cache=False).logits
    alone = torch.cat([model(part, use_cache=False).logits for part in x.split(lengths, dim=1)], 1)
    assert rel_err(packed, alone) < 1e-5


@pytest.mark.parametrize("impl", IMPLS)
def test_packed_sequences(impl):
    packed_check(tiny.model("qwen3_sliding", impl))


def test_static_cache_is_refused():
    """A static cache hands over empty slots that only its mask hides: refused, not attended."""
    model = tiny.model("llama", "regattn_softmax")
    with pytest.raises(ValueError, match="static cache"):
        model.generate(tiny.tokens(B=1, T=5), max_new_tokens=2, do_sample=False, cache_implementation="static")


def test_attention_dropout_is_refused():
    model = tiny.model("llama", "regattn_softmax", attention_dropout=0.1).train()
    with pytest.raises(ValueError, match="dropout"):
        model(tiny.tokens())


def test_bad_backend_is_refused():
    model = tiny.model("llama", "regattn_softmax", regattn_backend="cuda")
    with pytest.raises(ValueError, match="backend"):
        model(tiny.tokens())


def test_softcap_is_refused():
    fn = regattn.hf.ATTENTION_FUNCTIONS["regattn_softmax"]
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="softcap"):
        fn(torch.nn.Module(), q, q, q, None, scaling=None, softcap=30.0)


def test_mask_check_errors():
    check = regattn.hf.check_plain_mask
    causal = torch.ones(4, 4, dtype=torch.bool).tril()[None, None]
    check(causal, 4, 4, causal=True, window=None)
    check(torch.zeros(1, 1, 4, 4).masked_fill(~causal, float("-inf")), 4, 4, causal=True, window=None)
    with pytest.raises(ValueError, match="window"):
        check(causal, 4, 4, causal=True, window=2)
    with pytest.raises(ValueError, match="shape"):
        check(causal, 3, 4, causal=True, window=None)
    two = torch.tensor([0, 2, 4], dtype=torch.int32)
    block = causal & torch.tensor([[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 1], [0, 0, 1, 1]], dtype=torch.bool)
    check(block, 4, 4, causal=True, window=None, cu_seqlens=two)
    with pytest.raises(ValueError, match="attention_mask"):
        check(block, 4, 4, causal=True, window=None)
    with pytest.raises(TypeError, match="attention_mask"):
        check([[1]], 4, 4, causal=True, window=None)


@pytest.mark.parametrize("impl", IMPLS)
def test_triton_kernels_through_transformers(interpret, impl):
    """``config.regattn_backend = "triton"``: the fused kernels (interpreter on CPU) inside the model."""
    x = tiny.tokens(B=1, T=9)
    ours = tiny.model("qwen3_sliding", impl, regattn_backend="triton")
    assert ours.config.regattn_backend == "triton"
    assert rel_err(ours(x).logits, tiny.model("qwen3_sliding")(x).logits) < 1e-5
