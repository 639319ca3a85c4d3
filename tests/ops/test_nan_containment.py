"""NaN containment: a non-finite key or value reaches only the rows that see it, forward and backward.

Each case puts a non-finite entry into k and another into v at a position some rows cannot see (the
causal future, outside a window, another packed sequence, another batch row, beyond a cache length):
NaN in k and +inf in v, and for the window case also the other way round. The rows that cannot see it,
and the gradients that depend on those rows alone, must be finite and equal to a run where the entries
hold random finite numbers instead.
"""
import pytest
import torch

import regattn
from regattn.ops._common import attention_tiles
from regattn.ops.lla import forward as lla_kernels
from tests.helpers import randn

DEV = "cuda" if torch.cuda.is_available() else "cpu"
H, D = 2, 16
NAN, INF = float("nan"), float("inf")

# name: (B, T, where the bad entries sit as (batch, time), window, cu_seqlens)
CASES = {
    "future": (2, 16, (1, 15), None, None),
    "window": (2, 16, (0, 0), 4, None),
    "varlen": (1, 16, (0, 4), None, [0, 7, 16]),
    "varlen_next": (1, 16, (0, 12), None, [0, 7, 16]),  # read by the first sequence's last tile
    "batch": (2, 16, (0, 9), None, None),
}
# (case, value put in k, value put in v)
POISON = [(case, NAN, INF) for case in CASES] + [("window", INF, NAN)]


def _visible(B, T, window, cu_seqlens):
    """Boolean ``[B*T, B*T]``: flattened row ``(b, i)`` sees key ``(b', j)``."""
    bt = torch.arange(B * T)
    b, t = bt // T, bt % T
    seq = torch.zeros(B * T, dtype=torch.long)
    if cu_seqlens is not None:
        seq = torch.bucketize(t, torch.tensor(cu_seqlens[1:]), right=True)
    keep = (b[:, None] == b[None, :]) & (seq[:, None] == seq[None, :]) & (t[None, :] <= t[:, None])
    if window is not None:
        keep &= t[None, :] > t[:, None] - window
    return keep


def _unreached(B, T, window, cu_seqlens, bad):
    """Rows that cannot see ``bad`` and key positions whose every reader cannot see it (``[B, T]`` each)."""
    sees = _visible(B, T, window, cu_seqlens)
    at = bad[0] * T + bad[1]
    rows = ~sees[:, at]
    keys = ~(sees & sees[:, at][:, None]).any(0)
    keys[at] = False
    return rows.view(B, T), keys.view(B, T)


def _softmax(q, k, v, aux, window, cu_seqlens, backend):
    return regattn.softmax_attention(q, k, v, causal=True, window=window, cu_seqlens=cu_seqlens, backend=backend)


def _gatedfwa(q, k, v, aux, window, cu_seqlens, backend):
    u = -torch.cumsum(aux[..., 0].abs() * 0.2, 1)
    return regattn.gatedfwa(q, k, v, u, window=window, cu_seqlens=cu_seqlens, backend=backend)


def _parallax(q, k, v, aux, window, cu_seqlens, backend):
    return regattn.parallax(q, aux * 0.3, k, v, causal=True, window=window, cu_seqlens=cu_seqlens, backend=backend)


def _scan(q, k, v, aux, window, cu_seqlens, backend, precision="ieee"):
    return regattn.scan_attention(q, k, v, causal=True, window=window, cu_seqlens=cu_seqlens, precision=precision,
                                  backend=backend)


def _scan_tf32x3(*args):
    return _scan(*args, precision="tf32x3")


def _scan_fp16x3(*args):
    return _scan(*args, precision="fp16x3")


def _scan_tf32(*args):
    return _scan(*args, precision="tf32")


def _scan_fp16(q, k, v, *args):
    """fp16 inputs, the key and value tiles through tensor descriptors (TMA) where the kernel can take them."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(attention_tiles, "TMA_WORK", 0)
        return _scan(q.half(), k.half(), v.half(), *args).float()


def _lla(q, k, v, aux, window, cu_seqlens, backend, blocks=None):
    if cu_seqlens is not None:
        pytest.skip("lla takes no cu_seqlens")
    return regattn.lla(q, k, v, lam=0.5, window=window, blocks=blocks, cg_iters=2 * D, cg_tol=1e-7, backend=backend)


def _lla_pairs(*args):  # BD-LLA by direct 2 x 2 solves
    return _lla(*args, blocks=D // 2)


def _lla_diag(*args):  # BD-LLA by direct 1 x 1 solves
    return _lla(*args, blocks=D)


def _lla_blocks(*args):  # BD-LLA by one CG per block of 4 features
    return _lla(*args, blocks=D // 4)


def _lla_launches(*args):
    """Full LLA's CG in ``cg_iters + 2`` launches, each row's state in memory between them."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(lla_kernels, "CG_LAUNCH_ROWS", 1)
        return _lla(*args)


def _mesanet(q, k, v, aux, window, cu_seqlens, backend):
    if window is not None or cu_seqlens is not None:
        pytest.skip("mesanet is causal over one sequence")
    return regattn.mesanet(q, torch.nn.functional.normalize(k, dim=-1), v, chunk=8, backend=backend)


