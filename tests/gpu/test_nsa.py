"""NSA compression and selection on a GPU (``-m gpu``): the selection kernel in bf16 as close to float64 as
the torch path in bf16, forward and backward; the peak memory of the forward (and of forward+backward)
grows linearly in T at 4k, 16k and 64k tokens (NSA's default blocks: compressed 32 with stride 16,
selection 64, top 16) on both paths, and the layer decodes step by step as its full forward."""
import pytest
import torch

from regattn import reference
from regattn.layers import GatedFWANSA
from regattn.ops.nsa import nsa_attention
from tests.helpers import decode_one_by_one, randn, rel_err

pytestmark = pytest.mark.gpu
NSA = dict(block_cmp=32, stride_cmp=16, block_slc=64, topk=16)


def inputs(T, B=1, HQ=16, H=4, D=128, dtype=torch.bfloat16, grad=False):
    n = (T - NSA["block_cmp"]) // NSA["stride_cmp"] + 1
    return [randn(B, s, h, D, dtype=dtype, device="cuda", requires_grad=grad)
            for s, h in ((T, HQ), (T, H), (T, H), (n, H), (n, H))]


def outputs(fn, x, do):
    o = fn(*x)
    return [*o, *torch.autograd.grad(o, x, do)]


def test_kernel_in_bf16_is_as_close_to_float64_as_the_torch_path():
    x = inputs(2048, grad=True)
    do = [randn(*x[0].shape, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    exact = outputs(lambda *a: reference.nsa_attention(*a, **NSA),
                    [t.detach().double().requires_grad_(True) for t in x], [g.double() for g in do])
    kernel = outputs(lambda *a: nsa_attention(*a, **NSA, backend="triton"), x, do)
    torch_path = outputs(lambda *a: nsa_attention(*a, **NSA, backend="torch"), x, do)
    for name, a, b, e in zip(["o_cmp", "o_slc", "dq", "dk", "dv", "dkc", "dvc"], kernel, torch_path, exact):
        assert rel_err(a, e) <= 2 * rel_err(b, e) + 1e-3, (name, rel_err(a, e), rel_err(b, e))


def peak_bytes(T, backward, backend):
    """Peak memory allocated by one call (and its backward) above what its inputs hold."""
    x = inputs(T, grad=backward)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    o = nsa_attention(*x, **NSA, backend=backend)
    if backward:
        torch.autograd.grad(o, x, [torch.ones_like(o[0])] * 2)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("backward", [False, True], ids=["forward", "forward-backward"])
def test_peak_memory_grows_linearly(backward, backend):
    peaks = {T: peak_bytes(T, backward, backend) for T in (4096, 16384, 65536)}
    print({T: f"{p / 2**20:.0f} MiB" for T, p in peaks.items()})
    assert peaks[65536] <= 4.5 * peaks[16384] and peaks[16384] <= 4.5 * peaks[4096], peaks


def test_layer_decode_equals_forward():
    torch.manual_seed(0)
    layer = GatedFWANSA(256, 4, 64, num_kv_heads=2, block_cmp=16, stride_cmp=8, block_slc=32, topk=4,
                        rope=True).cuda().double()
    x = randn(2, 300, 256, device="cuda")
    with torch.no_grad():
        full = layer(x)
        decoded, _ = decode_one_by_one(layer, x, 100)
    assert rel_err(decoded, full) < 1e-10
