import pytest
import torch

from regattn.layers import GatedFWANSA
from regattn.models.stack import build_model
from regattn.tasks import mqar
from regattn.train.optim import BatchedMuon, apply_schedule, build_optimizer, capturable, parameter_roles


def model():
    torch.manual_seed(0)
    return build_model(mqar(length=16, pairs=2, vocab_size=30, num_train=4, num_test=1), "softmax", dim=16, heads=2)


def test_roles():
    m = model()
    roles = parameter_roles(m)
    ids = {k: {id(p) for p in v} for k, v in roles.items()}
    assert id(m.embed.weight) in ids["embed"] and id(m.head.weight) in ids["embed"]
    assert id(m.norm.weight) in ids["scalar"]
    assert id(m.blocks[0].mixer.q_proj.weight) in ids["hidden"]
    assert all(p.ndim == 2 for p in roles["hidden"]) and all(p.ndim != 2 for p in roles["scalar"])
    assert sum(len(v) for v in roles.values()) == len(list(m.parameters()))


def step(m, opt):
    x = torch.randint(0, 30, (4, 16))
    loss = m(x).logsumexp(-1).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def test_muon_groups_and_update():
    m = model()
    opt = build_optimizer(m, "muon", lr=0.02, weight_decay=0.1)
    muon, adam = opt.optimizers
    assert isinstance(muon, torch.optim.Muon) and all(p.ndim == 2 for g in muon.param_groups for p in g["params"])
    lrs = sorted(g["lr"] for g in adam.param_groups)
    assert lrs == [0.02 * 0.015, 0.02 * 0.3]
    before = [p.detach().clone() for p in m.parameters()]
    step(m, opt)
    changed = [not torch.equal(a, p) for a, p in zip(before, m.parameters())]
    assert sum(changed) == len(changed)
    apply_schedule(opt, 0.5, 0.25)
    assert muon.param_groups[0]["lr"] == 0.01 and muon.param_groups[0]["weight_decay"] == 0.1 * 0.25


def test_adamw_decay_groups_and_state_roundtrip():
    m = model()
    opt = build_optimizer(m, "adamw", lr=1e-3, weight_decay=0.1)
    wds = sorted(g["weight_decay"] for g in opt.param_groups)
    assert wds == [0.0, 0.1]
    step(m, opt)
    other = build_optimizer(m, "adamw", lr=1e-3)
    other.load_state_dict(opt.state_dict())
    assert other.state_dict()[0]["state"].keys() == opt.state_dict()[0]["state"].keys()


def test_embeddings_anywhere_are_not_hidden():
    class LM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.tokens = torch.nn.Embedding(10, 8)
            self.body = torch.nn.Linear(8, 8)
            self.lm_head = torch.nn.Linear(8, 10, bias=False)

    m = LM()
    roles = {k: {id(p) for p in v} for k, v in parameter_roles(m).items()}
    assert roles["embed"] == {id(m.tokens.weight), id(m.lm_head.weight)}
    assert roles["hidden"] == {id(m.body.weight)} and roles["scalar"] == {id(m.body.bias)}


def test_gate_projections_take_adam_under_muon():
    torch.manual_seed(0)
    m = build_model(mqar(length=16, pairs=2, vocab_size=30, num_train=4, num_test=1), "gatedfwa", dim=16, heads=2,
                    mixer_options=dict(window=4))
    gates = {id(getattr(b.mixer, n).weight) for b in m.blocks for n in ("g_proj", "beta_proj")}
    roles = {k: {id(p) for p in v} for k, v in parameter_roles(m).items()}
    assert roles["gate"] == gates and id(m.blocks[0].mixer.q_proj.weight) in roles["hidden"]
    muon, adam = build_optimizer(m, "muon", lr=0.02).optimizers
    assert not gates & {id(p) for g in muon.param_groups for p in g["params"]}
    in_adam = {id(p): g for g in adam.param_groups for p in g["params"]}
    assert all(in_adam[i]["lr"] == 0.02 * 0.015 and in_adam[i]["weight_decay"] == 0 for i in gates)
    nsa = GatedFWANSA(16, 2, 4, block_cmp=4, stride_cmp=2, block_slc=4, topk=2)
    assert {id(p) for p in parameter_roles(nsa)["gate"]} == {
        id(getattr(nsa, n).weight) for n in ("g_proj", "beta_proj", "branch_gate")}


