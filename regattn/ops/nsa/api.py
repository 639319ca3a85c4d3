"""NSA's compression and selection branches (gatedfwa.md Appendix B, eq. 16-19, 22) in linear memory.

Two paths give the numbers of :func:`regattn.reference.nsa.nsa_attention`, neither building a ``[T, T]`` mask:

* the kernel path (``backend="triton"``): the compression attention on the FlashAttention kernels, the block
  importance and its top-k in one Triton kernel (:mod:`regattn.ops.nsa.compression`), and the selected
  attention in the kernel of :mod:`regattn.ops.nsa.kernels`, which reads the selected tokens in place;
* the torch path: the queries in chunks of ``chunk`` positions, a chunk's compression attention ``[chunk, n]``
  (``n ~ T / stride_cmp`` compressed blocks) and its selection attention ``[chunk, topk * block_slc]`` (each
  query's selected tokens, gathered), each chunk checkpointed (saving only its inputs, recomputed in the
  backward).

Either costs ``O(T (T / stride_cmp + topk block_slc))`` time; the kernel path's memory is linear in T, the torch
path's one chunk's worth of that time.
"""
from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from regattn.ops._common.checks import (
    check_attention_inputs, check_int, check_same, check_scale, check_shape, check_tensor, resolve_kernel_backend,
)
from regattn.ops.nsa.compression import compressed_attention, selected_blocks
from regattn.ops.nsa.function import selected_attention
from regattn.reference.common import accumulation_dtype, contained_matmul
from regattn.reference.nsa import compressed_ends, masked_softmax, select_blocks

HAS_TRITON = True
TORCH_CHUNK = 128


def nsa_attention(q, k, v, kc, vc, *, block_cmp, stride_cmp, block_slc, topk, scale=None, offset=0, chunk=None,
                  backend="auto"):
    """NSA compression and selection attention: ``(o_cmp, o_slc)``, each ``[B, T, HQ, Dv]`` in q's dtype.

    Args:
        q: ``[B, T, HQ, D]`` queries at positions ``offset .. offset + T - 1``.
        k: ``[B, S, H, D]`` keys at positions ``0 .. S - 1`` (``S >= offset + T``); ``HQ % H == 0``.
        v: ``[B, S, H, Dv]`` values.
        kc: ``[B, n, H, D]`` compressed keys, block ``i`` made of tokens ``i stride_cmp .. i stride_cmp +
            block_cmp - 1`` (every block that fits in ``S`` tokens or fewer).
        vc: ``[B, n, H, Dv]`` compressed values.
        block_cmp, stride_cmp: compressed block length and stride (``stride_cmp <= block_cmp``).
        block_slc, topk: selection block length and the number of blocks each query selects.
        scale: defaults to ``D ** -0.5``.
        offset: position of the first query (decoding: the cache length before the new token).
        chunk: queries per chunk of the torch path (memory, not numbers; 128 by default): a chunk gathers
            ``chunk * topk * block_slc`` tokens. The kernel path takes all queries at once.
        backend: ``"auto" | "torch" | "triton"`` (the module text); ``"triton"`` takes fp16, bf16 and fp32 and
            is the default on CUDA.

    See :mod:`regattn.reference.nsa` for what each branch attends. The torch path computes in fp32 (float64 for
    float64); the kernels accumulate in fp32, as FlashAttention does.
    """
    B, T, S, HQ, H, D, Dv = check_attention_inputs(q, k, v)
    for name, x, dim in (("kc", kc, D), ("vc", vc, Dv)):
        check_tensor(name, x, 4)
        check_same(q=q, **{name: x})
    n = kc.shape[1]
    check_shape("kc", kc, (B, n, H, D), "[B, n, H, D]")
    check_shape("vc", vc, (B, n, H, Dv), "[B, n, H, Dv]")
    for name, value in (("block_cmp", block_cmp), ("stride_cmp", stride_cmp), ("block_slc", block_slc),
                        ("topk", topk)):
        check_int(name, value, minimum=1)
    if chunk is not None:
        check_int("chunk", chunk, minimum=1)
    check_int("offset", offset, minimum=0)
    if stride_cmp > block_cmp:
        raise ValueError(f"stride_cmp: expected at most block_cmp = {block_cmp}, got {stride_cmp}")
    if offset + T > S:
        raise ValueError(f"k: expected at least offset + T = {offset + T} keys, got {S}")
    if n and (n - 1) * stride_cmp + block_cmp > S:
        raise ValueError(f"kc: expected at most {max(0, (S - block_cmp) // stride_cmp + 1)} compressed blocks "
                         f"of {S} keys, got {n}")
    scale = check_scale(scale, D)
    backend = resolve_kernel_backend(backend, q, op="nsa_attention", has_triton=HAS_TRITON)
    options = dict(block_cmp=block_cmp, stride_cmp=stride_cmp, block_slc=block_slc, topk=topk, scale=scale)
    if backend == "torch":
        return _torch_path(q, k, v, kc, vc, offset=offset, chunk=chunk or TORCH_CHUNK, **options)
    o_cmp, lse2 = compressed_attention(q, kc, vc, offset=offset, block_cmp=block_cmp, stride_cmp=stride_cmp,
                                       scale=scale)
    blocks = selected_blocks(q, kc, lse2, S, offset=offset, **options)
    return o_cmp, selected_attention(q, k, v, blocks, block_slc=block_slc, offset=offset, scale=scale)


