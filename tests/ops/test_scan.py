"""The ELSA scan kernel against the float64 reference: forward, backward, awkward sizes, bad input."""
import numpy as np
import pytest
import torch

import regattn
from regattn.ops._common import attention_tiles
from regattn.ops.scan import kernels
from regattn.ops.scan.api import partition_offsets
from regattn.reference.elsa import scan_attention as scan_reference
from regattn.reference.softmax import softmax_attention
from tests.helpers import no_host_reads, randn, rel_err

FP32_TOL = 1e-5


def _inputs(B, T, S, HQ, H, D, Dv, dtype=torch.float32, scale=1.0, seed=None):
    q = randn(B, T, HQ, D, dtype=dtype, seed=seed, scale=scale, requires_grad=True)
    k = randn(B, S, H, D, dtype=dtype, seed=None if seed is None else seed + 1, scale=scale, requires_grad=True)
    v = randn(B, S, H, Dv, dtype=dtype, seed=None if seed is None else seed + 2, requires_grad=True)
    return q, k, v


def _double(*xs):
    return [x.detach().double().requires_grad_() for x in xs]


def _run(q, k, v, **kwargs):
    """Kernel output and gradients, and the float64 reference's, for one random output gradient."""
    o = regattn.scan_attention(q, k, v, backend="triton", **kwargs)
    qd, kd, vd = _double(q, k, v)
    ref_kwargs = {key: kwargs[key] for key in ("causal", "window", "cu_seqlens", "scale") if key in kwargs}
    r = softmax_attention(qd, kd, vd, causal=ref_kwargs.pop("causal", False), **ref_kwargs)
    do = randn(*r.shape)
    o.backward(do.to(o.dtype))
    r.backward(do)
    return (o, q.grad, k.grad, v.grad), (r, qd.grad, kd.grad, vd.grad)


def _assert_close(got, want, tol):
    for name, a, b in zip(("o", "dq", "dk", "dv"), got, want):
        assert a.dtype == got[0].dtype and a.shape == b.shape, name
        err = rel_err(a, b) if b.norm() > 0 else (a.double() - b).abs().max().item()
        assert err < tol, f"{name}: relative error {err:.2e} >= {tol:.0e}"


CASES = [
    # B, T, S, HQ, H, D, Dv, causal, window, splits
    dict(shape=(1, 20, 20, 2, 2, 16, 16), causal=False, window=None, splits=1),
    dict(shape=(2, 37, 37, 4, 2, 24, 16), causal=True, window=None, splits=1),  # GQA, T % 16 != 0, D padded
    dict(shape=(1, 37, 29, 2, 1, 32, 32), causal=True, window=7, splits=1),  # T > S: first rows see nothing
    dict(shape=(1, 29, 37, 2, 1, 32, 32), causal=False, window=7, splits=1),
    dict(shape=(1, 45, 45, 2, 2, 16, 16), causal=False, window=None, splits=4),  # tree merge of 4 slices
    dict(shape=(1, 45, 45, 2, 1, 16, 16), causal=True, window=None, splits=2),
    dict(shape=(1, 1, 1, 1, 1, 16, 16), causal=False, window=None, splits=1),  # n = 1
    dict(shape=(1, 1, 1, 1, 1, 16, 16), causal=True, window=None, splits=2),  # n = 1, an empty slice
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c["shape"])) + f"-c{int(c['causal'])}"
                         f"-w{c['window']}-s{c['splits']}")
@pytest.mark.parametrize("precision", ["ieee", "fp16x3"])
def test_forward_backward_fp32(interpret, case, precision):
    q, k, v = _inputs(*case["shape"])
    got, want = _run(q, k, v, causal=case["causal"], window=case["window"], num_splits=case["splits"],
                     precision=precision)
    _assert_close(got, want, FP32_TOL)


@pytest.mark.parametrize("precision,tol", [("tf32x3", FP32_TOL), ("tf32", 2e-3)])
def test_precisions(interpret, precision, tol):
    q, k, v = _inputs(1, 33, 33, 2, 1, 32, 32)
    got, want = _run(q, k, v, causal=True, precision=precision)
    _assert_close(got, want, tol)


