"""What ``ls_attention(..., implementation=None)`` runs: one rule, ``choose_implementation``.

Per platform:

| platform | case | backend | why |
|---|---|---|---|
| cpu | any | "reference" | the pure-JAX twin (dense [B, H, T, S] logits; CPU runs are small) |
| tpu | any | "pallas_tpu" | the only block-sparse TPU path |
| cuda ("gpu") | every head global (window None or >= T), no logit statistics, no segment ids, bfloat16/float16, D a multiple of 8 and <= 128 | "cudnn" | full causal attention: our kernel runs at 0.81x / 0.78x of cuDNN (fwd / fwd+bwd) at n=8192 and 0.77x / 0.72x at n=32768, D=64 (H100, docs/performance.md, run F); at D=32, n=32768 it is 0.93x / 1.01x |
| cuda ("gpu") | anything else | "pallas_gpu" | any local head: 2.56x / 2.50x the cuDNN composition at 1 global + 15 local, p=128, n=8192, D=64 (same run); logit statistics cost cuDNN an extra pass; cuDNN takes no segment ids or float32 |
| rocm or other | any | error | the Pallas GPU kernel is written for CUDA (Triton) and "reference" materialises [B, H, T, S] float32 logits: the caller must choose |

The D range is the one ``jax.nn.dot_product_attention(implementation="cudnn")`` accepts on
every CUDA card (<= 128, a multiple of 8; Hopper also takes up to 256, not measured here).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ls_jax.kernels.band import WindowSizes, is_global

IMPLEMENTATIONS = ("reference", "cudnn", "pallas_gpu", "pallas_tpu")
PALLAS_IMPLEMENTATIONS = ("pallas_gpu", "pallas_tpu")

# The backend of each platform when the case does not change it (see the table above).
DEFAULT_IMPLEMENTATION = {
    "cpu": "reference",
    "gpu": "pallas_gpu",
    "cuda": "pallas_gpu",
    "tpu": "pallas_tpu",
}


def current_platform() -> str:
    """JAX's default platform, with "gpu" resolved to "cuda" or "rocm"."""
    platform = jax.default_backend()
    if platform == "gpu":
        version = str(getattr(jax.devices()[0].client, "platform_version", "")).lower()
        return "rocm" if "rocm" in version else "cuda"
    return platform


def cudnn_fits(window_sizes: WindowSizes, seq_len: int, head_dim: int, dtype,
               has_segments: bool, return_logit_stats: bool) -> bool:
    """True for a call where cuDNN is faster than our kernel and computes the same thing."""
    return (all(is_global(p, seq_len) for p in window_sizes) and not return_logit_stats
            and not has_segments and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)
            and head_dim % 8 == 0 and head_dim <= 128)


def choose_implementation(platform: str | None = None, *, window_sizes: WindowSizes | None = None,
                          seq_len: int | None = None, head_dim: int | None = None, dtype=None,
                          has_segments: bool = False, return_logit_stats: bool = False) -> str:
    """The backend for one call on ``platform`` (default: ``current_platform()``).

    Without the case (``window_sizes`` etc. None) it returns the platform's default backend.
    Raises ValueError on a platform with no memory-safe default.
    """
    platform = current_platform() if platform is None else platform
    if platform not in DEFAULT_IMPLEMENTATION:
        raise ValueError(
            f"implementation: no default backend on platform {platform!r} (pallas_gpu is "
            "written for CUDA and 'reference' materialises [B, H, T, T] float32 logits); pass "
            f"one of {IMPLEMENTATIONS} explicitly")
    implementation = DEFAULT_IMPLEMENTATION[platform]
    if implementation == "pallas_gpu" and window_sizes is not None and cudnn_fits(
            window_sizes, seq_len, head_dim, dtype, has_segments, return_logit_stats):
        return "cudnn"
    return implementation