def _torch_path(q, k, v, kc, vc, *, offset, chunk, **options):
    """Both branches in torch, chunk by chunk of queries, each chunk checkpointed when a gradient is wanted."""
    save = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v, kc, vc))
    outs = []
    for lo in range(0, q.shape[1], chunk):
        t = torch.arange(offset + lo, offset + min(lo + chunk, q.shape[1]), device=q.device)
        args = (q[:, lo:lo + chunk], t, k, v, kc, vc)
        outs.append(checkpoint(_chunk, *args, **options, use_reentrant=False) if save else _chunk(*args, **options))
    return torch.cat([o[0] for o in outs], 1), torch.cat([o[1] for o in outs], 1)


def block_importance(p_cmp: torch.Tensor, *, block_cmp: int, stride_cmp: int, block_slc: int,
                     n_slc: int) -> torch.Tensor:
    """``[..., n] -> [..., n_slc]``: each selection block's sum of the probabilities of the compressed blocks
    that overlap it, a gather of the few (at most ``ceil((block_slc + block_cmp - 1) / stride_cmp)``)
    compressed blocks per selection block: ``O(n_slc)`` per query, not ``O(n n_slc)``."""
    n = p_cmp.shape[-1]
    j = torch.arange(n_slc, device=p_cmp.device)
    first = (j * block_slc - block_cmp).div(stride_cmp, rounding_mode="floor").add(1).clamp_min(0)
    last = ((j + 1) * block_slc - 1).div(stride_cmp, rounding_mode="floor").clamp_max(n - 1)
    span = (block_slc + block_cmp + stride_cmp - 2) // stride_cmp
    i = first[:, None] + torch.arange(span, device=p_cmp.device)                     # [n_slc, span]
    hit = (i <= last[:, None]).to(p_cmp.dtype)
    picked = p_cmp[..., i.clamp(0, max(n - 1, 0)).flatten()].unflatten(-1, (n_slc, span))
    return (picked * hit).sum(-1)


def _compress_select(q, t, kc, vc, S, *, block_cmp, stride_cmp, block_slc, topk, scale):
    """The compression branch of the queries ``q: [B, C, HQ, D]`` at positions ``t: [C]`` and their selection:
    ``(o_cmp [B, C, HQ, Dv] in q's dtype, blocks, chosen)``, the last two ``[B, H, C, k]``."""
    acc = accumulation_dtype(q.dtype)
    B, C, HQ, D = q.shape
    H, n, Dv = kc.shape[2], kc.shape[1], vc.shape[3]
    qg = q.to(acc).view(B, C, H, HQ // H, D)
    ends = compressed_ends(n, block_cmp=block_cmp, stride_cmp=stride_cmp, device=q.device)
    logits = torch.einsum("bchgd,bnhd->bhgcn", qg, kc.to(acc)) * scale
    seen_cmp = ends[None, :] <= t[:, None]                                             # [C, n]
    p_cmp = masked_softmax(logits, seen_cmp)                                          # [B, H, G, C, n]
    o_cmp = contained_matmul(p_cmp, vc.to(acc).transpose(1, 2)[:, :, None], seen_cmp)  # [B, H, G, C, Dv]
    n_slc = -(-S // block_slc)
    if n:
        importance = block_importance(p_cmp.detach().sum(2), block_cmp=block_cmp, stride_cmp=stride_cmp,
                                      block_slc=block_slc, n_slc=n_slc)               # [B, H, C, n_slc]
    else:
        importance = p_cmp.new_zeros(B, H, C, n_slc)
    blocks, chosen = select_blocks(importance, t, block_slc=block_slc, topk=topk)     # [B, H, C, k]
    return o_cmp.permute(0, 3, 1, 2, 4).reshape(B, C, HQ, Dv).to(q.dtype), blocks, chosen


def selected_gather(q, t, k, v, blocks, chosen, *, block_slc, scale):
    """The selection branch in torch: each query's selected tokens gathered, ``[B, C, HQ, Dv]`` in q's dtype."""
    acc = accumulation_dtype(q.dtype)
    B, C, HQ, D = q.shape
    S, H, Dv = k.shape[1], k.shape[2], v.shape[3]
    qg = q.to(acc).view(B, C, H, HQ // H, D)
    tokens = blocks[..., None] * block_slc + torch.arange(block_slc, device=q.device)  # [B, H, C, k, b]
    seen = (chosen[..., None] & (tokens <= t[:, None, None])).flatten(-2)             # [B, H, C, L]
    tokens = tokens.clamp_max(S - 1).flatten(-2)
    L = tokens.shape[-1]

    def gather(x):  # [B, S, H, E] -> [B, H, C, L, E]
        index = tokens.reshape(B, H, C * L, 1).expand(-1, -1, -1, x.shape[-1])
        return x.to(acc).transpose(1, 2).gather(2, index).view(B, H, C, L, x.shape[-1])
    logits = torch.einsum("bchgd,bhcld->bhgcl", qg, gather(k)) * scale
    p_slc = masked_softmax(logits, seen[:, :, None]).transpose(2, 3)                  # [B, H, C, G, L]
    o_slc = contained_matmul(p_slc, gather(v), seen[:, :, :, None].expand_as(p_slc))  # [B, H, C, G, Dv]
    return o_slc.transpose(1, 2).reshape(B, C, HQ, Dv).to(q.dtype)


def _chunk(q, t, k, v, kc, vc, *, block_slc, scale, **options):
    """Both branches in torch for the queries ``q: [B, C, HQ, D]`` at positions ``t: [C]``."""
    o_cmp, blocks, chosen = _compress_select(q, t, kc, vc, k.shape[1], block_slc=block_slc, scale=scale, **options)
    return o_cmp, selected_gather(q, t, k, v, blocks, chosen, block_slc=block_slc, scale=scale)
