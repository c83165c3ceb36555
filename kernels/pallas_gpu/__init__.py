"""The "pallas_gpu" backend: ``heuristics.py`` decides a call's launches (``configs.py``),
``backend.py`` runs them on the Mosaic GPU (``mosaic/``, Hopper) or Triton (``triton/``)
lowering; ``plan.py`` the static plan; ``decode.py`` the cached-attention kernel."""

from ls_jax.kernels.pallas_gpu.backend import (
    pallas_gpu_attention,
    pallas_gpu_attention_parts,
    pallas_gpu_backend,
)
from ls_jax.kernels.pallas_gpu.configs import (
    HopperBackwardConfig,
    HopperForwardConfig,
    Launch,
    Launches,
    StripBackwardConfig,
    StripConfig,
    TritonConfig,
)

__all__ = ["HopperBackwardConfig", "HopperForwardConfig", "Launch", "Launches",
           "StripBackwardConfig", "StripConfig", "TritonConfig", "pallas_gpu_attention",
           "pallas_gpu_attention_parts", "pallas_gpu_backend"]
