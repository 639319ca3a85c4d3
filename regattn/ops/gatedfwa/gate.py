"""GatedFWA gate preprocessing kernels: ``u = -cumsum(softplus(beta * h) / (beta + eps))`` over time.

* forward: one program per (batch, time chunk, block of heads), many programs in flight, each tile
  read with the head axis contiguous; a chunk's offset comes from the earlier chunks' published sums
  (a decoupled look-back), so h and beta are read once and u written once, in one launch. Which earlier
  sums a chunk adds (its neighbours' own or their inclusive ones) depends on timing, so on a GPU u may
  differ between runs in the last bits.
* backward: ``dalpha_s = -sum_{t >= s} du_t`` turned into ``dh`` and ``dbeta``, by the same look-back over
  the chunks in reverse order.

gatedfwa.md's Algorithm 1 (one program streaming time for a few heads) and Appendix E.1's
scan-then-propagate (tile sums, their scan, a second pass) were kernels here too; timed inside CUDA graphs
on an H100 they took several times this scan's time, forward and backward, at every size measured (T 8192
and 65536, 16 to 128 heads), so they are gone.

``h, beta, u: [B, T, H]``, any strides; alpha and u are computed in fp32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from regattn.ops._common.attention_tiles import interpreting
from regattn.ops._common.ints import ceil_div, next_pow2
from regattn.ops._common.launch import launch
from regattn.ops._common.vmap import fold_rule

@triton.jit
def _softplus(z):
    """``nu + log(exp(z - nu) + exp(-nu))``, ``nu = max(z, 0)``: ``max(z, 0) + log1p(exp(-|z|))``.

    ``log1p(x)`` is its series ``x - x^2/2 + x^3/3 - x^4/4`` for ``x < 0.01`` (``log(1 + x)`` in fp32
    would lose ``eps / x`` of relative precision there), so very negative ``z`` keeps its small value.
    """
    x = tl.exp(-tl.abs(z))
    series = x * (1.0 - x * (0.5 - x * (0.3333333333333333 - 0.25 * x)))
    return tl.maximum(z, 0.0) + tl.where(x < 0.01, series, tl.log(1.0 + x))


@triton.jit
def _tile(H_ptr, BETA, b, t0, offs_h, T, NH, shb, sht, shh, sbb, sbt, sbh, BLOCK_T: tl.constexpr):
    """Load the ``[BLOCK_T, BLOCK_H]`` tile at time ``t0``; returns ``(h, beta, mask)`` in fp32."""
    offs_t = t0 + tl.arange(0, BLOCK_T)
    mask = (offs_t < T)[:, None] & (offs_h < NH)[None, :]
    h = tl.load(H_ptr + b * shb + offs_t[:, None] * sht + offs_h[None, :] * shh, mask=mask, other=0.0)
    beta = tl.load(BETA + b * sbb + offs_t[:, None] * sbt + offs_h[None, :] * sbh, mask=mask, other=1.0)
    return h.to(tl.float32), beta.to(tl.float32), mask


@triton.jit
def _alpha(h, beta, mask, eps):
    eps = tl.cast(eps, tl.float32)  # fp64 when torch.compile launches the kernel: keep the arithmetic fp32
    return tl.where(mask, _softplus(beta * h) / (beta + eps), 0.0)


@triton.jit
def _store_u(U, b, t0, offs_h, T, NH, sub, sut, suh, u, BLOCK_T: tl.constexpr):
    offs_t = t0 + tl.arange(0, BLOCK_T)
    mask = (offs_t < T)[:, None] & (offs_h < NH)[None, :]
    tl.store(U + b * sub + offs_t[:, None] * sut + offs_h[None, :] * suh, u, mask=mask)


# Look-back state of a chunk, one int64 per (batch, chunk, head): the flag in the high 32 bits, the fp32 bits
# of the sum in the low 32. AGGREGATE: the chunk's own sum; INCLUSIVE: the sum of it and every earlier chunk.
AGGREGATE = tl.constexpr(1)
INCLUSIVE = tl.constexpr(2)
LOOK_BACK = 8  # chunks read a step of the look-back at least: 4 KiB at 64 heads (16 or 32 spill at 4 heads, sm_90)


def look_back_width(block_h: int, num_warps: int) -> int:
    """Chunks a step of the look-back reads: :data:`LOOK_BACK`, or more so that the ``[LOOK, BLOCK_H]`` tile of
    published words has one for every thread. Each word is then read by one thread: two threads reading the
    same word while it is being published may see it before and after, and the reductions that decide the
    step would mix the two (on an H100, tiles with more threads than words gave sums off by up to 50%)."""
    return max(LOOK_BACK, 32 * num_warps // block_h)


@triton.jit
def _claim_chunk(STATE, n_chunks, n_head_blocks, REVERSE: tl.constexpr):
    """``(b, c, head block)`` of this program in the order programs start, from a ticket (``STATE[0]``): a
    program waits only on chunks whose programs started before it, so the look-back cannot deadlock."""
    v = tl.atomic_add(STATE, 1).to(tl.int32)
    programs_per_chunk = tl.num_programs(0) // n_chunks
    k = v // programs_per_chunk
    r = v % programs_per_chunk
    c = n_chunks - 1 - k if REVERSE else k
    return r // n_head_blocks, c, r % n_head_blocks


@triton.jit
def _publish(ptrs, value, flag, mask):
    bits = value.to(tl.uint32, bitcast=True).to(tl.int64)
    tl.atomic_xchg(ptrs, bits | (flag.to(tl.int64) << 32), mask=mask, sem="relaxed")


@triton.jit
def _chunk_offset(STATE, total, b, c, n_chunks, NH, offs_h, REVERSE: tl.constexpr, LOOK: tl.constexpr):
    """Exclusive sum of ``total`` over the chunks before ``c`` (after ``c`` if ``REVERSE``), per head.

    Publishes this chunk's own sum, then reads the published sums of the ``LOOK`` nearest chunks not yet
    added at a time: those up to the nearest inclusive one are added and the walk ends; else the
    aggregates up to the nearest chunk not yet published are added and the walk goes on from there (a
    chunk counts as published once every head of it carries the same flag). Last, publishes this chunk's
    inclusive sum."""
    hmask = offs_h < NH
    row = STATE + 1 + b * n_chunks * NH + offs_h
    step = -1 if REVERSE else 1
    first = c == (n_chunks - 1 if REVERSE else 0)
    _publish(row + c * NH, total, tl.where(first, INCLUSIVE, AGGREGATE), hmask)
    offset = tl.zeros_like(total)
    near = tl.arange(0, LOOK)  # 0: the nearest chunk not yet added
    j = c - step
    while (j >= 0) & (j < n_chunks):
        chunk = j - step * near
        read = ((chunk >= 0) & (chunk < n_chunks))[:, None] & hmask[None, :]
        s = tl.load(row[None, :] + chunk[:, None] * NH, mask=read, other=0, volatile=True)
        flag = (s >> 32).to(tl.int32)
        lo = tl.min(tl.where(read, flag, INCLUSIVE), 1)  # over the heads of this block only
        ready = (lo > 0) & (lo == tl.max(tl.where(read, flag, 0), 1))  # rows past the first chunk: never
        first_waiting = tl.min(tl.where(ready, LOOK, near), 0)
        first_inclusive = tl.min(tl.where(ready & (lo == INCLUSIVE), near, LOOK), 0)
        done = first_inclusive < first_waiting
        take = tl.where(done, near <= first_inclusive, near < first_waiting)[:, None] & read
        offset += tl.sum(tl.where(take, s.to(tl.int32).to(tl.float32, bitcast=True), 0.0), 0)
        j = tl.where(done, -1, j - step * first_waiting)
    _publish(row + c * NH, offset + total, tl.full([], INCLUSIVE, tl.int32), hmask)
    return offset


@triton.jit
def _gate_chunked_kernel(H_ptr, BETA, U, STATE, T, NH, n_chunks, n_head_blocks, eps, shb, sht, shh, sbb, sbt, sbh,
                         sub, sut, suh, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, LOOK: tl.constexpr):
    b, c, hb = _claim_chunk(STATE, n_chunks, n_head_blocks, False)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h, beta, mask = _tile(H_ptr, BETA, b, c * BLOCK_T, offs_h, T, NH, shb, sht, shh, sbb, sbt, sbh, BLOCK_T)
    neg = -_alpha(h, beta, mask, eps)
    offset = _chunk_offset(STATE, tl.sum(neg, 0), b, c, n_chunks, NH, offs_h, False, LOOK)
    _store_u(U, b, c * BLOCK_T, offs_h, T, NH, sub, sut, suh, tl.cumsum(neg, 0) + offset[None, :], BLOCK_T)


@triton.jit
def _gate_grads(dalpha, h, beta, eps):
    """``(dh, dbeta)`` of ``alpha = softplus(beta * h) / (beta + eps)`` given ``dalpha``."""
    eps = tl.cast(eps, tl.float32)  # fp64 when torch.compile launches the kernel: keep the arithmetic fp32
    z = beta * h
    inv = 1.0 / (beta + eps)
    sig = tl.sigmoid(z)
    return dalpha * sig * beta * inv, dalpha * (sig * h * inv - _softplus(z) * inv * inv)


@triton.jit
def _gate_chunked_bwd_kernel(H_ptr, BETA, DU, DH, DBETA, STATE, T, NH, n_chunks, n_head_blocks, eps,
                             shb, sht, shh, sbb, sbt, sbh, sdb, sdt, sdh, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
                             LOOK: tl.constexpr):
    b, c, hb = _claim_chunk(STATE, n_chunks, n_head_blocks, True)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    t0 = c * BLOCK_T
    h, beta, mask = _tile(H_ptr, BETA, b, t0, offs_h, T, NH, shb, sht, shh, sbb, sbt, sbh, BLOCK_T)
    grad = (t0 + tl.arange(0, BLOCK_T))[:, None] * sdt + offs_h[None, :] * sdh + b * sdb
    du = tl.load(DU + grad, mask=mask, other=0.0).to(tl.float32)
    later = _chunk_offset(STATE, tl.sum(du, 0), b, c, n_chunks, NH, offs_h, True, LOOK)
    dh, dbeta = _gate_grads(-(tl.cumsum(du, 0, reverse=True) + later[None, :]), h, beta, eps)
    tl.store(DH + grad, dh.to(DH.dtype.element_ty), mask=mask)
    tl.store(DBETA + grad, dbeta.to(DBETA.dtype.element_ty), mask=mask)


# The chunked scan's tile by pass and size: (elements of a tile, most heads of a block, num_warps). On an H100
# (``time_chunked_tiles``, fp32, T 8192 and 65536 at 16, 64 and 128 heads, 17 tiles timed in CUDA graphs) these
# took at most 1.07x (forward) and 1.17x (backward) the time of the best tile at each shape; the former single
# tile of up to 64 heads and 2048 elements (512 under 2**20 elements) took up to 5.0x.
CHUNK_TILES_SMALL = {"fwd": (2048, 8, 8), "bwd": (1024, 8, 4)}
CHUNK_TILES_LARGE = {"fwd": (2048, 16, 4), "bwd": (4096, 16, 8)}  # from 2**22 elements


def chunked_blocks(num_heads: int, numel: int, backward: bool = False) -> tuple[int, int, int]:
    """``(BLOCK_T, BLOCK_H, num_warps)`` of the chunked scan's forward or backward pass (see
    :data:`CHUNK_TILES_SMALL`)."""
    if interpreting():
        return 16, min(16, next_pow2(num_heads)), 4
    elements, heads, num_warps = (CHUNK_TILES_LARGE if numel >= 1 << 22 else CHUNK_TILES_SMALL)[
        "bwd" if backward else "fwd"]
    block_h = min(heads, next_pow2(num_heads))
    return elements // block_h, block_h, num_warps


def _chunked_launch(h, blocks, backward=False):
    """``(grid, state, n_chunks, n_head_blocks, tiles)`` for the tile ``blocks`` (``(BLOCK_T, BLOCK_H,
    num_warps)``, default :func:`chunked_blocks`): the state starts zeroed (no chunk published, ticket 0)."""
    B, T, NH = h.shape
    BT, BH, num_warps = blocks or chunked_blocks(NH, h.numel(), backward)
    n_chunks, n_head_blocks = ceil_div(T, BT), ceil_div(NH, BH)
    state = torch.zeros(1 + B * n_chunks * NH, device=h.device, dtype=torch.int64)
    tiles = dict(BLOCK_T=BT, BLOCK_H=BH, LOOK=look_back_width(BH, num_warps), num_warps=num_warps)
    return (B * n_chunks * n_head_blocks,), state, n_chunks, n_head_blocks, tiles


def _strides(x):
    return x.stride(0), x.stride(1), x.stride(2)


def gate_forward(h, beta, eps, blocks=None):
    """``u: [B, T, H]`` fp32 from ``h, beta: [B, T, H]``; ``blocks``: the tile (see :func:`_chunked_launch`)."""
    B, T, NH = h.shape
    u = torch.empty(B, T, NH, device=h.device, dtype=torch.float32)
    grid, state, n_chunks, n_head_blocks, tiles = _chunked_launch(h, blocks)
    launch(_gate_chunked_kernel, grid, h, beta, u, state, T, NH, n_chunks, n_head_blocks, eps, *_strides(h),
           *_strides(beta), *_strides(u), **tiles)
    return u


def gate_backward(du, h, beta, eps, blocks=None):
    """``(dh, dbeta)`` in the dtypes of ``h`` and ``beta``; ``blocks`` as for :func:`gate_forward`."""
    B, T, NH = h.shape
    du = du.contiguous()
    dh = torch.empty(B, T, NH, device=h.device, dtype=h.dtype)
    dbeta = torch.empty(B, T, NH, device=h.device, dtype=beta.dtype)
    grid, state, n_chunks, n_head_blocks, tiles = _chunked_launch(h, blocks, backward=True)
    launch(_gate_chunked_bwd_kernel, grid, h, beta, du, dh, dbeta, state, T, NH, n_chunks, n_head_blocks, eps,
           *_strides(h), *_strides(beta), *_strides(du), **tiles)
    return dh, dbeta


class GateScanFunction(torch.autograd.Function):
    @staticmethod
    def forward(h, beta, eps):
        return gate_forward(h, beta, eps)

    @staticmethod
    def setup_context(ctx, inputs, output):
        h, beta, ctx.eps = inputs
        ctx.save_for_backward(h, beta)

    @staticmethod
    def backward(ctx, du):
        h, beta = ctx.saved_tensors
        dh, dbeta = gate_backward(du, h, beta, ctx.eps)
        return dh, dbeta, None

    vmap = staticmethod(fold_rule(lambda *args: GateScanFunction.apply(*args), batched=(0, 1), outputs=(0,)))


def gate_scan(h, beta, *, eps):
    """Fused gate preprocessing with autograd; ``h, beta: [B, T, H]`` -> ``u: [B, T, H]`` fp32."""
    return GateScanFunction.apply(h, beta, eps)
