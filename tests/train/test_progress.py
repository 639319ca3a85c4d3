import io

from regattn.train.progress import Progress


def test_log_lines_at_each_tenth():
    out = io.StringIO()
    bar = Progress(20, stream=out, label="t")
    for step in range(1, 21):
        bar.update(step, loss=1.0 / step, accuracy=step / 20)
    bar.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 10 and lines[-1].startswith("t [########################] 20/20 loss 0.05 accuracy 1")


def test_disabled_and_resumed():
    out = io.StringIO()
    Progress(10, stream=out, enabled=False).update(5, loss=1.0)
    assert out.getvalue() == ""
    bar = Progress(10, start=5, stream=out)
    bar.update(5, loss=1.0)
    assert out.getvalue() == ""                      # no line for the tenth it resumed in
    bar.update(6, loss=1.0)
    assert out.getvalue().count("\n") == 1


def test_throughput_between_log_points_less_pauses(monkeypatch):
    """Each mark gives the steps per second since the previous one, less the pauses in between; a pause first
    lets queued work finish (``sync``), so that work counts as training."""
    from regattn.train import progress
    now, synced = [0.0], []
    monkeypatch.setattr(progress.time, "perf_counter", lambda: now[0])
    clock = progress.Throughput(sync=lambda: synced.append(now[0]))
    assert clock.mark(0) is None
    now[0] = 2.0
    assert clock.mark(10) == 5.0
    now[0] = 3.0
    with clock.paused():
        now[0] = 7.0
    now[0] = 8.0
    assert clock.mark(20) == 10 / (8.0 - 2.0 - 4.0)
    assert synced == [3.0]
    assert clock.rate() == 20 / (8.0 - 4.0)
