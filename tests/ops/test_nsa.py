"""NSA compression and selection in linear memory (regattn.ops.nsa) against the dense float64 spec."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from regattn import reference
from regattn.ops.nsa import nsa_attention
from regattn.ops.nsa import compression
from regattn.ops.nsa.api import block_importance
from regattn.ops.nsa.kernels import inverse_index
from regattn.reference.nsa import compressed_ends, masked_softmax
from tests.helpers import randn, rel_err


def _inputs(B, T, HQ, H, D, Dv, block_cmp, stride_cmp, dtype=torch.float64, n=None):
    n = max(0, (T - block_cmp) // stride_cmp + 1) if n is None else n
    shapes = [(B, T, HQ, D), (B, T, H, D), (B, T, H, Dv), (B, n, H, D), (B, n, H, Dv)]
    return [randn(*s, dtype=dtype, requires_grad=True) for s in shapes]


def _outputs(fn, x, do):
    o = fn(*x)
    return [*o, *torch.autograd.grad(o, x, do)]


CASES = [
    # B, T, HQ, H, D, Dv, block_cmp, stride_cmp, block_slc, topk, chunk
    (2, 37, 4, 2, 8, 6, 5, 3, 4, 3, 10),     # GQA, Dv != D, T and the chunk not multiples of the blocks
    (1, 50, 2, 2, 16, 16, 4, 4, 8, 2, 7),    # stride = block, selection blocks larger than compressed ones
    (1, 23, 3, 1, 8, 8, 8, 2, 3, 100, 64),   # topk above the number of blocks; one chunk
    (2, 9, 2, 1, 4, 4, 16, 8, 4, 1, 3),      # T < block_cmp: no compressed block, o_cmp = 0
    (1, 1, 2, 2, 4, 4, 1, 1, 1, 1, 1),       # one token
]
# As CASES, with fewer compressed blocks than fit: the queries past the last block see every block
FEWER_BLOCKS = [(1, 40, 4, 2, 8, 8, 6, 2, 4, 3, 16, 5), (2, 29, 2, 1, 8, 4, 3, 3, 5, 2, 8, 1)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_matches_reference_forward_backward(case):
    B, T, HQ, H, D, Dv, bc, sc, bs, topk, chunk = case
    x = _inputs(B, T, HQ, H, D, Dv, bc, sc)
    kw = dict(block_cmp=bc, stride_cmp=sc, block_slc=bs, topk=topk)
    do = [randn(B, T, HQ, Dv), randn(B, T, HQ, Dv)]
    got = _outputs(lambda *a: nsa_attention(*a, **kw, chunk=chunk), x, do)
    want = _outputs(lambda *a: reference.nsa_attention(*a, **kw), x, do)
    for name, a, b in zip(["o_cmp", "o_slc", "dq", "dk", "dv", "dkc", "dvc"], got, want):
        assert a.shape == b.shape and a.dtype == torch.float64
        assert rel_err(a, b) < 1e-12, name
    if x[3].shape[1] == 0:
        assert got[0].abs().max() == 0


def test_fp32_against_float64():
    """On the same fp32 inputs: rounding them can change which blocks win a near tie."""
    x = [t.detach().float() for t in _inputs(1, 30, 2, 1, 16, 16, 4, 2)]
    kw = dict(block_cmp=4, stride_cmp=2, block_slc=4, topk=2)
    do = [randn(1, 30, 2, 16), randn(1, 30, 2, 16)]
    got = _outputs(lambda *a: nsa_attention(*a, **kw, chunk=8), [t.requires_grad_(True) for t in x], do)
    want = _outputs(lambda *a: reference.nsa_attention(*a, **kw), [t.double().requires_grad_(True) for t in x], do)
    for a, b in zip(got, want):
        assert a.dtype == torch.float32 and rel_err(a, b) < 1e-5


@pytest.mark.parametrize("backend, dtype, bound", [("torch", torch.float64, 1e-14), ("triton", torch.float32, 1e-6)])
def test_queries_at_an_offset_are_the_full_rows(backend, dtype, bound, request):
    """Decoding: queries at positions a..b-1 over all the keys (later keys unseen) give the full forward's rows."""
    if backend == "triton":
        request.getfixturevalue("interpret")
    x = [t.detach().to(dtype) for t in _inputs(2, 41, 4, 2, 16, 16, 6, 2)]
    kw = dict(block_cmp=6, stride_cmp=2, block_slc=5, topk=3, backend=backend)
    full = nsa_attention(*x, **kw)
    q, k, v, kc, vc = x
    for a, b in [(17, 18), (30, 41), (0, 5)]:
        part = nsa_attention(q[:, a:b], k, v, kc, vc, **kw, offset=a)
        for o, f in zip(part, full):
            assert rel_err(o, f[:, a:b]) < bound


