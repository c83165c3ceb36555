"""LS-attention kernels: one entry point, ``ls_attention``, over several backends.

Backends: "reference" (pure JAX, the oracle), "cudnn" (GPU baseline), "pallas_gpu" and
"pallas_tpu" (our block-sparse Pallas kernels, subpackages of the same shape), "split" (GPU:
cuDNN for the global heads, "pallas_gpu" for the local ones). The band rule lives in
``kernels/band.py``, the choice of ``implementation=None`` in ``kernels/dispatch.py`` (a call
that nothing differentiates may run another backend than a differentiated one:
``kernels/directional.py``), the entry point, validation and the shape-letter legend in
``kernels/api.py``, one call per shard on sharded inputs in ``kernels/sharded.py``, forward-mode
autodiff in ``kernels/forward_mode.py``.
"""

from ls_jax.kernels.api import (
    DEFAULT_IMPLEMENTATION,
    IMPLEMENTATIONS,
    LogitStats,
    default_implementation,
    ls_attention,
    normalize_window_sizes,
)

__all__ = [
    "DEFAULT_IMPLEMENTATION",
    "IMPLEMENTATIONS",
    "LogitStats",
    "default_implementation",
    "ls_attention",
    "normalize_window_sizes",
]
