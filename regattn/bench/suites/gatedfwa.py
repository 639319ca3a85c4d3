"""GatedFWA (gatedfwa.md Figure 10 and Section 4): windowed gated attention forward and
forward+backward (with the gate's gradient) against FlexAttention (the gate as a score_mod reading
u twice, the window as a mask_mod), flash-linear-attention's forgetting attention, our ungated
sliding window and full-causal FlashAttention; and the gate scan, every variant of ``SCANS``, forward and
backward, in fp32 against a device copy of the same bytes (the memory floor)."""
from __future__ import annotations

import inspect

import torch
import triton

import regattn
from regattn import reference
from regattn.bench import counts, peers
from regattn.bench.check import Check, Slice
from regattn.bench.runner import Setup, build, flex_case, for_mode, ours, randn, reference_case, sdpa_cases
from regattn.ops.gatedfwa.api import gate_dispatch
from regattn.ops.gatedfwa.gate import SCANS

NAME = "gatedfwa"
PEERS = ("sdpa-flash", "sdpa-cudnn", "flex", "fla", "copy")
QUICK_PEERS = ("flex", "copy")
MAIN = {"fwd": ("flex",), "fwd+bwd": ("flex",), "gate fwd": ("copy",), "gate fwd+bwd": ("copy",)}
MODES = ("fwd", "fwd+bwd")
ATTENTION = [dict(B=1, H=16, T=32768, D=128, w=512)]
GATE = [dict(part="gate", B=1, T=65536, H=H) for H in (64, 128)]
GRIDS = {
    "tiny": [dict(B=1, H=2, T=48, D=16, w=16), dict(part="gate", B=1, T=64, H=4)],
    "goal": ATTENTION + GATE,
    "quick": ATTENTION + GATE[1:],
    "full": [dict(B=1, H=16, T=T, D=128, w=w) for T in (4096, 8192, 16384, 32768, 65536, 131072) for w in (512, 1024)]
    + [dict(part="gate", B=1, T=T, H=H) for T in (8192, 65536) for H in (16, 64, 128)],
}
CHECK_ROWS = 2048
# Tiles of the chunked gate scan timed by time_chunked_tiles: (elements of a tile, heads of a block).
CHUNK_TILES = [(elements, heads) for elements in (512, 1024, 2048, 4096) for heads in (16, 32, 64)]


def cases(shape: dict, setup):
    """Attention shapes: B, H, HQ (default H), T, D, w. Gate shapes: part="gate", B, T, H."""
    yield from (gate_cases if shape.get("part") == "gate" else attention_cases)(shape, setup)


def gate_inputs(setup, B, T, H, dtype=None, grad=False):
    """Gate pre-activations ``h`` and amplitudes ``beta`` near 1 (the layer's ``1 + elu(.)`` at init)."""
    h = randn(setup, B, T, H, dtype=dtype, grad=grad)
    beta = (1.0 + 0.1 * torch.rand(B, T, H, device=setup.device, dtype=dtype or setup.dtype)).requires_grad_(grad)
    return h, beta


