"""The distributed LM path on 2 CPU processes (gloo): FSDP2 training with activation checkpointing
equals one process trained on both ranks' batches; a torch.distributed.checkpoint saved on 2 ranks loads
on 1 rank with equal parameters and resumes there."""
import os
import socket

import torch
import torch.multiprocessing as mp

from regattn.data import stdlib_corpus
from regattn.train.lm import (
    LMTrainConfig, Runtime, build_model, full_state_dict, load_checkpoint, train_batch, train_lm,
)
from regattn.train.optim import apply_schedule, build_optimizer
from regattn.train.schedules import lr_factor

MAX_BYTES = 200_000


def config(checkpoint: str | None, steps: int = 4, optimizer: str = "adamw") -> LMTrainConfig:
    return LMTrainConfig(mixer=["parallax", "gatedfwa"], window=8, dim=32, layers=2, heads=4, kv_heads=2,
                         seq_len=16, batch_size=2, steps=steps, lr=3e-3, optimizer=optimizer, eval_tokens=256,
                         log_every=2, device="cpu", activation_checkpointing=True, checkpoint=checkpoint)


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
    """One rank, set up as torchrun would; rank 0 writes the gathered parameters and its result."""
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
    if rank == 0:
        torch.save(dict(state=full, muon=muon, ppl=result["final"]["ppl"], world=result["world_size"]),
                   os.path.join(folder, "rank0.pt"))
    dist.destroy_process_group()


def test_fsdp_checkpoint_on_two_ranks_loads_on_one(tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        check_two_ranks_then_one(str(tmp_path))
    finally:
        torch.set_num_threads(threads)


def check_two_ranks_then_one(folder: str) -> None:
    mp.spawn(worker, args=(2, free_port(), folder), nprocs=2, join=True)
    saved = torch.load(os.path.join(folder, "rank0.pt"))
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
    reference = one_process_reference(config(None), world=2)
    for name, value in reference.items():
        assert torch.allclose(loaded[name], value, rtol=1e-4, atol=1e-6), name

    check_muon(saved["muon"], fresh)

    resumed = train_lm(config(ck, steps=6), corpus=stdlib_corpus(MAX_BYTES), log=lambda *_: None)
    assert resumed["steps"] == 6 and resumed["world_size"] == 1
    assert [row["step"] for row in resumed["history"]["train"]] == [2, 4, 6]
    assert torch.isfinite(torch.tensor(resumed["final"]["ppl"]))


def check_muon(sharded: dict, fresh: dict) -> None:
    """Muon on FSDP2 shards orthogonalises each whole matrix: its parameters match one process's up to the
    bf16 rounding of the Newton-Schulz steps (a few per cent of the update; per-shard steps would be far off)."""
    reference = one_process_reference(config(None, optimizer="muon"), world=2)
    for name, value in reference.items():
        moved = (value - fresh[name]).norm()
        assert moved > 0, name
        assert (sharded[name] - value).norm() / moved < 0.1, name
