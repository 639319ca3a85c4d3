"""Local Linear Attention (lla-local-linear-attention.txt eq. 6-8), BD-LLA and SW-LLA."""
from __future__ import annotations

from numbers import Real

import torch

from regattn import reference
from regattn.ops._common.checks import (
    check_attention_inputs, check_bool, check_choice, check_device, check_int, check_positive, check_scale,
    check_tensor, check_window, host_checks_allowed, resolve_kernel_backend,
)
from regattn.ops.lla.backward import lla_backward
from regattn.ops.lla.forward import direct_solver, lla_forward
from regattn.reference.lla import CG_GRADIENTS, lla_blocks_uncentred, lla_matrix_free

HAS_TRITON = True


def check_lam(lam, B: int, T: int, HQ: int, D: int, q: torch.Tensor):
    """Ridge ``lam``: a float, ``[B, T, HQ]`` (per query) or ``[B, T, HQ, D]`` (per dimension); finite and > 0
    (a tensor's values are checked where :func:`host_checks_allowed`)."""
    if isinstance(lam, Real) and not isinstance(lam, bool):
        return check_positive("lam", lam)
    if not isinstance(lam, torch.Tensor):
        raise TypeError(f"lam: expected a float or a tensor, got {type(lam).__name__}")
    check_tensor("lam", lam)
    if tuple(lam.shape) not in ((B, T, HQ), (B, T, HQ, D)):
        raise ValueError(f"lam: expected shape [B, T, HQ] = {(B, T, HQ)} or [B, T, HQ, D] = {(B, T, HQ, D)}, "
                         f"got {tuple(lam.shape)}")
    check_device("lam", lam, q, "q")
    if host_checks_allowed() and not bool((torch.isfinite(lam) & (lam > 0)).all()):
        raise ValueError(f"lam: expected finite values > 0, got min {lam.min().item()}")
    return lam


