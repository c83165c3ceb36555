"""What ``ls_attention(..., implementation=None)`` runs: one rule, ``choose_implementation``.

Per platform:

| platform | case | backend | why |
|---|---|---|---|
| cpu | any | "reference" | the pure-JAX twin (dense [B, H, T, S] logits; CPU runs are small) |
| tpu | any | "pallas_tpu" | the only block-sparse TPU path |
| cuda ("gpu") | every head global (window None or >= T), no logit statistics, no segment ids, bfloat16/float16, D a multiple of 8 and <= 128 | "cudnn" | full causal attention: our kernel runs at 0.81x / 0.78x of cuDNN (fwd / fwd+bwd) at n=8192 and 0.77x / 0.72x at n=32768, D=64 (H100, docs/performance.md, run F); at D=32, n=32768 it is 0.93x / 1.01x |
| cuda ("gpu") | an LS mix at T >= 65536 with D > 64 (and <= 128, a multiple of 8), at least 1 head in 8 global, no logit statistics, no segment ids, bfloat16/float16 | "cudnn" (the composition) | the global heads' O(T^2) work dominates and cuDNN runs it faster: at D=128, n=65536, 2 global + 14 local heads, our kernel is 0.81-0.84x of the composition (fwd) and 0.87-0.89x (fwd+bwd) for p=128 and 512, while with 1 global + 15 local it is 1.08-1.13x / 1.00-1.09x and at n=32768 its fwd+bwd is still ahead (1.01-1.10x) (H100, docs/performance.md, run I) |
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


# LS mixes go to the cuDNN composition from this length on, at D > 64 with >= 1 head in 8 global
# (measured with 16 heads: 2 global is where it wins, 1 global is where it does not; run I)
LONG_SEQ_FOR_CUDNN = 65536


def cudnn_fits(window_sizes: WindowSizes, seq_len: int, head_dim: int, dtype,
               has_segments: bool, return_logit_stats: bool) -> bool:
    """True for a call where cuDNN is faster than our kernel and computes the same thing
    (the table in this module's docstring)."""
    if (return_logit_stats or has_segments or jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16)
            or head_dim % 8 or head_dim > 128):
        return False
    n_global = sum(is_global(p, seq_len) for p in window_sizes)
    if n_global == len(window_sizes):
        return True  # full causal
    return head_dim > 64 and seq_len >= LONG_SEQ_FOR_CUDNN and 8 * n_global >= len(window_sizes)


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