def gate_cases(shape, setup):
    """The gate in fp32 (as the layer computes it); the backward moves du, h, beta in and dh, dbeta out.

    Each scan is timed as the layers call it (:func:`gate_dispatch`, no value check); the public
    :func:`regattn.gatedfwa_gate` once more with its eager value check (three reductions over h and beta
    and a device sync), which rows before the chunked scan included in every scan's time. On a GPU the
    chunked scan and the copy once more inside a CUDA graph: at these sizes the eager forward and
    backward launches' host work can exceed the kernels' time."""
    B, T, H = shape["B"], shape["T"], shape["H"]
    h, beta = gate_inputs(setup, B, T, H, dtype=torch.float32, grad=True)
    where = Slice(kv_heads=H)
    for mode in ("gate fwd", "gate fwd+bwd"):
        bwd = mode.endswith("fwd+bwd")
        truth = Check(lambda h, beta: reference.gatedfwa_gate(h, beta), dict(h=h, beta=beta), where,
                      grads=("h", "beta") if bwd else ())
        nbytes = counts.gate_bytes(B, T, H, 4) * (8 / 3 if bwd else 1)  # fwd: 3 arrays; fwd+bwd: 3 + 5
        n = dict(flops=None if bwd else counts.gate_flops(B, T, H), bytes=nbytes)
        for scan in SCANS:  # the scan as the layers call it: no value check
            yield mode, ours(gate_dispatch, h, setup,
                             lambda scan=scan: gate_dispatch(h, beta, eps=1e-6, scan=scan, backend=setup.backend),
                             [h, beta], tag=f"[{scan}]", check=truth, **n)
        yield mode, ours(regattn.gatedfwa_gate, h, setup,  # the public op: its value check reads h and beta
                         lambda: regattn.gatedfwa_gate(h, beta, backend=setup.backend), [h, beta],
                         tag="[one_pass, value check]", check=truth, **n)
        yield from reference_case(setup, mode, lambda: reference.gatedfwa_gate(h, beta), [h, beta], check=truth, **n)
        copy = lambda: peers.copy_floor(nbytes, setup.device)  # noqa: E731
        if peers.wanted(setup.peers, "copy"):
            yield mode, build("copy (memory floor)", copy, bytes=nbytes)
        if setup.cuda:  # the kernels' own time: a CUDA graph takes the launches' host work away
            yield mode, ours(gate_dispatch, h, setup,
                             lambda: gate_dispatch(h, beta, eps=1e-6, scan="chunked", backend=setup.backend),
                             [h, beta], tag="[chunked]", check=truth, graph=True, **n)
            if peers.wanted(setup.peers, "copy"):
                yield mode, build("copy (memory floor)", copy, bytes=nbytes, graph=True)


def fla_forgetting(q, k, v, u, window):
    """flash-linear-attention's forgetting attention with per-step log-gates ``g_t = u_t - u_{t-1}``;
    its gradient ``dg`` gives ours as ``du_t = dg_t - dg_{t+1}``."""
    fn = peers.fla_function("parallel_forgetting_attn")
    g = torch.diff(u.detach().float(), dim=1, prepend=torch.zeros_like(u[:, :1]).float())
    kwargs = {"window_size": window} if "window_size" in inspect.signature(fn).parameters else {}
    leaves = [peers.leaf(x) for x in (q, k, v)] + [g.requires_grad_(u.requires_grad)]

    def grads(gs):
        dg = gs[3]
        du = dg.clone()
        du[:, :-1] -= dg[:, 1:]
        return {"dq": gs[0], "dk": gs[1], "dv": gs[2], "du": du}
    return (lambda: fn(*leaves, **kwargs)), leaves, grads


def attention_cases(shape, setup):
    B, H, T, D, w = shape["B"], shape["H"], shape["T"], shape["D"], shape["w"]
    HQ = shape.get("HQ", H)
    q = randn(setup, B, T, HQ, D, grad=True)
    k, v = randn(setup, B, T, H, D, grad=True), randn(setup, B, T, H, D, grad=True)
    h, beta = gate_inputs(setup, B, T, HQ, dtype=torch.float32)
    u = reference.gatedfwa_gate(h, beta).requires_grad_(True)
    where = Slice(kv_heads=H, rows=min(T, CHECK_ROWS))  # the gate is read at rows and keys: first rows
    for mode in MODES:
        bwd = mode == "fwd+bwd"
        truth = Check(lambda q, k, v, u: reference.gatedfwa(q, k, v, u, window=w), dict(q=q, k=k, v=v, u=u), where,
                      grads=("q", "k", "v", "u") if bwd else ())
        n = dict(flops=counts.attention_flops(B, T, T, HQ, D, D, window=w, backward=bwd),
                 bytes=counts.attention_bytes(B, T, T, HQ, H, D, D, q.element_size(), backward=bwd, extra_per_query=1))
        yield mode, ours(regattn.gatedfwa, q, setup,
                         lambda: regattn.gatedfwa(q, k, v, u, window=w, backend=setup.backend), [q, k, v, u],
                         check=truth, **n)
        yield mode, ours(regattn.softmax_attention, q, setup,
                         lambda: regattn.softmax_attention(q, k, v, window=w, backend=setup.backend), [q, k, v],
                         tag=" (window, no gate)", **n)
        yield from sdpa_cases(setup, mode, q, k, v, backends=("flash", "cudnn"), tag=" (full causal)", **n)
        yield from flex_case(setup, mode, q, k, v, window=w, gate=u, check=truth, **n)
        if peers.wanted(setup.peers, "fla"):
            yield mode, build("fla:parallel_forgetting_attn", lambda: fla_forgetting(*for_mode(mode, q, k, v, u), w),
                              check=truth, **n)
        yield from reference_case(setup, mode, lambda: reference.gatedfwa(q, k, v, u, window=w), [q, k, v, u],
                                  check=truth, **n)


