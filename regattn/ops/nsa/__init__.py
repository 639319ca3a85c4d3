"""NSA's compression and selection branches in linear memory (gatedfwa.md Appendix B)."""
from regattn.ops.nsa.api import nsa_attention
