"""GatedFWA at full size on a GPU (``-m gpu``): the attention kernel (gated window, full causal, sliding
window, varlen) forward and backward, and the gate kernels, against the float64 reference."""
import pytest
import torch
import torch.nn.functional as F

import regattn
from regattn import reference
from tests.gpu.rule import assert_within, leaves, outputs, segments
from tests.helpers import randn

pytestmark = pytest.mark.gpu
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
# The reference computed in fp16/bf16 (upcast=False) casts the gate u to that dtype and can be far off: a
# fixed bound per dtype caps flash-attn's rule there.
CAP = {FP16: 2e-3, BF16: 1e-2}


def check_attention(B, T, HQ, H, D, dtype, *, window, gated, cu_seqlens=None, device="cuda"):
    """Output and the gradients of q, k, v (and the fp32 gate u); each packed sequence on its own as well."""
    x = [randn(B, T, n, D, dtype=dtype, device=device) for n in (HQ, H, H)]
    if gated:  # u = -cumsum(alpha), alpha uniform in [0, 0.1]
        x.append((-torch.cumsum(torch.rand(B, T, HQ, dtype=torch.float64) * 0.1, 1)).float().to(device))
    do = randn(B, T, HQ, D, dtype=dtype, device=device)
    cu = None if cu_seqlens is None else torch.tensor(cu_seqlens, dtype=torch.int32, device=device)

    def attend(backend):
        return lambda q, k, v, *u: regattn.softmax_attention(q, k, v, window=window, gate=u[0] if u else None,
                                                             cu_seqlens=cu, backend=backend)
    got = outputs(attend("triton"), leaves(x), do)
    exact = outputs(attend("torch"), leaves(x, torch.float64), do)
    plain = lambda q, k, v, *u: reference.softmax_attention(q, k, v, window=window, gate=u[0] if u else None,
                                                            cu_seqlens=cu, upcast=False)
    same = None if dtype == FP32 else outputs(plain, leaves(x), do)
    assert_within(["o", "dq", "dk", "dv", "du"], got, exact, same, fixed=2e-5, cap=CAP.get(dtype),
                  parts=segments(cu_seqlens) if cu_seqlens else ())


def check_gate(B, T, H, device="cuda"):
    """u, dh and dbeta against float64, within 2x the error of the torch reference in fp32 plus 1e-5."""
    h = randn(B, T, H, dtype=FP32, device=device, scale=3.0)
    beta = 1 + F.elu(randn(B, T, H, dtype=FP32, device=device))
    du = randn(B, T, H, dtype=FP32, device=device)
    got = outputs(lambda h, b: regattn.gatedfwa_gate(h, b, backend="triton"), leaves([h, beta]), du)
    exact = outputs(reference.gatedfwa_gate, leaves([h, beta], torch.float64), du)
    same = outputs(reference.gatedfwa_gate, leaves([h, beta]), du)
    assert_within(["u", "dh", "dbeta"], got, exact, same, slack=1e-5)


@pytest.mark.parametrize("B,T,HQ,H,D,dtype,window,gated,cu_seqlens", [
    pytest.param(1, 4096, 16, 4, 128, BF16, 512, True, None, id="gated-window-GQA-bf16"),
    pytest.param(1, 2048, 16, 4, 128, FP16, 512, True, None, id="gated-window-GQA-fp16"),
    pytest.param(1, 2048, 16, 4, 128, FP32, 512, True, None, id="gated-window-GQA-fp32"),
    pytest.param(1, 3000, 16, 16, 64, BF16, None, True, None, id="gated-full-causal-T3000-bf16"),
    pytest.param(2, 2048, 8, 8, 64, BF16, 300, False, None, id="sliding-window-d64-bf16"),
    pytest.param(1, 4096, 8, 8, 128, BF16, 512, True, [0, 1000, 1001, 3333, 4096], id="gated-window-varlen-bf16"),
    pytest.param(1, 4096, 8, 8, 128, FP16, 512, True, [0, 1000, 1001, 3333, 4096], id="gated-window-varlen-fp16"),
])
def test_attention(B, T, HQ, H, D, dtype, window, gated, cu_seqlens):
    check_attention(B, T, HQ, H, D, dtype, window=window, gated=gated, cu_seqlens=cu_seqlens)


def test_gate_against_torch_fp32():
    check_gate(2, 65536, 64)


# Chunked-scan tiles of more threads than words in a look-back step of LOOK_BACK chunks: before the step was
# widened to a word per thread (gate.look_back_width), each gave relative errors of 1e-3 to 0.5 on an H100 at
# some of the swept shapes.
WIDE_TILES = [(128, 8, 4), (256, 8, 8), (128, 16, 8), (256, 16, 16), (128, 32, 16)]


@pytest.mark.parametrize("H", [16, 64])
@pytest.mark.parametrize("blocks", WIDE_TILES)
def test_chunked_gate_wide_tiles(blocks, H):
    """u, dh and dbeta of the chunked scan against float64 in three calls (the look-back's order varies)."""
    from regattn.ops.gatedfwa.gate import gate_backward, gate_forward
    h = randn(1, 65536, H, dtype=FP32, device="cuda", scale=3.0)
    beta = 1 + F.elu(randn(1, 65536, H, dtype=FP32, device="cuda"))
    du = randn(1, 65536, H, dtype=FP32, device="cuda")
    exact = outputs(reference.gatedfwa_gate, leaves([h, beta], torch.float64), du)
    for _ in range(3):
        got = [gate_forward(h, beta, 1e-6, blocks=blocks), *gate_backward(du, h, beta, 1e-6, blocks=blocks)]
        for name, g, e in zip(("u", "dh", "dbeta"), got, exact):
            err = ((g.double() - e).norm() / e.norm()).item()
            assert err < 1e-5, f"{name}: relative error {err:.2e} with tile {blocks}"
