"""The fused per-head RMSNorm (or L2 norm) + RoPE at the LM's sizes in bf16, and the residual stream's pre-norm
under bf16 autocast (``-m gpu``): output and gradients of x and of the norm's weight against float64, within
flash-attn's rule of the torch ops run in the same precision."""
import pytest
import torch

from regattn.layers import RotaryEmbedding
from regattn.layers.norm import L2Norm, PreNorm, RMSNorm
from regattn.layers.rope import norm_rope
from tests.gpu.rule import assert_within, leaves

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("shape,offset", [((16, 1024, 8, 64), 0), ((2, 4099, 5, 128), 7), ((3, 1, 32, 128), 4095)])
@pytest.mark.parametrize("rotate", [True, False])
def test_bf16_within_the_rule(shape, offset, rotate):
    D = shape[-1]
    weight = 1 + 0.5 * torch.randn(D, device="cuda", dtype=torch.float64)
    angles = RotaryEmbedding(D, base=1e6).angles(shape[1], offset, "cuda") if rotate else None
    x = torch.randn(shape, device="cuda", dtype=torch.float64) * 3
    dy = torch.randn(shape, device="cuda", dtype=torch.float64)

    def outputs(dtype, backend):
        """``[y, dy/dx, dy/dweight]``: x in ``dtype``, the weight in fp32 (float64 for the exact run)."""
        norm = RMSNorm(D, eps=1e-6).to(device="cuda", dtype=torch.float64 if dtype == torch.float64 else torch.float32)
        with torch.no_grad():
            norm.weight.copy_(weight)
        (xs,) = leaves([x], dtype)
        y = norm_rope(xs, norm, angles, backend=backend)
        dx, dweight = torch.autograd.grad(y, [xs, norm.weight], dy.to(y.dtype))
        return [y, dx, dweight[None]]  # the rule slices dim 1

    got = outputs(torch.bfloat16, "triton")
    assert got[0].dtype == torch.bfloat16 and got[2].dtype == torch.float32
    assert_within(["y", "dx", "dweight"], got, outputs(torch.float64, "torch"), outputs(torch.bfloat16, "torch"))


@pytest.mark.parametrize("shape", [(16, 1024, 8, 64), (3, 4099, 2, 128)])
def test_l2_norm_bf16_within_the_rule(shape):
    angles = RotaryEmbedding(shape[-1], base=1e4).angles(shape[1], 0, "cuda")
    x = torch.randn(shape, device="cuda", dtype=torch.float64) * 3
    dy = torch.randn(shape, device="cuda", dtype=torch.float64)

    def outputs(dtype, backend):
        (xs,) = leaves([x], dtype)
        y = norm_rope(xs, L2Norm(), angles, backend=backend)
        return [y, *torch.autograd.grad(y, [xs], dy.to(y.dtype))]

    got = outputs(torch.bfloat16, "triton")
    assert_within(["y", "dx"], got, outputs(torch.float64, "torch"), outputs(torch.bfloat16, "torch"))


@pytest.mark.parametrize("shape", [(128, 128, 128), (2, 4099, 1024)])
def test_prenorm_under_autocast_within_the_rule(shape):
    """An fp32 residual stream under bf16 autocast: the kernels' bf16 output and fp32 gradients against float64,
    within the rule of torch's norm under the same autocast."""
    weight = 1 + 0.5 * torch.randn(shape[-1], device="cuda", dtype=torch.float64)
    x = torch.randn(shape, device="cuda", dtype=torch.float64) * 3
    dy = torch.randn(shape, device="cuda", dtype=torch.float64)

    def outputs(exact, backend):
        norm = PreNorm(shape[-1], backend=backend).to(device="cuda", dtype=torch.float64 if exact else torch.float32)
        with torch.no_grad():
            norm.weight.copy_(weight)
        (xs,) = leaves([x], None if exact else torch.float32)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=not exact):
            y = norm(xs)
        dx, dweight = torch.autograd.grad(y, [xs, norm.weight], dy.to(y.dtype))
        return [y, dx, dweight[None]]

    got = outputs(False, "triton")
    assert got[0].dtype == torch.bfloat16 and got[1].dtype == got[2].dtype == torch.float32
    assert_within(["y", "dx", "dweight"], got, outputs(True, "torch"), outputs(False, "torch"))
