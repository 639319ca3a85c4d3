"""The executable specification: every mechanism of the family in plain PyTorch.

Float64-capable and differentiable by autograd; every fast path is tested against it.
"""
from regattn.reference.common import repeat_kv, visible
from regattn.reference.softmax import attention_logits, softmax_attention
from regattn.reference.gatedfwa import gatedfwa, gatedfwa_gate
from regattn.reference.nsa import nsa_attention
from regattn.reference.elsa import scan_attention
from regattn.reference.parallax import parallax, parallax_scores
from regattn.reference.lla import lla
from regattn.reference.regression import (
    affine_linear_attention, affine_mesanet, linear_attention, mesanet, value_averaging,
)
from regattn.reference.decay import decay_linear_attention, decay_linear_prefill, decay_linear_step
