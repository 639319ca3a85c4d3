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
