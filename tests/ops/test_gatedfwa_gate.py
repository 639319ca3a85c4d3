"""The fused gate scan (time chunks, offsets by a decoupled look-back) against the float64 reference."""
import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

import regattn
from regattn import reference
from regattn.ops.gatedfwa.gate import AGGREGATE, INCLUSIVE, _chunk_offset, gate_backward, gate_forward
from tests.helpers import randn, rel_err

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _gate_inputs(B, T, H, dtype, device=DEV):
    h = randn(B, T, H, dtype=dtype, device=device, scale=3.0, requires_grad=True)
    beta = (1 + F.elu(randn(B, T, H, device=device))).to(dtype).requires_grad_(True)
    return h, beta


def _check(B, T, H, dtype, bound):
    h, beta = _gate_inputs(B, T, H, dtype)
    du = randn(B, T, H, device=DEV, dtype=torch.float32)
    u = regattn.gatedfwa_gate(h, beta, backend="triton")
    dh, dbeta = torch.autograd.grad(u, [h, beta], du)
    hd, bd = (x.detach().double().requires_grad_(True) for x in (h, beta))
    ud = reference.gatedfwa_gate(hd, bd)
    rh, rb = torch.autograd.grad(ud, [hd, bd], du.double())
    assert u.dtype == torch.float32 and u.shape == (B, T, H)
    assert rel_err(u, ud) < bound
    assert rel_err(dh, rh) < bound
    assert rel_err(dbeta, rb) < bound


def test_gate_matches_reference(interpret):
    _check(2, 37, 3, torch.float32, 1e-5)   # several chunks, T not a multiple of the chunk
    _check(1, 1, 20, torch.float32, 1e-5)   # one token, head block larger than one chunk


@pytest.mark.parametrize("B,T,H", [(3, 53, 1), (2, 45, 3), (2, 40, 64)])
def test_gate_many_chunks_and_head_blocks(B, T, H, interpret):
    """T not a multiple of the chunk, one head, heads not a power of two, several blocks of heads, B > 1."""
    _check(B, T, H, torch.float32, 1e-5)


@triton.jit
def _offset_probe(STATE, TOTAL, OUT, c, n_chunks, NH, REVERSE: tl.constexpr, BLOCK_H: tl.constexpr,
                  LOOK: tl.constexpr):
    offs_h = tl.arange(0, BLOCK_H)
    total = tl.load(TOTAL + offs_h, mask=offs_h < NH, other=0.0)
    offset = _chunk_offset(STATE, total, 0, c, n_chunks, NH, offs_h, REVERSE, LOOK)
    tl.store(OUT + offs_h, offset, mask=offs_h < NH)


def _packed(values, flags):
    """Published look-back state: the flag in the high 32 bits, the fp32 bits of the sum in the low 32."""
    return (values.float().view(torch.int32).to(torch.int64) & 0xFFFFFFFF) | (flags.to(torch.int64) << 32)


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("look", [1, 4])
def test_chunk_offset_walks_back_over_aggregates(reverse, look, interpret):
    """The look-back as it runs on a GPU, where earlier chunks may have published only their own sums:
    it adds aggregates up to the nearest inclusive sum and reads nothing beyond it; then publishes this
    chunk's inclusive sum."""
    n_chunks, NH, c = 12, 3, 10
    sums = randn(n_chunks, NH, dtype=torch.float32)
    flags = torch.full((n_chunks, 1), AGGREGATE.value).expand(n_chunks, NH).clone()
    flags[0] = INCLUSIVE.value
    near = [c - 1 - i for i in range(c)]  # chunks before c, nearest first
    if reverse:  # chunk c of the reverse scan sits at n_chunks - 1 - c of the forward one
        sums, flags, c = sums.flip(0), flags.flip(0), n_chunks - 1 - c
        near = [n_chunks - 1 - i for i in near]
    for inclusive_at in (len(near) - 1, 5, 0):  # the first chunk, one in the middle, the neighbour
        f = flags.clone()
        f[near[inclusive_at]] = INCLUSIVE.value
        values = sums.clone()
        values[near[inclusive_at]] = 100.0 + sums[near[inclusive_at]]  # an inclusive sum ends the walk
        for far in near[inclusive_at + 1:]:
            values[far] = float("nan")  # beyond it: never added
        state = torch.cat([torch.zeros(1, dtype=torch.int64), _packed(values, f).flatten()]).to(DEV)
        total = randn(NH, dtype=torch.float32).to(DEV)
        out = torch.empty(NH, device=DEV)
        _offset_probe[(1,)](state, total, out, c, n_chunks, NH, reverse, BLOCK_H=4, LOOK=look)
        expected = values[near[: inclusive_at + 1]].sum(0)
        assert torch.allclose(out.cpu(), expected, atol=1e-5)
        published = state[1:].view(n_chunks, NH)[c].cpu()
        assert (published >> 32 == INCLUSIVE.value).all()
        assert torch.allclose((published & 0xFFFFFFFF).to(torch.int32).view(torch.float32), expected + total.cpu(),
                              atol=1e-5)


def test_gate_low_precision_inputs_accumulate_in_fp32(interpret):
    _check(1, 70, 4, torch.float16, 1e-3)


def _check_chunked(B, T, H, blocks):
    """The scan, forward and backward, with the tile ``blocks``: the same numbers as the reference."""
    h, beta = (x.detach() for x in _gate_inputs(B, T, H, torch.float32))
    du = randn(B, T, H, device=DEV, dtype=torch.float32)
    u = gate_forward(h, beta, 1e-6, blocks=blocks)
    dh, dbeta = gate_backward(du, h, beta, 1e-6, blocks=blocks)
    hd, bd = (x.double().requires_grad_(True) for x in (h, beta))
    ud = reference.gatedfwa_gate(hd, bd)
    rh, rb = torch.autograd.grad(ud, [hd, bd], du.double())
    assert rel_err(u, ud) < 1e-5 and rel_err(dh, rh) < 1e-5 and rel_err(dbeta, rb) < 1e-5


