"""Timing statuses, ratios, the table, shape parsing."""
import pytest
import torch

from regattn import cli as command
from regattn.bench import cli, suites
from regattn.bench.runner import add_ratios, format_table, relative_diff, shape_label, worst_error
from regattn.bench.timing import describe, measure


def test_measure_times_a_call_on_cpu():
    m = measure(lambda: torch.ones(8).sum(), cuda=False)
    assert m.status == "ok" and m.ms > 0 and m.peak_mb is None


def test_measure_reports_oom_and_errors_as_status():
    def oom():
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 4 GiB")

    def broken():
        raise NotImplementedError("no kernel\nsecond line")

    assert measure(oom, cuda=False).status == "OOM"
    assert measure(broken, cuda=False).status == "error: NotImplementedError: no kernel"
    assert describe(RuntimeError("No available kernel. Aborting execution.")) == "unsupported"


def rows(*specs):
    return [{"shape": "s", "mode": mode, "op": op, "ours": ours, "status": "ok" if ms else "OOM", "ms": ms,
             "graph": False} for op, mode, ours, ms in specs]


def test_ratio_is_time_over_the_main_peer_else_the_best_peer_of_the_same_shape_and_mode():
    r = rows(("ours", "fwd", True, 1.0), ("a", "fwd", False, 4.0), ("b", "fwd", False, 2.0), ("c", "fwd", False, None),
             ("ours", "fwd+bwd", True, 3.0), ("a", "fwd+bwd", False, 6.0), ("only-ours", "decode", True, 1.0))
    add_ratios(r)
    assert [x["ratio"] for x in r] == [0.5, 2.0, 1.0, None, 0.5, 1.0, None]
    assert r[0]["vs"] == {"a": 0.25, "b": 0.5} and "vs" not in r[1]
    add_ratios(r, {"fwd": ("c", "a")})  # c did not run: a is the main peer
    assert [x["ratio"] for x in r[:4]] == [0.25, 1.0, 0.5, None]


def test_ratios_compare_eager_with_eager_and_graph_with_graph():
    r = rows(("ours", "decode", True, 2.0), ("sdpa", "decode", False, 1.0),
             ("ours", "decode", True, 1.0), ("sdpa", "decode", False, 0.5))
    for x in r[2:]:
        x["graph"] = True
    add_ratios(r)
    assert [x["ratio"] for x in r] == [2.0, 1.0, 2.0, 1.0]


def test_table_shows_status_in_place_of_time_and_the_largest_error():
    r = rows(("ours", "fwd", True, 1.0), ("peer", "fwd", False, None))
    add_ratios(r)
    for x in r:
        x.update(tflops=None, gbps=None, peak_mb=None, params={}, err=None)
    r[0]["err"] = {"o": 1e-3, "dk": 4e-3, "dq": 2e-3}
    text = format_table(r)
    assert "OOM" in text and "ratio" in text and "peak MB" in text and "TFLOP/s" in text and "dk 4.00e-03" in text
    assert worst_error({"status": "error: X"}) == "check error: X" and worst_error(None) == ""


def test_relative_diff():
    a = torch.tensor([1.0, 2.0])
    assert relative_diff(a, a) == 0.0
    assert relative_diff(torch.tensor([float("nan"), 2.0]), a) == float("inf")
    assert relative_diff(a, torch.ones(3)) is None


def test_parse_shapes_expands_alternatives_and_grid_names():
    suite = suites.get("softmax")
    shapes = cli.parse_shapes(["B=4,H=16,T=2048/8192,D=128,window=none/1024"], suite, cuda=True)
    assert shapes == [dict(B=4, H=16, T=T, D=128, window=w) for T in (2048, 8192) for w in (None, 1024)]
    assert cli.parse_shapes(["T=64,causal=true/False,scale=0.5"], suite, cuda=True) == [
        dict(T=64, causal=True, scale=0.5), dict(T=64, causal=False, scale=0.5)]
    assert cli.parse_shapes(["tiny"], suite, cuda=True) == suite.GRIDS["tiny"]
    assert cli.parse_shapes(None, suite, cuda=False) == suite.GRIDS["tiny"]
    assert cli.parse_shapes(None, suite, cuda=True) == suite.GRIDS["goal"]
    assert cli.parse_shapes(None, suite, cuda=True, quick=True) == suite.GRIDS["quick"]
    assert cli.grid_name(["goal"], suite, False, True) == "goal"
    for specs in (["goal", "tiny"], ["T=64"]):
        assert cli.grid_name(specs, suite, False, True) == "custom"
    defaults = [(False, True), (True, True), (False, False)]  # (quick, cuda)
    assert [cli.grid_name(None, suite, quick, cuda) for quick, cuda in defaults] == ["goal", "quick", "tiny"]
    for bad in ("B4", "B=", "=4"):
        with pytest.raises(cli.UsageError, match="--shapes"):
            cli.parse_shapes([bad], suite, cuda=True)
    with pytest.raises(cli.UsageError, match="several specs"):  # a shell-quoted list of specs: not one shape
        cli.parse_shapes(["B=1,T=64,causal=true B=2,T=128"], suite, cuda=True)
    with pytest.raises(cli.UsageError, match="'T' given twice"):
        cli.parse_shapes(["T=64,D=16,T=128"], suite, cuda=True)
    assert shape_label(dict(B=1, window=None, T=8)) == "B=1 T=8"


