"""NSA's compression branch and block selection on the GPU kernels (gatedfwa.md Appendix B, eq. 16-19).

* :func:`compressed_attention`: query ``t`` attends the compressed blocks ``i`` that end at or before it,
  ``i <= (t - block_cmp + 1) // stride_cmp``. The queries sharing ``r = (t - block_cmp + 1) % stride_cmp``
  see one more block at each step of ``stride_cmp`` positions, so they form a causal sequence over the
  blocks: the queries are relaid as ``[B, T / stride_cmp, HQ * stride_cmp, D]`` (query head ``hq`` and
  phase ``r`` as head ``hq * stride_cmp + r``) and attend the blocks with the FlashAttention kernels of
  :mod:`regattn.ops.softmax` (``causal=True``), forward and backward. Queries past the last block see every
  block (a non-causal call); those before the first see none (zero).
* :func:`selected_blocks`: each query's ``topk`` selection blocks in one kernel, :func:`selection_kernel`. It
  recomputes the compression probabilities ``exp2(s2 - lse2)`` from the compression's log-sum-exp, sums them
  over the compressed blocks that overlap each selection block and over the group's query heads, and keeps a
  running top-k per query in registers: no ``[T, T / block_slc]`` importance is written or sorted.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from regattn.ops._common.attention_tiles import LOG2E, dot_precision, head_block, interpreting
from regattn.ops._common.ints import ceil_div, next_pow2
from regattn.ops.softmax.function import attention_fwd_op

# Selection launch settings. H100, bf16, B1 HQ16 H4 D128, NSA's blocks: 64 queries, 64 compressed blocks a step and
# 8 warps took 2.8 ms at T = 32768 and 41 ms at 131072, against 3.8 / 55 ms for 32 queries, 32 blocks, 4 warps and
# 5.1 / 76 ms for 64, 32, 8. Under triton 3.6 they spill 104 bytes a thread (196 registers and no spill under 3.9),
# the other two none.
BLOCK_J = 64         # compressed blocks a selection step reads
SELECTION_ROWS = 64  # queries of a selection program (16 in the interpreter)
SELECTION_WARPS = 8
NONE = tl.constexpr(2 ** 30)  # the index of an empty entry of the running top-k


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


def selection_tiles(block_cmp: int, stride_cmp: int, block_slc: int) -> tuple[int, int]:
    """``(compressed blocks a selection step reads, selection blocks it covers)``: :data:`BLOCK_J` (more where
    one selection block overlaps more compressed blocks), and as many selection blocks, at most 64, as the
    compressed blocks overlapping them fit in (at most ``(s block_slc + block_cmp - 2) // stride_cmp + 2``
    for ``s`` blocks)."""
    def span(s):
        return (s * block_slc + block_cmp - 2) // stride_cmp + 2
    block_j = max(BLOCK_J, next_pow2(span(1)))
    return block_j, max(s for s in range(1, 65) if span(s) <= block_j)


@triton.jit
def _keep_best(best_s, best_i, cand_s, cand_i, KP: tl.constexpr):
    """The ``KP`` best of the running list ``best [BM, KP]`` and the candidates ``cand [BM, BS]`` (disjoint
    block indices), best first: higher score, and of equal scores the lower index (a stable descending sort).
    Taken entries leave with score ``-inf`` and index :data:`NONE`."""
    slot = tl.arange(0, KP)
    out_s = tl.full([best_s.shape[0], KP], float("-inf"), dtype=tl.float32)
    out_i = tl.full([best_s.shape[0], KP], NONE, dtype=tl.int32)
    for r in range(KP):
        m = tl.maximum(tl.max(best_s, 1), tl.max(cand_s, 1))
        i = tl.minimum(tl.min(tl.where(best_s == m[:, None], best_i, NONE), 1),
                       tl.min(tl.where(cand_s == m[:, None], cand_i, NONE), 1))
        out_s = tl.where(slot[None, :] == r, m[:, None], out_s)
        out_i = tl.where(slot[None, :] == r, i[:, None], out_i)
        best_s = tl.where(best_i == i[:, None], float("-inf"), best_s)
        best_i = tl.where(best_i == i[:, None], NONE, best_i)
        cand_s = tl.where(cand_i == i[:, None], float("-inf"), cand_s)
        cand_i = tl.where(cand_i == i[:, None], NONE, cand_i)
    return out_s, out_i


@triton.jit
def selection_kernel(Q, KC, LSE, BLK, SCORE, stride_qb, stride_qt, stride_qh, stride_kb, stride_kn, stride_kh,
                     stride_lb, stride_lt, stride_lh, stride_bb, stride_bh, stride_bt,
                     C, n, H, D, offset, n_slc, k, block_cmp, stride_cmp, block_slc, step, qk_scale2,
                     GROUP: tl.constexpr, KP: tl.constexpr, SCORES: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_J: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    """The ``k`` selection blocks ``BLK[b, h, t, :]`` (int32, ``-1`` for none) of the ``BLOCK_M`` queries of one
    program, best first, and with ``SCORES`` their importances ``SCORE`` (fp32, same strides). A block's
    importance is the compression probability of the group's query heads, ``exp2(s2 - lse2)`` from the
    compression's base-2 log-sum-exp ``LSE``, summed over the compressed blocks that overlap it; the query's own
    block ranks first (``+inf``), blocks not started yet last (``-inf``, not chosen). The blocks are scored a
    step of ``step`` at a time and merged into a running list of the ``KP`` best."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    b = tl.program_id(1) // H
    h = tl.program_id(1) % H
    real = rows < C
    pos = offset + rows
    d = tl.arange(0, BLOCK_D)
    jj = tl.arange(0, BLOCK_J)
    ss = tl.arange(0, BLOCK_S)
    best_s = tl.full([BLOCK_M, KP], float("-inf"), dtype=tl.float32)
    best_i = tl.full([BLOCK_M, KP], NONE, dtype=tl.int32)
    last = offset + tl.minimum(tl.program_id(0) * BLOCK_M + BLOCK_M, C) - 1
    s_end = tl.minimum(last // block_slc + 1, n_slc)  # blocks no query of the program has started rank last
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
        lane = (ss < step) & (s < n_slc)
        overlap = ((j * stride_cmp)[:, None] < ((s + 1) * block_slc)[None, :]) \
            & ((j * stride_cmp + block_cmp)[:, None] > (s * block_slc)[None, :]) & lane[None, :]
        imp = tl.dot(p, overlap.to(tl.float32), input_precision="ieee")
        imp = tl.where((s * block_slc)[None, :] <= pos[:, None], imp, float("-inf"))
        imp = tl.where(s[None, :] == (pos // block_slc)[:, None], float("inf"), imp)
        cand_i = tl.where(lane, s, NONE)[None, :] + 0 * rows[:, None]
        cand_s = tl.where(lane[None, :], imp, float("-inf"))
        kth = tl.min(best_s, 1)
        if tl.max((tl.max(cand_s, 1) > kth).to(tl.int32), 0) > 0:  # some row has a candidate that ranks
            best_s, best_i = _keep_best(best_s, best_i, cand_s, cand_i, KP)
    r = tl.arange(0, KP)
    out = b * stride_bb + h * stride_bh + rows[:, None] * stride_bt + r[None, :]
    chosen = (best_s > float("-inf")) & (best_i < n_slc)
    tl.store(BLK + out, tl.where(chosen, best_i, -1), mask=real[:, None] & (r < k)[None, :])
    if SCORES:
        tl.store(SCORE + out, best_s, mask=real[:, None] & (r < k)[None, :])


def selected_blocks(q, kc, lse2, S: int, *, offset: int, block_cmp: int, stride_cmp: int, block_slc: int, topk: int,
                    scale: float, scores: bool = False):
    """``[B, H, T, k]`` int32 (``k = min(topk, n_slc)``): the selection blocks of the queries ``q`` at positions
    ``offset ..`` over ``S`` keys, best first, ``-1`` where fewer than ``k`` blocks have started (the order and
    the ties of :func:`regattn.reference.nsa.select_blocks`); ``lse2`` is :func:`compressed_attention`'s. With
    ``scores``, also their importances ``[B, H, T, k]`` fp32 (``inf`` at the query's own block). Not
    differentiated."""
    B, T, HQ, D = q.shape
    n, H = kc.shape[1], kc.shape[2]
    n_slc = ceil_div(S, block_slc)
    k = min(topk, n_slc)
    blocks = torch.full((B, H, T, k), -1, device=q.device, dtype=torch.int32)
    score = torch.full((B, H, T, k), float("-inf"), device=q.device) if scores else blocks
    if T and k:
        block_j, step = selection_tiles(block_cmp, stride_cmp, block_slc)
        block_m = 16 if interpreting() else SELECTION_ROWS
        launch = {} if interpreting() else dict(num_warps=SELECTION_WARPS, num_stages=2)
        kc = kc.detach() if n else q.detach()  # no block: every load is masked, the pointer only has to be valid
        selection_kernel[(ceil_div(T, block_m), B * H)](
            q.detach(), kc, lse2.detach(), blocks, score, *q.stride()[:3], *kc.stride()[:3], *lse2.stride()[:3],
            *blocks.stride()[:3], T, n, H, D, offset, n_slc, k, block_cmp, stride_cmp, block_slc, step,
            scale * LOG2E, GROUP=HQ // H, KP=next_pow2(k), SCORES=scores, BLOCK_M=block_m, BLOCK_J=block_j,
            BLOCK_S=max(16, next_pow2(step)), BLOCK_D=head_block(D), PRECISION=dot_precision(q.dtype), **launch)
    return (blocks, score) if scores else blocks