def test_batched_muon_is_torch_muon():
    shapes = [(16, 16), (24, 16), (16, 24), (16, 16), (24, 16)]
    start = [torch.randn(s) for s in shapes]
    ours = [p.clone().requires_grad_() for p in start]
    theirs = [p.clone().requires_grad_() for p in start]
    a = BatchedMuon(ours, lr=0.02, weight_decay=0.1)
    b = torch.optim.Muon(theirs, lr=0.02, weight_decay=0.1, adjust_lr_fn="original")
    for _ in range(3):
        for p, q in zip(ours, theirs):
            p.grad = torch.randn(p.shape)
            q.grad = p.grad.clone()
        a.step()
        b.step()
    for p, q, p0 in zip(ours, theirs, start):
        assert (p - q).norm() <= 1e-2 * (q - p0).norm()
        assert torch.allclose(a.state[p]["momentum_buffer"], b.state[q]["momentum_buffer"], rtol=1e-6, atol=1e-7)
    loaded = BatchedMuon([p.clone().requires_grad_() for p in start], lr=0.02)
    loaded.load_state_dict(b.state_dict())                       # torch.optim.Muon's state is its state
    assert torch.equal(next(iter(loaded.state.values()))["momentum_buffer"], b.state[theirs[0]]["momentum_buffer"])


def test_fused_optimizers_skip_on_found_inf():
    m = model()
    for name in ("adamw", "muon"):
        opt = build_optimizer(m, name, lr=0.02, fused=True)
        step(m, opt)
        before = [p.detach().clone() for p in m.parameters()]
        states = [{k: v.clone() for k, v in s.items()} for o in opt.optimizers for s in o.state.values()]
        for p in m.parameters():
            p.grad = torch.full_like(p, float("nan"))
        opt.step(found_inf=torch.ones(()))
        assert all(torch.equal(a, p) for a, p in zip(before, m.parameters())), name
        after = [s for o in opt.optimizers for s in o.state.values()]
        assert all(torch.equal(s[k], t[k]) for s, t in zip(states, after) for k in s), name
        for p in m.parameters():
            p.grad = torch.randn_like(p)
        opt.step(found_inf=torch.zeros(()))
        assert all(not torch.equal(a, p) for a, p in zip(before, m.parameters())), name


def test_device_learning_rates_give_the_same_steps():
    # a captured step reads its learning rates from tensors that the schedule sets in place
    runs = []
    for on_device in (False, True):
        m = model()
        start = [p.detach().clone() for p in m.parameters()]
        opt = build_optimizer(m, "muon", lr=0.02, fused=True)
        if on_device:
            capturable(opt, torch.device("cpu"))
            rates = [g["lr"] for g in opt.param_groups]
        for scale in (1.0, 0.5, 0.25):
            apply_schedule(opt, scale)
            step(m, opt)
        if on_device:
            assert all(g["lr"] is r for g, r in zip(opt.param_groups, rates))   # the same tensors, set in place
            assert all(float(g["lr"]) == pytest.approx(g["base_lr"] * 0.25, rel=1e-6) for g in opt.param_groups)
        runs.append([p.detach().clone() for p in m.parameters()])
    # the rates round to fp32 on the device; Newton-Schulz in bf16 may round a product the other way
    assert all((a - b).norm() <= 1e-2 * (a - p0).norm() for a, b, p0 in zip(*runs, start))
