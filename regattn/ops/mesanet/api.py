"""MesaNet (lla eq. 2, parallax eq. 5), exactly, in chunks.

``o_i = S_i H_i^-1 q_i`` with ``H_i = lam I + sum_{j<=i} k_j k_j^T`` and ``S_i = sum_{j<=i} v_j k_j^T``.
The reference solves one ``D x D`` system per query (``B T H`` of them). Here the queries are taken in
chunks of ``C`` positions: with ``G`` the chunk's starting ``H`` (previous chunks' keys) and ``U`` its
keys, query ``r`` of the chunk has ``H = G + U_{<=r}^T U_{<=r}``, and Woodbury's identity gives

    H^-1 q = A q - A U_{<=r}^T (M_{<=r})^-1 U_{<=r} A q,    A = G^-1,  M = I + U A U^T,

where ``M_{<=r}`` is the leading ``(r+1) x (r+1)`` block of ``M``. With ``M = L L^T`` that block's inverse
is ``L_{<=r}^-T L_{<=r}^-1``, the leading blocks of ``L``'s inverse, so every query of the chunk is
served by products with one triangular inverse and a causal mask. A non-finite key or value entry
reaches only the rows that see it (they give NaN). Per chunk: one ``D x D`` and one ``C x C`` Cholesky
factorisation and the factors' inverses (``B T H / C`` of each), batched matrix products, no host
read; the numbers are the reference's up to rounding (``H`` and ``M`` are positive definite for ``lam > 0``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from regattn.ops._common.checks import check_attention_inputs, check_int, check_positive, resolve_backend
from regattn.reference.common import accumulation_dtype, repeat_kv


def mesanet(q, k, v, *, lam: float = 1.0, chunk: int = 64, backend="auto"):
    """MesaNet ``[B, T, HQ, Dv]`` in q's dtype, computed in fp32 (float64 for float64).

    Args:
        q: ``[B, T, HQ, D]`` queries, aligned to the last ``T`` of the ``S`` keys.
        k: ``[B, S, H, D]`` keys (``HQ % H == 0``); v: ``[B, S, H, Dv]`` values.
        lam: the ridge ``lam > 0`` (a float, as the MesaNet layer has it).
        chunk: positions per chunk (cost, not numbers).
        backend: ``"auto"`` or ``"torch"`` (this form is torch; there is no Triton kernel).

    Matches :func:`regattn.reference.mesanet` with a float ``lam``. In fp32 ``lam`` must stay well above
    fp32's rounding of ``sum k k^T`` (about ``1e-7 T max|k|^2``): below it the chunk's starting matrix is
    singular to fp32 and its Cholesky factor fails (NaN rows), where the reference's fp32 solve is finite
    but wrong. The MesaNet layer (L2-normalised keys, ``lam = 1``) is far from that bound.
    """
    B, T, S, HQ, H, D, Dv = check_attention_inputs(q, k, v)
    lam = check_positive("lam", lam)
    check_int("chunk", chunk, minimum=1)
    resolve_backend(backend, q, op="mesanet", has_triton=False)
    if T > S:
        raise ValueError(f"q: expected at most as many queries as keys ({S}), got {T}")
    dtype = accumulation_dtype(q.dtype)
    C = min(chunk, S)
    n = -(-S // C)
    pad = n * C - S

    def chunks(x, front=0):          # [B, S', HQ, E] -> [B, HQ, n, C, E], zeros appended (and prepended)
        x = F.pad(repeat_kv(x, HQ).to(dtype), (0, 0, 0, 0, front, pad))
        return x.permute(0, 2, 1, 3).reshape(B, HQ, n, C, x.shape[-1])

    k_ok, v_ok = torch.isfinite(k), torch.isfinite(v)
    seen = _sees_nonfinite(k_ok, v_ok, HQ)[:, S - T:]
    k, v = torch.where(k_ok, k, 0.0), torch.where(v_ok, v, 0.0)
    with torch.autocast(q.device.type, enabled=False):
        o = _chunked(chunks(q, front=S - T), chunks(k), chunks(v), lam)
    o = o.reshape(B, HQ, n * C, Dv)[:, :, S - T:S].transpose(1, 2)
    return torch.where(seen[..., None], float("nan"), o).to(q.dtype)


def _sees_nonfinite(k_ok, v_ok, HQ):
    """``[B, S, HQ]``: the query at each position sees a non-finite key or value entry (``k_ok``, ``v_ok``:
    which entries are finite).

    Within a chunk every row's products touch every key, so such entries are zeroed before the chunked
    algebra and the rows that see them are set to NaN after it (the rows that cannot see them are exact).
    """
    bad = ~(k_ok.all(-1) & v_ok.all(-1))
    return repeat_kv(bad.cumsum(1).gt(0)[..., None], HQ)[..., 0]


def _exclusive_sum(x):
    """Sums over the chunks before each chunk (dim 2)."""
    return x.cumsum(2) - x


class _InverseFactor(torch.autograd.Function):
    """``(L, X)``, ``X = L^-1`` where ``A = L L^T`` (``A`` symmetric positive definite; ``L`` carries no
    gradient): one Cholesky factorisation and one triangular solve against the identity. The chunks' products
    with ``X`` are batched matrix products, faster on the GPU than solves against their rows. The backward solves
    nothing either: with ``dX = -X dL X`` and the Cholesky factor's gradient ``L^-T Phi(L^T gL) L^-1``
    (symmetrised; ``Phi``: the lower triangle, its diagonal halved), every solve is a product with ``X``.
    Autograd's backward of the factorisation and the solve ran three batched triangular solves (cuBLAS's trsm:
    1.1 ms of a 4.0 ms training step of the MAD model on an H200). Its torch ops make its vmap rule."""

    generate_vmap_rule = True

    @staticmethod
    def forward(A, eye):
        L = torch.linalg.cholesky_ex(A)[0]                  # positive definite: no error check (a host read)
        return L, torch.linalg.solve_triangular(L, eye, upper=False)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*output)
        ctx.mark_non_differentiable(output[0])

    @staticmethod
    def backward(ctx, _gL, gX):
        L, X = ctx.saved_tensors
        gL = -(X.mT @ gX @ X.mT).tril()
        P = (L.mT @ gL).tril()
        P.diagonal(dim1=-2, dim2=-1).mul_(0.5)
        gA = X.mT @ P @ X
        return 0.5 * (gA + gA.mT), None


def _chunked(Q, U, V, lam):
    """``[B, H, n, C, D]`` chunks -> outputs ``[B, H, n, C, Dv]`` (see the module's text)."""
    C, D = U.shape[-2:]
    eye_d = torch.eye(D, dtype=U.dtype, device=U.device)
    eye_c = torch.eye(C, dtype=U.dtype, device=U.device)
    G = lam * eye_d + _exclusive_sum(U.mT @ U)                 # H at each chunk's start
    S = _exclusive_sum(V.mT @ U)                               # [.., Dv, D]
    Ig = _InverseFactor.apply(G, eye_d)[1]                     # G^-1 = Ig^T Ig
    QA, UA = ((torch.cat([Q, U], -2) @ Ig.mT) @ Ig).split(C, -2)
    Im = _InverseFactor.apply(eye_c + UA @ U.mT, eye_c)[1]
    Y = (QA @ U.mT @ Im.mT).tril() @ Im                        # row r: the leading (r+1) block of M^-1
    X = QA - Y @ UA                                            # H_i^-1 q_i, each row
    return X @ S.mT + (X @ U.mT).tril() @ V
