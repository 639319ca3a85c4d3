"""Shared test helpers: relative error, fresh random inputs, the dtype-tied bounds."""
import torch

TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||`` in float64; NaN anywhere gives inf."""
    a, b = a.detach().double(), b.detach().double()
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def randn(*shape, dtype=torch.float64, device="cpu", seed=None, scale=1.0, requires_grad=False):
    g = torch.Generator(device="cpu")
    if seed is not None:
        g.manual_seed(seed)
    else:
        g.seed()
    x = (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(device=device, dtype=dtype)
    return x.requires_grad_(requires_grad)
