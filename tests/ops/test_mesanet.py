"""MesaNet in chunks (regattn.mesanet) against the per-query float64 spec (regattn.reference.mesanet)."""
import pytest
import torch

import regattn
from regattn import reference
from tests.helpers import no_host_reads, randn, rel_err


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # of the Triton kernels' tests (CPU: the interpreter)


def _inputs(B, T, S, HQ, H, D, Dv, dtype=torch.float64, device="cpu"):
    q = randn(B, T, HQ, D, dtype=dtype, device=device, requires_grad=True)
    k = torch.nn.functional.normalize(randn(B, S, H, D, dtype=dtype, device=device), dim=-1).requires_grad_(True)
    v = randn(B, S, H, Dv, dtype=dtype, device=device, requires_grad=True)
    return q, k, v


def _outputs(fn, x, do):
    o = fn(*x)
    return [o, *torch.autograd.grad(o, x, do)]


CASES = [
    # B, T, S, HQ, H, D, Dv, chunk, lam
    (2, 37, 37, 4, 2, 8, 5, 16, 0.7),      # GQA, Dv != D, T not a multiple of the chunk
    (1, 64, 64, 2, 2, 16, 16, 64, 1.0),    # one whole chunk
    (1, 50, 50, 1, 1, 32, 8, 7, 0.05),     # chunks smaller than D, a small ridge
    (2, 5, 19, 2, 1, 6, 6, 4, 2.0),        # fewer queries than keys (aligned to the end)
    (1, 9, 9, 2, 2, 4, 4, 1, 1.0),         # chunks of one position
    (1, 1, 1, 1, 1, 8, 8, 64, 1.0),        # one token
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_matches_reference_forward_backward(case):
    B, T, S, HQ, H, D, Dv, chunk, lam = case
    x = _inputs(B, T, S, HQ, H, D, Dv)
    do = randn(B, T, HQ, Dv)
    got = _outputs(lambda *a: regattn.mesanet(*a, lam=lam, chunk=chunk), x, do)
    want = _outputs(lambda *a: reference.mesanet(*a, lam=lam), x, do)
    for name, a, b in zip(["o", "dq", "dk", "dv"], got, want):
        assert a.shape == b.shape and a.dtype == torch.float64
        assert rel_err(a, b) < 1e-11, name


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rows_do_not_depend_on_later_keys_bit_for_bit(dtype):
    """Other keys and values from position 13 on (inside the second chunk of 8) leave the rows before it, and their
    gradients, the same bits: the chunk sums before a chunk do not take that chunk's own products in and out."""
    q, k, v = (x.detach().to(dtype) for x in _inputs(2, 20, 20, 2, 1, 8, 8))
    k2, v2 = k.clone(), v.clone()
    k2[:, 13:], v2[:, 13:] = _inputs(2, 7, 7, 2, 1, 8, 8, dtype=dtype)[1:]
    do = randn(2, 20, 2, 8, dtype=dtype)

    def o_dq(*inputs):
        leaves = [x.clone().requires_grad_(True) for x in inputs]
        return _outputs(lambda *a: regattn.mesanet(*a, chunk=8, backend="torch"), leaves, do)[:2]

    got, want = o_dq(q, k2, v2), o_dq(q, k, v)
    for name, a, b in zip(["o", "dq"], got, want):
        assert torch.equal(a[:, :13], b[:, :13]), name
        assert not torch.equal(a[:, 13:], b[:, 13:]), name


# Not the one token: its one output entry is (q.k / 2) v, and where q.k nearly cancels, the error of three TF32
# products (about 1e-6 |q| |k|) is 1e-4 of it at some seeds.
TRITON_CASES = [case for case in CASES if case[1] > 1] + [(1, 70, 70, 2, 1, 64, 48, 64, 1.0)]


@pytest.mark.parametrize("case", TRITON_CASES, ids=lambda c: "-".join(map(str, c)))
def test_triton_chunks_match_reference_forward_backward(case, interpret):
    """fp32 through the Triton kernels (each product three TF32 products) against float64."""
    B, T, S, HQ, H, D, Dv, chunk, lam = case
    x = _inputs(B, T, S, HQ, H, D, Dv, device=DEVICE)
    do = randn(B, T, HQ, Dv, device=DEVICE)
    want = _outputs(lambda *a: reference.mesanet(*a, lam=lam), x, do)
    x32 = [t.detach().float().requires_grad_(True) for t in x]
    got = _outputs(lambda *a: regattn.mesanet(*a, lam=lam, chunk=chunk, backend="triton"), x32, do.float())
    for name, a, b in zip(["o", "dq", "dk", "dv"], got, want):
        assert a.dtype == torch.float32
        assert rel_err(a.double(), b) < 2e-5, name


def test_triton_path_takes_head_dims_and_chunks_up_to_64(interpret):
    x = [t.detach() for t in _inputs(1, 80, 80, 1, 1, 8, 80, dtype=torch.float32, device=DEVICE)]
    with pytest.raises(ValueError, match="backend: the Triton path of mesanet takes .* got D=8, Dv=80, chunk=64"):
        regattn.mesanet(*x, backend="triton")
    with pytest.raises(ValueError, match="chunk=80"):
        regattn.mesanet(x[0], x[1], x[1], chunk=128, backend="triton")
    want = regattn.mesanet(*x, backend="torch")
    assert torch.equal(regattn.mesanet(*x, backend="auto"), want)      # auto: the torch path there


def test_triton_refuses_float64(interpret):
    x = [t.detach() for t in _inputs(1, 8, 8, 2, 2, 4, 4, device=DEVICE)]
    with pytest.raises(TypeError, match="q: backend='triton' expects"):
        regattn.mesanet(*x, backend="triton")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fp32_against_float64_on_learned_like_keys(backend, request):
    """Keys along few directions make ``H`` ill-conditioned (eigenvalues from lam to about T)."""
    if backend == "triton":
        request.getfixturevalue("interpret")
    B, T, H, D = 2, 200, 2, 32
    device = DEVICE if backend == "triton" else "cpu"
    basis = torch.nn.functional.normalize(randn(4, D, device=device), dim=-1)
    k = randn(B, T, H, 4, device=device) @ basis + 0.05 * randn(B, T, H, D, device=device)
    k = torch.nn.functional.normalize(k, dim=-1)
    q, v, do = (randn(B, T, H, D, device=device) for _ in range(3))
    x64 = [t.clone().requires_grad_(True) for t in (q, k, v)]
    x32 = [t.float().requires_grad_(True) for t in (q, k, v)]
    want = _outputs(lambda *a: reference.mesanet(*a, lam=1.0), x64, do)
    got = _outputs(lambda *a: regattn.mesanet(*a, lam=1.0, backend=backend), x32, do.float())
    for name, a, b in zip(["o", "dq", "dk", "dv"], got, want):
        assert a.dtype == torch.float32
        assert rel_err(a.double(), b) < 1e-5, name


@pytest.mark.xfail(strict=True, reason="fp32 Cholesky of a chunk's starting matrix fails when lam is below fp32's "
                                       "rounding of sum k k^T; float64 stays finite")
def test_fp32_stays_finite_for_a_tiny_ridge_on_low_rank_keys():
    basis = torch.nn.functional.normalize(randn(2, 64), dim=-1)
    k = torch.nn.functional.normalize(randn(1, 2048, 1, 2) @ basis, dim=-1)
    q, v = randn(1, 2048, 1, 64), randn(1, 2048, 1, 64)
    assert torch.isfinite(regattn.mesanet(q, k, v, lam=1e-6)).all()          # float64: finite
    assert torch.isfinite(regattn.mesanet(q.float(), k.float(), v.float(), lam=1e-6)).all()


def test_low_precision_inputs_compute_in_fp32_under_autocast():
    q, k, v = (t.detach() for t in _inputs(1, 40, 40, 2, 2, 16, 16))
    want = reference.mesanet(q, k, v, lam=1.0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = regattn.mesanet(q.bfloat16(), k.bfloat16(), v.bfloat16(), lam=1.0)
    assert got.dtype == torch.bfloat16
    assert rel_err(got.double(), want) < 2e-2


def test_reads_nothing_back():
    x = [t.detach() for t in _inputs(2, 30, 30, 2, 2, 8, 8, dtype=torch.float32)]
    with no_host_reads():
        regattn.mesanet(*x, lam=1.0, chunk=8)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(lam=0.0), ValueError, "lam"),
    (dict(lam=float("nan")), ValueError, "lam"),
    (dict(lam=torch.tensor(1.0)), TypeError, "lam"),
    (dict(chunk=0), ValueError, "chunk"),
    (dict(chunk=2.5), TypeError, "chunk"),
    (dict(backend="cuda"), ValueError, "backend"),
])
def test_bad_arguments(kwargs, error, match):
    x = [t.detach() for t in _inputs(1, 8, 8, 2, 2, 4, 4)]
    with pytest.raises(error, match=match):
        regattn.mesanet(*x, **kwargs)


