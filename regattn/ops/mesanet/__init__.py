"""MesaNet as exact chunked linear algebra: Cholesky factors per chunk, no per-query solve."""
from regattn.ops.mesanet.api import mesanet
