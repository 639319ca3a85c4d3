"""The fused per-head RMSNorm + RoPE at the LM's sizes in bf16 (``-m gpu``): output and gradients of x and of
the norm's weight against float64, within flash-attn's rule of the torch ops run in bf16."""
import pytest
import torch

from regattn.layers import RotaryEmbedding
from regattn.layers.norm import RMSNorm
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
