"""NSA's compression and selection branches (gatedfwa.md Appendix B, ``regattn.ops.nsa.nsa_attention``) at
NSA's default blocks (compressed 32 with stride 16, selection 64, top 16), forward and forward+backward.

* The whole op: the selection by the Triton kernel against the same op's torch path (each chunk's selected
  tokens gathered), and the dense reference in the run's dtype where it fits. A case returns the two
  branches' outputs side by side, ``[B, T, HQ, 2 Dv]``.
* ``part="selection"``: the selected attention alone on given block indices (drawn once by the op's own
  compression and selection), our kernel against flash-linear-attention's ``parallel_nsa`` (which takes
  groups of 16 query heads or more a key/value head, NSA's layout)."""
from __future__ import annotations

import torch

from regattn import reference
from regattn.bench import counts, peers
from regattn.bench.check import Check, Slice
from regattn.bench.runner import backward, build, for_mode, ours, randn, reference_case
from regattn.ops._common.attention_tiles import interpreting
from regattn.ops.nsa import nsa_attention
from regattn.ops.nsa.api import selected_gather
from regattn.ops.nsa.compression import compressed_attention, selected_blocks
from regattn.ops.nsa.function import selected_attention

NAME = "nsa"
PEERS = ("reference", "fla")
QUICK_PEERS = ("reference", "fla")
MAIN = {"fwd": ("regattn:torch", "fla"), "fwd+bwd": ("regattn:torch", "fla")}
MODES = ("fwd", "fwd+bwd")
BLOCKS = dict(block_cmp=32, stride_cmp=16, block_slc=64, topk=16)
SELECTION = [dict(part="selection", B=1, HQ=64, H=4, T=T, D=128) for T in (8192, 32768)]
GRIDS = {
    "tiny": [dict(B=1, HQ=4, H=2, T=40, D=16, block_cmp=4, stride_cmp=2, block_slc=8, topk=2),
             dict(part="selection", B=1, HQ=4, H=2, T=40, D=16, block_cmp=4, stride_cmp=2, block_slc=8, topk=2)],
    "goal": [dict(B=1, HQ=16, H=4, T=T, D=128) for T in (8192, 32768)] + SELECTION,
    "quick": [dict(B=1, HQ=16, H=4, T=8192, D=128), SELECTION[0]],
    "full": [dict(B=1, HQ=16, H=4, T=T, D=128) for T in (4096, 8192, 16384, 32768, 65536)] + SELECTION,
}
CHECK_ROWS = 1024
SELECTION_CHECK_ROWS = 256  # the float64 check gathers each row's selected tokens
REFERENCE_MAX_T = 8192  # the dense reference builds [T, T] masks per head


def both(fn, **blocks):
    """The call as a case times it: the two branch outputs side by side."""
    return lambda q, k, v, kc, vc: torch.cat(fn(q, k, v, kc, vc, **blocks), -1)


def cases(shape: dict, setup):
    """Shape keys: part (optional), B, HQ, H, T, D; optionally block_cmp, stride_cmp, block_slc, topk (NSA's by
    default)."""
    blocks = {name: shape.get(name, value) for name, value in BLOCKS.items()}
    yield from (selection_cases if shape.get("part") == "selection" else op_cases)(shape, blocks, setup)


def op_cases(shape, blocks, setup):
    B, HQ, H, T, D = shape["B"], shape["HQ"], shape["H"], shape["T"], shape["D"]
    n = (T - blocks["block_cmp"]) // blocks["stride_cmp"] + 1
    for mode in MODES:
        bwd = backward(mode)
        x = dict(q=randn(setup, B, T, HQ, D, grad=bwd), k=randn(setup, B, T, H, D, grad=bwd),
                 v=randn(setup, B, T, H, D, grad=bwd), kc=randn(setup, B, n, H, D, grad=bwd),
                 vc=randn(setup, B, n, H, D, grad=bwd))
        leaves = list(x.values()) if bwd else []
        truth = Check(both(reference.nsa_attention, **blocks), x, Slice(kv_heads=H, rows=min(T, CHECK_ROWS)),
                      grads=tuple(x) if bwd else ())
        n_counts = dict(flops=counts.nsa_flops(B, T, HQ, D, D, backward=bwd, **blocks),
                        bytes=counts.attention_bytes(B, T, T, HQ, H, D, D, x["q"].element_size(), backward=bwd))
        case = ours(nsa_attention, x["q"], setup, lambda: both(nsa_attention, **blocks, backend=setup.backend)(**x),
                    leaves, check=truth, **n_counts)
        yield mode, case
        if case.op.startswith("regattn:triton"):  # the torch path is the peer the kernel is measured against
            torch_path = both(nsa_attention, **blocks, backend="torch")
            yield mode, build("regattn:torch", lambda: (lambda: torch_path(**x), leaves), check=truth, **n_counts)
        if T <= REFERENCE_MAX_T:
            call = both(reference.nsa_attention, **blocks)
            yield from reference_case(setup, mode, lambda call=call: call(**x), leaves, check=truth, **n_counts)


