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
On CUDA the same algebra runs in the Triton kernels of :mod:`regattn.ops.mesanet.kernels` (the factorisations
stay torch's), and the rows go into and out of the chunks in one pass each way, the non-finite entries' masks
with them (:mod:`regattn.ops.mesanet.layout`).
"""
from __future__ import annotations

import torch

from regattn.ops._common.checks import check_attention_inputs, check_int, check_positive, resolve_kernel_backend
from regattn.ops._common.hidden import finite_copy, hidden_flags, per_query_head, rows_seeing
from regattn.ops._common.vmap import fold_rule
from regattn.ops.mesanet.kernels import ChunkOutput, ChunkSums, Precondition, inverse_factor_backward, lower_inverse
from regattn.ops.mesanet.layout import FromChunks, ToChunks
from regattn.reference.common import accumulation_dtype

HAS_TRITON = True
KERNEL_MAX = 64  # the largest head dims and chunk of the Triton path (larger tiles spill and overflow shared memory)


def mesanet(q, k, v, *, lam: float = 1.0, chunk: int = 64, backend="auto"):
    """MesaNet ``[B, T, HQ, Dv]`` in q's dtype, computed in fp32 (float64 for float64).

    Args:
        q: ``[B, T, HQ, D]`` queries, aligned to the last ``T`` of the ``S`` keys.
        k: ``[B, S, H, D]`` keys (``HQ % H == 0``); v: ``[B, S, H, Dv]`` values.
        lam: the ridge ``lam > 0`` (a float, as the MesaNet layer has it).
        chunk: positions per chunk (cost, not numbers).
        backend: ``"auto"`` (Triton on CUDA fp16, bf16 and fp32 inputs with head dims and chunk up to
            :data:`KERNEL_MAX`, else torch), ``"torch"`` or ``"triton"``: the chunk algebra in the Triton kernels of
            :mod:`regattn.ops.mesanet.kernels`, the Cholesky factorisations torch's either way.

    Matches :func:`regattn.reference.mesanet` with a float ``lam``. In fp32 ``lam`` must stay well above
    fp32's rounding of ``sum k k^T`` (about ``1e-7 T max|k|^2``): below it the chunk's starting matrix is
    singular to fp32 and its Cholesky factor fails (NaN rows), where the reference's fp32 solve is finite
    but wrong. The MesaNet layer (L2-normalised keys, ``lam = 1``) is far from that bound.
    """
    B, T, S, HQ, H, D, Dv = check_attention_inputs(q, k, v)
    lam = check_positive("lam", lam)
    check_int("chunk", chunk, minimum=1)
    backend = _kernels_take(resolve_kernel_backend(backend, q, op="mesanet", has_triton=HAS_TRITON), backend,
                            D=D, Dv=Dv, chunk=min(chunk, S))
    if T > S:
        raise ValueError(f"q: expected at most as many queries as keys ({S}), got {T}")
    dtype = accumulation_dtype(q.dtype)
    C = min(chunk, S)
    n = -(-S // C)
    pad = n * C - S

    if backend == "triton":
        with torch.autocast(q.device.type, enabled=False):
            return _mesanet_kernels(q, k, v, lam, C, n)

    def chunks(x, front=0):  # [B, S', H', E] -> [B, HQ, n, C, E] in dtype, zeros around, in one copy
        heads, E = x.shape[2:]
        out = (x.new_zeros if front or pad else x.new_empty)(B, heads, HQ // heads, n * C, E, dtype=dtype)
        out[:, :, :, front:front + x.shape[1]] = x.transpose(1, 2).unsqueeze(2)   # each kv head to its group
        return out.view(B, HQ, n, C, E)

    # within a chunk every row's products touch every key: non-finite entries become zeros, and the rows that see
    # one are set to NaN after the chunked algebra (the rows that cannot see them are exact)
    seen = per_query_head(rows_seeing(hidden_flags(k, v), T, None), HQ // H).transpose(1, 2)   # [B, T, HQ]
    k, v = finite_copy(k), finite_copy(v)
    with torch.autocast(q.device.type, enabled=False):
        o = _chunked(chunks(q, front=S - T), chunks(k), chunks(v), lam)
    o = o.reshape(B, HQ, n * C, Dv)[:, :, S - T:S].transpose(1, 2)
    return torch.where(seen[..., None], float("nan"), o).to(q.dtype)


def _kernels_take(resolved: str, asked: str, **sizes) -> str:
    """``resolved``, or ``"torch"`` where the Triton path was picked by ``"auto"`` and a size is over
    :data:`KERNEL_MAX`; asked for by name there, a ValueError naming the sizes."""
    if resolved != "triton" or max(sizes.values()) <= KERNEL_MAX:
        return resolved
    if asked == "auto":
        return "torch"
    raise ValueError(f"backend: the Triton path of mesanet takes head dims and a chunk up to {KERNEL_MAX}, got "
                     + ", ".join(f"{key}={value}" for key, value in sizes.items()) + "; use backend='auto' or 'torch'")


def _exclusive_sum(x):
    """Sums over the chunks before each chunk (dim 2), the first zero. A running sum shifted by one chunk, not the
    inclusive sum less each chunk's own: that difference rounds with the chunk's keys, later positions included."""
    return torch.cat([torch.zeros_like(x[:, :, :1]), x[:, :, :-1].cumsum(2)], 2)


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


class _KernelInverseFactor(_InverseFactor):
    """:class:`_InverseFactor` on ``[N, K, K]`` matrices with the inverse and the backward in Triton
    (:func:`lower_inverse`, :func:`inverse_factor_backward`), not cuBLAS's batched triangular solve and five batched
    products with their masks."""

    generate_vmap_rule = False

    @staticmethod
    def forward(A):
        L = torch.linalg.cholesky_ex(A)[0].contiguous()
        return L, lower_inverse(L)

    @staticmethod
    def backward(ctx, _gL, gX):
        return inverse_factor_backward(*ctx.saved_tensors, gX.contiguous())

    vmap = staticmethod(fold_rule(lambda A: _KernelInverseFactor.apply(A), batched=(0,), outputs=(0, 0)))


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


def _mesanet_kernels(q, k, v, lam, C, n):
    """:func:`mesanet` in ``n`` chunks of ``C`` through the Triton kernels: the rows into and out of the chunks in one
    pass each way (:mod:`regattn.ops.mesanet.layout`), the chunk algebra in :func:`_chunked_kernels`."""
    T, HQ, S = q.shape[1], q.shape[2], k.shape[1]
    Q = ToChunks.apply(q, HQ, n * C, S - T, False)[0]
    U, bad_k = ToChunks.apply(k, HQ, n * C, 0, True)
    V, bad_v = ToChunks.apply(v, HQ, n * C, 0, True)
    seen = (bad_k | bad_v).cumsum(1) > 0                      # [B, S, H]: sees a non-finite key or value entry
    O = _chunked_kernels(*(x.unflatten(2, (n, C)) for x in (Q, U, V)), lam)
    return FromChunks.apply(O.flatten(2, 3), seen, T, q.dtype)


def _chunked_kernels(Q, U, V, lam):
    """:func:`_chunked` through the Triton kernels on the chunks flattened to ``[B H n, ...]``: :class:`ChunkSums`,
    :class:`Precondition` and :class:`ChunkOutput`, with :class:`_KernelInverseFactor` for the factors."""
    shape, n_chunks = V.shape, V.shape[2]
    Q, U, V = (x.flatten(0, 2).contiguous() for x in (Q, U, V))
    G, S = ChunkSums.apply(U, V, lam, n_chunks)
    Ig = _KernelInverseFactor.apply(G)[1]
    QA, UA, M = Precondition.apply(Q, U, Ig)
    Im = _KernelInverseFactor.apply(M)[1]
    return ChunkOutput.apply(QA, UA, U, V, S, Im)[0].view(shape)
