"""Mechanism diagnostics of a trained task model, per layer (parallax.txt Sections 4.3-4.4, Table 4;
lla-local-linear-attention.txt Appendix F.3).

For an attention layer with queries, keys and values at its input, in float64 and heads first,
``p_ij = softmax_j(scale q_i.k_j)`` over the visible keys and, for Parallax, ``rho_i`` the probe:

* ``COR_i = ||Sigma_KV rho_i|| / ||o_SA_i||`` (eq. 16), ``Sigma_KV = E_p[(v - v_bar)(k - k_bar)^T]``;
* ``||Corr_i||_F`` with ``Corr_i = Sigma_VV^-1/2 Sigma_KV Sigma_KK^-1/2`` (eq. 17; inverse square roots
  taken on the eigenvalues above 1e-6 of the largest, so early positions with few keys stay finite);
* ``CPA_i = ||Sigma_KV rho_i|| / (||rho_i|| ||Sigma_KV||_2)`` (eq. 17) and the probe norm ``||rho_i||``;
* scores ``s_ij``: ``p_ij`` for softmax (with the gate bias for GatedFWA), ``p_ij (1 - t_ij + t_bar_i)`` for Parallax (eq. 18),
  ``w_ij (1 - z_ij.rho_i) / (omega_i - mu_i.rho_i)`` for LLA; their per-query range and extremes,
  the attention sink (eq. 19: ``p_i1`` for the base softmax, ``s_i1^2 / sum_j s_ij^2`` for signed
  scores), the entropy of ``p`` (eq. 20), and the density ``#{j : |s_ij| > 0.1}`` (lla F.3);
* the mean probe gate ``sigmoid(x w_g)`` of a gated Parallax layer (Section 4.3);
* stable ranks ``||W||_F^2 / ||W||_2^2`` of ``W_Q, W_K, W_V, W_O, W_R`` and of the per-head circuits
  ``W_QK = W_Q^h W_K^g^T``, ``W_OV = W_O^h W_V^g``, ``W_RK = W_R^h W_K^g^T`` (Table 4), averaged over the
  query heads ``h``, each with its key/value head ``g = h // (HQ // H)`` (GQA); with GQA also their mean
  over each key/value group (``W_QK.kv0``, ...).

Every per-query quantity is averaged over queries, heads and the batch. The models are the task models
(:class:`regattn.models.stack.MixerStack`) and the language models (:class:`regattn.models.DecoderLM`);
GatedFWA+NSA and the linear mixers get the weight ranks alone.
"""
from __future__ import annotations

import torch

from regattn.layers import LLA, GatedFWA, GatedFWANSA, Parallax
from regattn.models.lm import LayerStep, SelfAttention
from regattn.models.mixers import Softmax
from regattn.ops.gatedfwa.api import gate_dispatch
from regattn.reference.common import repeat_kv, visible
from regattn.reference.lla import lla_probe, lla_statistics

DENSITY_THRESHOLD = 0.1


def stable_rank(w: torch.Tensor) -> float:
    """``||W||_F^2 / ||W||_2^2`` of a matrix."""
    s = torch.linalg.svdvals(w.detach().double())
    return float((s ** 2).sum() / s[0] ** 2) if s.numel() and s[0] > 0 else 0.0


def head_rows(w: torch.Tensor, heads: int) -> list[torch.Tensor]:
    """The rows of a ``[heads * D, d]`` projection per head: ``heads`` matrices ``[D, d]``."""
    return list(w.detach().double().view(heads, -1, w.shape[-1]))


def head_columns(w: torch.Tensor, heads: int) -> list[torch.Tensor]:
    """The columns of a ``[d, heads * D]`` output projection per head: ``heads`` matrices ``[d, D]``."""
    return list(w.detach().double().view(w.shape[0], heads, -1).transpose(0, 1))


def head_counts(mixer) -> tuple[int, int] | None:
    """``(HQ, H)``: query heads and key/value heads of a mixer; None when it names no heads."""
    HQ = getattr(mixer, "heads", None) or getattr(mixer, "num_heads", None)
    if HQ is None:
        return None
    return HQ, getattr(mixer, "kv_heads", None) or getattr(mixer, "num_kv_heads", None) or HQ