@pytest.mark.parametrize("argv, names", [(["nonsense"], "suite"), (["softmax", "--shapes", "B4"], "--shapes"),
                                          (["all", "--peers", "sdpa-flash,nope"], "--peers"),
                                          (["scan", "--rep-ms", "0"], "--rep-ms")])
def test_bad_arguments_give_one_line_and_status_2(argv, names, capsys):
    assert command.main(["bench", *argv, "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"regattn bench: error: {names}") and "Traceback" not in err
    with pytest.raises(ValueError, match="suite"):
        suites.get("nonsense")


def test_every_suite_declares_its_goal_and_quick_grids_and_main_peers():
    for name in suites.NAMES:
        suite = suites.get(name)
        assert suite.GRIDS["goal"] and suite.GRIDS["quick"] and suite.GRIDS["tiny"]
        # a quick shape is a goal shape, or one narrowed to fewer variants by a key of its own (lla's cg)
        assert all(any(goal.items() <= shape.items() for goal in suite.GRIDS["goal"])
                   for shape in suite.GRIDS["quick"])
        assert suite.MAIN and all(isinstance(v, tuple) and v for v in suite.MAIN.values())
        assert suite.QUICK_PEERS and set(suite.QUICK_PEERS) <= set(suite.PEERS)
        assert cli.parse_peers(None, suite) == suite.PEERS
        assert cli.parse_peers(None, suite, quick=True) == suite.QUICK_PEERS
        assert cli.parse_peers("sdpa-flash", suite, quick=True) == ("sdpa-flash",)


@pytest.fixture
def fake_cuda(monkeypatch):
    """The CUDA calls of the timing module, replaced by counters, to exercise its GPU control flow on CPU."""
    import triton.testing

    state = {"allocated": 1024 * 2**20, "peak": 1536 * 2**20, "graph_fails": False, "calls": [], "event_ms": [1.0]}

    class Event:  # elapsed_time gives the next of state["event_ms"] (the last one repeats)
        def __init__(self, enable_timing=False):
            pass

        def record(self):
            pass

        def elapsed_time(self, end):
            times = state["event_ms"]
            return times.pop(0) if len(times) > 1 else times[0]

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: state["allocated"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: state["peak"])

    def do_bench(fn, warmup, rep, return_mode):
        state["calls"].append(("do_bench", return_mode))
        fn()
        return 2.5

    def do_bench_cudagraph(fn, rep, return_mode):
        state["calls"].append(("graph", return_mode))
        if state["graph_fails"]:
            raise RuntimeError("operation not permitted when stream is capturing")
        return 0.25

    monkeypatch.setattr(triton.testing, "do_bench", do_bench)
    monkeypatch.setattr(triton.testing, "do_bench_cudagraph", do_bench_cudagraph)
    return state


def test_measure_on_cuda_takes_the_median_and_the_peak_above_the_inputs(fake_cuda):
    m = measure(lambda: None, cuda=True)
    assert (m.status, m.ms, m.peak_mb) == ("ok", 2.5, 512.0)
    assert fake_cuda["calls"] == [("do_bench", "median")]


def test_measure_times_a_call_slower_than_the_window_by_three_calls_the_peak_call_among_them(fake_cuda):
    calls = []
    fake_cuda["event_ms"] = [40.0, 20.0, 30.0]  # the peak-memory call, then two more
    m = measure(lambda: calls.append(1), cuda=True, rep_ms=10)
    assert (m.status, m.ms, m.peak_mb) == ("ok", 30.0, 512.0)
    assert len(calls) == 4 and fake_cuda["calls"] == []  # warm-up, peak, two more; no do_bench


def test_measure_times_calls_back_to_back_in_batches_synced_at_their_ends(fake_cuda, monkeypatch):
    calls, syncs = [], []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: syncs.append(len(calls)))
    fake_cuda["event_ms"] = [0.5]  # one call's time: batches of 100 / 5 / 0.5 = 40 calls
    m = measure(lambda: calls.append(1), cuda=True, back_to_back=True, rep_ms=100)
    assert (m.status, m.peak_mb) == ("ok", 512.0) and m.ms > 0
    assert len(calls) == 2 + 5 * 40 and fake_cuda["calls"] == []  # warm-up, peak, five batches; no do_bench
    synced_after = [b - a for a, b in zip(syncs, syncs[1:]) if b > a]  # calls between two syncs
    assert synced_after[-5:] == [40] * 5  # nothing synced within a batch


def test_decode_rows_made_eagerly_are_timed_back_to_back():
    from regattn.bench.runner import Case, back_to_back, row_of
    from regattn.bench.timing import Measurement

    eager, captured = Case("op", lambda: None), Case("op", lambda: None, graph=True)
    assert back_to_back("decode", eager) and not back_to_back("decode", captured)
    assert not back_to_back("fwd", eager) and not back_to_back("gate fwd", eager)
    row = row_of({"B": 1}, "decode", eager, Measurement("ok", ms=0.02), None)
    assert row["back_to_back"] and not row["graph"]


def test_measure_replays_a_cuda_graph_and_says_when_capture_fails(fake_cuda):
    m = measure(lambda: None, cuda=True, graph=True)
    assert (m.status, m.ms) == ("ok", 0.25)
    fake_cuda["graph_fails"] = True
    m = measure(lambda: None, cuda=True, graph=True)
    assert (m.status, m.ms) == ("not capturable: operation not permitted when stream is capturing", None)
