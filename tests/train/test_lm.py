"""LM training on the standard-library byte corpus: loss goes down, perplexity, checkpoints, the command."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from regattn.data import ByteTokenizer, stdlib_corpus
from regattn.data.text import stdlib_files
from regattn.train.lm import LMTrainConfig, Runtime, build_model, parse_args, perplexity, train_lm, train_step
from regattn.train.optim import build_optimizer
from regattn.train.schedules import wd_factor

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def corpus():
    return stdlib_corpus(400_000)


def small(**kw) -> LMTrainConfig:
    options = dict(mixer="softmax", dim=32, layers=2, heads=2, seq_len=32, batch_size=8, steps=30, lr=0.02,
                   eval_tokens=2048, log_every=5, device="cpu")
    options.update(kw)
    return LMTrainConfig(**options)


def test_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "def f(x):\n    return x + 1  # é ∑"
    ids = tok.encode(text)
    assert max(ids) < 256 and tok.decode(ids) == text
    assert tok.decode([104, 105, tok.EOT]) == "hi\n"


def test_corpus_is_the_standard_library(corpus):
    files = stdlib_files()
    assert len(files) > 50 and all(f.endswith(".py") for f in files)
    again = stdlib_corpus(400_000)
    assert torch.equal(again.train, corpus.train) and torch.equal(again.val, corpus.val)
    assert corpus.info["sha256"] == again.info["sha256"] and corpus.info["bytes"] >= 400_000
    eot = ByteTokenizer.EOT
    docs = corpus.info["files"]
    assert int((corpus.train == eot).sum()) + int((corpus.val == eot).sum()) == docs
    assert corpus.train.max() <= eot and corpus.train.min() >= 0
    with open(files[0], "rb") as f:                       # file 0 opens the training stream
        head = f.read(200)
    assert bytes(corpus.train[:200].tolist()) == head
    with open(files[9], "rb") as f:                       # file 9 (val_every = 10) opens the validation stream
        head = f.read(200)
    assert bytes(corpus.val[:200].tolist()) == head


def test_batches_and_windows(corpus):
    g = torch.Generator().manual_seed(0)
    x, y = corpus.batch("train", 4, 16, g)
    assert x.shape == y.shape == (4, 16)
    assert torch.equal(x[:, 1:], y[:, :-1])
    wx, wy = corpus.windows("val", 16, max_tokens=160)
    assert wx.shape == (10, 16) and torch.equal(wx.flatten()[1:], wy.flatten()[:-1])
    with pytest.raises(ValueError, match="split"):
        corpus.batch("test", 1, 4, g)


def test_perplexity_is_exp_of_mean_nll(corpus):
    config = small()
    rt = Runtime(0, 1, torch.device("cpu"))
    model = build_model(config, rt)
    result = perplexity(model, corpus, config, rt)
    x, y = corpus.windows("val", config.seq_len, config.eval_tokens)
    with torch.no_grad():
        logits = model(x)
    nll = F.cross_entropy(logits.flatten(0, 1).double(), y.flatten(), reduction="sum").item() / y.numel()
    assert result["tokens"] == y.numel() == 2048
    assert math.isclose(result["nll"], nll, rel_tol=1e-5)
    assert math.isclose(result["ppl"], math.exp(nll), rel_tol=1e-5)
    assert math.isclose(result["bits_per_byte"], nll / math.log(2), rel_tol=1e-5)
    assert abs(result["nll"] - math.log(ByteTokenizer.vocab_size)) < 0.5      # an untrained model is near uniform


def test_training_lowers_validation_loss(corpus):
    config = small(mixer="parallax")
    rt = Runtime(0, 1, torch.device("cpu"))
    before = perplexity(build_model(config, rt), corpus, config, rt)
    result = train_lm(config, corpus=corpus, log=lambda *_: None)
    after = result["final"]
    assert result["steps"] == 30 and len(result["history"]["train"]) == 6
    assert after["nll"] < before["nll"] - 1.0, (before, after)
    assert result["history"]["train"][-1]["loss"] < result["history"]["train"][0]["loss"]
    assert result["history"]["train"][-1]["lr"] < config.lr          # WSD decays over the last 20 %


def test_checkpoint_resume_matches_one_run(corpus, tmp_path):
    config = small(steps=6, log_every=3, optimizer="muon", checkpoint=str(tmp_path / "ck"))
    stopped = train_lm(config, corpus=corpus, stop_at=3, log=lambda *_: None)
    assert json.load(open(tmp_path / "ck" / "meta.json"))["step"] == 3 and stopped["loaded"] is None
    at_stop = perplexity(stopped["model"], corpus, config, Runtime(0, 1, torch.device("cpu")))
    result = train_lm(config, corpus=corpus, log=lambda *_: None)
    assert result["loaded"]["step"] == 3 and math.isclose(result["loaded"]["nll"], at_stop["nll"], rel_tol=1e-12)
    resumed = result["model"]
    whole = train_lm(small(steps=6, log_every=3, optimizer="muon"), corpus=corpus, log=lambda *_: None)["model"]
    for (name, a), b in zip(resumed.state_dict().items(), whole.state_dict().values()):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), name


def test_wda_gamma_anneals_the_weight_decay(corpus):
    config = small(steps=10, wda_gamma=2.0, weight_decay=0.3, optimizer="adamw")
    assert parse_args(["--wda-gamma", "2"])[0].wda_gamma == 2.0
    rt = Runtime(0, 1, torch.device("cpu"))
    model = build_model(config, rt)
    opt = build_optimizer(model, "adamw", lr=config.lr, weight_decay=config.weight_decay, fused=True)
    for step in (0, 9):
        train_step(model, opt, config, corpus, step, rt)
        factor = wd_factor(config.schedule, step, config.steps, gamma=2.0)
        assert all(g["weight_decay"] == g["base_wd"] * factor for g in opt.param_groups)
    assert factor < 1 and max(g["weight_decay"] for g in opt.param_groups) < 0.3


def poison_training_forward(monkeypatch, at: set[int]):
    """The model's training forwards number ``at`` (from 1) return a NaN loss."""
    from regattn.models.lm import DecoderLM
    forward, calls = DecoderLM.forward, []

    def poisoned(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        if self.training:
            calls.append(1)
            return out * math.nan if len(calls) in at else out
        return out
    monkeypatch.setattr(DecoderLM, "forward", poisoned)


def test_a_non_finite_loss_skips_the_update(corpus, monkeypatch):
    config = small(optimizer="muon")
    rt = Runtime(0, 1, torch.device("cpu"))
    model = build_model(config, rt)
    opt = build_optimizer(model, "muon", lr=config.lr, weight_decay=config.weight_decay, fused=True)
    poison_training_forward(monkeypatch, {2})
    train_step(model, opt, config, corpus, 0, rt)
    before = [p.detach().clone() for p in model.parameters()]
    loss, bad = train_step(model, opt, config, corpus, 1, rt)
    assert not math.isfinite(loss.item()) and bad.item() == 1.0
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    loss, bad = train_step(model, opt, config, corpus, 2, rt)
    assert math.isfinite(loss.item()) and bad.item() == 0.0
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_a_run_counts_its_skipped_steps_and_goes_on(corpus, monkeypatch):
    poison_training_forward(monkeypatch, {3, 4})
    result = train_lm(small(steps=6, log_every=2, optimizer="muon"), corpus=corpus, log=lambda *_: None)
    rows = result["history"]["train"]
    assert result["skipped_steps"] == 2 and [row["skipped"] for row in rows] == [0, 2, 0]
    assert math.isfinite(rows[0]["loss"]) and math.isnan(rows[1]["loss"]) and math.isfinite(rows[2]["loss"])
    assert math.isfinite(result["final"]["nll"])


def run_command(args, cwd) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)
    cmd = [sys.executable, "-m", "regattn.train", "lm", "--dim", "32", "--layers", "2", "--heads", "2",
           "--seq-len", "16", "--batch-size", "2", "--steps", "3", "--max-bytes", "200000", "--eval-tokens", "256",
           "--device", "cpu", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd, timeout=120)