def circuits(mats: dict, HQ: int, H: int) -> dict[str, list[torch.Tensor]]:
    """Per query head ``h`` with key/value head ``g = h // (HQ // H)``: ``W_QK^h = W_Q^h^T W_K^g``,
    ``W_OV^h = W_O^h W_V^g`` and, with a probe, ``W_RK^h = W_R^h^T W_K^g`` (``[d, d]`` each)."""
    q, k, v = head_rows(mats["W_Q"], HQ), head_rows(mats["W_K"], H), head_rows(mats["W_V"], H)
    o = head_columns(mats["W_O"], HQ)
    kv = [h // (HQ // H) for h in range(HQ)]
    out = dict(W_QK=[q[h].T @ k[kv[h]] for h in range(HQ)], W_OV=[o[h] @ v[kv[h]] for h in range(HQ)])
    if "W_R" in mats:
        r = head_rows(mats["W_R"], HQ)
        out["W_RK"] = [r[h].T @ k[kv[h]] for h in range(HQ)]
    return out


def weight_ranks(mixer) -> dict:
    """Stable ranks of the projections and of the per-head circuits of an attention mixer (Table 4):
    their mean over query heads, and with GQA their mean over each key/value group."""
    names = dict(W_Q="q_proj", W_K="k_proj", W_V="v_proj", W_O="o_proj", W_R="r_proj")
    mats = {key: getattr(mixer, attr).weight for key, attr in names.items() if hasattr(mixer, attr)}
    out = {key: stable_rank(w) for key, w in mats.items()}
    heads = head_counts(mixer)
    if heads is None or not {"W_Q", "W_K", "W_V", "W_O"} <= set(mats):
        return out
    HQ, H = heads
    for key, per_head in circuits(mats, HQ, H).items():
        ranks = [stable_rank(c) for c in per_head]
        out[key] = sum(ranks) / HQ
        if H < HQ:
            group = HQ // H
            for g in range(H):
                out[f"{key}.kv{g}"] = sum(ranks[g * group:(g + 1) * group]) / group
    return out


def attention_inputs(mixer, x: torch.Tensor) -> dict | None:
    """``q, k, v`` (and ``r`` for Parallax) of a mixer at its input ``x [B, T, dim]``, as ``[B, T, H, D]``;
    for GatedFWA also the gate bias ``u_i - u_j`` (``[B, H, T, T]``).

    None for mixers without a softmax weighting (linear attention, MesaNet, Retention) and for GatedFWA+NSA
    (whose output mixes three branches).
    """
    if isinstance(mixer, SelfAttention):
        q, k, v = mixer._qkv(x, 0)
        return dict(kind="softmax", q=q, k=k, v=v, window=mixer.window)
    if isinstance(mixer, GatedFWANSA):
        return None
    if isinstance(mixer, Softmax):
        q, k, v = mixer.qkv(x)
        return dict(kind="softmax", q=q, k=k, v=v, window=mixer.window)
    if isinstance(mixer, Parallax):
        q, r, k, v = mixer.projections(x)
        out = dict(kind="parallax", q=q, r=r, k=k, v=v, window=mixer.window)
        if mixer.gate_proj is not None:
            out["gate"] = torch.sigmoid(mixer.gate_proj(x)).mean().item()
        return out
    if isinstance(mixer, LLA):
        q, k, v = mixer._qkv(x, 0)
        return dict(kind="lla", q=q, k=k, v=v, window=mixer.window, lam=mixer.ridge(x), blocks=mixer.blocks)
    if isinstance(mixer, GatedFWA):
        q, k, v = mixer._qkv(x)
        h, beta = mixer.gate_inputs(x)
        u = gate_dispatch(h, beta, eps=mixer.eps, backend="torch").double().transpose(1, 2)   # [B, H, T]
        return dict(kind="softmax", q=q, k=k, v=v, window=mixer.window, bias=u[..., :, None] - u[..., None, :])
    return None


def heads_first(x: torch.Tensor, heads: int) -> torch.Tensor:
    return repeat_kv(x.double(), heads).transpose(1, 2)


def softmax_weights(q, k, *, scale: float, window, bias=None) -> torch.Tensor:
    """``p [B, H, T, T]`` over the visible keys; ``q, k`` heads first; ``bias`` added to the logits."""
    T = q.shape[2]
    logits = (q @ k.transpose(-1, -2)) * scale
    logits = logits if bias is None else logits + bias
    return torch.softmax(logits.masked_fill(~visible(T, T, causal=True, window=window, device=q.device),
                                            float("-inf")), dim=-1)


def inv_sqrt(m: torch.Tensor, rel: float = 1e-6) -> torch.Tensor:
    """Pseudo inverse square root of symmetric PSD ``[..., n, n]`` (eigenvalues below ``rel * max`` dropped)."""
    e, u = torch.linalg.eigh(m)
    keep = e > rel * e.amax(-1, keepdim=True).clamp_min(1e-300)
    d = torch.where(keep, e.clamp_min(1e-300).rsqrt(), torch.zeros_like(e))
    return (u * d[..., None, :]) @ u.transpose(-1, -2)


def covariance_terms(p, k, v, r=None) -> dict:
    """COR, ||Corr||_F, and for a probe CPA and ||rho||: ``p [B,H,T,T]``, ``k, v, r`` heads first."""
    k_bar, v_bar = p @ k, p @ v
    o_sa = v_bar
    kc = k[:, :, None] - k_bar[:, :, :, None]                     # [B, H, T, S, D]
    vc = v[:, :, None] - v_bar[:, :, :, None]
    s_kv = torch.einsum("bhts,bhtsd,bhtse->bhtde", p, vc, kc)
    s_kk = torch.einsum("bhts,bhtsd,bhtse->bhtde", p, kc, kc)
    s_vv = torch.einsum("bhts,bhtsd,bhtse->bhtde", p, vc, vc)
    corr = inv_sqrt(s_vv) @ s_kv @ inv_sqrt(s_kk)
    out = dict(corr_f=corr.flatten(-2).norm(dim=-1).mean().item())
    if r is not None:
        corr_term = (s_kv @ r[..., None])[..., 0]
        out["cor"] = (corr_term.norm(dim=-1) / o_sa.norm(dim=-1).clamp_min(1e-300)).mean().item()
        spectral = torch.linalg.matrix_norm(s_kv, ord=2)
        cpa = corr_term.norm(dim=-1) / (r.norm(dim=-1) * spectral).clamp_min(1e-300)
        out["cpa"] = cpa.mean().item()
        out["probe_norm"] = r.norm(dim=-1).mean().item()
    return out


def score_terms(s: torch.Tensor, p: torch.Tensor, mask: torch.Tensor) -> dict:
    """Range, extremes, sinks, entropy and density of the scores ``s`` and base weights ``p`` (``[B,H,T,T]``)."""
    big = torch.finfo(s.dtype).max
    hi = s.masked_fill(~mask, -big).amax(-1)
    lo = s.masked_fill(~mask, big).amin(-1)
    entropy = -(p * torch.log(p.clamp_min(1e-300))).sum(-1)
    sq = (s * mask) ** 2
    return dict(score_range=(hi - lo).mean().item(), score_min=lo.min().item(), score_max=hi.max().item(),
                sink_base=p[..., 0].mean().item(), sink_scores=(sq[..., 0] / sq.sum(-1).clamp_min(1e-300)).mean().item(),
                entropy=entropy.mean().item(),
                density=((s.abs() > DENSITY_THRESHOLD) & mask).sum(-1).double().mean().item())


def lla_scores(q, k, *, lam, scale, window, blocks) -> torch.Tensor:
    """LLA's signed scores ``s_ij = w_ij (1 - z_ij.rho_i) / (omega_i - mu_i.rho_i)`` (lla eq. 8), ``[B, H, T, T]``."""
    stats = lla_statistics(q.double(), k.double(), lam=lam.double() if torch.is_tensor(lam) else lam, scale=scale,
                           window=window, blocks=blocks)
    rho = lla_probe(stats)
    qh, kh = q.double().transpose(1, 2), repeat_kv(k.double(), q.shape[2]).transpose(1, 2)
    z_rho = rho @ kh.transpose(-1, -2) - (rho * qh).sum(-1, keepdim=True)
    delta = stats.omega - (stats.mu * rho).sum(-1)
    return stats.w * (1 - z_rho) / delta[..., None]


@torch.no_grad()
def layer_diagnostics(mixer, x: torch.Tensor) -> dict:
    """Every diagnostic that applies to one mixer at its input ``x [B, T, dim]`` (a language model's mixer
    is read through its decoding adapter)."""
    mixer = mixer.layer if isinstance(mixer, LayerStep) else mixer
    out = weight_ranks(mixer)
    inputs = attention_inputs(mixer, x)
    if inputs is None:
        return out
    H = inputs["q"].shape[2]
    q, k, v = (heads_first(inputs[n], H) for n in ("q", "k", "v"))
    scale = q.shape[-1] ** -0.5
    T = q.shape[2]
    mask = visible(T, T, causal=True, window=inputs["window"], device=q.device).expand_as(q @ k.transpose(-1, -2))
    p = softmax_weights(q, k, scale=scale, window=inputs["window"], bias=inputs.get("bias"))
    r = heads_first(inputs["r"], H) if inputs["kind"] == "parallax" else None
    out.update(covariance_terms(p, k, v, r))
    if inputs["kind"] == "parallax":
        t = r @ k.transpose(-1, -2)
        t_bar = (p * t).sum(-1, keepdim=True)
        s = p * (1 - t + t_bar)
    elif inputs["kind"] == "lla":
        s = lla_scores(inputs["q"], inputs["k"], lam=inputs["lam"], scale=scale, window=inputs["window"],
                       blocks=inputs["blocks"])
    else:
        s = p
    out.update(score_terms(s, p, mask))
    if "gate" in inputs:
        out["probe_gate"] = inputs["gate"]
    return out


def block_inputs(model, inputs: torch.Tensor) -> list[torch.Tensor]:
    """The residual stream entering each block, ``[B, T, dim]``: the embedding, then each block's output."""
    h, out = model.embed(inputs), []
    for block in model.blocks:
        out.append(h)
        h = block(h)
    return out


@torch.no_grad()
def analyze(model, inputs: torch.Tensor) -> list[dict]:
    """Per block of a :class:`regattn.models.stack.MixerStack` or a :class:`regattn.models.DecoderLM`: the
    diagnostics at the mixer's input."""
    model.eval()
    return [dict(layer=i, **layer_diagnostics(block.mixer, block.mixer_norm(h)))
            for i, (block, h) in enumerate(zip(model.blocks, block_inputs(model, inputs)))]
