"""One ``torch.autograd.Function`` per decay kernel.

For ``O = (B C^T ⊙ M) V`` with ``M_ij = gamma^(i-j)``, ``i >= j``, the gradients are the same
operator on other inputs, run forward or backward in time:

    dB = F(dO, V, C)            rows i see j <= i
    dC = F_rev(V, dO, B)        dC_j = sum_{i>=j} gamma^(i-j) (v_j.dO_i) b_i
    dV = F_rev(C, B, dO)        dV_j = sum_{i>=j} gamma^(i-j) (c_j.b_i) dO_i

so each kernel's backward is three launches of the kernel itself (``reverse=True`` walks the rows
from the last). Saved for backward: b, c, v (and the initial state), their rows made contiguous once, by the
callers, before the Function. gamma is a constant of these kernels.
"""
from __future__ import annotations

import torch

from regattn.ops._common.vmap import fold_rule
from regattn.ops.decay.causal_dot_product import cdp_forward
from regattn.ops.decay.fleet import fleet_forward
from regattn.ops.decay.lightning2 import lightning2_forward
from regattn.ops.decay.memo import TensorMemo

LOG2E = 1.4426950408889634


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


class _DecayKernelFunction(torch.autograd.Function):
    """Base: subclasses set ``kernel(b, c, v, log2g, reverse=...) -> o``."""

    kernel = None

    @classmethod
    def forward(cls, b, c, v, log2g):
        return cls.kernel(b, c, v, log2g, reverse=False)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @classmethod
    def backward(cls, ctx, do):
        b, c, v, log2g = ctx.saved_tensors
        do = _rows_contiguous(do)
        db = dc = dv = None
        if ctx.needs_input_grad[0]:
            db = cls.kernel(do, v, c, log2g, reverse=False)
        if ctx.needs_input_grad[1]:
            dc = cls.kernel(v, do, b, log2g, reverse=True)
        if ctx.needs_input_grad[2]:
            dv = cls.kernel(c, b, do, log2g, reverse=True)
        return db, dc, dv, None

    @classmethod
    def vmap(cls, info, in_dims, *args):
        return fold_rule(cls.apply, batched=(0, 1, 2), outputs=(0,))(info, in_dims, *args)


class Lightning2Function(_DecayKernelFunction):
    kernel = staticmethod(lightning2_forward)


class FleetFunction(_DecayKernelFunction):
    kernel = staticmethod(fleet_forward)


class CausalDotProductFunction(_DecayKernelFunction):
    kernel = staticmethod(cdp_forward)


def _transposed(state):
    """``[N, H, R, D] -> [N, H, D, R]`` contiguous (the state of the same operator with b, c and v swapped)."""
    return None if state is None else state.transpose(-1, -2).contiguous()


class Lightning2StateFunction(torch.autograd.Function):
    """lightning2 from an initial state ``S_0 [N, H, R, D]`` (float32 or None), returning ``(o, S_T)``,
    over packed sequences with ``cu_seqlens``.

    With the final state's gradient ``G`` (``dS_T``), and 0-based rows:

        dB = F(dO, V, C)      from the state S_0^T, entering row t with gamma^(t+1)
        dC = F_rev(V, dO, B)  from the state G^T, entering row T-1-j with gamma^(T-1-j)
        dV = F_rev(C, B, dO)  from the state G, as dC
        dS_0 = gamma^T G + sum_t gamma^(t+1) b_t^T dO_t     (the final state of dV's launch)
    """

    @staticmethod
    def forward(b, c, v, s0, log2g, cu_seqlens):
        return lightning2_forward(b, c, v, log2g, initial_state=s0, output_final_state=True, cu_seqlens=cu_seqlens)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, do, d_final):
        b, c, v, s0, log2g, cu = ctx.saved_tensors
        do = torch.zeros_like(v) if do is None else _rows_contiguous(do)
        db = dc = dv = ds0 = None
        if ctx.needs_input_grad[0]:
            db = lightning2_forward(do, v, c, log2g, initial_state=_transposed(s0), cu_seqlens=cu)
        if ctx.needs_input_grad[1]:
            dc = lightning2_forward(v, do, b, log2g, reverse=True, initial_state=_transposed(d_final), init_pow=0,
                                    cu_seqlens=cu)
        if ctx.needs_input_grad[2] or ctx.needs_input_grad[3]:
            g = None if d_final is None else d_final.contiguous()
            dv, ds0 = lightning2_forward(c, b, do, log2g, reverse=True, initial_state=g, init_pow=0, final_pow=1,
                                         output_final_state=True, cu_seqlens=cu)
        return db, dc, dv, ds0 if ctx.needs_input_grad[3] else None, None, None

    vmap = staticmethod(fold_rule(lambda *args: Lightning2StateFunction.apply(*args), batched=(0, 1, 2, 3),
                                  outputs=(0, 0), whole=(5,)))


_LOG2 = TensorMemo()


def log2_gamma(gamma, H: int, device) -> torch.Tensor:
    """``log2 gamma`` as an fp32 ``[H]`` tensor (zeros for None); kept per gamma tensor until it is written to."""
    if gamma is None:
        return torch.zeros(H, device=device, dtype=torch.float32)
    if gamma.requires_grad and torch.is_grad_enabled():
        raise ValueError("gamma: the Triton decay methods take gamma as a constant, got a tensor that requires "
                         "grad; pass gamma.detach() or use backend='torch'")
    log2g = _LOG2.get(gamma)
    if log2g is None:
        log2g = (torch.log(gamma.detach().double()) * LOG2E).float().contiguous()
        _LOG2.put(gamma, log2g)
    return log2g


def _apply(function):
    def run(b, c, v, gamma):
        return function.apply(*(_rows_contiguous(x) for x in (b, c, v)), log2_gamma(gamma, b.shape[2], b.device))
    run.__name__ = function.__name__
    return run


lightning2 = _apply(Lightning2Function)
fleet = _apply(FleetFunction)
causal_dot_product = _apply(CausalDotProductFunction)


def lightning2_with_state(b, c, v, gamma, initial_state=None, cu_seqlens=None):
    """``(o, S_T)`` of lightning2 from ``initial_state`` (any float dtype, used as float32) over packed sequences."""
    s0 = None if initial_state is None else initial_state.float().contiguous()
    b, c, v = (_rows_contiguous(x) for x in (b, c, v))
    return Lightning2StateFunction.apply(b, c, v, s0, log2_gamma(gamma, b.shape[2], b.device), cu_seqlens)
