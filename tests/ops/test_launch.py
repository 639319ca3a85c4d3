"""``regattn.ops._common.launch``: a kernel launched through its compiled binary gives what ``kernel[grid]`` gives,
with one binary per specialization Triton would make (pointer alignment, integer divisibility, constexprs)."""
import pytest
import torch
import triton
import triton.language as tl

from regattn.ops._common import launch as launch_module
from regattn.ops._common.launch import launch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _scaled_sum(X, Y, O, n, stride, alpha, BLOCK: tl.constexpr, SQUARE: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(X + offs * stride, mask=mask)
    y = tl.load(Y + offs, mask=mask)
    if SQUARE:
        x = x * x
    tl.store(O + offs, alpha * x + y, mask=mask)


def _run(x, y, stride, alpha, square, block=64):
    n = y.numel()
    o = torch.empty_like(y)
    launch(_scaled_sum, (triton.cdiv(n, block),), x, y, o, n, stride, alpha, BLOCK=block, SQUARE=square,
           num_warps=2)
    return o


def _expected(x, y, stride, alpha, square):
    xs = x[::stride][:y.numel()]
    return alpha * (xs * xs if square else xs) + y


# (offset of x into its buffer: 1 misaligns the pointer; n: 1 and 16 are specialized; stride; square)
CASES = [(0, 100, 1, False), (0, 100, 1, False), (1, 100, 1, False), (0, 16, 1, True), (0, 1, 2, False),
         (1, 37, 3, True), (0, 100, 1, False), (0, 33, 16, False)]


def test_matches_the_reference_per_specialization(interpret):
    """Every case, repeated and interleaved, against torch; on a GPU each specialization gets its own binary
    and a case seen before reuses its own (a misaligned pointer or an n of 1 never takes an aligned binary)."""
    launch_module._BINARIES.pop(_scaled_sum, None)
    for offset, n, stride, square in CASES + CASES[::-1]:
        buf = torch.randn(offset + n * stride + 1, device=DEVICE)
        x, y = buf[offset:], torch.randn(n, device=DEVICE)
        got = _run(x, y, stride, 0.5, square)
        torch.testing.assert_close(got, _expected(x, y, stride, 0.5, square), rtol=1e-6, atol=1e-6)
    binaries = launch_module._BINARIES.get(_scaled_sum, {})
    if DEVICE == "cpu":
        assert not binaries  # the interpreter always goes through kernel[grid]
    else:
        assert len(binaries) == len({(o, n == 1, n % 16 == 0, s == 1, s % 16 == 0, q) for o, n, s, q in CASES})


@pytest.mark.skipif(DEVICE == "cpu", reason="needs a CUDA device")
def test_in_a_cuda_graph():
    x, y = torch.randn(300, device=DEVICE), torch.randn(300, device=DEVICE)
    _run(x, y, 1, 2.0, True)  # the first call of a specialization compiles
    _run(x, y, 1, 2.0, True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o = _run(x, y, 1, 2.0, True)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.testing.assert_close(o, _expected(x, y, 1, 2.0, True))


@pytest.mark.skipif(DEVICE == "cpu", reason="needs a CUDA device")
def test_under_torch_compile():
    """torch.compile traces the launch as Triton's (its own capture), and the result is the same."""
    x, y = torch.randn(200, device=DEVICE), torch.randn(200, device=DEVICE)
    compiled = torch.compile(lambda x, y: _run(x, y, 1, 3.0, False), fullgraph=True)
    torch.testing.assert_close(compiled(x, y), _expected(x, y, 1, 3.0, False))


BOXES = []  # the tile each pre-hook call saw
_tuned_sum = triton.autotune([triton.Config({"BLOCK": 32}, num_warps=1, pre_hook=lambda a: BOXES.append(a["BLOCK"]))],
                             key=["n", "alpha"])(triton.heuristics({"SQUARE": lambda a: a["alpha"] > 1.0})(_scaled_sum))


def test_tuned_launch_takes_the_chosen_config(interpret, monkeypatch):
    """After a key's first call through the autotuner, calls of that key launch its config's binary,
    with the config's pre-hook run and the heuristics applied as Triton applies them; a new key goes through the
    autotuner again."""
    launched = []

    def recorded(kernel, binder, device, grid, *args, **kwargs):
        launched.append((kernel, grid, kwargs))
        kernel[grid](*args, **kwargs)

    monkeypatch.setattr(launch_module, "_binder", lambda kernel: (object(), None))  # as on a GPU
    monkeypatch.setattr(launch_module, "_launch_binary", recorded)
    monkeypatch.setattr(launch_module, "_CHOSEN", {})
    BOXES.clear()
    for n, alpha, fast in ((100, 0.5, False), (100, 0.5, True), (37, 2.0, False), (37, 2.0, True), (100, 0.5, True)):
        x, y = torch.randn(n, device=DEVICE), torch.randn(n, device=DEVICE)
        o = torch.empty_like(y)
        before = len(launched)
        launch_module.launch_tuned(_tuned_sum, lambda meta: (triton.cdiv(meta["n"], meta["BLOCK"]),), x, y, o, n, 1,
                                   alpha=alpha)  # a key name given by keyword
        torch.testing.assert_close(o, _expected(x, y, 1, alpha, alpha > 1.0), rtol=1e-6, atol=1e-6)
        assert len(launched) == before + fast
        if fast:
            kernel, grid, kwargs = launched[-1]
            assert kernel is _scaled_sum and grid == (triton.cdiv(n, 32),)
            assert kwargs["BLOCK"] == 32 and kwargs["num_warps"] == 1 and kwargs["SQUARE"] == (alpha > 1.0)
    assert BOXES == [32] * 5


def test_launch_takes_a_grid_function_through_the_binary(interpret, monkeypatch):
    """A grid given as a function (as ``kernel[grid]`` takes it) reaches the binary's launch as its value on the
    named arguments, for a plain and for an autotuned kernel."""
    launched = []

    def recorded(kernel, binder, device, grid, *args, **kwargs):
        launched.append(grid)
        kernel[grid](*args, **kwargs)

    monkeypatch.setattr(launch_module, "_binder", lambda kernel: (object(), None))  # as on a GPU
    monkeypatch.setattr(launch_module, "_launch_binary", recorded)
    monkeypatch.setattr(launch_module, "_CHOSEN", {})
    n = 100
    x, y, o = torch.randn(n, device=DEVICE), torch.randn(n, device=DEVICE), torch.empty(n, device=DEVICE)
    grid = lambda meta: (triton.cdiv(meta["n"], meta["BLOCK"]),)  # noqa: E731
    launch(_scaled_sum, grid, x, y, o, n, 1, 0.5, BLOCK=16, SQUARE=False)
    torch.testing.assert_close(o, _expected(x, y, 1, 0.5, False), rtol=1e-6, atol=1e-6)
    for _ in range(2):  # the autotuner's run, then the chosen binary
        launch_module.launch_tuned(_tuned_sum, grid, x, y, o, n, 1, alpha=0.5)
    assert launched == [(7,), (4,)]


def test_launch_any_takes_the_autotuned_path_for_an_autotuned_kernel_only(monkeypatch):
    calls = []
    def recorder(label):
        return lambda kernel, grid, *args, **kwargs: calls.append((label, kernel))
    monkeypatch.setattr(launch_module, "launch_tuned", recorder("tuned"))
    monkeypatch.setattr(launch_module, "launch", recorder("plain"))
    launch_module.launch_any(_tuned_sum, (1,), 1, alpha=0.5)
    launch_module.launch_any(_scaled_sum, (1,), 1, alpha=0.5)
    assert calls == [("tuned", _tuned_sum), ("plain", _scaled_sum)]
