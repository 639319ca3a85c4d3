"""DecoderLM: every mixer trains and generates with its cache exactly as without it."""
import math

import pytest
import torch

from regattn.models import LM_MIXERS, DecoderLM, LMConfig
from regattn.models.lm import EOS_CHECK_EVERY, top_p_filter

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 48
NSA = {"gatedfwa_nsa": dict(block_cmp=4, stride_cmp=2, block_slc=4, topk=2)}


def tiny(mixer, **kw) -> DecoderLM:
    """Two layers, width 32, 4 query heads over 2 key/value heads (GQA; decay has none), window 4."""
    names = [mixer] if isinstance(mixer, str) else mixer
    kv = None if "decay" in names else 2
    options = dict(vocab_size=VOCAB, dim=32, layers=2, heads=4, kv_heads=kv, mixer=mixer, window=4,
                   mixer_options=NSA)
    options.update(kw)
    torch.manual_seed(0)
    return DecoderLM(LMConfig(**options))


@pytest.mark.parametrize("mixer", LM_MIXERS)
def test_forward_backward(mixer):
    model = tiny(mixer)
    tokens = torch.randint(0, VOCAB, (2, 11))
    logits = model(tokens)
    assert logits.shape == (2, 11, VOCAB)
    loss = model(tokens[:, :-1], tokens[:, 1:])
    assert torch.isfinite(loss) and abs(loss.item() - torch.log(torch.tensor(VOCAB)).item()) < 1.0
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    assert model.embed.weight.grad.abs().sum() > 0
    assert sum(p.grad.abs().sum() for p in model.blocks[0].mixer.parameters()) > 0


@pytest.mark.parametrize("mixer", LM_MIXERS)
def test_greedy_generation_with_cache_equals_without(mixer):
    """Prompt of 5 tokens, 7 new ones: the window of 4 is passed, so cached windows are evicted."""
    model = tiny(mixer)
    prompt = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(1))
    cached = model.generate(prompt, 7)
    uncached = model.generate(prompt, 7, use_cache=False)
    assert cached.shape == (2, 12)
    assert torch.equal(cached[:, :5], prompt)
    assert torch.equal(cached, uncached)


def test_nsa_generation_steps_one_token_at_a_time(monkeypatch):
    """The NSA layers run the prompt once, then each step sees only its new token (their cache)."""
    from regattn.layers import GatedFWANSA
    seen = []
    for name in ("prefill", "step"):
        original = getattr(GatedFWANSA, name)
        monkeypatch.setattr(GatedFWANSA, name, lambda self, x, *a, _f=original, _n=name, **k:
                            seen.append((_n, x.shape[1])) or _f(self, x, *a, **k))
    model = tiny("gatedfwa_nsa")
    prompt = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(4))
    model.generate(prompt, 4)
    assert seen == [("prefill", 5)] * 2 + [("step", 1)] * 6


def test_lla_generation_at_head_dim_16():
    """LLA's default exact solve at a head dim where 8 CG iterations would not be exact."""
    model = tiny("lla", dim=64)
    assert model.blocks[0].mixer.layer.cg_iters is None and model.blocks[0].mixer.layer.head_dim == 16
    prompt = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(6))
    assert torch.equal(model.generate(prompt, 8), model.generate(prompt, 8, use_cache=False))


def test_generation_per_layer_mixers():
    model = tiny(["parallax", "decay", "gatedfwa"], layers=3, kv_heads=None)
    prompt = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(2))
    assert torch.equal(model.generate(prompt, 6), model.generate(prompt, 6, use_cache=False))
    assert [type(b.mixer.layer).__name__ for b in model.blocks] == ["Parallax", "Retention", "GatedFWA"]


def test_cached_logits_match_full_forward():
    """The last-position logits of each cached step equal the full forward's, for a Parallax model."""
    model = tiny("parallax").eval()
    tokens = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(tokens)
        logits, caches = model._run(tokens[:, :4], None)
        steps = [logits]
        for t in range(4, 9):
            logits, caches = model._run(tokens[:, t:t + 1], caches)
            steps.append(logits)
    got = torch.stack(steps, 1)
    ref = full[:, 3:]
    assert (got - ref).norm() / ref.norm() < 1e-5


