"""NSA's selected attention as ``torch.library`` custom ops with a registered backward, so it trains and
compiles (torch.compile treats the kernels as opaque calls). ``blocks`` is an int32 index, not differentiated."""
from __future__ import annotations

import torch
from torch import Tensor

from regattn.ops.nsa.kernels import selected_backward, selected_forward


@torch.library.custom_op("regattn::nsa_selected_fwd", mutates_args=())
def selected_fwd_op(q: Tensor, k: Tensor, v: Tensor, blocks: Tensor, block_slc: int, offset: int,
                    scale: float) -> tuple[Tensor, Tensor]:
    return selected_forward(q, k, v, blocks, block_slc=block_slc, offset=offset, scale=scale)


@selected_fwd_op.register_fake
def _(q, k, v, blocks, block_slc, offset, scale):
    B, T, HQ, _ = q.shape
    return q.new_empty(B, T, HQ, v.shape[3]), q.new_empty(B, HQ, T, dtype=torch.float32)


@torch.library.custom_op("regattn::nsa_selected_bwd", mutates_args=())
def selected_bwd_op(do: Tensor, q: Tensor, k: Tensor, v: Tensor, blocks: Tensor, o: Tensor, lse: Tensor,
                    block_slc: int, offset: int, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    return selected_backward(do, q, k, v, blocks, o, lse, block_slc=block_slc, offset=offset, scale=scale)


@selected_bwd_op.register_fake
def _(do, q, k, v, blocks, o, lse, block_slc, offset, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, blocks, block_slc, offset, scale = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, blocks, o, lse)
    ctx.args = (block_slc, offset, scale)
    ctx.mark_non_differentiable(lse)


def _backward(ctx, do, _dlse):
    q, k, v, blocks, o, lse = ctx.saved_tensors
    dq, dk, dv = selected_bwd_op(do, q, k, v, blocks, o, lse, *ctx.args)
    return dq, dk, dv, None, None, None, None


selected_fwd_op.register_autograd(_backward, setup_context=_setup_context)


def selected_attention(q, k, v, blocks, *, block_slc: int, offset: int, scale: float) -> Tensor:
    """``o [B, T, HQ, Dv]``: each query over the visible tokens of its selected blocks (``blocks [B, H, T, topk]``
    int32, ``-1`` for none); inputs already checked."""
    q, k, v, blocks = (x.contiguous() for x in (q, k, v, blocks))
    o, _ = selected_fwd_op(q, k, v, blocks, int(block_slc), int(offset), float(scale))
    return o
