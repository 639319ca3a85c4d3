"""Shared test helpers: relative error, fresh random inputs, the dtype-tied bounds."""
import contextlib

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


_HOST_READS = ("item", "tolist", "numpy", "__int__", "__index__", "__float__", "__bool__")


@contextlib.contextmanager
def no_host_reads():
    """Fails the test when code inside reads a tensor's value on the host (``.item()``, ``int(t)``,
    ``bool(t)``, ``.tolist()``, ...), the reads that sync a GPU; on CUDA any synchronizing call is an
    error as well (``torch.cuda.set_sync_debug_mode("error")``)."""
    def refuse(name):
        def read(self, *args, **kwargs):
            raise AssertionError(f"a tensor was read on the host (Tensor.{name}) where no host read may happen")
        return read

    saved = {name: getattr(torch.Tensor, name) for name in _HOST_READS}
    mode = torch.cuda.get_sync_debug_mode() if torch.cuda.is_available() else None
    for name in _HOST_READS:
        setattr(torch.Tensor, name, refuse(name))
    if mode is not None:
        torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)
        if mode is not None:
            torch.cuda.set_sync_debug_mode(mode)


def decode_one_by_one(layer, x: torch.Tensor, prompt: int):
    """``(outputs, cache)`` of ``layer.prefill`` on the first ``prompt`` tokens of ``x`` (none when 0: the
    first ``step`` starts from no cache), then ``layer.step`` on each later token, outputs joined in time."""
    cache, outs = None, []
    if prompt:
        y, cache = layer.prefill(x[:, :prompt])
        outs.append(y)
    for t in range(prompt, x.shape[1]):
        y, cache = layer.step(x[:, t:t + 1], cache)
        outs.append(y)
    return torch.cat(outs, 1), cache