OPS = {"softmax": _softmax, "gatedfwa": _gatedfwa, "parallax": _parallax, "scan": _scan, "scan_tf32x3": _scan_tf32x3,
       "scan_fp16x3": _scan_fp16x3, "scan_tf32": _scan_tf32, "scan_fp16": _scan_fp16, "lla": _lla,
       "lla_pairs": _lla_pairs, "lla_diag": _lla_diag, "lla_blocks": _lla_blocks, "lla_launches": _lla_launches,
       "mesanet": _mesanet}

def _run(op, q, k, v, aux, do, window, cu_seqlens, backend):
    """Output and the gradients of q, k, v; ``aux`` feeds the probe (parallax) or the gate (gatedfwa)."""
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
    o = op(*leaves, aux, window, cu_seqlens, backend)
    return [o, *torch.autograd.grad(o, leaves, do)]


def _backend(backend, request):
    if backend == "triton":
        request.getfixturevalue("interpret")


# Kernels that do not contain hidden entries yet, and why: containment in their partially masked tiles
# was measured on an H100 against SDPA cuDNN in the same process (bf16, the bench goal shapes) and cost
# more than the 2% it may cost.
NOT_CONTAINED = {
    "softmax": "the contained kernels cost 6% forward+backward at B4 H16 T8192 D128",
    "gatedfwa": "the contained kernels cost 35% forward and 68% forward+backward at B1 H16 T32768 D128 w512",
    "parallax": "the contained prefill forward costs 6% at B4 H16 T8192 D128 (decode is contained)",
}


def _op_backends():
    for backend in ("torch", "triton"):
        for op in OPS:
            if backend == "torch" and op.startswith("scan_"):
                continue  # the precisions are the Triton kernels'
            marks = ()
            if backend == "triton" and op in NOT_CONTAINED:
                marks = pytest.mark.xfail(run=False, reason=NOT_CONTAINED[op])
            yield pytest.param(backend, op, id=f"{backend}-{op}", marks=marks)


@pytest.mark.parametrize("case, k_value, v_value", POISON, ids=[f"{c}-k{k}-v{v}" for c, k, v in POISON])
@pytest.mark.parametrize("backend, op", list(_op_backends()))
def test_hidden_entries_do_not_leak(backend, op, case, k_value, v_value, request):
    _backend(backend, request)
    B, T, bad, window, cu = CASES[case]
    if op == "gatedfwa" and window is None:
        window = T
    cu_seqlens = None if cu is None else torch.tensor(cu, dtype=torch.int32, device=DEV)
    q, k, v, aux, do = (randn(B, T, H, D, dtype=torch.float32, device=DEV) for _ in range(5))
    bad_k, bad_v = k.clone(), v.clone()
    bad_k[bad[0], bad[1], 0, 3] = k_value
    bad_v[bad[0], bad[1], 1, 5] = v_value
    got = _run(OPS[op], q, bad_k, bad_v, aux, do, window, cu_seqlens, backend)
    want = _run(OPS[op], q, k, v, aux, do, window, cu_seqlens, backend)
    rows, keys = _unreached(B, T, window, cu, bad)
    assert rows.any() and keys.any()
    for name, g, w, where in zip(("o", "dq", "dk", "dv"), got, want, (rows, rows, keys, keys)):
        assert torch.isfinite(g[where]).all(), f"{name}: a hidden non-finite key or value leaked"
        torch.testing.assert_close(g[where], w[where], rtol=1e-5, atol=1e-6, msg=f"{name} differs")
        # they read the entry as zero: the rows that see it must still show it (the scan and mesanet in o only:
        # mesanet's NaN rows pass no gradient back, and the scan's dv of a key is p^T dO, finite where p is)
        if op.startswith("lla") or (op.startswith(("scan", "mesanet")) and name == "o"):
            assert not torch.isfinite(g[~where]).flatten(1).all(1).any(), f"{name}: a seen non-finite entry was dropped"


@pytest.mark.parametrize("tensor", ["k", "v"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_parallax_decode_ignores_hidden_cache_entries(backend, tensor, request):
    """Entries beyond each row's cache length, and (with a window of 4) inside the cache but behind the window."""
    _backend(backend, request)
    B, Tn, S, window = 2, 2, 40, 4
    q, r = (randn(B, Tn, H, D, dtype=torch.float32, device=DEV) for _ in range(2))
    k, v = (randn(B, S, H, D, dtype=torch.float32, device=DEV) for _ in range(2))
    lens = torch.tensor([17, 33], dtype=torch.int32, device=DEV)
    beyond = {"k": k.clone(), "v": v.clone()}
    beyond[tensor][0, 20, 1, 5], beyond[tensor][1, 39, 0, 2] = NAN, INF
    behind = {"k": beyond["k"].clone(), "v": beyond["v"].clone()}
    behind[tensor][0, 10, 0, 1], behind[tensor][1, 25, 1, 3] = INF, NAN
    for w, poisoned in ((None, beyond), (window, behind)):
        got = regattn.parallax_decode(q, r, poisoned["k"], poisoned["v"], cache_seqlens=lens, window=w,
                                      backend=backend)
        want = regattn.parallax_decode(q, r, k, v, cache_seqlens=lens, window=w, backend=backend)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
