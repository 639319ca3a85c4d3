"""GatedFWA (gatedfwa.md Figure 10 and Section 4): windowed gated attention forward and
forward+backward against full-causal FlashAttention, our ungated sliding window, FlexAttention
(the gate as a score_mod, the window as a mask_mod) and flash-linear-attention's forgetting
attention; and the gate preprocessing against the two-kernel torch path and a device copy of
the same bytes (the memory-bound floor)."""
from __future__ import annotations

import inspect

import torch

import regattn
from regattn import reference
from regattn.bench import counts, peers
from regattn.bench.runner import build, flex_case, for_mode, ours, randn, reference_case, sdpa_cases

NAME = "gatedfwa"
PEERS = ("sdpa-flash", "sdpa-cudnn", "flex", "fla", "reference", "copy")
MODES = ("fwd", "fwd+bwd")
GRIDS = {
    "tiny": [dict(B=1, H=2, T=48, D=16, w=16), dict(part="gate", B=1, T=64, H=4)],
    "default": [dict(B=1, H=16, T=T, D=128, w=w) for T in (4096, 32768) for w in (512, 1024)]
    + [dict(part="gate", B=1, T=65536, H=H) for H in (64, 128)],
    "full": [dict(B=1, H=16, T=T, D=128, w=w) for T in (4096, 8192, 16384, 32768, 65536, 131072) for w in (512, 1024)]
    + [dict(part="gate", B=1, T=65536, H=H) for H in (16, 64, 128)],
}


def cases(shape: dict, setup):
    """Attention shapes: B, H, HQ (default H), T, D, w. Gate shapes: part="gate", B, T, H."""
    yield from (gate_cases if shape.get("part") == "gate" else attention_cases)(shape, setup)


def gate_inputs(setup, B, T, H):
    """Gate pre-activations ``h`` and amplitudes ``beta`` near 1 (the layer's ``1 + elu(.)`` at init)."""
    h = randn(setup, B, T, H)
    beta = 1.0 + 0.1 * torch.rand(B, T, H, device=setup.device, dtype=setup.dtype)
    return h, beta


def gate_cases(shape, setup):
    B, T, H = shape["B"], shape["T"], shape["H"]
    h, beta = gate_inputs(setup, B, T, H)
    n = dict(flops=counts.gate_flops(B, T, H), bytes=counts.gate_bytes(B, T, H, h.element_size()))
    yield "gate", ours(regattn.gatedfwa_gate, h, setup, lambda: regattn.gatedfwa_gate(h, beta, backend=setup.backend),
                       [], mode="gate", **n)
    yield from reference_case(setup, "gate", lambda: reference.gatedfwa_gate(h, beta), [], **n)
    if peers.wanted(setup.peers, "copy"):
        yield "gate", build("copy (memory floor)", lambda: peers.copy_floor(n["bytes"], setup.device), mode="gate",
                            compare=False, **n)


def fla_forgetting(q, k, v, u, window):
    """flash-linear-attention's forgetting attention with per-step log-gates ``g_t = u_t - u_{t-1}``."""
    fn = peers.fla_function("parallel_forgetting_attn")
    g = torch.diff(u.detach().float(), dim=1, prepend=torch.zeros_like(u[:, :1]).float())
    kwargs = {"window_size": window} if "window_size" in inspect.signature(fn).parameters else {}
    leaves = [peers.leaf(x) for x in (q, k, v)] + [g.requires_grad_(u.requires_grad)]
    return (lambda: fn(*leaves, **kwargs)), leaves


def attention_cases(shape, setup):
    B, H, T, D, w = shape["B"], shape["H"], shape["T"], shape["D"], shape["w"]
    HQ = shape.get("HQ", H)
    q = randn(setup, B, T, HQ, D, grad=True)
    k, v = randn(setup, B, T, H, D, grad=True), randn(setup, B, T, H, D, grad=True)
    h, beta = gate_inputs(setup, B, T, HQ)
    u = reference.gatedfwa_gate(h, beta).requires_grad_(True)
    for mode in MODES:
        bwd = mode == "fwd+bwd"
        n = dict(flops=counts.attention_flops(B, T, T, HQ, D, D, window=w, backward=bwd),
                 bytes=counts.attention_bytes(B, T, T, HQ, H, D, D, q.element_size(), backward=bwd, extra_per_query=1))
        yield mode, ours(regattn.gatedfwa, q, setup,
                         lambda: regattn.gatedfwa(q, k, v, u, window=w, backend=setup.backend), [q, k, v, u],
                         mode=mode, **n)
        yield mode, ours(regattn.softmax_attention, q, setup,
                         lambda: regattn.softmax_attention(q, k, v, window=w, backend=setup.backend), [q, k, v],
                         mode=mode, tag=" (window, no gate)", compare=False, **n)
        yield from sdpa_cases(setup, mode, q, k, v, backends=("flash", "cudnn"), tag=" (full causal)", **n)
        yield from flex_case(setup, mode, q, k, v, window=w, gate=u, **n)
        if peers.wanted(setup.peers, "fla"):
            yield mode, build("fla:parallel_forgetting_attn", lambda: fla_forgetting(*for_mode(mode, q, k, v, u), w),
                              mode=mode, **n)
        yield from reference_case(setup, mode, lambda: reference.gatedfwa(q, k, v, u, window=w), [q, k, v, u], **n)
