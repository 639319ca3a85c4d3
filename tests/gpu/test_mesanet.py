"""MesaNet in chunks on a GPU (``-m gpu``), through torch's products and through the Triton kernels: fp32 at the
MAD model's size against the float64 spec, bf16 Triton against torch, and one forward+backward of each captured in a
CUDA graph (nothing is read back)."""
import pytest
import torch

import regattn
from regattn import reference
from tests.gpu.rule import leaves, outputs
from tests.helpers import randn, rel_err

pytestmark = pytest.mark.gpu


def _inputs(B, T, H, D, Dv=None):
    Dv = Dv or D
    k = torch.nn.functional.normalize(randn(B, T, H, D, device="cuda"), dim=-1)
    return [randn(B, T, H, D, device="cuda"), k, randn(B, T, H, Dv, device="cuda")], randn(B, T, H, Dv, device="cuda")


BACKENDS = ["torch", "triton"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("T, D, Dv", [(128, 64, 64), (300, 64, 64), (200, 48, 40)])
def test_fp32_matches_float64_reference(T, D, Dv, backend):
    x, do = _inputs(8, T, 2, D, Dv)
    want = outputs(lambda *a: reference.mesanet(*a, lam=1.0), leaves(x), do)
    got = outputs(lambda *a: regattn.mesanet(*a, lam=1.0, backend=backend), leaves(x, torch.float32), do)
    for name, a, b in zip(["o", "dq", "dk", "dv"], got, want):
        assert rel_err(a.double(), b) < 1e-5, name


def test_bf16_triton_matches_torch():
    x, do = _inputs(16, 128, 2, 64)
    got, want = (outputs(lambda *a: regattn.mesanet(*a, lam=1.0, backend=b), leaves(x, torch.bfloat16),
                         do.bfloat16()) for b in ("triton", "torch"))
    for name, a, b in zip(["o", "dq", "dk", "dv"], got, want):
        assert a.dtype == torch.bfloat16 and rel_err(a.double(), b.double()) < 1e-2, name


@pytest.mark.parametrize("backend", BACKENDS)
def test_forward_backward_in_a_cuda_graph(backend):
    x, do = _inputs(128, 128, 2, 64)
    xs = leaves(x, torch.float32)

    def step():
        return outputs(lambda *a: regattn.mesanet(*a, lam=1.0, backend=backend), xs, do.float())

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        want = step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = step()
    graph.replay()
    torch.cuda.synchronize()
    for name, a, b in zip(["o", "dq", "dk", "dv"], got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)
