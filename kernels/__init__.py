"""LS-attention kernels: one entry point, ``ls_attention``, over several backends.

Backends (``kernels/backends.py``): "reference" (pure JAX, the oracle), "cudnn" (GPU
baseline), "pallas_gpu" and "pallas_tpu" (our block-sparse Pallas kernels, subpackages of the
same shape), "split" (GPU: cuDNN for the global heads, "pallas_gpu" for the local ones). The
band rule lives in ``kernels/band.py``; the entry point, validation and the shape-letter
legend in ``kernels/api.py``. Each call is planned once (``kernels/plan.py``: the backends by
``kernels/dispatch.py``'s rules, the partitioning over the mesh, the launches; ``explain``
prints the plan) and executed: per shard on sharded inputs (``kernels/sharded.py``), a faster
forward-only backend where nothing differentiates (``kernels/directional.py``), forward-mode
autodiff (``kernels/forward_mode.py``).
"""

from ls_jax.kernels.api import (
    DEFAULT_IMPLEMENTATION,
    IMPLEMENTATIONS,
    CallPlan,
    LogitStats,
    default_implementation,
    explain,
    ls_attention,
    normalize_window_sizes,
)

__all__ = [
    "DEFAULT_IMPLEMENTATION",
    "IMPLEMENTATIONS",
    "CallPlan",
    "LogitStats",
    "default_implementation",
    "explain",
    "ls_attention",
    "normalize_window_sizes",
]
