"""The "pallas_tpu" backend (Pallas Mosaic): plan.py, forward.py, backward.py, tiles.py, and
backend.py (layout, custom_vjp, the backend function)."""

from ls_jax.kernels.pallas_tpu.backend import (
    interpret_params,
    pallas_tpu_attention_parts,
    pallas_tpu_backend,
)

__all__ = ["interpret_params", "pallas_tpu_attention_parts", "pallas_tpu_backend"]
