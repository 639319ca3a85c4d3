"""NSA compression and selection on a GPU (``-m gpu``): the peak memory of the forward (and of
forward+backward) grows linearly in T at 4k, 16k and 64k tokens (NSA's default blocks: compressed 32 with
stride 16, selection 64, top 16), and the layer decodes step by step as its full forward."""
import pytest
import torch

from regattn.layers import GatedFWANSA
from regattn.ops.nsa import nsa_attention
from tests.helpers import decode_one_by_one, randn, rel_err

pytestmark = pytest.mark.gpu
NSA = dict(block_cmp=32, stride_cmp=16, block_slc=64, topk=16)


def peak_bytes(T, backward, B=1, HQ=16, H=4, D=128, device="cuda"):
    """Peak memory allocated by one call (and its backward) above what its inputs hold."""
    n = (T - NSA["block_cmp"]) // NSA["stride_cmp"] + 1
    x = [randn(B, s, h, D, dtype=torch.bfloat16, device=device, requires_grad=backward)
         for s, h in ((T, HQ), (T, H), (T, H), (n, H), (n, H))]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    o = nsa_attention(*x, **NSA)
    if backward:
        torch.autograd.grad(o, x, [torch.ones_like(o[0])] * 2)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "forward-backward"])
def test_peak_memory_grows_linearly(backward):
    peaks = {T: peak_bytes(T, backward) for T in (4096, 16384, 65536)}
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
