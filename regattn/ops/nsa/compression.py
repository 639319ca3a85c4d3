"""NSA's compression branch and block selection on the GPU kernels (gatedfwa.md Appendix B, eq. 16-19).

* :func:`compressed_attention`: query ``t`` attends the compressed blocks ``i`` that end at or before it,
  ``i <= (t - block_cmp + 1) // stride_cmp``. The queries sharing ``r = (t - block_cmp + 1) % stride_cmp``
  see one more block at each step of ``stride_cmp`` positions, so they form a causal sequence over the
  blocks: the queries are relaid as ``[B, T / stride_cmp, HQ * stride_cmp, D]`` (query head ``hq`` and
  phase ``r`` as head ``hq * stride_cmp + r``) and attend the blocks with the FlashAttention kernels of
  :mod:`regattn.ops.softmax` (``causal=True``), forward and backward. Queries past the last block see every
  block (a non-causal call); those before the first see none (zero).
* :func:`selected_blocks`: each query's ``topk`` selection blocks from the compression probabilities,
  ``exp2(s2 - lse2)`` recomputed with the compression's log-sum-exp by :func:`importance_kernel` and summed
  over the compressed blocks that overlap each selection block and over the group's query heads, then
  ranked by :func:`regattn.reference.nsa.select_blocks`, chunk by chunk of queries.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from regattn.ops._common.attention_tiles import LOG2E, dot_precision, head_block, interpreting
from regattn.ops._common.ints import ceil_div, next_pow2
from regattn.ops.softmax.function import attention_fwd_op
from regattn.reference.nsa import select_blocks

IMPORTANCE_ELEMENTS = 2 ** 22  # the importance of one chunk of queries, [B, H, chunk, n_slc], in fp32: 16 MiB
BLOCK_J = 64                   # compressed blocks an importance step reads
IMPORTANCE_ROWS = 64           # queries of an importance program (16 in the interpreter)
IMPORTANCE_WARPS = 8


def compressed_attention(q, kc, vc, *, offset: int, block_cmp: int, stride_cmp: int, scale: float):
    """``(o [B, T, HQ, Dv] in q's dtype, lse2 [B, T, HQ] fp32)``: the compression attention of the queries at
    positions ``offset ..``, differentiable in ``q, kc, vc``; ``lse2`` (base 2) is ``-inf`` where a query sees
    no block."""
    B, T, HQ, _ = q.shape
    n = kc.shape[1]
    first = T if n == 0 else min(max(block_cmp - 1 - offset, 0), T)  # queries before this index see no block
    every = min(max(block_cmp - 1 + stride_cmp * n - offset, first), T)  # from this index on, every block
    o = [_unseen_rows(q[:, :first], kc, vc)]
    lse = [q.new_full((B, first, HQ), float("-inf"), dtype=torch.float32)]
    if every > first:
        part = _causal_part(q[:, first:every], kc, vc, offset + first, block_cmp=block_cmp, stride_cmp=stride_cmp,
                            scale=scale)
        o.append(part[0])
        lse.append(part[1])
    if T > every:
        part = attention_fwd_op(q[:, every:], kc, vc, None, False, 0, scale, None, 0)
        o.append(part[0])
        lse.append(part[1])
    return torch.cat(o, 1), torch.cat(lse, 1)


def _unseen_rows(q, kc, vc):
    """Zeros ``[B, T, HQ, Dv]`` for queries that see no block, in the autograd graph of ``q, kc, vc`` as the
    spec's output is (their gradients there are zeros, never NaN, even where an input is not finite)."""
    linked = q[..., :1] + kc[..., :1].sum() + vc[..., :1].sum()
    hidden = torch.zeros((), dtype=torch.bool, device=q.device)
    return torch.where(hidden, linked, 0.0).expand(*q.shape[:3], vc.shape[3])


def _causal_part(q, kc, vc, start: int, *, block_cmp: int, stride_cmp: int, scale: float):
    """:func:`compressed_attention` of queries at positions ``start ..`` that see at least one block and not
    every block, through the relaid causal call (the module text)."""
    B, T, HQ, D = q.shape
    H = kc.shape[2]
    lo = (start - block_cmp + 1) // stride_cmp                   # the blocks the first and last query see last
    hi = (start + T - block_cmp) // stride_cmp
    before = start - (block_cmp - 1 + stride_cmp * lo)           # padding rows before the first query
    rows = hi - lo + 1
    after = rows * stride_cmp - before - T
    qr = F.pad(q, (0, 0, 0, 0, before, after)).view(B, rows, stride_cmp, HQ, D).transpose(2, 3)
    keys, values = (x[:, :hi + 1].repeat_interleave(HQ // H, 2) for x in (kc, vc))  # a key head per query head
    o, lse = attention_fwd_op(qr.reshape(B, rows, HQ * stride_cmp, D), keys, values, None, True, 0, scale, None, 0)

    def unrelay(x):  # [B, rows, HQ * stride_cmp, ...] -> [B, T, HQ, ...]
        x = x.view(B, rows, HQ, stride_cmp, *x.shape[3:]).transpose(2, 3)
        return x.reshape(B, rows * stride_cmp, HQ, *x.shape[4:])[:, before:before + T]
    return unrelay(o), unrelay(lse)


def selection_step(block_cmp: int, stride_cmp: int, block_slc: int) -> int:
    """Selection blocks an importance step covers: as many as the compressed blocks overlapping them fit in
    :data:`BLOCK_J` (at most ``(s block_slc + block_cmp - 2) // stride_cmp + 2`` for ``s`` blocks), at most 64."""
    step = 64
    while step > 1 and (step * block_slc + block_cmp - 2) // stride_cmp + 2 > BLOCK_J:
        step -= 1
    return step


@triton.jit
def importance_kernel(Q, KC, LSE, IMP, stride_qb, stride_qt, stride_qh, stride_kb, stride_kn, stride_kh,
                      stride_lb, stride_lt, stride_lh, stride_ib, stride_ih, stride_it,
                      C, n, H, D, offset, n_slc, block_cmp, stride_cmp, block_slc, step, qk_scale2,
                      GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_S: tl.constexpr,
                      BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    """``IMP[b, h, t, s]`` (fp32) for the ``BLOCK_M`` queries of one program and every selection block ``s``
    some of them have started: the compression probabilities of the group's query heads, summed over the
    compressed blocks that overlap ``s``. ``LSE`` holds the compression's base-2 log-sum-exp per query head."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    b = tl.program_id(1) // H
    h = tl.program_id(1) % H
    real = rows < C
    pos = offset + rows
    d = tl.arange(0, BLOCK_D)
    jj = tl.arange(0, BLOCK_J)
    ss = tl.arange(0, BLOCK_S)
    last = offset + tl.minimum(tl.program_id(0) * BLOCK_M + BLOCK_M, C) - 1
    s_end = tl.minimum(last // block_slc + 1, n_slc)
    for s0 in range(0, s_end, step):
        j0 = tl.maximum(s0 * block_slc + stride_cmp - block_cmp, 0) // stride_cmp  # first block overlapping s0
        j = j0 + jj
        kc = tl.load(KC + b * stride_kb + j[:, None] * stride_kn + h * stride_kh + d[None, :],
                     mask=(j < n)[:, None] & (d < D)[None, :], other=0.0)
        seen = real[:, None] & (j < n)[None, :] & ((j * stride_cmp + block_cmp - 1)[None, :] <= pos[:, None])
        p = tl.zeros([BLOCK_M, BLOCK_J], dtype=tl.float32)
        for g in range(GROUP):  # not unrolled: each unrolled head would keep its own query tile in shared memory
            head = h * GROUP + g
            q = tl.load(Q + b * stride_qb + rows[:, None] * stride_qt + head * stride_qh + d[None, :],
                        mask=real[:, None] & (d < D)[None, :], other=0.0)
            lse2 = tl.load(LSE + b * stride_lb + rows * stride_lt + head * stride_lh, mask=real, other=0.0)
            s2 = tl.dot(q, tl.trans(kc), input_precision=PRECISION) * qk_scale2
            p += tl.where(seen, tl.exp2(s2 - lse2[:, None]), 0.0)
        s = s0 + ss
        overlap = ((j * stride_cmp)[:, None] < ((s + 1) * block_slc)[None, :]) \
            & ((j * stride_cmp + block_cmp)[:, None] > (s * block_slc)[None, :]) & (ss < step)[None, :]
        imp = tl.dot(p, overlap.to(tl.float32), input_precision="ieee")
        tl.store(IMP + b * stride_ib + h * stride_ih + rows[:, None] * stride_it + s[None, :], imp,
                 mask=real[:, None] & ((ss < step) & (s < n_slc))[None, :])


def importance_from_lse(q, kc, lse2, n_slc: int, *, offset: int, block_cmp: int, stride_cmp: int, block_slc: int,
                     scale: float) -> torch.Tensor:
    """``[B, H, C, n_slc]`` fp32: :func:`importance_kernel` for the queries ``q: [B, C, HQ, D]`` at positions
    ``offset ..`` (zero at the blocks no query of a tile has started)."""
    B, C, HQ, D = q.shape
    n, H = kc.shape[1], kc.shape[2]
    imp = torch.zeros(B, H, C, n_slc, device=q.device, dtype=torch.float32)
    if C == 0 or n == 0 or n_slc == 0:
        return imp
    step = selection_step(block_cmp, stride_cmp, block_slc)
    block_m = 16 if interpreting() else IMPORTANCE_ROWS
    launch = {} if interpreting() else dict(num_warps=IMPORTANCE_WARPS, num_stages=2)
    importance_kernel[(ceil_div(C, block_m), B * H)](
        q, kc, lse2, imp, *q.stride()[:3], *kc.stride()[:3], *lse2.stride()[:3], imp.stride(0), imp.stride(1),
        imp.stride(2), C, n, H, D, offset, n_slc, block_cmp, stride_cmp, block_slc, step, scale * LOG2E,
        GROUP=HQ // H, BLOCK_M=block_m, BLOCK_J=BLOCK_J, BLOCK_S=max(16, next_pow2(step)), BLOCK_D=head_block(D),
        PRECISION=dot_precision(q.dtype), **launch)
    return imp


def selection_chunk(B: int, H: int, n_slc: int) -> int:
    """Queries per chunk of :func:`selected_blocks`: as many as keep a chunk's importance ``[B, H, chunk, n_slc]``
    within :data:`IMPORTANCE_ELEMENTS`, a multiple of 128 (at least 128)."""
    return max(128, IMPORTANCE_ELEMENTS // max(B * H * n_slc, 1) // 128 * 128)


def selected_blocks(q, kc, lse2, S: int, *, offset: int, block_cmp: int, stride_cmp: int, block_slc: int, topk: int,
                    scale: float, chunk: int | None = None) -> torch.Tensor:
    """``[B, H, T, k]`` int32 (``k = min(topk, n_slc)``): the selection blocks of the queries ``q`` at positions
    ``offset ..`` over ``S`` keys, ``-1`` where fewer than ``k`` blocks have started; ``lse2`` is
    :func:`compressed_attention`'s. Not differentiated."""
    B, T, HQ, _ = q.shape
    H = kc.shape[2]
    n_slc = ceil_div(S, block_slc)
    chunk = chunk or selection_chunk(B, H, n_slc)
    q, kc, lse2 = q.detach(), kc.detach().contiguous(), lse2.detach()
    parts = []
    for lo in range(0, T, chunk):
        imp = importance_from_lse(q[:, lo:lo + chunk], kc, lse2[:, lo:lo + chunk], n_slc, offset=offset + lo,
                               block_cmp=block_cmp, stride_cmp=stride_cmp, block_slc=block_slc, scale=scale)
        t = torch.arange(offset + lo, offset + lo + imp.shape[2], device=q.device)
        blocks, chosen = select_blocks(imp, t, block_slc=block_slc, topk=topk)
        parts.append(torch.where(chosen, blocks, -1).to(torch.int32))
    if not parts:
        return torch.empty(B, H, 0, min(topk, n_slc), device=q.device, dtype=torch.int32)
    return torch.cat(parts, 2)