def time_chunked_tiles(tiles=None, *, shapes=None, device="cuda", rep_ms=100) -> list[dict]:
    """Time the chunked gate scan's forward and backward kernels with each tile, beside device copies of
    the bytes each moves (fp32: 12 bytes an element forward, 20 backward), in one process.

    Args:
        tiles: ``(elements of a tile, heads of a block)`` pairs (default :data:`CHUNK_TILES`); the block of
            heads is cut to the heads' next power of two, ``BLOCK_T = elements // BLOCK_H``.
        shapes: ``(B, T, H)`` triples (default: the full grid's gate shapes).

    Returns:
        One dict per (shape, tile): ``B, T, H, BLOCK_T, BLOCK_H``, ``fwd_ms``, ``bwd_ms``, ``fwd_of_copy`` and
        ``bwd_of_copy`` (the copy's time over the kernel's: the fraction of copy bandwidth reached) and
        ``err`` (relative errors of u, dh and dbeta against float64).

    On a GPU::

        python -c "from regattn.bench.suites.gatedfwa import time_chunked_tiles
        for row in time_chunked_tiles(): print(row)"
    """
    from regattn.bench.timing import measure
    from regattn.ops.gatedfwa.gate import gate_backward, gate_forward
    setup = Setup(dtype=torch.float32, device=device, backend="triton", rep_ms=rep_ms)
    cuda = device.startswith("cuda")
    shapes = shapes or [(g["B"], g["T"], g["H"]) for g in GRIDS["full"] if g.get("part") == "gate"]
    rows = []
    for B, T, H in shapes:
        h, beta = gate_inputs(setup, B, T, H, dtype=torch.float32)
        du = randn(setup, B, T, H, dtype=torch.float32)
        hd, bd = (x.double().requires_grad_(True) for x in (h, beta))
        exact = reference.gatedfwa_gate(hd, bd)
        exact = (exact, *torch.autograd.grad(exact, [hd, bd], du.double()))
        copy = {n: measure(peers.copy_floor(n * h.numel(), device)[0], cuda=cuda, rep_ms=rep_ms).ms for n in (12, 20)}
        for elements, heads in tiles or CHUNK_TILES:
            block_h = min(heads, triton.next_power_of_2(H))
            blocks = (max(1, elements // block_h), block_h)
            forward = lambda: gate_forward(h, beta, 1e-6, "chunked", blocks=blocks)
            backward = lambda: gate_backward(du, h, beta, 1e-6, blocks=blocks, scan="chunked")
            got = (forward(), *backward())
            fwd, bwd = (measure(fn, cuda=cuda, rep_ms=rep_ms).ms for fn in (forward, backward))
            rows.append(dict(B=B, T=T, H=H, BLOCK_T=blocks[0], BLOCK_H=blocks[1], fwd_ms=fwd, bwd_ms=bwd,
                             fwd_of_copy=copy[12] / fwd if fwd else None, bwd_of_copy=copy[20] / bwd if bwd else None,
                             err={name: ((a.double() - b).norm() / b.norm()).item()
                                  for name, a, b in zip(("u", "dh", "dbeta"), got, exact)}))
    return rows