def test_tied_embeddings():
    model = tiny("softmax")
    assert model.head.weight is model.embed.weight
    params = dict(model.named_parameters())
    assert "head.weight" not in params
    assert model.num_parameters() == sum(p.numel() for p in params.values())
    untied = tiny("softmax", tie_embeddings=False)
    assert untied.num_parameters() == model.num_parameters() + VOCAB * 32
    tokens = torch.randint(0, VOCAB, (1, 6))
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    unused = torch.ones(VOCAB, dtype=torch.bool)      # rows never looked up get the output head's gradient
    unused[tokens[0, :-1]] = False
    assert model.embed.weight.grad[unused].abs().sum() > 0


def test_zero_probe_parallax_is_the_softmax_model():
    """Parallax with W_R = 0 (parallax.txt Section 5) computes the same logits as the softmax decoder."""
    plx = tiny("parallax", mixer_options={"parallax": {"zero_init_probe": True}})
    soft = tiny("softmax")
    state = {k.replace("mixer.layer.", "mixer."): v for k, v in plx.state_dict().items() if ".r_proj." not in k
             and ".r_norm." not in k}
    soft.load_state_dict(state)
    tokens = torch.randint(0, VOCAB, (2, 10))
    a, b = plx(tokens), soft(tokens)
    assert (a - b).norm() / b.norm() < 1e-6


def test_sampling():
    model = tiny("decay")
    prompt = torch.randint(0, VOCAB, (2, 3))
    assert torch.equal(model.generate(prompt, 5, temperature=1.0, top_k=1), model.generate(prompt, 5))
    a = model.generate(prompt, 8, temperature=1.0, generator=torch.Generator().manual_seed(5))
    b = model.generate(prompt, 8, temperature=1.0, generator=torch.Generator().manual_seed(5), use_cache=False)
    assert torch.equal(a, b)
    assert ((0 <= a) & (a < VOCAB)).all()


def test_checkpointing_gives_the_same_gradients():
    tokens = torch.randint(0, VOCAB, (2, 8))
    grads = []
    for flag in (False, True):
        model = tiny("gatedfwa", checkpointing=flag)
        model(tokens[:, :-1], tokens[:, 1:]).backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert torch.allclose(grads[0], grads[1], rtol=1e-5, atol=1e-7)


def test_bad_inputs():
    with pytest.raises(ValueError, match="mixer"):
        tiny("nope")
    with pytest.raises(ValueError, match="window"):
        tiny("gatedfwa", window=None)
    with pytest.raises(ValueError, match="mixer"):
        tiny(["softmax"], layers=2)
    with pytest.raises(ValueError, match="kv_heads"):
        tiny("decay", kv_heads=2)
    with pytest.raises(ValueError, match="layers"):
        tiny("softmax", layers=0)
    with pytest.raises(ValueError, match="vocab_size"):
        tiny("softmax", vocab_size=0)
    model = tiny("softmax")
    prompt = torch.randint(0, VOCAB, (2, 3))
    with pytest.raises(ValueError, match="prompt"):
        model.generate(prompt[0], 2)
    with pytest.raises(TypeError, match="prompt"):
        model.generate(prompt.float(), 2)
    for ids in (prompt - VOCAB, prompt + VOCAB):
        with pytest.raises(ValueError, match="prompt"):
            model.generate(ids, 2)
    bad = [dict(max_new_tokens=-1), dict(max_new_tokens=2.0), dict(top_k=0), dict(top_k=-3), dict(top_p=0.0),
           dict(top_p=1.5), dict(temperature=-1.0), dict(temperature=float("nan")), dict(temperature=float("inf")),
           dict(eos_token_id=VOCAB), dict(eos_token_id=-1)]
    for kwargs in bad:
        kwargs = {"max_new_tokens": 2, **kwargs}
        name = next(k for k in kwargs if k != "max_new_tokens" or len(kwargs) == 1)
        with pytest.raises(ValueError, match=name):
            model.generate(prompt, **kwargs)
    assert torch.equal(model.generate(prompt, 0), prompt)


