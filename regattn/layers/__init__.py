"""nn.Modules built on the regattn ops: projections, norms, RoPE, gates and caches."""
from regattn.layers.rope import RotaryEmbedding
from regattn.layers.retention import Retention
from regattn.layers.gatedfwa import GatedFWA, GatedFWACache, GatedFWANSA, GatedFWANSACache
from regattn.layers.lla import LLA, LLACache
from regattn.layers.parallax import Parallax, ParallaxCache
