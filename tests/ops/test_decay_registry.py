"""The decay-method registry and method='auto' (tables and the fallback rule)."""
import pytest
import torch

import regattn
from regattn import reference
from regattn.ops.decay import choose, registry
from tests.helpers import randn, rel_err


def test_register_user_method():
    calls = []

    @regattn.register_decay_method("test_scaled_vanilla")
    def mine(b, c, v, gamma):
        calls.append(b.shape)
        return reference.decay_linear_attention(b, c, v, gamma, method="block_based", block=5)

    try:
        assert "test_scaled_vanilla" in registry.method_names()
        b, c, v = (randn(1, 11, 2, n, seed=i) for i, n in enumerate((3, 3, 4)))
        g = torch.tensor([0.9, 0.5], dtype=torch.float64)
        out = regattn.decay_linear_attention(b, c, v, g, method="test_scaled_vanilla")
        assert calls and rel_err(out, reference.decay_linear_attention(b, c, v, g)) < 1e-12
        with pytest.raises(ValueError, match="already"):
            regattn.register_decay_method("test_scaled_vanilla")(mine)
    finally:
        registry.unregister_decay_method("test_scaled_vanilla")
    assert "test_scaled_vanilla" not in registry.method_names()


@pytest.mark.parametrize("name", ["auto", "lightning2", "not a name", 3])
def test_register_bad_names(name):
    with pytest.raises(ValueError, match="name"):
        regattn.register_decay_method(name)


def entry(B, T, dtype, ms, R=128, D=128, decay=True):
    return dict(B=B, T=T, H=32, R=R, D=D, dtype=dtype, decay=decay, ms=ms)


def test_pick_from_table_nearest_point():
    table = {"entries": [
        entry(1, 128, "bfloat16", {"vanilla": 0.01, "lightning2": 0.02}),
        entry(1, 100000, "bfloat16", {"vanilla": "OOM", "lightning2": 1.0, "fleet": 9.0}),
        entry(16, 8192, "bfloat16", {"lightning2": 3.0, "causal_dot_product": 2.0}),
        entry(16, 8192, "float32", {"fleet": 1.0, "lightning2": 3.0}),
        entry(1, 512, "bfloat16", {"vanilla": "OOM", "someone_elses": 0.001}),
    ]}
    pick = lambda B, T, dt=torch.bfloat16: choose.pick_from_table(table, B, T, 32, 128, 128, dt, True)
    assert pick(1, 100) == "vanilla"
    assert pick(1, 90000) == "lightning2"          # OOM entries are never chosen
    assert pick(16, 8000) == "causal_dot_product"
    assert pick(16, 8000, torch.float32) == "fleet"  # same dtype preferred
    assert pick(1, 512) in ("vanilla", "lightning2")  # unregistered names are skipped
    assert choose.pick_from_table({"entries": []}, 1, 10, 1, 1, 1, torch.float32, True) is None


def test_fallback_rules():
    cpu = torch.device("cpu")
    assert choose.choose_method(1, 64, 2, 8, 8, torch.float32, True, cpu) == "vanilla"
    assert choose.choose_method(1, 1000, 2, 8, 8, torch.float32, True, cpu) == "lightning2"
    assert choose.choose_method(1, 10000, 2, 8, 8, torch.float32, True, cpu) == "block_based"
    assert choose.gpu_kind("NVIDIA H100 80GB HBM3") == "h100"
    assert choose.gpu_kind("NVIDIA H200") == "h200"
    assert choose.load_table("no_such_gpu") is None


def test_shipped_tables_are_well_formed():
    for path in choose.TABLES.glob("*.json"):
        table = choose.load_table(path.stem)
        assert table["entries"], path
        for e in table["entries"]:
            assert {"B", "T", "H", "R", "D", "dtype", "decay", "ms"} <= set(e)
            assert all(isinstance(v, float) or v in ("OOM", "skipped", "error") for v in e["ms"].values())


def test_torch_methods_accumulate_in_fp32():
    """bf16 inputs through the torch backend: decay powers and sums in float32, result in bf16."""
    b, c, v = (randn(1, 300, 2, n, seed=i, scale=n ** -0.25) for i, n in enumerate((8, 8, 8)))
    g = torch.tensor([0.999, 0.99])
    truth = reference.decay_linear_attention(b, c, v, g.double())
    low = [x.bfloat16() for x in (b, c, v)]
    out = regattn.decay_linear_attention(*low, g, method="block_based", backend="torch")
    assert out.dtype == torch.bfloat16
    # only the rounding of inputs and output to bf16 remains
    assert rel_err(out, truth) < 1.5e-2


def test_tune_command_needs_a_gpu(capsys):
    if torch.cuda.is_available():
        pytest.skip("on a GPU this would run the whole tuning grid")
    from regattn import cli
    assert cli.main(["tune", "decay"]) == 2
    err = capsys.readouterr().err
    assert "CUDA device" in err and len(err.strip().splitlines()) == 1


def imported(path, *, anywhere: bool = False) -> set[str]:
    """The modules a file imports: at module level, or also inside functions with ``anywhere``."""
    import ast
    tree = ast.parse(path.read_text())
    names = set()
    for node in (ast.walk(tree) if anywhere else tree.body):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def test_api_and_tune_import_one_way():
    """tune (the measuring command) imports api; api, and the lookup it uses, never import tune."""
    from pathlib import Path
    folder = Path(registry.__file__).parent
    tune_name = "regattn.ops.decay.tune"
    assert "regattn.ops.decay.api" in imported(folder / "tune.py")
    for name in ("api.py", "choose.py", "registry.py"):
        assert tune_name not in imported(folder / name, anywhere=True), name


def test_tune_imports_alone():
    import subprocess
    import sys
    code = "import regattn.ops.decay.tune as t; assert callable(t.main) and callable(t.decay_linear_attention)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