def _close(got, want, bound):
    """Relative error within ``bound``, or within ``bound`` absolutely where the truth is 0 (a softmax over
    one entry has no gradient, and fp32 leaves its rounding there)."""
    return rel_err(got, want) < bound or (got - want).abs().max() < bound


def _kernel_against_spec(case, dtype, bound):
    """The Triton path in ``dtype`` against the float64 spec on the same rounded inputs (rounding them can
    change which blocks win a near tie), forward and every gradient."""
    B, T, HQ, H, D, Dv, bc, sc, bs, topk, chunk, *n = case
    x = [t.detach().to(dtype) for t in _inputs(B, T, HQ, H, D, Dv, bc, sc, n=n[0] if n else None)]
    kw = dict(block_cmp=bc, stride_cmp=sc, block_slc=bs, topk=topk)
    do = [randn(B, T, HQ, Dv, dtype=dtype), randn(B, T, HQ, Dv, dtype=dtype)]
    got = _outputs(lambda *a: nsa_attention(*a, **kw, chunk=chunk, backend="triton"),
                   [t.requires_grad_(True) for t in x], do)
    want = _outputs(lambda *a: reference.nsa_attention(*a, **kw), [t.double().requires_grad_(True) for t in x],
                    [g.double() for g in do])
    for name, a, b in zip(["o_cmp", "o_slc", "dq", "dk", "dv", "dkc", "dvc"], got, want):
        assert a.dtype == dtype and _close(a, b, bound), name


