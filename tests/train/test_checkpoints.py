"""Checkpoints load as data: a pickled object that would run code on load is refused, before it runs."""
import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp

from regattn.cli import main
from regattn.train.checkpoints import UnsafeCheckpointError, load_folder
from regattn.train.lm import LMTrainConfig, Runtime, build_model, save_checkpoint
from regattn.train.lm import load_checkpoint as load_lm_checkpoint
from regattn.train.optim import build_optimizer
from regattn.train.trainer import TrainConfig, load_checkpoint, train


def mark(path: str) -> None:
    """What the payload runs when it is unpickled: it leaves a file."""
    open(path, "w").close()


class Payload:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return mark, (self.marker,)


def tiny_train_config(path) -> TrainConfig:
    return TrainConfig(task="mqar", task_options=dict(length=16, pairs=2, vocab_size=32, num_train=16, num_test=4),
                       dim=16, steps=2, batch_size=4, device="cpu", progress=False, checkpoint=str(path))


def test_task_checkpoint_with_code_is_refused(tmp_path, capsys):
    path, marker = tmp_path / "ck.pt", str(tmp_path / "ran")
    train(tiny_train_config(path))
    state = load_checkpoint(str(path))                         # a normal checkpoint is data
    assert state["step"] == 2 and isinstance(state["config"], dict)
    state["history"]["note"] = Payload(marker)
    torch.save(state, path)
    with pytest.raises(UnsafeCheckpointError, match="checkpoint"):
        load_checkpoint(str(path))
    with pytest.raises(UnsafeCheckpointError, match="checkpoint"):
        train(tiny_train_config(path))                         # resuming from it
    assert main(["analyze", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("regattn analyze: error: checkpoint") and err.count("\n") == 1
    assert not os.path.exists(marker)


def lm_checkpoint(path):
    config = LMTrainConfig(dim=16, layers=1, heads=2, device="cpu", optimizer="adamw")
    rt = Runtime(0, 1, torch.device("cpu"))
    model = build_model(config, rt)
    opt = build_optimizer(model, "adamw", lr=0.01, weight_decay=0.1)
    save_checkpoint(str(path), model, opt, {"step": 1}, rt)
    return model, opt


def test_lm_checkpoint_metadata_with_code_is_refused(tmp_path):
    model, opt = lm_checkpoint(tmp_path / "ck")
    assert load_lm_checkpoint(str(tmp_path / "ck"), model, opt)["step"] == 1
    marker = str(tmp_path / "ran")
    with open(tmp_path / "ck" / ".metadata", "wb") as f:
        pickle.dump(Payload(marker), f)
    with pytest.raises(UnsafeCheckpointError, match="checkpoint"):
        load_lm_checkpoint(str(tmp_path / "ck"), model, opt)
    assert not os.path.exists(marker)


def test_lm_checkpoint_entry_with_code_is_refused(tmp_path):
    marker = str(tmp_path / "ran")
    dcp.save({"weight": torch.randn(3), "note": Payload(marker)}, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    state = {"weight": torch.zeros(3), "note": 0}
    with pytest.raises(UnsafeCheckpointError, match="note"):
        load_folder(state, str(tmp_path / "ck"), no_dist=True)
    assert not os.path.exists(marker)
    saved = {"weight": torch.randn(3), "note": (0.9, "wsd", None)}
    dcp.save(saved, checkpoint_id=str(tmp_path / "ok"), no_dist=True)
    load_folder(state, str(tmp_path / "ok"), no_dist=True)
    assert torch.equal(state["weight"], saved["weight"]) and state["note"] == (0.9, "wsd", None)