def test_command(tmp_path):
    out = tmp_path / "out"
    proc = run_command(["--mixer", "gatedfwa,decay", "--window", "8", "--sample-tokens", "4", "--out", str(out)],
                       tmp_path)
    assert proc.returncode == 0, proc.stderr
    result = json.load(open(out / "lm-gatedfwa-decay-world1.json"))
    assert result["steps"] == 3 and result["world_size"] == 1
    assert result["config"]["mixer"] == ["gatedfwa", "decay"]
    assert result["tokens_per_second"] > 0 and all(row["tokens_per_second"] > 0 for row in result["history"]["train"])
    assert math.isfinite(result["final"]["ppl"]) and result["corpus"]["source"] == "python-stdlib"
    assert isinstance(result["sample"]["continuation"], str)
    assert (out / "lm-gatedfwa-decay-world1-curves.png").stat().st_size > 0
    assert "lm/gatedfwa-decay [" in proc.stderr and "3/3" in proc.stderr           # the progress bar


def test_command_stop_at_then_resume(tmp_path):
    args = ["--mixer", "softmax", "--quiet", "--log-every", "1", "--checkpoint", str(tmp_path / "ck"),
            "--out", str(tmp_path / "out")]
    assert run_command([*args, "--stop-at", "2"], tmp_path).returncode == 0
    assert json.load(open(tmp_path / "out" / "lm-softmax-world1.json"))["steps"] == 2
    proc = run_command(args, tmp_path)
    assert proc.returncode == 0, proc.stderr
    result = json.load(open(tmp_path / "out" / "lm-softmax-world1.json"))
    assert result["steps"] == 3 and result["loaded"]["step"] == 2 and "resumed at step 2: val nll" in proc.stdout
    assert [row["step"] for row in result["history"]["train"]] == [1, 2, 3]
    bad = run_command([*args, "--stop-at", "0"], tmp_path)
    assert bad.returncode == 2 and "--stop-at" in bad.stderr


def test_command_compare(tmp_path):
    out = tmp_path / "out"
    proc = run_command(["--compare", "softmax,swa", "--window", "8", "--out", str(out)], tmp_path)
    assert proc.returncode == 0, proc.stderr
    for name in ("softmax", "swa"):
        result = json.load(open(out / f"lm-{name}-world1.json"))
        assert result["config"]["mixer"] == name and math.isfinite(result["final"]["ppl"])
    assert (out / "lm-compare-world1-curves.png").stat().st_size > 0



def test_compile_mode_is_checked_before_anything_is_built(corpus):
    with pytest.raises(ValueError, match="compile"):
        train_lm(small(compile="reduce-overhead"), corpus=corpus)
    config, _ = parse_args(["--compile", "default", "--device", "cpu"])
    assert config.compile == "default"
