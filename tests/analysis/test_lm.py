"""Diagnostics of language models with GQA: a DecoderLM object and a `regattn lm` checkpoint folder."""
import json
import math

import pytest
import torch

from regattn.analysis.diagnostics import analyze, block_inputs
from regattn.cli import main
from regattn.data.text import stdlib_corpus
from regattn.models import DecoderLM, LMConfig
from regattn.train.lm import LMTrainConfig, train_lm

VOCAB = 40


pytestmark = pytest.mark.usefixtures("one_thread")


def srank(w: torch.Tensor) -> float:
    return (torch.linalg.matrix_norm(w, "fro") ** 2 / torch.linalg.matrix_norm(w, 2) ** 2).item()


def expected_circuits(mixer) -> dict:
    """The circuit stable ranks straight from the weights: query head h reads key/value head h // (HQ // H)."""
    mixer = getattr(mixer, "layer", mixer)
    HQ = getattr(mixer, "heads", None) or mixer.num_heads
    H = getattr(mixer, "kv_heads", None) or mixer.num_kv_heads
    D = mixer.head_dim
    rows = lambda w, i: w.weight.detach().double()[i * D:(i + 1) * D]           # noqa: E731
    per_head = {"W_QK": [], "W_OV": [], "W_RK": []}
    for h in range(HQ):
        g = h // (HQ // H)
        per_head["W_QK"].append(srank(rows(mixer.q_proj, h).T @ rows(mixer.k_proj, g)))
        per_head["W_OV"].append(srank(mixer.o_proj.weight.detach().double()[:, h * D:(h + 1) * D] @ rows(mixer.v_proj, g)))
        if hasattr(mixer, "r_proj"):
            per_head["W_RK"].append(srank(rows(mixer.r_proj, h).T @ rows(mixer.k_proj, g)))
    out = {}
    for key, ranks in per_head.items():
        if ranks:
            out[key] = sum(ranks) / HQ
            for g in range(H):
                group = ranks[g * (HQ // H):(g + 1) * (HQ // H)]
                out[f"{key}.kv{g}"] = sum(group) / len(group)
    return out


def check_circuits(model, rows):
    for block, row in zip(model.blocks, rows):
        expected = expected_circuits(block.mixer)
        assert set(expected) <= set(row)
        for key, value in expected.items():
            assert math.isclose(row[key], value, rel_tol=1e-9), (key, row[key], value)


def test_gqa_decoder_lm_circuits_and_scores():
    torch.manual_seed(0)
    model = DecoderLM(LMConfig(mixer=["softmax", "parallax"], vocab_size=VOCAB, dim=32, layers=2, heads=4,
                               kv_heads=2)).double()
    for p in model.parameters():                     # trained-looking weights: no two heads alike
        p.data += 0.05 * torch.randn_like(p)
    tokens = torch.randint(0, VOCAB, (2, 12))
    rows = analyze(model, tokens)
    check_circuits(model, rows)
    assert rows[0]["W_QK.kv0"] != rows[0]["W_QK.kv1"] and "W_RK.kv1" in rows[1] and "W_RK" not in rows[0]
    assert math.isfinite(rows[1]["cor"]) and math.isfinite(rows[1]["cpa"])
    # the entropy of the softmax layer, with each query head reading its key/value head
    attention = model.blocks[0].mixer
    x = model.blocks[0].mixer_norm(block_inputs(model, tokens)[0])
    q, k, _ = attention._qkv(x, 0)
    k = k.repeat_interleave(2, dim=2)
    logits = torch.einsum("bthd,bshd->bhts", q, k) * attention.head_dim ** -0.5
    p = torch.softmax(logits.masked_fill(torch.ones(12, 12, dtype=torch.bool).triu(1), -math.inf), -1)
    entropy = -(p * p.clamp_min(1e-300).log()).sum(-1).mean().item()
    assert math.isclose(rows[0]["entropy"], entropy, rel_tol=1e-9)


def test_analyze_an_lm_checkpoint(tmp_path, capsys):
    config = LMTrainConfig(mixer=["parallax", "softmax"], dim=32, layers=2, heads=2, kv_heads=1, seq_len=16,
                           batch_size=2, steps=2, eval_tokens=256, max_bytes=200_000, device="cpu", progress=False,
                           checkpoint=str(tmp_path / "ck"))
    model = train_lm(config, log=lambda *_: None)["model"].double()
    out = tmp_path / "rows.json"
    assert main(["analyze", str(tmp_path / "ck"), "--examples", "2", "--seq-len", "12", "--json", str(out)]) == 0
    assert "lm / parallax,softmax, step 2" in capsys.readouterr().out
    saved = json.loads(out.read_text())
    assert saved["task"] == "lm" and saved["step"] == 2
    check_circuits(model, saved["layers"])
    windows, _ = stdlib_corpus(200_000).windows("val", 12, 24)
    for got, want in zip(saved["layers"], analyze(model, windows)):
        assert got.keys() == want.keys() and all(math.isclose(got[k], want[k], rel_tol=1e-9) for k in got)