@pytest.fixture
def tf32_tensor_cores(monkeypatch):
    """The interpreter's fp32 ``tl.dot`` at TF32 reads its operands as the tensor cores do: their low 13 mantissa
    bits dropped (it multiplies in fp32 otherwise, so an operand that is not a TF32 value would pass unseen)."""
    from triton.runtime import interpreter

    exact = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, *rest):
        if str(input_precision).endswith(".TF32") and a.data.dtype == np.float32:
            a, b = (interpreter.TensorHandle((x.data.view(np.uint32) & np.uint32(0xFFFFE000)).view(np.float32),
                                             x.dtype) for x in (a, b))
        return exact(self, a, b, d, input_precision, *rest)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)


@pytest.mark.parametrize("precision,tol", [("tf32x3", FP32_TOL), ("tf32", 5e-4)])
def test_forward_products_read_as_tf32(interpret, tf32_tensor_cores, precision, tol):
    """With each TF32 product reading only TF32's bits: ``tf32x3``'s scores, products of the query's and the key
    tile's TF32 parts, stay as exact as fp32's; ``tf32``'s operands are rounded to their nearest TF32 values first,
    so its error is about half that of truncated ones (3.3e-4 at most over 12 seeds here, against 7.6e-4 at
    least)."""
    q, k, v = (x.detach() for x in _inputs(2, 37, 37, 4, 2, 24, 16))
    o = regattn.scan_attention(q, k, v, causal=True, window=19, precision=precision, backend="triton")
    want = softmax_attention(*(x.double() for x in (q, k, v)), causal=True, window=19)
    assert rel_err(o, want) < tol


@pytest.mark.parametrize("precision", ["tf32", "tf32x3", "fp16x3"])
@pytest.mark.parametrize("bits", [-1, 0x7FFFFFFF], ids=["negative", "positive"])
@pytest.mark.parametrize("tensor", ["k", "v"])
def test_tf32_rounding_keeps_nan_payloads(interpret, tensor, bits, precision):
    """A NaN key or value whose payload fills the mantissa (rounding it to TF32 by an integer addition carries
    out of the exponent and leaves a zero) still makes NaN exactly the rows that see it."""
    q, k, v = (x.detach() for x in _inputs(1, 20, 20, 2, 1, 16, 16))
    (k if tensor == "k" else v).view(torch.int32)[0, 7, 0, 3] = bits
    o = regattn.scan_attention(q, k, v, causal=True, precision=precision, backend="triton")
    seeing = o[0, 7:] if tensor == "k" else o[0, 7:, :, 3]  # a NaN value reaches its own column at least
    assert torch.isnan(seeing).all() and torch.isfinite(o[0, :7]).all()


@pytest.mark.parametrize("precision", ["ieee", "tf32x3"])
def test_key_at_the_top_of_fp32_stays_finite(interpret, precision):
    """A key entry within half a TF32 step of fp32's largest value (it would round to inf) against a query small
    enough that the score is moderate: every row stays finite and close to float64's. (``"tf32"`` rounds its
    operands to TF32, where that value is inf, as a cast to bf16 makes it.)"""
    q, k, v = (x.detach() for x in _inputs(1, 24, 24, 2, 1, 16, 16))
    q[..., 0] *= 1e-37
    k[0, 5, 0, 0] = float.fromhex("0x1.fffp127")
    o = regattn.scan_attention(q, k, v, causal=True, precision=precision, backend="triton")
    want = softmax_attention(*(x.double() for x in (q, k, v)), causal=True)
    assert torch.isfinite(want).all() and torch.isfinite(o).all()
    assert rel_err(o, want) < 5e-3


def test_fp16_within_twice_torch_half_error(interpret):
    q, k, v = _inputs(1, 40, 40, 2, 1, 32, 32, dtype=torch.float16)
    got, want = _run(q, k, v, causal=True)
    half = softmax_attention(q.detach(), k.detach(), v.detach(), causal=True, upcast=False)
    bound = 2 * rel_err(half, want[0]) + 1e-4
    assert got[0].dtype == torch.float16
    assert rel_err(got[0], want[0]) <= bound
    for a, b in zip(got[1:], want[1:]):
        assert rel_err(a, b) < 1e-2


