import pytest

from regattn.train.schedules import lr_factor, wd_factor


def curve(schedule, total=100, **kw):
    return [lr_factor(schedule, s, total, **kw) for s in range(total)]


def test_wsd_shape():
    f = curve("wsd")
    assert f[:80] == [1.0] * 80                                    # no warm-up, stable until 80%
    tail = f[80:]
    assert all(a > b for a, b in zip(tail, tail[1:]))              # linear decay ...
    assert abs((tail[0] - tail[1]) - (tail[1] - tail[2])) < 1e-12
    assert 0 < tail[-1] <= 0.05 + 1e-9                                   # ... towards 0
    warm = curve("wsd", warmup=0.1)
    assert warm[0] == pytest.approx(0.1) and warm[9] == 1.0 and all(a < b for a, b in zip(warm[:9], warm[1:10]))


def test_cosine_shape():
    f = curve("cosine")
    assert f[0] == 1.0                                             # 1% warm-up of 100 steps: one step
    assert all(a >= b for a, b in zip(f[1:], f[2:]))
    assert f[50] == pytest.approx(0.5, abs=0.02) and f[-1] < 0.01
    assert curve("cosine", final=0.1)[-1] > 0.1 - 1e-9


def test_constant_and_bad_name():
    assert curve("constant") == [1.0] * 100
    with pytest.raises(ValueError, match="schedule"):
        lr_factor("linear", 0, 10)


def test_weight_decay_annealing():
    total = 100
    assert [wd_factor("wsd", s, total, gamma=0.0) for s in range(total)] == [1.0] * total
    for gamma in (0.5, 1.0, 2.0):
        w = [wd_factor("wsd", s, total, gamma=gamma) for s in range(total)]
        assert w[:81] == [1.0] * 81
        t = (90 - 80) / 20
        assert w[90] == pytest.approx((1 - t) ** gamma)
        assert all(a >= b for a, b in zip(w, w[1:]))
    # larger gamma anneals harder
    assert wd_factor("wsd", 95, total, gamma=2.0) < wd_factor("wsd", 95, total, gamma=0.5)