def with_eos(reference: torch.Tensor, start: int, eos: int) -> torch.Tensor:
    """``reference``'s rows cut at their first new ``eos`` (the rest ``eos``), and cut after the check
    (every EOS_CHECK_EVERY steps) that finds every row ended."""
    out, ends = reference.clone(), []
    for row in out:
        hits = (row[start:] == eos).nonzero()
        ends.append(int(hits[0]) + 1 if len(hits) else math.inf)
        if len(hits):
            row[start + int(hits[0]):] = eos
    last = max(ends)
    steps = reference.shape[1] - start if last == math.inf else math.ceil(last / EOS_CHECK_EVERY) * EOS_CHECK_EVERY
    return out[:, :start + steps]


def test_eos_ends_each_row_and_generation_stops_when_all_have():
    model = tiny("softmax")
    prompt = torch.randint(0, VOCAB, (3, 4))
    n = 2 * EOS_CHECK_EVERY + 3
    reference = model.generate(prompt, n)
    eos = int(reference[1, 6])                                   # row 1 ends at its third new token
    assert torch.equal(model.generate(prompt, n, eos_token_id=eos), with_eos(reference, 4, eos))
    same = prompt[1:2].expand(3, -1)                             # every row ends at its third token: stops early
    out = model.generate(same, n, eos_token_id=eos)
    assert out.shape == (3, 4 + EOS_CHECK_EVERY) and torch.equal(out, with_eos(reference[1:2].expand(3, -1), 4, eos))
    sampled = model.generate(prompt, n, temperature=1.0, eos_token_id=eos, generator=torch.Generator().manual_seed(1))
    for row in sampled[:, 4:]:
        hits = (row == eos).nonzero()
        assert not len(hits) or (row[int(hits[0]):] == eos).all()


def test_top_p_keeps_the_smallest_nucleus():
    logits = torch.randn(6, VOCAB) * 3
    for p in (0.05, 0.5, 0.9, 1.0):
        kept = top_p_filter(logits, p) > -math.inf
        probs = torch.softmax(logits.double(), -1)
        for row, keep in zip(probs, kept):
            ranked = row.sort(descending=True).values
            size = int((ranked.cumsum(0) < p).sum()) + 1                  # smallest prefix with mass >= p
            size = min(size, VOCAB)
            assert int(keep.sum()) == size and row[keep].min() >= ranked[size - 1]
    model = tiny("softmax")
    prompt = torch.randint(0, VOCAB, (2, 3))
    tiny_p = model.generate(prompt, 5, temperature=1.0, top_p=1e-9, generator=torch.Generator().manual_seed(2))
    assert torch.equal(tiny_p, model.generate(prompt, 5))                 # only the most likely token is left


@pytest.mark.gpu
@pytest.mark.parametrize("mixer", LM_MIXERS)
def test_gpu_kernels_generate_and_train_in_bf16(mixer):
    """On CUDA the mixers run their Triton kernels (prefill and decode): cached greedy generation in fp32
    equals the uncached one, and 20 AdamW steps under bf16 autocast lower the loss on a fixed batch."""
    model = tiny(mixer, dim=64, window=16).cuda()
    torch.manual_seed(4)
    prompt = torch.randint(0, VOCAB, (2, 20), device="cuda")
    assert torch.equal(model.generate(prompt, 12), model.generate(prompt, 12, use_cache=False))
    tokens = torch.randint(0, VOCAB, (4, 65), device="cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(20):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(tokens[:, :-1], tokens[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0] - 0.5, losses



@pytest.mark.parametrize("mixer", LM_MIXERS)
def test_backward_under_cpu_autocast(mixer):
    """Under bf16 autocast the backward of every mixer runs (outside the autocast region, on gradients of
    another dtype than the forward's products) and gives finite gradients."""
    model = tiny(mixer, dim=64, window=16)
    tokens = torch.randint(0, VOCAB, (2, 33))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