@pytest.mark.parametrize("form", ["fused-tma", "fused", "two-passes"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c["shape"])) + f"-c{int(c['causal'])}"
                         f"-w{c['window']}")
def test_fp16_backward_fused_and_in_two_passes(interpret, monkeypatch, case, form):
    """fp16 gradients with dq added by the dK/dV pass (its query and dO tiles through tensor descriptors or
    pointers) or formed in a pass of its own, at awkward sizes (GQA, D padded, T > S: rows that see no key),
    within twice the error of softmax differentiated in fp16."""
    monkeypatch.setattr(kernels, "FUSED_DQ", form != "two-passes")
    monkeypatch.setattr(kernels, "TENSOR_DESCRIPTORS", form == "fused-tma")
    monkeypatch.setattr(attention_tiles, "TMA_WORK", 0)
    kw = dict(causal=case["causal"], window=case["window"])
    inputs = _inputs(*case["shape"], dtype=torch.float16)
    q = inputs[0].detach()
    assert (kernels.query_descriptors(q, q, q.float(), 32, 32, work=1) is not None) == (form == "fused-tma")
    do = randn(*inputs[0].shape[:3], inputs[2].shape[-1])
    grads = {}
    for name, fn, dtype in (("ours", lambda *x: regattn.scan_attention(*x, backend="triton", **kw), torch.float16),
                            ("half", lambda *x: softmax_attention(*x, upcast=False, **kw), torch.float16),
                            ("exact", lambda *x: softmax_attention(*x, **kw), torch.float64)):
        xs = [x.detach().to(dtype).requires_grad_() for x in inputs]
        fn(*xs).backward(do.to(dtype))
        grads[name] = [x.grad for x in xs]
    for name, a, h, b in zip(("dq", "dk", "dv"), *grads.values()):
        assert a.dtype == torch.float16
        if b.norm() == 0:  # n = 1: one key, ds = 0 exactly; fp16 rounding of p (dp - delta) is left
            assert (a.double() - b).abs().max() < 1e-3, name
        else:
            assert rel_err(a, b) <= 2 * rel_err(h, b) + 1e-4, name


def test_fp16_backward_forms_dq_in_its_own_pass_under_deterministic_algorithms(interpret, monkeypatch):
    """Atomic additions of dq land in any order on a GPU: deterministic algorithms take the two passes."""
    q, k, v = (x.detach().requires_grad_() for x in _inputs(1, 20, 20, 2, 1, 16, 16, dtype=torch.float16))
    o = regattn.scan_attention(q, k, v, backend="triton")
    launched = []
    monkeypatch.setattr(kernels, "_launch", lambda configs, tuned, plain, *a, **kw: launched.append(
        getattr(plain, "fn", plain).__name__))  # (under its heuristics)
    for deterministic in (False, True):
        launched.clear()
        monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda d=deterministic: d)
        torch.autograd.grad(o, (q, k, v), torch.ones_like(o), retain_graph=True)
        assert launched == (["_bwd_dkdv_kernel", "_bwd_dq_kernel"] if deterministic else ["_bwd_dkdv_kernel"])


@pytest.mark.parametrize("descriptors", [True, False], ids=["tma", "pointers"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c["shape"])) + f"-c{int(c['causal'])}"
                         f"-w{c['window']}-s{c['splits']}")
def test_fp16_forward_through_descriptors_and_pointers(interpret, monkeypatch, case, descriptors):
    """fp16 key and value tiles loaded through tensor descriptors (TMA on Hopper) or through pointers, at awkward
    sizes (GQA, D padded, T > S, split keys), within twice the error of softmax computed in fp16."""
    monkeypatch.setattr(kernels, "TENSOR_DESCRIPTORS", descriptors)
    monkeypatch.setattr(attention_tiles, "TMA_WORK", 0)  # these calls are far smaller than the launches that take them
    q, k, v = (x.detach() for x in _inputs(*case["shape"], dtype=torch.float16))
    assert (kernels.kv_descriptors(k, v, 32, 32, work=1) is not None) == descriptors
    kw = dict(causal=case["causal"], window=case["window"])
    o = regattn.scan_attention(q, k, v, num_splits=case["splits"], backend="triton", **kw)
    exact = softmax_attention(q.double(), k.double(), v.double(), **kw)
    half = softmax_attention(q, k, v, upcast=False, **kw)
    assert o.dtype == torch.float16
    assert rel_err(o, exact) <= 2 * rel_err(half, exact) + 1e-4


