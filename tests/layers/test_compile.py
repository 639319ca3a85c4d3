"""torch.compile(fullgraph=True) of every layer: no graph break, no recompile on new inputs of the
same shape, the eager numbers. On CPU the ops run their torch backend (Triton cannot run compiled here)."""
import pytest
import torch
from torch._dynamo.utils import counters

import regattn
from regattn.layers import LLA, GatedFWA, GatedFWANSA, Parallax, Retention
from regattn.ops._common.checks import host_checks_allowed
from tests.helpers import TOL, randn, rel_err

WIDTH = 16
DTYPE = torch.float64
LAYERS = {
    "gatedfwa": lambda: GatedFWA(WIDTH, 4, 3, num_kv_heads=2, rope=True, backend="torch"),
    "gatedfwa_nsa": lambda: GatedFWANSA(WIDTH, 4, 3, block_cmp=4, stride_cmp=2, block_slc=4, topk=2,
                                        backend="torch"),
    "parallax": lambda: Parallax(WIDTH, 4, num_kv_heads=2, window=4, probe_gate=True, backend="torch"),
    "lla": lambda: LLA(WIDTH, 4, num_kv_heads=2, lam="dim", rope=True, backend="torch"),
    "retention": lambda: Retention(WIDTH, 4, backend="torch"),
}


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def compiled_twice(fn, compiler: str, *inputs_per_call):
    """``fn`` compiled with fullgraph=True, run on each inputs in turn; every call after the first may not
    recompile. Returns the outputs; asserts no graph break was counted."""
    compiled = torch.compile(fn, fullgraph=True, backend=compiler)
    outs = [compiled(*inputs_per_call[0])]
    with torch._dynamo.config.patch(error_on_recompile=True):
        outs += [compiled(*inputs) for inputs in inputs_per_call[1:]]
    assert not counters["graph_break"], dict(counters["graph_break"])
    return outs


@pytest.mark.parametrize("compiler", ["eager", "aot_eager"])
@pytest.mark.parametrize("layer", LAYERS)
def test_layer_compiles_whole_and_matches_eager(layer, compiler):
    m = LAYERS[layer]().to(DTYPE)
    xs = [randn(2, 9, WIDTH, dtype=DTYPE) for _ in range(2)]
    outs = compiled_twice(m, compiler, *[(x,) for x in xs])
    for x, y in zip(xs, outs):
        assert rel_err(y, m(x)) < TOL[DTYPE]
    assert rel_err(outs[0], outs[1]) > 1e-3      # the second call computed its own inputs


def test_compiled_backward_matches_eager():
    """SW-LLA with CG iterations (the forward test covers the exact solve), forward and backward."""
    m = LLA(WIDTH, 4, window=4, cg_iters=3, backend="torch").to(DTYPE)
    x = randn(2, 9, WIDTH, dtype=DTYPE)

    def grads(fn):
        m.zero_grad()
        fn(x).square().sum().backward()
        return [p.grad.clone() for p in m.parameters()]

    eager = grads(m)
    compiled = grads(torch.compile(m, fullgraph=True, backend="aot_eager"))
    assert not counters["graph_break"]
    for g, ref in zip(compiled, eager):
        assert rel_err(g, ref) < TOL[DTYPE]


def test_gate_op_compiles_whole():
    """The public gate op, whose amplitude check reads values, compiles without a break."""
    def gate(h, beta):
        return regattn.gatedfwa_gate(h, beta, backend="torch")

    inputs = [(randn(2, 7, 3, dtype=DTYPE), randn(2, 7, 3, dtype=DTYPE).abs() + 0.5) for _ in range(2)]
    outs = compiled_twice(gate, "eager", *inputs)
    for (h, beta), u in zip(inputs, outs):
        assert rel_err(u, regattn.gatedfwa_gate(h, beta, backend="torch")) < TOL[DTYPE]


def test_host_checks_run_in_eager_code_only():
    assert host_checks_allowed()
    x = randn(3)
    compiled = torch.compile(lambda t: t + 1 if host_checks_allowed() else t - 1, fullgraph=True, backend="eager")
    assert torch.equal(compiled(x), x - 1)
    with pytest.raises(ValueError, match="^lam: "):                 # the eager call still checks values
        regattn.lla(*(randn(1, 5, 2, 4) for _ in range(3)), lam=-randn(1, 5, 2).abs(), backend="torch")
