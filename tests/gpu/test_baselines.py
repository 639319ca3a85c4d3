"""The flash-linear-attention baselines on a GPU (``-m gpu``, the ``baselines`` extra).

Each baseline in a tiny task model: forward and backward under bf16 autocast, a few training steps
whose loss falls, and the same steps captured in a CUDA graph; in a DecoderLM: a training step and generation. The chunked kernels the gla and gdn
layers train with, against FLA's own naive recurrences, forward and backward. A baseline FLA
refuses on this machine is skipped with FLA's reason.
"""
import functools

import pytest
import torch
import torch.nn.functional as F

from regattn.models import DecoderLM, LMConfig
from regattn.models.baselines import BASELINES, build_baseline, refusal
from regattn.models.stack import build_model
from regattn.tasks import IGNORE, mad_task
from regattn.train.trainer import TrainConfig, train
from tests.gpu.rule import assert_within, leaves, outputs
from tests.gpu.test_trainer import assert_graph_matches_eager

pytestmark = pytest.mark.gpu
pytest.importorskip("fla.layers")
DIM, HEADS = 64, 2                      # heads of 32: the kernel tests below use the same widths
# deltanet's first forward and backward autotuned for more than 400 s on the H100 (triton 3.6) without
# finishing: it is left out of these tests (its chunked kernel is the layer's).
LAYERS = tuple(name for name in BASELINES if name != "deltanet")


@functools.cache
def refused(name):
    return refusal(name, DIM, HEADS, "cuda")


def skip_if_refused(name):
    reason = refused(name)
    if reason is not None:
        pytest.skip(f"flash-linear-attention refuses {name} here: {reason}")


@pytest.mark.parametrize("name", LAYERS)
def test_forward_backward_in_bf16(name):
    skip_if_refused(name)
    task = mad_task("recall", num_train=8, num_test=1, seq_len=130, device="cuda")
    model = build_model(task, name, dim=DIM, heads=HEADS).cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(task.train.inputs)
    assert logits.shape == (*task.train.inputs.shape, task.vocab_size) and torch.isfinite(logits).all()
    F.cross_entropy(logits.float().flatten(0, 1), task.train.targets.flatten(), ignore_index=IGNORE).backward()
    for key, p in model.blocks.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), key
    assert all(p.grad.abs().sum() > 0 for p in model.blocks[0].mixer.parameters())


@pytest.mark.parametrize("name", LAYERS)
def test_loss_falls(name):
    skip_if_refused(name)
    options = dict(vocab_size=32, seq_len=128, num_train=64, num_test=16)
    r = train(TrainConfig(task="mad_memorization", task_options=options, mixer=name, dim=DIM, heads=HEADS,
                          steps=40, lr=3e-3, batch_size=8, schedule="constant", device="cuda", progress=False,
                          log_every=1))
    losses = [row["loss"] for row in r["history"]["train"]]
    assert not r["diverged"] and sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5, losses


@pytest.mark.parametrize("mode", ["none", "default"])
@pytest.mark.parametrize("name", LAYERS)
def test_trains_in_a_cuda_graph(name, mode):
    skip_if_refused(name)
    config = TrainConfig(task="mad_memorization", task_options=dict(vocab_size=32, seq_len=128, num_train=64,
                         num_test=16), mixer=name, dim=DIM, heads=HEADS, steps=12, log_every=4, batch_size=8,
                         device="cuda", progress=False, compile=mode)
    assert_graph_matches_eager(config)


# ---------------------------------------------------------------------------------- FLA's kernels
B, T, H, K = 2, 200, HEADS, DIM // HEADS          # T: not a multiple of the chunk (64)
ARGUMENTS = {"gla": ("q", "k", "v", "g"), "gdn": ("q", "k", "v", "beta", "g")}


def gla_inputs():
    q, k, v = (torch.randn(B, T, H, K, device="cuda") for _ in range(3))
    return [q, k, v, F.logsigmoid(torch.randn(B, T, H, K, device="cuda")) / 16]


def gated_delta_inputs():
    q, k, v = (torch.randn(B, T, H, K, device="cuda") for _ in range(3))
    return [q, k, v, torch.rand(B, T, H, device="cuda"), F.logsigmoid(torch.randn(B, T, H, device="cuda") + 3)]


def fla_ops(name):
    """``(the chunked kernel, FLA's naive recurrence, inputs)`` of the baseline ``name``, both as ``f(*inputs)``."""
    if name == "gla":
        from fla.ops.gla import chunk_gla
        from fla.ops.gla.naive import naive_recurrent_gla
        return (lambda q, k, v, g: chunk_gla(q, k, v, g)[0],
                lambda q, k, v, g: naive_recurrent_gla(q, k, v, g)[0], gla_inputs())
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule
    return (lambda q, k, v, beta, g: chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0],
            lambda q, k, v, beta, g: naive_recurrent_gated_delta_rule(
                F.normalize(q, dim=-1), F.normalize(k, dim=-1), v, beta, g)[0], gated_delta_inputs())


@pytest.mark.parametrize("name", ARGUMENTS)
def test_chunked_kernels_match_fla_naive_recurrence(name):
    """bf16 inputs (as the layers see them under autocast); the recurrence runs in fp32 on the same values."""
    skip_if_refused(name)
    kernel, naive, inputs = fla_ops(name)
    inputs = [x.bfloat16() for x in inputs]
    do = torch.randn(B, T, H, K, device="cuda")
    got = outputs(kernel, leaves(inputs), do.bfloat16())
    exact = outputs(naive, leaves(inputs, torch.float32), do)
    assert_within(["o"] + ["d" + x for x in ARGUMENTS[name]], [x.float() for x in got], exact, fixed=2e-2)


@pytest.mark.parametrize("name", LAYERS)
def test_decoder_lm_trains_and_generates(name):
    """A DecoderLM layer: a bf16 training step, and greedy generation (each step reruns the layer) equal
    to generation that reruns the whole model."""
    skip_if_refused(name)
    model = DecoderLM(LMConfig(mixer=["softmax", name], layers=2, dim=DIM, heads=HEADS)).cuda()
    tokens = torch.randint(0, 256, (2, 80), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters())
    prompt = tokens[:, :70]
    assert torch.equal(model.generate(prompt, 4), model.generate(prompt, 4, use_cache=False))


def test_mamba2_as_built_matches_flas_pytorch_path():
    """The mamba2 mixer (mamba_ssm's Triton kernels where installed, see ``mamba2_call``) against FLA's own
    PyTorch form of the same layer, forward and backward under bf16 autocast, at the MAD model's state size."""
    skip_if_refused("mamba2")
    mixer = build_baseline("mamba2", 128, 2, state_size=4, chunk_size=16).cuda()
    x = torch.randn(8, 128, 128, device="cuda")
    do = torch.randn(8, 128, 128, device="cuda")

    def run(forward):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return outputs(lambda x: forward(x).float(), leaves([x]), do)
    got = run(mixer)
    exact = run(lambda x: mixer.layer.torch_forward(x)[0])
    assert_within(["o", "dx"], got, exact, fixed=3e-2)