def test_rows_off_tmas_alignment_load_through_pointers(interpret, monkeypatch):
    """A row of 12 fp16 columns (24 bytes) breaks TMA's 16-byte rule: no descriptors, the same result."""
    monkeypatch.setattr(attention_tiles, "TMA_WORK", 0)
    q, k, v = (x.detach() for x in _inputs(1, 33, 33, 2, 1, 12, 12, dtype=torch.float16))
    assert kernels.kv_descriptors(k, v, 16, 16, work=1) is None
    wide = torch.zeros(1, 33, 1, 32, dtype=torch.float16)
    assert kernels.kv_descriptors(wide, wide, 32, 32, work=1) is not None
    assert kernels.kv_descriptors(wide[..., ::2], wide[..., ::2], 16, 16, work=1) is None  # a strided last dim
    o = regattn.scan_attention(q, k, v, causal=True, backend="triton")
    exact = softmax_attention(q.double(), k.double(), v.double(), causal=True)
    assert rel_err(o, exact) <= 2 * rel_err(softmax_attention(q, k, v, causal=True, upcast=False), exact) + 1e-4


def test_small_calls_load_through_pointers(interpret):
    """Below TMA_WORK an uncaptured call builds no descriptors (their launch costs the host more than it saves)."""
    k = torch.zeros(1, 64, 2, 16, dtype=torch.float16)
    assert kernels.kv_descriptors(k, k, 16, 16, work=attention_tiles.TMA_WORK - 1) is None
    assert kernels.kv_descriptors(k, k, 16, 16, work=attention_tiles.TMA_WORK) is not None


@pytest.mark.parametrize("precision", ["ieee", "fp16x3"])
@pytest.mark.parametrize("splits", [1, 4])
def test_varlen_with_empty_and_single_token_sequences(interpret, splits, precision):
    cu = torch.tensor([0, 1, 17, 17, 40], dtype=torch.int32)
    q, k, v = _inputs(1, 40, 40, 2, 1, 16, 16)
    with torch.no_grad():
        v[:, 17:] *= 1e3  # a sequence's values far larger than the others': fp16x3 scales each sequence's own
    got, want = _run(q, k, v, causal=True, cu_seqlens=cu, num_splits=splits, precision=precision)
    _assert_close(got, want, FP32_TOL)


@pytest.mark.parametrize("window, cu", [(None, None), (11, None), (None, [0, 5, 38, 70])],
                         ids=["causal", "window", "packed"])
def test_strict_fp32_masked_runs_of_wider_tiles(interpret, monkeypatch, window, cu):
    """32 x 32 tiles: strict fp32's masked runs (a window's first keys, the diagonal, a sequence's end) fold tiles
    that rows of the query tile see in part, and whole tiles between them."""
    monkeypatch.setattr(kernels, "INTERPRET_BLOCK", 32)
    q, k, v = _inputs(1, 70, 70, 2, 1, 16, 16)
    cu_seqlens = None if cu is None else torch.tensor(cu, dtype=torch.int32)
    got, want = _run(q, k, v, causal=True, window=window, cu_seqlens=cu_seqlens, precision="ieee")
    _assert_close(got, want, FP32_TOL)


@pytest.mark.parametrize("window, cu", [(None, None), (11, None), (None, [0, 5, 38, 70])],
                         ids=["causal", "window", "packed"])
