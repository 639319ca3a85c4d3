"""regattn: attention as test-time regression — exact references and fused Triton kernels.

Tensors are ``[B, T, H, D]``; every op takes ``backend="auto" | "torch" | "triton"``.
"""
from regattn.ops.softmax.api import softmax_attention
from regattn.ops.gatedfwa.api import gatedfwa, gatedfwa_gate
from regattn.ops.parallax.api import parallax, parallax_decode
from regattn.ops.lla.api import lla, lla_decode
from regattn.ops.mesanet.api import mesanet
from regattn.ops.decay.api import (
    decay_linear_attention, decay_linear_prefill, decay_linear_step, register_decay_method,
)
from regattn.ops.decay.leetdecoding import causal_linear_decoder
from regattn.ops.scan.api import scan_attention
from regattn.ops.scan.sdpa import exact_attention

__version__ = "0.1.0"

__all__ = [
    "softmax_attention", "gatedfwa_gate", "gatedfwa", "parallax", "parallax_decode", "lla", "lla_decode", "mesanet",
    "decay_linear_attention", "decay_linear_prefill", "decay_linear_step", "register_decay_method",
    "causal_linear_decoder",
    "scan_attention", "exact_attention",
]


def __getattr__(name):
    """``regattn.convert_to_parallax`` comes from :mod:`regattn.hf` (the ``hf`` extra), imported on first use.

    It stays out of ``__all__`` so that ``from regattn import *`` does not need transformers.
    """
    if name == "convert_to_parallax":
        from regattn.hf.convert import convert_to_parallax
        return convert_to_parallax
    raise AttributeError(f"module 'regattn' has no attribute {name!r}")
