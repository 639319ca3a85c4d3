"""``regattn.exact_attention()``: models that call SDPA run the scan and give the same outputs."""
import pytest
import torch
import torch.nn.functional as F

import regattn
from tests.helpers import randn, rel_err


class TinyViTBlock(torch.nn.Module):
    """Pre-norm attention + MLP block that calls SDPA directly (as timm / transformers models do)."""

    def __init__(self, dim=32, heads=2, causal=False):
        super().__init__()
        self.heads, self.causal = heads, causal
        self.norm1, self.norm2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.qkv, self.proj = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 2 * dim), torch.nn.GELU(), torch.nn.Linear(2 * dim, dim))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(B, T, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        x = x + self.proj(a.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp(self.norm2(x))


def _backend():
    return "triton" if torch.cuda.is_available() or __import__("os").environ.get("TRITON_INTERPRET") == "1" else "torch"


@pytest.mark.parametrize("causal", [False, True])
def test_model_calling_sdpa_matches(interpret, causal):
    torch.manual_seed(0)
    model = torch.nn.Sequential(TinyViTBlock(causal=causal), TinyViTBlock(causal=causal)).eval()
    x = randn(2, 21, 32, dtype=torch.float32)
    with torch.no_grad():
        ref = model(x)
        with regattn.exact_attention(backend=_backend()) as stats:
            out = model(x)
    assert stats.calls == 2 and stats.fallbacks == 0
    assert rel_err(out, ref) < 1e-5
    assert F.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention


def test_transformer_encoder_matches(interpret):
    """nn.TransformerEncoder in inference mode: its fused fast path is switched off so SDPA is routed."""
    torch.manual_seed(1)
    layer = torch.nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False).eval()
    x = randn(3, 17, 32, dtype=torch.float32)
    with torch.no_grad():
        ref = model(x)
        with regattn.exact_attention(backend=_backend()) as stats:
            out = model(x)
    assert stats.calls == 2
    assert rel_err(out, ref) < 1e-5
    assert torch.backends.mha.get_fastpath_enabled()


def test_unsupported_calls_fall_back():
    q, k, v = (randn(1, 2, 5, 8, dtype=torch.float32) for _ in range(3))
    mask = torch.rand(5, 5) > 0.3
    mask[:, 0] = True
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    with regattn.exact_attention(backend="torch") as stats:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        routed = F.scaled_dot_product_attention(q, k, v)
    assert stats.fallbacks == 1 and stats.calls == 1
    assert torch.equal(out, ref)
    assert rel_err(routed, F.scaled_dot_product_attention(q, k, v)) < 1e-5


def test_gqa_and_three_dim_inputs():
    q = randn(2, 4, 6, 8, dtype=torch.float64)
    k, v = randn(2, 2, 6, 8, dtype=torch.float64), randn(2, 2, 6, 8, dtype=torch.float64)
    ref = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    q3, k3, v3 = randn(3, 5, 8), randn(3, 7, 8), randn(3, 7, 4)
    ref3 = F.scaled_dot_product_attention(q3, k3, v3)
    with regattn.exact_attention(backend="torch") as stats:
        out = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        out3 = F.scaled_dot_product_attention(q3, k3, v3)
    assert stats.calls == 2
    assert rel_err(out, ref) < 1e-12 and rel_err(out3, ref3) < 1e-12


def test_bad_arguments():
    with pytest.raises(ValueError, match="precision"):
        with regattn.exact_attention(precision="bf16"):
            pass
    with pytest.raises(ValueError, match="backend"):
        with regattn.exact_attention(backend="cuda"):
            pass
