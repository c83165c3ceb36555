"""The "pallas_gpu" backend (Pallas Triton): plan.py, forward.py, backward.py, tiles.py, and
backend.py (padding, custom_vjp, the backend function)."""

from ls_jax.kernels.pallas_gpu.backend import (
    pallas_gpu_attention,
    pallas_gpu_attention_parts,
    pallas_gpu_backend,
)
from ls_jax.kernels.pallas_gpu.plan import KernelConfig, default_config

__all__ = ["KernelConfig", "default_config", "pallas_gpu_attention",
           "pallas_gpu_attention_parts", "pallas_gpu_backend"]