def test_strict_fp32_masked_launch_tiles_the_queries_its_own_way(interpret, monkeypatch, window, cu):
    """The whole tiles' launch on 32 x 32 tiles, the masked tiles' launch on 16 x 16: each finds the whole keys of
    the same 64 rows (kernels.WHOLE_ROWS in the interpreter: twice its tile), so together they fold every key once.
    Without a window the whole tiles' programs take query tiles 0 and 2, and 1, of the 3 of 70 rows."""
    launch, parts = kernels._launch, []

    def tiled(*args, **kwargs):
        parts.append((kwargs.get("PART"), kwargs.get("PAIRED")))
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(kernels, "INTERPRET_BLOCK", 16 if kwargs.get("PART") == 2 else 32)
            launch(*args, **kwargs)

    monkeypatch.setattr(kernels, "INTERPRET_BLOCK", 32)
    monkeypatch.setattr(kernels, "_launch", tiled)
    q, k, v = _inputs(1, 70, 70, 2, 1, 16, 16)
    cu_seqlens = None if cu is None else torch.tensor(cu, dtype=torch.int32)
    with torch.no_grad():
        got = regattn.scan_attention(q, k, v, causal=True, window=window, cu_seqlens=cu_seqlens, backend="triton")
    want = softmax_attention(*_double(q, k, v), causal=True, window=window, cu_seqlens=cu_seqlens)
    assert parts == [(1, window is None), (2, None)]  # causal folds pair their whole-tile query tiles
    assert rel_err(got, want) < FP32_TOL


