"""Shared test helpers: relative error, fresh random inputs, the dtype-tied bounds."""
import torch

TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||`` in float64; NaN anywhere gives inf."""
    a, b = a.detach().double(), b.detach().double()
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


_fresh = torch.Generator(device="cpu")


def reseed(seed: int) -> None:
    """Start the stream of fresh inputs (``randn`` without ``seed``) at ``seed``."""
    _fresh.manual_seed(seed)


def randn(*shape, dtype=torch.float64, device="cpu", seed=None, scale=1.0, requires_grad=False):
    """Gaussian input; ``seed=None`` draws from the run's fresh stream (see tests/conftest.py)."""
    g = _fresh
    if seed is not None:
        g = torch.Generator(device="cpu")
        g.manual_seed(seed)
    x = (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(device=device, dtype=dtype)
    return x.requires_grad_(requires_grad)
