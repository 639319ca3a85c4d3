"""lightning2: the intra-block / inter-block kernel (leetdecoding.txt Section 3.2, Lightning Attention-2).

For a block of ``BT`` rows starting after state ``S`` (the decayed sum ``sum_j gamma^(t0-1-j) c_j^T v_j``
of everything before it):

    o   = (b c^T ⊙ M) v  +  (gamma^(p+1) b) S          intra on the tensor cores, inter from the state
    S  <- gamma^n S  +  (gamma^(n-1-p) c)^T v            n = rows in the block, p = row in the block

Only non-negative powers of gamma are formed, so gamma near 0 underflows to exact zeros and
gamma = 1 never overflows.

Parallelism: one program per (value-column block, segment, batch*head). With more than one
segment, a first launch writes each segment's own final state (``WRITE_O=False``); in the second
launch every segment first folds the earlier segments' states into its initial state
(``S <- gamma^SEG S + local_q``, ``CHAIN``), then computes its rows.

``REVERSE`` runs the same recurrence from the last row to the first (row ``t`` reads position
``T-1-t``): ``o_j = sum_{i>=j} gamma^(i-j) (b_j.c_i) v_i``, which is what the backward needs.

An initial state ``X`` enters each row through its own product (``gamma^(t + INIT_POW) b X``), so the
segments chain as without it and the backward can pass the final state's gradient in with ``INIT_POW = 0``;
``FINAL`` is written by the last segment. ``VARLEN`` reads each packed sequence's bounds from ``CU``
(one program per sequence, head and value-column block).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from regattn.ops._common.attention_tiles import dot_precision, head_block, interpreting
from regattn.ops._common.checks import sm_count
from regattn.ops._common.ints import ceil_div
from regattn.ops.decay.tiles import decay_into, decay_matrix, decay_out_of

LOG2E = 1.4426950408889634


@triton.jit
def _lightning2_kernel(
    Bm, Cm, Vm, O, LOCAL, INIT, FINAL, CU, LOG2G,
    sb_b, sb_t, sb_h, sc_b, sc_t, sc_h, sv_b, sv_t, sv_h, so_b, so_t, so_h,
    T, H, R, D, SEG, NSEG, INIT_POW, FINAL_POW,
    BT: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr,
    REVERSE: tl.constexpr, CHAIN: tl.constexpr, WRITE_O: tl.constexpr, WRITE_STATE: tl.constexpr,
    HAS_INIT: tl.constexpr, WRITE_FINAL: tl.constexpr, VARLEN: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_d = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_bh = tl.program_id(2)
    bi = (pid_bh // H).to(tl.int64)     # the batch row, or the packed sequence with VARLEN
    hi = pid_bh % H
    if VARLEN:
        bos = tl.load(CU + bi).to(tl.int64)
        T = (tl.load(CU + bi + 1) - bos).to(tl.int32)
        batch = bi * 0
    else:
        bos = bi * 0
        batch = bi
    log2g = tl.load(LOG2G + hi)
    b_base = Bm + batch * sb_b + bos * sb_t + hi * sb_h
    c_base = Cm + batch * sc_b + bos * sc_t + hi * sc_h
    v_base = Vm + batch * sv_b + bos * sv_t + hi * sv_h
    o_base = O + batch * so_b + bos * so_t + hi * so_h

    offs_t = tl.arange(0, BT)
    offs_r = tl.arange(0, BR)
    offs_d = pid_d * BD + tl.arange(0, BD)
    mask_r = offs_r < R
    mask_d = offs_d < D

    intra_mask = decay_matrix(offs_t, log2g)
    into = decay_into(offs_t, log2g)

    # LOCAL: [B*H, NSEG, R, D] float32, each segment's own final state (written with WRITE_STATE);
    # INIT, FINAL: [B*H, R, D] float32, the state before the first row and after the last
    state_mask = mask_r[:, None] & mask_d[None, :]
    state_offs = offs_r[:, None] * D + offs_d[None, :]
    S = tl.zeros((BR, BD), dtype=tl.float32)
    if CHAIN or WRITE_STATE:
        local_base = LOCAL + pid_bh.to(tl.int64) * NSEG * R * D + state_offs
    if CHAIN:
        # initial state of this segment: Horner over the earlier segments' own states
        g_seg = tl.exp2(log2g * SEG)
        for q in range(0, pid_s):
            S = S * g_seg + tl.load(local_base + q * R * D, mask=state_mask, other=0.0)
    if HAS_INIT:
        X = tl.load(INIT + pid_bh.to(tl.int64) * R * D + state_offs, mask=state_mask, other=0.0)

    seg_start = pid_s * SEG
    seg_end = tl.minimum(seg_start + SEG, T)
    for start in range(seg_start, seg_end, BT):
        t = start + offs_t
        valid = t < seg_end
        if REVERSE:
            pos = (T - 1 - t).to(tl.int64)
        else:
            pos = t.to(tl.int64)
        c = tl.load(c_base + pos[:, None] * sc_t + offs_r[None, :], mask=valid[:, None] & mask_r[None, :], other=0.0)
        v = tl.load(v_base + pos[:, None] * sv_t + offs_d[None, :], mask=valid[:, None] & mask_d[None, :], other=0.0)
        if WRITE_O:
            b = tl.load(b_base + pos[:, None] * sb_t + offs_r[None, :], mask=valid[:, None] & mask_r[None, :],
                        other=0.0)
            scores = tl.dot(b, tl.trans(c), input_precision=PRECISION) * intra_mask
            o = tl.dot(scores.to(v.dtype), v, input_precision=PRECISION)
            b_in = (b * into[:, None]).to(v.dtype)
            o += tl.dot(b_in, S.to(v.dtype), input_precision=PRECISION)
            if HAS_INIT:
                b_init = (b * tl.exp2((t + INIT_POW).to(tl.float32) * log2g)[:, None]).to(v.dtype)
                o += tl.dot(b_init, X.to(v.dtype), input_precision=PRECISION)
            tl.store(o_base + pos[:, None] * so_t + offs_d[None, :], o.to(O.dtype.element_ty),
                     mask=valid[:, None] & mask_d[None, :])
        n = tl.minimum(seg_end - start, BT)
        out_of = decay_out_of(n, offs_t, valid, log2g)
        c_out = (c * out_of[:, None]).to(v.dtype)
        S = S * tl.exp2(n.to(tl.float32) * log2g) + tl.dot(tl.trans(c_out), v, input_precision=PRECISION)
    if WRITE_STATE:
        tl.store(local_base + pid_s * R * D, S, mask=state_mask)
    if WRITE_FINAL:
        if pid_s == NSEG - 1:
            # gamma^FINAL_POW S + gamma^(T - 1 + INIT_POW + FINAL_POW) X
            S = S * tl.exp2(FINAL_POW * log2g)
            if HAS_INIT:
                S += tl.exp2((T - 1 + INIT_POW + FINAL_POW) * log2g) * X
            tl.store(FINAL + pid_bh.to(tl.int64) * R * D + state_offs, S, mask=state_mask)


# GPU launch settings, from a sweep on an H100 (bf16, R = D = 128); ``OVERRIDE`` replaces any of them
# (keys BT, BD, num_warps, num_stages, waves) for tuning sweeps.
GPU_BLOCKS = dict(BT=64, BD=64, num_warps=4, num_stages=2, waves=4)
OVERRIDE: dict = {}


def lightning2_blocks(R: int, D: int, dtype: torch.dtype) -> dict:
    """Tile sizes: 16-row tiles in the interpreter; ``GPU_BLOCKS`` (fp32: 32-row tiles) on a GPU."""
    BR = head_block(R)
    if interpreting():
        return dict(BT=16, BR=BR, BD=min(head_block(D), 32), num_warps=1, num_stages=1, waves=2)
    cfg = dict(GPU_BLOCKS, BR=BR)
    if dtype == torch.float32 and BR > 64:
        cfg.update(BT=32, BD=64, num_warps=4)
    cfg.update(OVERRIDE)
    cfg["BD"] = min(head_block(D), cfg["BD"])
    return cfg


def plan_segments(B: int, H: int, T: int, n_dblocks: int, BT: int, device: torch.device, waves: int = 2) -> int:
    """Segment length (a multiple of ``BT``, or ``T`` for one segment): split the sequence when
    (batch*head*column blocks) alone would fill fewer than ``waves`` programs per SM (twice that when
    they do not even cover every SM once), keeping every segment at least 8 blocks long.

    On an H100 (bf16, H=32, R=D=128, B=1): T=100000 takes 3.14 / 2.82 / 2.51 ms at 2 / 4 / 8 waves,
    T=8192 0.29 / 0.28 / 0.27 ms; at B=16 one segment (no split) is fastest."""
    if interpreting() or device.type != "cuda":
        return T
    sms = sm_count(device)
    programs = B * H * n_dblocks
    if programs < sms:
        waves *= 2
    want = max(1, math.ceil(waves * sms / programs))
    most = max(1, T // (8 * BT))
    n_seg = min(want, most)
    if n_seg == 1:
        return T
    return ceil_div(ceil_div(T, n_seg), BT) * BT


@dataclass
class StateArgs:
    """The state side of a call: ``initial [N, H, R, D]`` float32 (entering row t with weight
    ``gamma^(t + init_pow)``), ``final [N, H, R, D]`` float32 to write
    (``gamma^final_pow S_T + gamma^(T - 1 + init_pow + final_pow) initial``), ``cu_seqlens [N + 1]``."""
    initial: torch.Tensor | None = None
    final: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None
    init_pow: int = 1
    final_pow: int = 0


def _launch(b, c, v, log2g, o, local, seg, n_seg, reverse, chain, write_o, write_state, cfg, state):
    """One launch; ``state``: the ``StateArgs`` of this call."""
    B, T, H, R = b.shape
    D = v.shape[-1]
    rows = B if state.cu_seqlens is None else state.cu_seqlens.numel() - 1
    grid = (ceil_div(D, cfg["BD"]), n_seg, rows * H)
    write_final = state.final is not None and write_o
    _lightning2_kernel[grid](
        b, c, v, o, local, state.initial, state.final if write_final else None, state.cu_seqlens, log2g,
        b.stride(0), b.stride(1), b.stride(2), c.stride(0), c.stride(1), c.stride(2),
        v.stride(0), v.stride(1), v.stride(2), o.stride(0), o.stride(1), o.stride(2),
        T, H, R, D, seg, n_seg, state.init_pow, state.final_pow,
        BT=cfg["BT"], BR=cfg["BR"], BD=cfg["BD"], REVERSE=reverse, CHAIN=chain,
        WRITE_O=write_o, WRITE_STATE=write_state, HAS_INIT=state.initial is not None, WRITE_FINAL=write_final,
        VARLEN=state.cu_seqlens is not None, PRECISION=dot_precision(v.dtype),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )


def lightning2_forward(b, c, v, log2g, *, reverse: bool = False, segment: int | None = None,
                       initial_state=None, output_final_state: bool = False, cu_seqlens=None,
                       init_pow: int = 1, final_pow: int = 0):
    """``o = (b c^T ⊙ M) v`` (or its time reverse) from a state: ``b, c: [B, T, H, R]``, ``v: [B, T, H, D]``,
    ``log2g: [H]`` fp32 (``log2 gamma``).

    ``initial_state``: ``[N, H, R, D]`` float32 contiguous or None; row ``t`` (0-based, counted from the
    end with ``reverse``) adds ``gamma^(t + init_pow) b_t S_0``. ``output_final_state``: also return
    ``gamma^final_pow S_T + gamma^(T - 1 + init_pow + final_pow) S_0``, S_T the sum over the rows.
    ``cu_seqlens``: ``[N + 1]`` offsets of packed sequences (B == 1, one segment per sequence).
    ``segment``: rows per sequence-parallel segment (a multiple of the row block; default from
    ``plan_segments``). Returns ``o`` in v's dtype, or ``(o, final)`` with ``output_final_state``.
    """
    B, T, H, R = b.shape
    D = v.shape[-1]
    cfg = lightning2_blocks(R, D, v.dtype)
    o = torch.empty_like(v)
    if segment is not None and (segment < 1 or segment % cfg["BT"]):
        raise ValueError(f"segment: expected a positive multiple of the row block {cfg['BT']}, got {segment}")
    rows = B if cu_seqlens is None else cu_seqlens.numel() - 1
    final = torch.empty(rows, H, R, D, device=v.device, dtype=torch.float32) if output_final_state else None
    state = StateArgs(initial_state, final, cu_seqlens, init_pow, final_pow)
    seg = T if cu_seqlens is not None else (
        segment or plan_segments(B, H, T, ceil_div(D, cfg["BD"]), cfg["BT"], v.device, cfg["waves"]))
    n_seg = ceil_div(T, seg)
    if n_seg == 1:
        _launch(b, c, v, log2g, o, None, T, 1, reverse, False, True, False, cfg, state)
    else:
        local = torch.empty(B * H, n_seg, R, D, device=v.device, dtype=torch.float32)
        _launch(b, c, v, log2g, o, local, seg, n_seg, reverse, False, False, True, cfg, state)
        _launch(b, c, v, log2g, o, local, seg, n_seg, reverse, True, True, False, cfg, state)
    return (o, final) if output_final_state else o