@pytest.mark.parametrize("dtype, bound", [(torch.float32, 1e-5), (torch.float16, 5e-3)], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", CASES + FEWER_BLOCKS, ids=lambda c: "-".join(map(str, c)))
def test_kernel_matches_reference_forward_backward(case, dtype, bound, interpret):
    """The kernel path (interpreter) against the float64 spec."""
    _kernel_against_spec(case, dtype, bound)


def _importance(q, kc, offset, *, block_cmp, stride_cmp, block_slc, n_slc):
    """``[B, H, T, n_slc]`` float64: the spec's block importance of the queries ``q`` at positions ``offset ..``."""
    B, T, HQ, D = q.shape
    n, H = kc.shape[1], kc.shape[2]
    t = torch.arange(offset, offset + T)
    logits = torch.einsum("bthd,bnhd->bhtn", q.double(), kc.double().repeat_interleave(HQ // H, 2)) * D ** -0.5
    p = masked_softmax(logits, compressed_ends(n, block_cmp=block_cmp, stride_cmp=stride_cmp)[None, :] <= t[:, None])
    lo, slc = torch.arange(n) * stride_cmp, torch.arange(n_slc) * block_slc
    overlap = (lo[:, None] < slc[None, :] + block_slc) & (lo[:, None] + block_cmp > slc[None, :])
    return (p @ overlap.double()).view(B, H, HQ // H, T, n_slc).sum(2)


@pytest.mark.parametrize("bc, sc, bs, topk", [(6, 2, 4, 5), (5, 3, 7, 3), (4, 4, 2, 16), (8, 4, 4, 30), (4, 2, 40, 2)])
def test_selection_kernel_picks_the_most_important_blocks(bc, sc, bs, topk, monkeypatch, interpret):
    """The kernel's blocks and their importances, over several steps of selection blocks (16 compressed blocks a
    step), for queries at an offset, against the float64 importance: each query has its own block first, then
    the started blocks best first, each at its float64 importance, and no started block left out is more
    important than one taken (up to fp32 rounding, which may reorder near ties); -1 only past the started ones.
    The last case's selection blocks each overlap more compressed blocks than a step of 16 holds."""
    monkeypatch.setattr(compression, "BLOCK_J", 16)
    T, first = 70, 23
    q, _, _, kc, vc = (t.detach().float() for t in _inputs(2, T, 6, 2, 16, 16, bc, sc))
    n_slc = -(-T // bs)
    options = dict(block_cmp=bc, stride_cmp=sc, block_slc=bs)
    _, lse2 = compression.compressed_attention(q, kc, vc, offset=0, block_cmp=bc, stride_cmp=sc, scale=16 ** -0.5)
    blocks, scores = compression.selected_blocks(q[:, first:], kc, lse2[:, first:], T, offset=first, topk=topk,
                                                 scale=16 ** -0.5, scores=True, **options)
    assert compression.selection_tiles(bc, sc, bs)[1] < n_slc    # several steps
    want = _importance(q[:, first:], kc, first, n_slc=n_slc, **options)
    assert blocks.shape == (2, 2, T - first, min(topk, n_slc))
    for t in range(T - first):
        started = (first + t) // bs + 1
        picked = blocks[:, :, t].long()
        taken = min(topk, started)
        assert (picked[..., :taken] >= 0).all() and (picked[..., taken:] == -1).all()
        assert (picked[..., 0] == started - 1).all() and torch.isinf(scores[:, :, t, 0]).all()
        if taken > 1:
            got = scores[:, :, t, 1:taken].double()
            exact = want[:, :, t].gather(-1, picked[..., 1:taken])
            assert (got - exact).abs().max() < 1e-5 and (got[..., :-1] >= got[..., 1:]).all()
            left = want[:, :, t, :started].scatter(-1, picked[..., :taken], float("-inf"))
            assert (left.amax(-1) <= exact.amin(-1) + 1e-5).all()


@pytest.mark.parametrize("case", CASES[:3], ids=lambda c: "-".join(map(str, c)))
def test_kernel_backward_with_several_segments_a_block(case, monkeypatch, interpret):
    """dK and dV by segments of 10 queries, 16 rows a tile: a block chosen by more queries is summed over
    several programs, and a segment over several tiles, the last one partly empty (a group of 3 heads leaves
    a row of every tile unused)."""
    monkeypatch.setattr("regattn.ops.nsa.kernels.SEGMENT", 10)
    monkeypatch.setattr("regattn.ops.nsa.kernels.DKV_ROWS", 16)
    _kernel_against_spec(case, torch.float32, 1e-5)


@pytest.mark.parametrize("segment", [1, 4, 1000])
def test_inverse_index_lists_every_selection_once(segment):
    """Each (block, query) selection appears in exactly one segment of its block, segments hold at most
    ``segment`` queries, and the slots suffice."""
    B, H, T, K, n_slc = 2, 3, 29, 4, 9
    scores = torch.rand(B, H, T, n_slc)
    blocks = scores.argsort(-1)[..., :K].to(torch.int32)
    blocks = torch.where(torch.rand(B, H, T, K) < 0.2, -1, blocks)      # some queries selected fewer
    queries, block, start, end = inverse_index(blocks, n_slc, segment)
    for b in range(B):
        for h in range(H):
            listed = sorted((int(j), int(t)) for j, lo, hi in zip(block[b, h], start[b, h], end[b, h])
                            for t in queries[b, h, lo:hi] if j >= 0)
            wanted = sorted((int(j), t) for t in range(T) for j in blocks[b, h, t] if j >= 0)
            assert listed == wanted
            assert ((end - start)[b, h] <= segment).all() and ((end > start) | (block < 0))[b, h].all()


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("name", ["k", "v"])
def test_a_hidden_nonfinite_token_reaches_no_row(name, backend, interpret):
    """NaN in a key or value of a token: no row before it turns non-finite, though the token's block is
    selected by the rows before it in the block; the token's own row does. Through the kernel, neither does
    the gradient of an earlier query."""
    q, k, v, kc, vc = (t.detach().float() for t in _inputs(1, 40, 2, 1, 16, 16, 4, 4))
    kw = dict(block_cmp=4, stride_cmp=4, block_slc=8, topk=2, backend=backend)
    bad = 21
    (k if name == "k" else v)[0, bad] = float("nan")
    q.requires_grad_(backend == "triton")
    _, o = nsa_attention(q, k, v, kc, vc, **kw)
    assert torch.isfinite(o[0, :bad]).all()
    assert not torch.isfinite(o[0, bad]).all()         # its own block is always selected
    if backend == "triton":
        dq, = torch.autograd.grad(o, q, torch.ones_like(o))
        assert torch.isfinite(dq[0, :bad]).all()


def test_kernel_refuses_float64():
    q, k, v, kc, vc = (t.detach() for t in _inputs(1, 12, 2, 1, 4, 4, 4, 2))
    with pytest.raises(TypeError, match="^q: "):
        nsa_attention(q, k, v, kc, vc, block_cmp=4, stride_cmp=2, block_slc=4, topk=2, backend="triton")


def test_block_importance_is_the_overlap_sum():
    for bc, sc, bs in [(5, 3, 4), (4, 4, 8), (8, 2, 3), (1, 1, 1), (7, 5, 2)]:
        S = 29
        n, n_slc = (S - bc) // sc + 1, -(-S // bs)
        p = torch.rand(3, n, dtype=torch.float64)
        lo, slc = torch.arange(n) * sc, torch.arange(n_slc) * bs
        overlap = (lo[:, None] < slc[None, :] + bs) & (lo[:, None] + bc > slc[None, :])
        got = block_importance(p, block_cmp=bc, stride_cmp=sc, block_slc=bs, n_slc=n_slc)
        assert rel_err(got, p @ overlap.double()) < 1e-15


class LargestTensor(TorchDispatchMode):
    """The most elements of any tensor an op produces while the mode is on."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def _largest(T):
    x = _inputs(1, T, 1, 1, 4, 4, 8, 8)
    with LargestTensor() as mode:
        o = nsa_attention(*x, block_cmp=8, stride_cmp=8, block_slc=8, topk=2, chunk=16)
        torch.autograd.grad(o, x, [torch.ones_like(o[0])] * 2)
    return mode.largest


def test_no_tensor_grows_faster_than_T():
    """Forward and backward: no [T, T] tensor, and the largest one grows linearly in T."""
    small, large = _largest(256), _largest(1024)
    assert large < 1024 * 1024 / 8
    assert large <= 4.5 * small


def test_bad_inputs_name_the_argument():
    q, k, v, kc, vc = (t.detach() for t in _inputs(1, 12, 2, 1, 4, 4, 4, 2))
    kw = dict(block_cmp=4, stride_cmp=2, block_slc=4, topk=2)
    for args, extra, name in [
        ((q, k, v, kc[..., :3], vc), {}, "kc"),
        ((q, k, v, kc, vc.float()), {}, "vc"),
        ((q, k, v, torch.cat([kc, kc], 1), torch.cat([vc, vc], 1)), {}, "kc"),
        ((q, k, v, kc, vc), dict(offset=1), "k"),
        ((q, k, v, kc, vc), dict(offset=-1), "offset"),
        ((q, k, v, kc, vc), dict(chunk=0), "chunk"),
        ((q, k, v, kc, vc), dict(backend="fast"), "backend"),
        ((q, k, v, kc, vc), dict(block_cmp=1), "stride_cmp"),
        ((q, k[:, :, :, :3], v, kc, vc), {}, "k"),
    ]:
        with pytest.raises((ValueError, TypeError), match=f"^{name}: "):
            nsa_attention(*args, **{**kw, **extra})