class FlashLLA(torch.autograd.Function):
    """Full LLA with the CG solver (Algorithm 1-2, ``bd = 0``), or BD-LLA by direct solves with
    1 x 1 (``bd = 1``) or 2 x 2 blocks (``bd = 2``): Triton forward and fused backward (Appendix D)."""

    @staticmethod
    def forward(ctx, q, k, v, lam_tensor, lam_value, scale, window, bd, cg_iters, cg_tol, cg_precondition):
        lam = lam_value if lam_tensor is None else lam_tensor
        cg_iters = cg_iters or 1  # not used by the direct solves
        D = q.shape[-1]
        o, rho, delta, m2, argmax, omega, centre = lla_forward(q, k, v, lam, scale=scale, window=window,
                                                blocks={0: None, 1: D, 2: D // 2}[bd],
                                                cg_iters=cg_iters, cg_tol=cg_tol, cg_precondition=cg_precondition)
        ctx.save_for_backward(q, k, v, lam_tensor, rho, delta, m2, argmax, omega, centre)
        ctx.lam_value, ctx.scale, ctx.window, ctx.cg_iters, ctx.cg_tol = lam_value, scale, window, cg_iters, cg_tol
        ctx.bd = bd
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, lam_tensor, rho, delta, m2, argmax, omega, centre = ctx.saved_tensors
        lam = ctx.lam_value if lam_tensor is None else lam_tensor
        lam_grad = lam_tensor is not None and ctx.needs_input_grad[3]
        dq, dk, dv, dlam = lla_backward(do, q, k, v, lam, rho, delta, m2, argmax, omega, centre, scale=ctx.scale,
                                        window=ctx.window, cg_iters=ctx.cg_iters, cg_tol=ctx.cg_tol,
                                        lam_grad=lam_grad, bd=ctx.bd)
        dlam = dlam.to(lam_tensor.dtype) if dlam is not None else None
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dlam, None, None, None, None, None, None, None


BLOCK_BACKWARD_CHUNK = 256


def block_lla_backward(do, q, k, v, lam, *, scale, window, blocks, lam_grad: bool, cg_iters=None, cg_tol=0.0):
    """BD-LLA gradients by recomputing eq. 10-11 per feature block (exact block solves) in float32,
    ``BLOCK_BACKWARD_CHUNK`` queries at a time against the keys they can see: memory
    ``O(chunk S + S D^2 / g)``, never the ``T x S x D`` differences. With fewer ``cg_iters`` than the
    block size (CG not yet exact) the chunks recompute the torch backend's CG and its implicit gradient
    instead (memory ``O(g chunk S)``), so both backends give the same gradient. Returns ``(dq, dk, dv, dlam)``."""
    B, T, HQ, D = q.shape
    if cg_iters is not None and cg_iters < D // blocks:
        def recompute(*a, lam):
            return lla_matrix_free(*a, lam=lam, scale=scale, window=window, blocks=blocks, cg_iters=cg_iters,
                                   cg_tol=cg_tol)
    else:
        def recompute(*a, lam):
            return lla_blocks_uncentred(*a, lam=lam, scale=scale, window=window, blocks=blocks)
    S = k.shape[1]
    dq, dk, dv = (torch.zeros(x.shape, device=x.device, dtype=torch.float32) for x in (q, k, v))
    dlam = torch.zeros(lam.shape, device=q.device, dtype=torch.float32) if lam_grad else None
    for i0 in range(0, T, BLOCK_BACKWARD_CHUNK):
        i1 = min(T, i0 + BLOCK_BACKWARD_CHUNK)
        end = i1 + S - T
        start = 0 if window is None else max(0, i0 + S - T - window + 1)
        if end <= 0:
            continue
        with torch.enable_grad():
            qc = q[:, i0:i1].detach().float().requires_grad_(True)
            kc, vc = (x[:, start:end].detach().float().requires_grad_(True) for x in (k, v))
            lamc = lam
            if isinstance(lam, torch.Tensor):
                lamc = lam[:, i0:i1].detach().float().requires_grad_(lam_grad)
            o = recompute(qc, kc, vc, lam=lamc)
            grads = torch.autograd.grad(o, [qc, kc, vc] + ([lamc] if lam_grad else []), do[:, i0:i1].float())
        dq[:, i0:i1] += grads[0]
        dk[:, start:end] += grads[1]
        dv[:, start:end] += grads[2]
        if lam_grad:
            dlam[:, i0:i1] += grads[3]
    return dq, dk, dv, dlam


class FlashBlockLLA(torch.autograd.Function):
    """BD-LLA with one CG per block over ``g`` blocks of more than 2 features: Triton forward; the backward
    recomputes the torch form query chunk by query chunk (not fused; see :func:`block_lla_backward`)."""

    @staticmethod
    def forward(ctx, q, k, v, lam_tensor, lam_value, scale, window, blocks, cg_iters, cg_tol):
        lam = lam_value if lam_tensor is None else lam_tensor
        o, *_ = lla_forward(q, k, v, lam, scale=scale, window=window, blocks=blocks,
                            cg_iters=cg_iters or 1, cg_tol=cg_tol)
        ctx.save_for_backward(q, k, v, lam_tensor)
        ctx.lam_value, ctx.scale, ctx.window, ctx.blocks = lam_value, scale, window, blocks
        ctx.cg_iters, ctx.cg_tol = cg_iters, cg_tol
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, lam_tensor = ctx.saved_tensors
        lam = ctx.lam_value if lam_tensor is None else lam_tensor
        lam_grad = lam_tensor is not None and ctx.needs_input_grad[3]
        dq, dk, dv, dlam = block_lla_backward(do, q, k, v, lam, scale=ctx.scale, window=ctx.window,
                                              blocks=ctx.blocks, lam_grad=lam_grad, cg_iters=ctx.cg_iters,
                                              cg_tol=ctx.cg_tol)
        dlam = dlam.to(lam_tensor.dtype) if dlam is not None else None
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dlam, None, None, None, None, None, None


def check_cg_gradient(cg_gradient, backend) -> str:
    """``cg_gradient`` of :func:`lla`: ``"unrolled"`` needs the torch backend."""
    if check_choice("cg_gradient", cg_gradient, CG_GRADIENTS) == "unrolled" and backend == "triton":
        raise ValueError("cg_gradient: 'unrolled' runs on the torch backend only; pass backend='torch' or 'auto'")
    return cg_gradient


def full_precision(q: torch.Tensor):
    """Autocast off: the torch forms compute in float32 (their solves and statistics lose every digit when an
    enclosing bf16 autocast rounds their products), and the kernels take the inputs' own dtypes."""
    return torch.autocast(device_type=q.device.type, enabled=False)


def check_lla_args(q, k, v, lam, scale, window, blocks, cg_iters, cg_tol, cg_precondition):
    """Validate every argument of :func:`lla`; returns ``(lam, scale, window, cg_tol)``."""
    B, T, S, HQ, H, D, Dv = check_attention_inputs(q, k, v)
    lam = check_lam(lam, B, T, HQ, D, q)
    scale = check_scale(scale, D)
    window = check_window(window)
    if blocks is not None:
        check_int("blocks", blocks, minimum=1)
        if D % blocks:
            raise ValueError(f"blocks: expected a divisor of the head dim D = {D}, got {blocks}")
    if cg_iters is not None:
        check_int("cg_iters", cg_iters, minimum=1)
    cg_tol = check_positive("cg_tol", cg_tol, allow_zero=True)
    check_bool("cg_precondition", cg_precondition)
    return lam, scale, window, cg_tol


# fp16 inputs run the fp32 kernels on widened copies: fp16's range cannot hold the solve's quantities, which
# grow as 1 / lam (at lam = 0.01 the fp16 kernels' output was 18 to 23 times its norm away from float64 at D 128,
# and their gradients 80 to 1500 times at D 16; tests still run the fp16 kernels in the interpreter, where they
# stand in for the bf16 ones)
WIDEN_FP16 = True


def lla_triton(q, k, v, lam, *, scale, window, blocks, cg_iters, cg_tol, cg_precondition=False):
    """Dispatch to the kernels; exact solves other than the direct BD-LLA ones stay in torch."""
    if WIDEN_FP16 and q.dtype == torch.float16:
        return lla_triton(q.float(), k.float(), v.float(), lam, scale=scale, window=window, blocks=blocks,
                          cg_iters=cg_iters, cg_tol=cg_tol, cg_precondition=cg_precondition).to(torch.float16)
    D = q.shape[-1]
    lam_tensor, lam_value = (lam, None) if isinstance(lam, torch.Tensor) else (None, lam)
    bd = direct_solver(blocks, D)
    blocks = None if blocks == 1 else blocks
    if cg_iters is None and bd == 0:
        # the exact solve in torch: the uncentred form (eq. 10-11) in float32, O(T D^2 / g) memory
        f32 = [x.float() for x in (q, k, v)]
        lam32 = lam.float() if isinstance(lam, torch.Tensor) else lam
        return lla_blocks_uncentred(*f32, lam=lam32, scale=scale, window=window, blocks=blocks or 1).to(q.dtype)
    if blocks is None or bd:
        return FlashLLA.apply(q, k, v, lam_tensor, lam_value, scale, window, bd, cg_iters, cg_tol, cg_precondition)
    return FlashBlockLLA.apply(q, k, v, lam_tensor, lam_value, scale, window, blocks, cg_iters, cg_tol)


def lla(q, k, v, *, lam, scale=None, window=None, blocks=None, cg_iters=None, cg_tol=1e-6, cg_gradient="implicit",
        cg_precondition=False, backend="auto"):
    """Local Linear Attention (lla eq. 6-8): the local linear estimator at each query.

    Kernel weights ``w_ij = exp(scale * q_i.k_j - m_i)`` over the visible keys ``j <= i``
    (and the window), where ``m_i`` is the row maximum of ``scale * q_i.k_j``: the weights of
    FlashLLA's Algorithms 1-2, whose largest is 1. The ridge ``lam`` is measured against these
    weights (eq. 8 is not homogeneous in w, so this normalisation is part of the definition,
    and gradients flow through ``m_i`` as well).
    With ``z_ij = k_j - q_i``, ``omega_i = sum w_ij``, ``mu_i = sum w_ij z_ij``,
    ``Sigma_i = sum w_ij z_ij z_ij^T + diag(lam_i)`` and ``rho_i = Sigma_i^-1 mu_i``:

        ``o_i = sum_j w_ij (1 - z_ij.rho_i) v_j / (omega_i - mu_i.rho_i)``.

    Precision: a query with fewer visible keys than dimensions has a denominator of about
    ``lam / |z|^2``, formed by cancellation; fp32 keeps about ``eps |z|^2 / lam`` relative error there.
    Finite inputs still give finite outputs and gradients for any ``lam > 0``: the denominator is kept
    above its exact lower bound ``omega^2 lam_min / (omega lam_min + |mu|^2)`` with its sign, the output is
    formed as ``w (1 / omega - (k - kbar).rho / delta)`` so the weighted mean of the values never passes
    through it (nearly one-hot weights give the top value), a system singular in fp32 falls back to
    ``rho = 0`` in the exact solves, and a CG row whose curvature ``p.Sigma p`` falls below
    ``0.1 lam_min |p|^2`` keeps its iterate. For accuracy keep ``lam`` well above ``eps |z|^2``
    (:class:`regattn.layers.LLA` floors it at ``lam_min``) or pass float64. Truncated CG in fp32 also
    needs more than ``D`` iterations as ``lam`` shrinks (rounding breaks its finite termination).
    A NaN or inf key or value reaches only the rows that see it, whose outputs and ``dq`` (and the ``dk``,
    ``dv`` of the keys they see) turn non-finite; the kernels set them NaN (:mod:`regattn.ops._common.hidden`).

    Args:
        q: ``[B, T, HQ, D]``; k: ``[B, S, H, D]``; v: ``[B, S, H, Dv]`` (GQA when ``HQ % H == 0``);
            queries are aligned to the end of the keys.
        lam: ridge, a float, ``[B, T, HQ]`` per query, or ``[B, T, HQ, D]`` per dimension.
        scale: defaults to ``D ** -0.5`` (the inverse bandwidth ``1/h``).
        window: SW-LLA, keys ``i - w < j <= i``.
        blocks: BD-LLA with ``g`` diagonal blocks of size ``D / g`` (Appendix E.1).
        cg_iters: None for an exact solve; an int for that many conjugate-gradient iterations
            (Algorithm 2, with the active mask: a system stops once ``||r|| <= cg_tol ||mu||``; BD-LLA
            runs one CG per block, exact after ``D / g`` iterations in exact arithmetic). Gradients with
            ``cg_iters`` are implicit by default, on both backends: the CG result is treated as the exact
            ``Sigma^-1 mu`` and the adjoint system is solved by the same CG (``cg_iters``, ``cg_tol``), so
            they are the same on both backends at every ``cg_iters`` below ``D`` and the derivative of the
            output once CG has converged. From ``cg_iters = D`` on, the fused backward allows its adjoint
            ``2 cg_iters`` iterations (fp32 rounding delays CG on an ill-conditioned ``Sigma``; rows stop at
            ``cg_tol`` as before; ``ops.lla.backward.adjoint_iterations``).
        cg_gradient: ``"implicit"`` (the default, above) or ``"unrolled"``: autograd through the CG
            iterations run, the derivative of the truncated solve itself; torch backend only (``"auto"``
            takes it), storing every iteration's state for the backward. On MQAR (8 iterations) the implicit
            gradient solved length 128 and the unrolled one reached 0.11 (docs/EXPERIMENTS.md): the default.
        cg_precondition: precondition full LLA's CG by the inverse covariance of the keys that every query
            of a block of 128 positions sees before the block (with a small relative ridge;
            :func:`regattn.reference.lla.key_preconditioner`). It shares the keys' sampling noise with each
            query's scatter: on the H100 (bf16, D 128, T 512) 8 iterations come within 0.035 of the exact
            solve instead of 0.084, and with anisotropic keys the gain is larger. Off by default: at B 4,
            H 16, T 8192 it adds a quarter to cg=8's time, about what three more plain iterations cost
            (docs/MODELS.md). BD-LLA's blocks and the backward's adjoint solve run plain CG.
        backend: ``"auto" | "torch" | "triton"``. Triton (bf16, fp32; fp16 on the fp32 kernels, whose range
            holds the solve) runs full LLA with
            ``cg_iters`` given (fused forward and backward) and BD-LLA (``g = D`` and ``g = D / 2``
            by direct solves, where ``cg_iters`` is not needed; other ``g`` by one CG per block); the backward is
            fused for full LLA, ``g = D`` and ``g = D / 2``, and recomputes the block-exact torch form
            per query chunk for other ``g``. For ``g = D`` and ``g = D / 2`` the fused backward adds ``dq`` in
            fp32 atomically (its last bits may differ between runs); under
            ``torch.use_deterministic_algorithms(True)`` it forms ``dq`` in a pass of its own instead. With
            ``cg_iters=None`` full LLA (and BD-LLA with other ``g``) solves exactly in torch through the uncentred form
            (eq. 10-11, ``[T, D, D]`` per head), not in a kernel.

    Returns:
        ``o: [B, T, HQ, Dv]`` in q's dtype.
    """
    lam, scale, window, cg_tol = check_lla_args(q, k, v, lam, scale, window, blocks, cg_iters, cg_tol,
                                                cg_precondition)
    return lla_dispatch(q, k, v, lam, scale=scale, window=window, blocks=blocks, cg_iters=cg_iters, cg_tol=cg_tol,
                        cg_gradient=check_cg_gradient(cg_gradient, backend), cg_precondition=cg_precondition,
                        backend=backend)


def lla_dispatch(q, k, v, lam, *, scale: float, window, blocks, cg_iters, cg_tol, cg_gradient="implicit",
                 cg_precondition=False, backend="auto", op="lla"):
    """:func:`lla` on checked arguments. The LLA layer's entry: its ridge is in range by construction, so no
    value is read on the host (no device sync per call), and a non-finite input flows to the output instead
    of raising (a training step with it is skipped, not crashed)."""
    if cg_gradient == "unrolled" and cg_iters is not None:
        backend = "torch"
    with full_precision(q):
        if resolve_kernel_backend(backend, q, op=op, has_triton=HAS_TRITON) == "triton":
            return lla_triton(q, k, v, lam, scale=scale, window=window, blocks=blocks, cg_iters=cg_iters,
                              cg_tol=cg_tol, cg_precondition=cg_precondition)
        return reference.lla(q, k, v, lam=lam, scale=scale, window=window, blocks=blocks, cg_iters=cg_iters,
                             cg_tol=cg_tol, cg_gradient=cg_gradient, cg_precondition=cg_precondition)


def lla_decode(q, k_cache, v_cache, *, lam, scale=None, window=None, blocks=None, cg_iters=None, cg_tol=1e-6,
               cg_precondition=False, backend="auto"):
    """LLA for new tokens against a KV cache (inference; no autograd graph is built).

    Args:
        q: ``[B, Tn, HQ, D]``, the ``Tn`` newest queries; k_cache: ``[B, S, H, D]`` and
            v_cache: ``[B, S, H, Dv]`` hold every key and value so far, the new tokens' last
            (query ``i`` sits at cache position ``S - Tn + i``).
        lam, scale, window, blocks, cg_iters, cg_tol, cg_precondition, backend: as in :func:`lla` (the
            preconditioner of a query's block reads the cache before the block once per call).

    Returns:
        ``o: [B, Tn, HQ, Dv]``. The kernel keeps only per-query state, so memory grows with the
        cache alone.
    """
    lam, scale, window, cg_tol = check_lla_args(q, k_cache, v_cache, lam, scale, window, blocks, cg_iters,
                                                cg_tol, cg_precondition)
    if q.shape[1] > k_cache.shape[1]:
        raise ValueError(f"q: expected at most as many new tokens as the cache holds ({k_cache.shape[1]}), "
                         f"got {q.shape[1]}")
    with torch.no_grad():
        return lla_dispatch(q, k_cache, v_cache, lam, scale=scale, window=window, blocks=blocks, cg_iters=cg_iters,
                            cg_tol=cg_tol, cg_precondition=cg_precondition, backend=backend, op="lla_decode")