def test_gate_chunked_gpu_sized_chunks(interpret):
    """The scan at the tiles it takes on a GPU (64 heads of 32 rows; 2048 rows of one head) over several
    chunks."""
    for (B, T, H), blocks in (((2, 77, 64), (32, 64, 4)), ((1, 4500, 1), (2048, 1, 4))):
        _check_chunked(B, T, H, blocks)


@pytest.mark.parametrize("B,T,H,blocks", [(1, 1100, 40, (512, 16, 16)), (2, 700, 20, (256, 16, 8)),
                                          (1, 600, 40, (256, 8, 8))])
def test_gate_chunked_tiles_of_more_warps(B, T, H, blocks, interpret):
    """Tiles of the scan's sweep other than the default, num_warps included, over several chunks and blocks
    of heads (the last one masked but for 8 heads a block): 8192 elements at 16 warps, 4096 at 8, 2048 at 8
    with 8 heads a block."""
    _check_chunked(B, T, H, blocks)


def test_gate_backward_in_one_long_tile(interpret):
    """A GPU-sized time tile (1024 rows): the reverse sums near the tile's end stay accurate where the
    whole tile's sum of du is large against them (``total - prefix`` would cancel there)."""
    T = 1000
    h, beta = (x.detach().float() for x in _gate_inputs(1, T, 4, torch.float32, device="cpu"))
    du = randn(1, T, 4, dtype=torch.float32)
    du[:, : T // 2] += 100.0  # early rows dominate the tile's sum; late rows carry small reverse sums
    dh, dbeta = gate_backward(du.to(DEV), h.to(DEV), beta.to(DEV), 1e-6, blocks=(1024, 4, 4))
    hd, bd = (x.double().requires_grad_(True) for x in (h, beta))
    rh, rb = torch.autograd.grad(reference.gatedfwa_gate(hd, bd), [hd, bd], du.double())
    tail = slice(T - 64, T)
    assert rel_err(dh.cpu()[:, tail], rh[:, tail]) < 1e-5
    assert rel_err(dbeta.cpu()[:, tail], rb[:, tail]) < 1e-5


def test_gate_strided_inputs(interpret):
    x = randn(1, 40, 6, device=DEV, dtype=torch.float32)
    h, beta = x[..., :3], 1 + F.elu(x[..., 3:])
    u = regattn.gatedfwa_gate(h, beta, backend="triton")
    assert rel_err(u, reference.gatedfwa_gate(h.double(), beta.double())) < 1e-5


def test_gate_strong_gates_stay_finite(interpret):
    h = torch.full((1, 50, 2), 1e4, device=DEV)
    beta = torch.ones_like(h)
    u = regattn.gatedfwa_gate(h, beta, backend="triton")
    assert torch.isfinite(u).all()
    assert rel_err(u, reference.gatedfwa_gate(h.double(), beta.double())) < 1e-6


def test_gate_bad_input():
    h = randn(1, 5, 2, dtype=torch.float32)
    with pytest.raises(ValueError, match="beta"):
        regattn.gatedfwa_gate(h, -torch.ones_like(h))
    with pytest.raises(ValueError, match="beta"):
        regattn.gatedfwa_gate(h, torch.ones(1, 5, 3))


def test_gate_feeds_attention_end_to_end(interpret):
    """gate kernel -> attention kernel: gradients of q, k, v, h and beta match the reference chain, within 10x the
    error of the same chain in fp32 torch. dbeta is compared times beta^2: it carries d alpha / d beta ~ 1 / beta^2,
    which amplifies the rounding of the kernels' gate gradient that the torch chain cancels (the notes of
    regattn/ops/softmax/kernels.py). Compared as it is, a draw with beta at 0.03 left the kernels' dbeta 2.7e-5 from
    float64 and the torch chain's 4.1e-7; times beta^2, 1.4e-6 and 4.6e-7 (over 720 other draws, at most 0.32 of the
    bound)."""
    B, T, HQ, H, D = 1, 36, 2, 1, 16
    q, k, v = (randn(B, T, n, D, device=DEV, dtype=torch.float32, requires_grad=True) for n in (HQ, H, H))
    h, beta = _gate_inputs(B, T, HQ, torch.float32)
    do = randn(B, T, HQ, D, device=DEV, dtype=torch.float32)

    def chain(q, k, v, h, beta, backend):
        u = regattn.gatedfwa_gate(h, beta, backend=backend) * 0.1
        return regattn.gatedfwa(q, k, v, u, window=11, backend=backend)

    leaves = [q, k, v, h, beta]
    got = torch.autograd.grad(chain(*leaves, "triton"), leaves, do)
    same = torch.autograd.grad(chain(*leaves, "torch"), leaves, do)
    exact_leaves = [x.detach().double().requires_grad_(True) for x in leaves]
    exact = torch.autograd.grad(chain(*exact_leaves, "torch"), exact_leaves, do.double())
    weights = [1.0] * 4 + [beta.detach().double() ** 2]
    for a, c, b, w in zip(got, same, exact, weights):
        assert rel_err(a * w, b * w) < 10 * rel_err(c * w, b * w) + 1e-6


@pytest.mark.gpu
def test_gate_full_size_gpu():
    _check(2, 65536, 64, torch.float32, 1e-4)  # a 65536-long fp32 sum: rounding grows with T
    _check(1, 4097, 128, torch.bfloat16, 1e-2)  # dh, dbeta come back in bf16