def op_blocks(q, kc, vc, S, *, scale, **blocks) -> torch.Tensor:
    """``[B, H, T, topk]`` int32: the blocks the op's compression and selection choose for ``q``."""
    options = dict(block_cmp=blocks["block_cmp"], stride_cmp=blocks["stride_cmp"], scale=scale)
    with torch.no_grad():
        _, lse2 = compressed_attention(q, kc, vc, offset=0, **options)
        return selected_blocks(q, kc, lse2, S, offset=0, block_slc=blocks["block_slc"], topk=blocks["topk"],
                               **options)


def selection_truth(q, k, v, chosen, *, block_slc, scale, bwd) -> Check:
    """The float64 selected attention of the first rows of head group 0, by the op's torch path (each row's
    selected tokens gathered)."""
    rows = min(q.shape[1], SELECTION_CHECK_ROWS)
    first = chosen[:1, :1, :rows].long()

    def selected(q, k, v):
        t = torch.arange(q.shape[1], device=q.device)
        return selected_gather(q, t, k, v, first.clamp_min(0), first >= 0, block_slc=block_slc, scale=scale)
    return Check(selected, dict(q=q, k=k, v=v), Slice(kv_heads=k.shape[2], rows=rows),
                 grads=("q", "k", "v") if bwd else ())


def fla_selection(q, k, v, chosen, topk, block_slc, scale):
    fn = peers.fla_function("parallel_nsa")
    index = chosen.permute(0, 2, 1, 3).contiguous()  # FLA's [B, T, H, topk]; it skips the -1 entries too
    leaves = [peers.leaf(x) for x in (q, k, v)]
    return (lambda: fn(*leaves, block_indices=index, block_counts=topk, block_size=block_slc, scale=scale)), leaves


def selection_cases(shape, blocks, setup):
    """The selected attention alone on the blocks the op chooses (drawn by the op's kernels: none run on a CPU
    outside the interpreter)."""
    if not (setup.cuda or interpreting()):
        return
    B, HQ, H, T, D = shape["B"], shape["HQ"], shape["H"], shape["T"], shape["D"]
    n = (T - blocks["block_cmp"]) // blocks["stride_cmp"] + 1
    block_slc, topk, scale = blocks["block_slc"], blocks["topk"], D ** -0.5
    q, k, v = randn(setup, B, T, HQ, D, grad=True), randn(setup, B, T, H, D, grad=True), randn(setup, B, T, H, D, grad=True)
    chosen = op_blocks(q.detach(), randn(setup, B, n, H, D), randn(setup, B, n, H, D), T, scale=scale, **blocks)
    kernel = setup.backend != "torch"
    for mode in MODES:
        bwd = backward(mode)
        truth = selection_truth(q, k, v, chosen, block_slc=block_slc, scale=scale, bwd=bwd)
        n_counts = dict(flops=counts.attention_flops(B, T, T, HQ, D, D, window=topk * block_slc, backward=bwd),
                        bytes=counts.attention_bytes(B, T, T, HQ, H, D, D, q.element_size(), backward=bwd))
        if kernel:
            call = lambda: selected_attention(q, k, v, chosen, block_slc=block_slc, offset=0, scale=scale)  # noqa: E731
            yield mode, build("regattn:triton[selection]", lambda: (call, [q, k, v]), ours=True, check=truth,
                              **n_counts)
        if peers.wanted(setup.peers, "fla"):
            yield mode, build("fla:parallel_nsa", lambda: fla_selection(*for_mode(mode, q, k, v), chosen, topk,
                                                                        block_slc, scale), check=truth, **n_counts)
