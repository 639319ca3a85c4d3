"""LM training on a GPU (``-m gpu``): a step waits on the device nowhere, so the host queues the next step
while this one runs (the loop reads the losses back at log points only)."""
import pytest
import torch

from regattn.data import stdlib_corpus
from regattn.train.lm import LMTrainConfig, Runtime, build_model, train_step
from regattn.train.optim import build_optimizer

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("mixer", ["softmax", "parallax"])
def test_a_training_step_waits_on_the_device_nowhere(mixer):
    config = LMTrainConfig(mixer=mixer, dim=64, layers=2, heads=2, seq_len=64, batch_size=4, device="cuda")
    corpus = stdlib_corpus(200_000)
    rt = Runtime(rank=0, world=1, device=torch.device("cuda"))
    model = build_model(config, rt)
    opt = build_optimizer(model, config.optimizer, lr=config.lr, weight_decay=config.weight_decay, fused=True)
    train_step(model, opt, config, corpus, 0, rt)  # compiles and tunes the kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        losses = [train_step(model, opt, config, corpus, step, rt) for step in range(1, 4)]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(torch.stack(losses)).all()


@pytest.mark.parametrize("mixer", ["softmax", "parallax"])
def test_compiled_model_trains_as_the_eager_one(mixer):
    """``compile="default"``: the same losses as eager over a few steps (bf16 autocast: within rounding), and the
    state dict keeps its keys (checkpoints load into either)."""
    corpus = stdlib_corpus(200_000)
    rt = Runtime(rank=0, world=1, device=torch.device("cuda"))
    losses, keys = {}, {}
    for mode in ("none", "default"):
        config = LMTrainConfig(mixer=mixer, dim=64, layers=2, heads=2, seq_len=64, batch_size=4, device="cuda",
                               compile=mode)
        model = build_model(config, rt)
        opt = build_optimizer(model, config.optimizer, lr=config.lr, weight_decay=config.weight_decay, fused=True)
        losses[mode] = torch.stack([train_step(model, opt, config, corpus, step, rt) for step in range(4)])
        keys[mode] = list(model.state_dict())
    assert keys["none"] == keys["default"]
    torch.testing.assert_close(losses["default"], losses["none"], rtol=2e-2, atol=0)