def test_strict_fp32_whole_tiles_fold_in_chunks_within_one_loop(interpret, monkeypatch):
    """Chunks of 3 tiles, 16 x 16 tiles, 130 rows: query tile ``t`` of the whole tiles' launch folds
    ``2 * (t // 2)`` whole key tiles (those of its 32-row group), its chunks combining into the run's total inside
    the key loop wherever 3 tiles (or the last) are folded, 13 chunks in all; each of the 9 runs then combines into
    the total parked in the output rows."""
    monkeypatch.setattr(kernels, "INTERPRET_CHUNK", 3)
    launch, combine, combined, part = kernels._launch, kernels._combine, [], []

    def launched(*args, **kwargs):
        part[:] = [kwargs.get("PART")]
        launch(*args, **kwargs)

    def counted(*args, **kwargs):
        if part == [1]:
            combined.append(kwargs.get("ROWS_AXIS", 0))
        return combine(*args, **kwargs)

    monkeypatch.setattr(kernels, "_launch", launched)
    monkeypatch.setattr(kernels, "_combine", counted)
    q, k, v = _inputs(1, 130, 130, 1, 1, 16, 16)
    with torch.no_grad():
        got = regattn.scan_attention(q, k, v, causal=True, backend="triton")
    assert rel_err(got, softmax_attention(*_double(q, k, v), causal=True)) < FP32_TOL
    chunks = sum(-(-2 * (t // 2) // 3) for t in range(9))
    assert (combined.count(1), combined.count(0)) == (chunks, 9) == (13, 9)


def test_strict_fp32_two_launches_take_tiles_within_their_row_groups():
    """A query tile longer than kernels.WHOLE_ROWS would fold, unmasked, keys its later rows cannot see (with a
    window): the launches of a two-part fold prune such tiles, a one-part fold keeps them."""
    prune = kernels._pruner("N")["early_config_prune"]
    q = torch.empty(1, 16, 4, 64, device="meta", dtype=torch.float32)
    sides = lambda cfgs: {max(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]) for c in cfgs}  # noqa: E731
    whole = dict(BLOCK_D=64, BLOCK_DV=64, HAS_DESC=False)
    assert max(sides(prune(kernels.FWD_CONFIGS["ieee"], {"Q": q}, **whole))) == 128
    for configs in (kernels.FWD_CONFIGS["ieee"], kernels.MASKED_CONFIGS):
        kept = prune(configs, {"Q": q}, WHOLE_ROWS=64, **whole)
        assert kept and max(sides(kept)) <= 64


def test_strict_fp32_diagonal_tile_keeps_a_later_nan_out(interpret, monkeypatch):
    """A NaN value at key 40 sits in the diagonal tile [32, 64) of 32 x 32 tiles: rows 32 to 39 fold that tile
    without seeing it and stay as without the NaN; every later row shows it."""
    monkeypatch.setattr(kernels, "INTERPRET_BLOCK", 32)
    q, k, v = _inputs(1, 70, 70, 2, 1, 16, 16)
    bad = v.detach().clone()
    bad[0, 40, 0, 3] = float("nan")
    with torch.no_grad():
        got = regattn.scan_attention(q, k, bad, causal=True, backend="triton")
        want = regattn.scan_attention(q, k, v, causal=True, backend="triton")
    assert torch.isfinite(got[:, :40]).all()
    torch.testing.assert_close(got[:, :40], want[:, :40], rtol=0, atol=0)
    assert (~torch.isfinite(got[0, 40:])).any(-1).all()


@pytest.mark.parametrize("descriptors", [True, False], ids=["tma", "pointers"])
@pytest.mark.parametrize("causal, window", [(True, None), (False, None), (True, 5)])
def test_fp16_varlen_through_descriptors_and_pointers(interpret, monkeypatch, descriptors, causal, window):
    """Packed fp16 sequences (an empty one, one token, lengths off the 16-row tile, GQA) forward and backward with
    the key, value, query and dO tiles through tensor descriptors, whose last tile of a sequence reads the next
    sequence's rows, or through pointers: within twice the error of softmax in fp16 (dq added by the dK/dV pass)."""
    monkeypatch.setattr(kernels, "TENSOR_DESCRIPTORS", descriptors)
    monkeypatch.setattr(attention_tiles, "TMA_WORK", 0)
    cu = torch.tensor([0, 9, 9, 10, 31, 50], dtype=torch.int32)
    q, k, v = _inputs(1, 50, 50, 4, 2, 32, 16, dtype=torch.float16)
    assert (kernels.kv_descriptors(k, v, 32, 16, work=1) is not None) == descriptors
    kw = dict(causal=causal, window=window, cu_seqlens=cu)
    do = randn(1, 50, 4, 16)
    grads = {}
    for name, fn, dtype in (("ours", lambda *x: regattn.scan_attention(*x, backend="triton", **kw), torch.float16),
                            ("half", lambda *x: softmax_attention(*x, upcast=False, **kw), torch.float16),
                            ("exact", lambda *x: softmax_attention(*x, **kw), torch.float64)):
        xs = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
        o = fn(*xs)
        o.backward(do.to(dtype))
        grads[name] = [o, *(x.grad for x in xs)]
    for name, a, h, b in zip(("o", "dq", "dk", "dv"), *grads.values()):
        assert a.dtype == torch.float16 and torch.isfinite(a).all(), name
        assert rel_err(a, b) <= 2 * rel_err(h, b) + 1e-4, name


@pytest.mark.parametrize("descriptors", [True, False], ids=["tma", "pointers"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_fp16_varlen_keeps_the_next_sequence_out(interpret, monkeypatch, descriptors, causal):
    """NaN and inf in every input of the second packed sequence (q, k, v and dO), whose rows the first sequence's
    last tiles read through descriptors: the first sequence's output and gradients stay finite and unchanged."""
    monkeypatch.setattr(kernels, "TENSOR_DESCRIPTORS", descriptors)
    monkeypatch.setattr(attention_tiles, "TMA_WORK", 0)
    cu = torch.tensor([0, 7, 16], dtype=torch.int32)
    clean = [x.detach() for x in _inputs(1, 16, 16, 2, 1, 16, 16, dtype=torch.float16)] + [randn(1, 16, 2, 16)]
    bad = [x.clone() for x in clean]
    for i, x in enumerate(bad):
        x[0, 11 + i % 2, 0, 3 * i] = float("nan") if i % 2 else float("inf")
    runs = []
    for q, k, v, do in (clean, bad):
        xs = [x.requires_grad_() for x in (q, k, v)]
        o = regattn.scan_attention(*xs, causal=causal, cu_seqlens=cu, backend="triton")
        runs.append([o, *torch.autograd.grad(o, xs, do.half())])
    for name, got, want in zip(("o", "dq", "dk", "dv"), runs[1], runs[0]):
        assert torch.isfinite(got[:, :7]).all(), f"{name}: the next sequence's entries leaked"
        torch.testing.assert_close(got[:, :7], want[:, :7], rtol=0, atol=0, msg=f"{name} differs")


def test_partition_is_window_attention(interpret):
    """Swin-style windows: each window of 16 tokens (the last of 8) attends only within itself."""
    B, T, w = 2, 40, 16
    q, k, v = _inputs(B, T, T, 2, 2, 16, 16)
    o = regattn.scan_attention(q, k, v, partition=w, backend="triton")
    qd, kd, vd = _double(q, k, v)
    parts = [softmax_attention(qd[:, a:a + w], kd[:, a:a + w], vd[:, a:a + w], causal=False) for a in range(0, T, w)]
    ref = torch.cat(parts, 1)
    assert rel_err(o, ref) < FP32_TOL
    assert rel_err(regattn.scan_attention(qd, kd, vd, partition=w, backend="torch"), ref) < 1e-12
    do = randn(*ref.shape)
    o.backward(do.float())
    ref.backward(do)
    assert rel_err(q.grad, qd.grad) < FP32_TOL and rel_err(k.grad, kd.grad) < FP32_TOL


def test_partition_offsets():
    assert partition_offsets(2, 5, 2, "cpu").tolist() == [0, 2, 4, 5, 7, 9, 10]


@pytest.mark.parametrize("scale", [0.0, -0.4])
@pytest.mark.parametrize("precision", ["ieee", "tf32x3", "fp16x3"])
def test_zero_and_negative_scales(interpret, scale, precision):
    """A positive scale multiplies inside exp2's argument; a zero or negative one scales the scores first (a
    max taken before a negative scale is a min, and 0 times a hidden -inf score is NaN)."""
    q, k, v = _inputs(1, 37, 37, 2, 1, 16, 16)
    got, want = _run(q, k, v, causal=True, window=11, scale=scale, precision=precision)
    _assert_close(got, want, FP32_TOL)


def test_large_logits_do_not_overflow(interpret):
    """|q.k| up to 1e4: every exponent is taken against the running maximum."""
    q, k, v = _inputs(1, 24, 24, 1, 1, 16, 16)
    with torch.no_grad():
        q.mul_(100.0 / q.norm(dim=-1, keepdim=True))
        k.mul_(100.0 / k.norm(dim=-1, keepdim=True))
    for splits in (1, 2):
        o = regattn.scan_attention(q, k, v, scale=1.0, num_splits=splits, backend="triton")
        ref = softmax_attention(*_double(q, k, v), causal=False, scale=1.0)
        assert torch.isfinite(o).all()
        assert rel_err(o, ref) < 1e-4  # logits of 1e4 carry fp32 rounding of ~1e-3 absolute


@pytest.mark.parametrize("precision", ["ieee", "tf32x3", "fp16x3", "fp16"])
def test_running_max_rising_and_falling_across_tiles(interpret, precision):
    """Key tiles whose scores rise past the running max by a little, then by far (the sum and the accumulator
    rescaled by 2^-12.5 at once), then fall far below it: forward and backward (which reads the forward's
    log-sum-exp) as exact as elsewhere."""
    dtype = torch.float16 if precision == "fp16" else torch.float32
    q, k, v = (x.detach() for x in _inputs(1, 80, 80, 2, 1, 16, 16, dtype=dtype))
    levels = torch.tensor([0.0, 3.0, 7.5, 20.0, -30.0]).repeat_interleave(kernels.INTERPRET_BLOCK)  # base 2
    q[..., 0] = 1.0
    k[..., 0] = (levels / attention_tiles.LOG2E)[None, :, None] + 0.1 * k[..., 0].float()
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    kw = dict(causal=True, scale=1.0) | ({} if precision == "fp16" else dict(precision=precision))
    got, want = _run(q, k, v, **kw)
    if precision != "fp16":
        _assert_close(got, want, FP32_TOL)
        return
    half = softmax_attention(q.detach(), k.detach(), v.detach(), causal=True, scale=1.0, upcast=False)
    assert rel_err(got[0], want[0]) <= 2 * rel_err(half, want[0]) + 1e-4
    for name, a, b in zip(("dq", "dk", "dv"), got[1:], want[1:]):
        assert rel_err(a, b) < 1e-2, name


def test_fully_masked_rows_are_zero_with_zero_gradient(interpret):
    q, k, v = _inputs(1, 24, 8, 2, 1, 16, 16)
    o = regattn.scan_attention(q, k, v, causal=True, backend="triton")
    assert torch.equal(o[:, :16], torch.zeros_like(o[:, :16]))
    o.sum().backward()
    assert torch.equal(q.grad[:, :16], torch.zeros_like(q.grad[:, :16]))


def test_no_grad_forward_matches(interpret):
    q, k, v = _inputs(1, 33, 33, 2, 1, 16, 16)
    with torch.no_grad():
        a = regattn.scan_attention(q, k, v, causal=True, backend="triton")
    b = regattn.scan_attention(q, k, v, causal=True, backend="triton")
    assert torch.equal(a, b.detach())


def test_torch_backend_is_the_blocked_scan():
    q, k, v = _double(*_inputs(2, 19, 19, 4, 2, 8, 8))
    for causal, window in ((False, None), (True, 5)):
        a = regattn.scan_attention(q, k, v, causal=causal, window=window, backend="torch")
        b = scan_reference(q, k, v, causal=causal, window=window, order="tree")
        assert rel_err(a, b) < 1e-13


def _qkv(dtype=torch.float32, T=8, S=8):
    return randn(1, T, 2, 16, dtype=dtype), randn(1, S, 2, 16, dtype=dtype), randn(1, S, 2, 16, dtype=dtype)


@pytest.mark.parametrize("kwargs,name", [
    (dict(partition=0), "partition"),
    (dict(partition=2.0), "partition"),
    (dict(partition=4, cu_seqlens=torch.tensor([0, 8])), "partition"),
    (dict(num_splits=3), "num_splits"),
    (dict(num_splits=0), "num_splits"),
    (dict(num_splits=128), "num_splits"),
    (dict(causal="yes"), "causal"),
    (dict(precision="fp16"), "precision"),
    (dict(window=0), "window"),
    (dict(cu_seqlens=torch.tensor([0, 3, 9])), "cu_seqlens"),
    (dict(cu_seqlens=torch.tensor([0.0, 8.0])), "cu_seqlens"),
])
def test_bad_input(kwargs, name):
    with pytest.raises((ValueError, TypeError), match=name):
        regattn.scan_attention(*_qkv(), backend="torch", **kwargs)


def test_bad_input_shapes_and_dtypes(interpret):
    q, k, v = _qkv(T=8, S=6)
    with pytest.raises(ValueError, match="partition"):
        regattn.scan_attention(q, k, v, partition=2)
    with pytest.raises(ValueError, match="cu_seqlens"):
        regattn.scan_attention(q, k, v, cu_seqlens=torch.tensor([0, 8]))
    with pytest.raises(TypeError, match="q"):
        regattn.scan_attention(*_qkv(torch.float64), backend="triton")


def test_varlen_max_seqlen_reads_nothing_on_the_host(interpret):
    cu = torch.tensor([0, 13, 13, 30], dtype=torch.int32)
    q, k, v = _inputs(1, 30, 30, 2, 1, 16, 16)
    do = randn(1, 30, 2, 16, dtype=torch.float32)
    with no_host_reads():
        o = regattn.scan_attention(q, k, v, causal=True, cu_seqlens=cu, max_seqlen=17, num_splits=2,
                                   backend="triton")
        grads = torch.autograd.grad(o, (q, k, v), do)
    x = _double(q, k, v)
    want = softmax_attention(*x, causal=True, cu_seqlens=cu)
    for a, b in zip((o, *grads), (want, *torch.autograd.grad(want, x, do.double()))):
        assert rel_err(a, b) < FP32_TOL
    with pytest.raises(ValueError, match="^max_seqlen: "):
        regattn.scan_attention(q, k, v, cu_seqlens=cu, max_seqlen=31, backend="triton")


def test_unchecked_offsets_past_t_are_clamped(interpret):
    q, k, v = _inputs(1, 20, 20, 2, 1, 16, 16)
    bad, good = torch.tensor([0, 7, 45], dtype=torch.int32), torch.tensor([0, 7, 20], dtype=torch.int32)
    o = regattn.scan_attention(q, k, v, causal=True, cu_seqlens=bad, max_seqlen=20, backend="triton")
    assert torch.equal(o, regattn.scan_attention(q, k, v, causal=True, cu_seqlens=good, backend="triton"))
