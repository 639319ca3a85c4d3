"""The distributed LM path on 2 CPU processes (gloo): FSDP2 training with activation checkpointing
equals one process trained on both ranks' batches; a torch.distributed.checkpoint saved on 2 ranks loads
on 1 rank with equal parameters and validation loss and resumes there, and resumes on 2 ranks with the
losses of the uninterrupted run."""
import math
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from regattn.data import stdlib_corpus
from regattn.train.lm import (
    LMTrainConfig, Runtime, build_model, full_state_dict, load_checkpoint, perplexity, train_batch, train_lm,
)
from regattn.train.optim import apply_schedule, build_optimizer
from regattn.train.schedules import lr_factor
from regattn.usage import exit_process

MAX_BYTES = 200_000


def config(checkpoint: str | None, steps: int = 4, optimizer: str = "adamw", log_every: int = 2) -> LMTrainConfig:
    return LMTrainConfig(mixer=["parallax", "gatedfwa"], window=8, dim=32, layers=2, heads=4, kv_heads=2,
                         seq_len=16, batch_size=2, steps=steps, lr=3e-3, optimizer=optimizer, eval_tokens=256,
                         log_every=log_every, device="cpu", activation_checkpointing=True, checkpoint=checkpoint)


def one_process_reference(cfg: LMTrainConfig, world: int) -> dict:
    """The same steps in one process on the batches of all ``world`` ranks together."""
    corpus = stdlib_corpus(MAX_BYTES)
    model = build_model(cfg, Runtime(0, 1, torch.device("cpu")))
    opt = build_optimizer(model, cfg.optimizer, lr=cfg.lr, weight_decay=cfg.weight_decay)
    for step in range(cfg.steps):
        apply_schedule(opt, lr_factor(cfg.schedule, step, cfg.steps))
        x, y = (torch.cat(t) for t in zip(*(train_batch(corpus, cfg, step, r) for r in range(world))))
        opt.zero_grad()
        model(x, y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
        opt.step()
    return model.state_dict()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank: int, world: int, port: int, folder: str) -> None:
    """One rank, set up as torchrun would; rank 0 writes the gathered parameters and its results: a run saved
    at its end (step 4), a Muon run, and a 6-step run whole and stopped at step 4 then resumed."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    corpus = stdlib_corpus(MAX_BYTES)
    result = train_lm(config(os.path.join(folder, "ck")), corpus=corpus, log=lambda *_: None)
    model = result["model"]
    assert all(isinstance(p, DTensor) for p in model.parameters())
    full = full_state_dict(model)
    muon = full_state_dict(train_lm(config(None, optimizer="muon"), corpus=corpus, log=lambda *_: None)["model"])
    whole = train_lm(config(None, steps=6, log_every=1), corpus=corpus, log=lambda *_: None)
    resumable = config(os.path.join(folder, "ck-resume"), steps=6, log_every=1)
    stopped = train_lm(resumable, corpus=corpus, stop_at=4, log=lambda *_: None)
    resumed = train_lm(resumable, corpus=corpus, log=lambda *_: None)
    if rank == 0:
        torch.save(dict(state=full, muon=muon, ppl=result["final"]["ppl"], world=result["world_size"],
                        runs={name: {k: r[k] for k in ("steps", "world_size", "history")}
                              for name, r in (("whole", whole), ("stopped", stopped), ("resumed", resumed))}),
                   os.path.join(folder, "rank0.pt"))
    dist.destroy_process_group()
    exit_process(0)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> tuple[str, dict]:
    """The folder of the 2-rank runs (checkpoints) and rank 0's results."""
    folder = str(tmp_path_factory.mktemp("two-ranks"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        mp.spawn(worker, args=(2, free_port(), folder), nprocs=2, join=True)
    finally:
        torch.set_num_threads(threads)
    return folder, torch.load(os.path.join(folder, "rank0.pt"))


def test_fsdp_checkpoint_on_two_ranks_loads_on_one(two_ranks, one_thread):
    folder, saved = two_ranks
    assert saved["world"] == 2 and torch.isfinite(torch.tensor(saved["ppl"]))

    ck = os.path.join(folder, "ck")
    cfg = config(ck)
    rt = Runtime(0, 1, torch.device("cpu"))
    model = build_model(cfg, rt)
    fresh = {k: v.clone() for k, v in model.state_dict().items()}
    opt = build_optimizer(model, cfg.optimizer, lr=cfg.lr, weight_decay=cfg.weight_decay)
    meta = load_checkpoint(ck, model, opt)
    assert meta["step"] == 4
    loaded = model.state_dict()
    assert loaded.keys() == saved["state"].keys()
    for name, value in saved["state"].items():
        assert torch.equal(loaded[name], value), name
    assert any(not torch.equal(fresh[k], loaded[k]) for k in fresh)        # training moved the parameters
    corpus = stdlib_corpus(MAX_BYTES)
    assert math.isclose(perplexity(model, corpus, cfg, rt)["ppl"], saved["ppl"], rel_tol=1e-6)
    reference = one_process_reference(config(None), world=2)
    for name, value in reference.items():
        assert torch.allclose(loaded[name], value, rtol=1e-4, atol=1e-6), name

    check_muon(saved["muon"], fresh)

    resumed = train_lm(config(ck, steps=6), corpus=corpus, log=lambda *_: None)
    assert resumed["steps"] == 6 and resumed["world_size"] == 1
    assert [row["step"] for row in resumed["history"]["train"]] == [2, 4, 6]
    assert torch.isfinite(torch.tensor(resumed["final"]["ppl"]))


def test_fsdp_checkpoint_on_two_ranks_resumes_on_two(two_ranks):
    """Stopped at step 4 of 6 and resumed on 2 ranks: the steps after the checkpoint have the losses, and
    the end the validation loss, of the run that was never stopped."""
    whole, stopped, resumed = (two_ranks[1]["runs"][name] for name in ("whole", "stopped", "resumed"))
    assert stopped["steps"] == 4 and resumed["steps"] == whole["steps"] == 6
    assert all(run["world_size"] == 2 for run in (whole, stopped, resumed))
    losses = {name: [(row["step"], row["loss"]) for row in run["history"]["train"]]
              for name, run in (("whole", whole), ("stopped", stopped), ("resumed", resumed))}
    assert losses["stopped"] == losses["whole"][:4]
    assert [step for step, _ in losses["resumed"]] == [1, 2, 3, 4, 5, 6]
    assert losses["resumed"][:4] == losses["stopped"]                      # the history came from meta.json
    for (step, loss), (_, expected) in zip(losses["resumed"][4:], losses["whole"][4:]):
        assert math.isclose(loss, expected, rel_tol=1e-6), (step, loss, expected)
    assert len(resumed["history"]["eval"]) == len(whole["history"]["eval"]) == 1
    assert math.isclose(resumed["history"]["eval"][0]["nll"], whole["history"]["eval"][0]["nll"], rel_tol=1e-6)


def check_muon(sharded: dict, fresh: dict) -> None:
    """Muon on FSDP2 shards orthogonalises each whole matrix (gathered once a step): its parameters match one
    process's ``torch.optim.Muon`` up to the bf16 rounding of the Newton-Schulz steps (under 3 % of the update;
    per-shard steps would be off by half of it or more)."""
    reference = one_process_reference(config(None, optimizer="muon"), world=2)
    for name, value in reference.items():
        moved = (value - fresh[name]).norm()
        assert moved > 0, name
        assert (sharded[name] - value).norm() / moved < 0.03, name