def test_bad_shapes():
    q, k, v = (t.detach() for t in _inputs(1, 8, 6, 2, 2, 4, 4))
    with pytest.raises(ValueError, match="q: expected at most as many queries as keys"):
        regattn.mesanet(q, k, v)
    with pytest.raises(ValueError, match="k: expected head dim"):
        regattn.mesanet(q[:, :6], k[..., :3], v)


@pytest.mark.parametrize("K", [1, 7, 20, 33, 64, 100])
@pytest.mark.parametrize("ridge", [1.0, 1e-3])
def test_kernel_triangular_inverse_is_as_accurate_as_the_triangular_solve(K, ridge, interpret):
    """``lower_inverse`` (blocks of 16, their rows through the rows above) against float64, beside fp32's
    triangular solve; a small ridge on low-rank Gram matrices makes the factors ill-conditioned."""
    from regattn.ops.mesanet.kernels import lower_inverse
    x = randn(3, K, max(2, K // 4), device=DEVICE)
    L = torch.linalg.cholesky(x @ x.mT + ridge * torch.eye(K, dtype=torch.float64, device=DEVICE))
    want = torch.linalg.inv(L)
    solve = torch.linalg.solve_triangular(L.float(), torch.eye(K, device=DEVICE), upper=False)
    got = lower_inverse(L.float().contiguous())
    assert rel_err(got.double(), want) <= 4 * rel_err(solve.double(), want) + 1e-7


def test_triton_path_keeps_the_inputs_dtype(interpret):
    """fp16 rows into the chunks and back (``regattn.ops.mesanet.layout``): the output and each gradient in fp16,
    each the fp32 path's rounded (strided inputs, GQA, fewer queries than keys, a partial last chunk)."""
    B, T, S, HQ, H, D, Dv = 2, 21, 27, 4, 2, 16, 8
    q, k, v = (t.detach().half() for t in _inputs(B, T, S, HQ, H, D, Dv, dtype=torch.float32, device=DEVICE))
    k = torch.cat([k, k], -1)[..., :D]                        # a view: rows 2 D apart
    do = randn(B, T, HQ, Dv, device=DEVICE).half()
    half = [t.clone().requires_grad_(True) for t in (q, k, v)]
    full = [t.float().requires_grad_(True) for t in (q, k, v)]
    got = _outputs(lambda *a: regattn.mesanet(*a, chunk=8, backend="triton"), half, do)
    want = _outputs(lambda *a: regattn.mesanet(*a, chunk=8, backend="triton"), full, do.float())
    for name, a, b in zip(["o", "dq", "dk", "dv"], got, want):
        assert a.dtype == torch.float16, name
        torch.testing.assert_close(a.float(), b.half().float(), rtol=0, atol=0, msg=name)
