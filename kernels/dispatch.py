"""What ``ls_attention(..., implementation=None)`` runs: ``choose_implementation`` for a call
that is differentiated (training) and ``choose_primal_implementation`` for one that is not
(inference, evaluation, a prefill). Where the two differ, ``kernels/directional.py`` runs each
in its place from one call site.

Per platform (every row applies to both kinds of call unless it says "not differentiated"):

| platform | case | backend | why |
|---|---|---|---|
| cpu | any | "reference" | the pure-JAX twin (dense [B, H, T, S] logits; CPU runs are small) |
| tpu | any | "pallas_tpu" | the only block-sparse TPU path |
| cuda ("gpu") | every head global (window None or >= T), no logit statistics, no segment ids, bfloat16/float16, D a multiple of 8 and <= 128 | "cudnn" | full causal attention: on an H100 our kernel (its Hopper kernels) runs the forward at 1.10-1.13x cuDNN's at D=64 (run L) and 1.08-1.11x at D=128 (run Q), but its forward+backward at 0.95-0.99x of cuDNN's (n=8192-32768; docs/performance.md, runs M and Q; 0.86-0.94x in run J), at D=64 a tie since run R (0.987x, 1.016x: one sample each); a call that nothing differentiates takes the next row on Hopper; without the Hopper kernels 0.63-0.82x (run I) |
| cuda ("gpu"), not differentiated | as the "cudnn" row, on a Hopper GPU (``pallas_gpu.mosaic_ring.is_hopper()``), D a multiple of 64 (where our Hopper forward runs), T >= ``HOPPER_FORWARD_MIN_SEQ_LEN`` | "pallas_gpu" | our all-global Hopper forward against cuDNN's (H100, run S, B=4 H=16): D=64 1.45x (n=1024), 0.96-1.00x (2048: a tie), 1.05x (4096), 1.07-1.11x (8192), 1.08-1.10x (32768); D=128 1.08x, 1.10x, 1.13-1.20x, 1.13x, 1.09x; at n=65536 (B=1) 1.10x and 1.12x (docs/performance.md); a differentiated call of the same case still runs cuDNN forward and backward |
| cuda ("gpu") | a GPU where our Hopper kernels do not run (``pallas_gpu.mosaic_ring.is_hopper()`` false; ``hopper=``), an LS mix (>= 1 global and >= 1 local head) at T >= 32768 with D > 64 (and <= 128, a multiple of 8), at least 1 head in 8 global, no logit statistics, no segment ids, bfloat16/float16 | "split" (kernels/split.py: cuDNN causal for the global heads, ours for the local ones) | the global heads' O(T^2) work dominates and cuDNN's causal backward beats our Triton one: on an H100 with our Triton-only path, D=128 2 global + 14 local p=128, f+b 19.72 vs 25.53 ms (n=32768) and 17.06 vs 23.16 ms (n=65536) (run J, call 3); on Hopper our kernel beats "split" (every forward; every f+b but one tie) and keeps these mixes |
| cuda ("gpu") | anything else | "pallas_gpu" | any local head: 2.7x forward / 1.8x forward+backward the cuDNN composition at 1 global + 15 local, p=128, n=8192, D=64; at D=128 (1-2 global heads, p=128-512, n=4096-65536) forward 1.4-2.6x, forward+backward 1.04-1.7x, the grid in one call (the local heads on the Hopper kernels; 0.98x in one row before run T: n=65536, 2 global, p=512) (H100, runs S-U; the composition takes no gathers since run S); logit statistics cost cuDNN an extra pass; cuDNN takes no segment ids or float32 |
| rocm or other | any | error | the Pallas GPU kernel is written for CUDA (Triton) and "reference" materialises [B, H, T, S] float32 logits: the caller must choose |

The D range is the one ``jax.nn.dot_product_attention(implementation="cudnn")`` accepts on
every CUDA card (<= 128, a multiple of 8; Hopper also takes up to 256, not measured here).
The "split" thresholds are the SPLIT_* constants below.
"""

from __future__ import annotations

from fractions import Fraction

import jax
import jax.numpy as jnp

from ls_jax.kernels.band import WindowSizes, is_global

IMPLEMENTATIONS = ("reference", "cudnn", "pallas_gpu", "pallas_tpu", "split")
# the backends that take interpret=True: the Pallas ones, and "split" (for its local heads)
INTERPRET_IMPLEMENTATIONS = ("pallas_gpu", "pallas_tpu", "split")

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


# The "split" rule (the table above), one place to edit it. On a GPU without our Hopper
# kernels, an LS mix goes to "split" when T >= SPLIT_MIN_SEQ_LEN,
# SPLIT_MIN_HEAD_DIM_EXCLUSIVE < D <= CUDNN_MAX_HEAD_DIM and at least SPLIT_MIN_GLOBAL_SHARE of
# its heads are global (16 heads: 2 global is where cuDNN's causal backward pays off against
# our Triton kernel, run J call 3; 1 global wins f+b by 8% but loses the forward by 36%).
SPLIT_MIN_SEQ_LEN = 32768
SPLIT_MIN_HEAD_DIM_EXCLUSIVE = 64
SPLIT_MIN_GLOBAL_SHARE = Fraction(1, 8)
# The primal rule (the table above): a call that nothing differentiates and that cuDNN would
# take (every head global) runs our kernel on a Hopper GPU when our Hopper forward runs it
# (D a multiple of 64) and T >= HOPPER_FORWARD_MIN_SEQ_LEN.
HOPPER_FORWARD_HEAD_DIM_MULTIPLE = 64
HOPPER_FORWARD_MIN_SEQ_LEN = 1024  # the shortest measured (run S); below it neither was timed
# what jax.nn.dot_product_attention(implementation="cudnn") takes on every CUDA card
CUDNN_MAX_HEAD_DIM = 128
CUDNN_HEAD_DIM_MULTIPLE = 8


def cudnn_takes(head_dim: int, dtype, has_segments: bool, return_logit_stats: bool) -> bool:
    """True for a call that cuDNN computes in one pass (no statistics, no segments, its dtypes
    and head sizes)."""
    return not (return_logit_stats or has_segments
                or jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16)
                or head_dim % CUDNN_HEAD_DIM_MULTIPLE or head_dim > CUDNN_MAX_HEAD_DIM)


def cudnn_fits(window_sizes: WindowSizes, seq_len: int, head_dim: int, dtype,
               has_segments: bool, return_logit_stats: bool) -> bool:
    """True for a call where cuDNN alone is faster than our kernel: every head global (full
    causal), and cuDNN takes the call (the table in this module's docstring)."""
    return (cudnn_takes(head_dim, dtype, has_segments, return_logit_stats)
            and all(is_global(p, seq_len) for p in window_sizes))


def split_fits(window_sizes: WindowSizes, seq_len: int, head_dim: int, dtype,
               has_segments: bool, return_logit_stats: bool) -> bool:
    """True for an LS mix that "split" should run: long, wide heads, enough of them global
    (the table in this module's docstring and the SPLIT_* constants)."""
    if not cudnn_takes(head_dim, dtype, has_segments, return_logit_stats):
        return False
    n_global = sum(is_global(p, seq_len) for p in window_sizes)
    return (0 < n_global < len(window_sizes) and seq_len >= SPLIT_MIN_SEQ_LEN
            and head_dim > SPLIT_MIN_HEAD_DIM_EXCLUSIVE
            and n_global >= SPLIT_MIN_GLOBAL_SHARE * len(window_sizes))


def _runs_hopper_kernels(hopper: bool | None) -> bool:
    """``hopper`` as given, or (None) whether this process's GPU runs our Hopper kernels."""
    if hopper is None:
        from ls_jax.kernels.pallas_gpu.mosaic_ring import is_hopper
        return is_hopper()
    return hopper


def choose_implementation(platform: str | None = None, *, window_sizes: WindowSizes | None = None,
                          seq_len: int | None = None, head_dim: int | None = None, dtype=None,
                          has_segments: bool = False, return_logit_stats: bool = False,
                          hopper: bool | None = None) -> str:
    """The backend for one call on ``platform`` (default: ``current_platform()``).

    Without the case (``window_sizes`` etc. None) it returns the platform's default backend.
    ``hopper``: whether the GPU runs our Hopper (Mosaic GPU) kernels; None asks the device.
    Raises ValueError on a platform with no memory-safe default.
    """
    platform = current_platform() if platform is None else platform
    if platform not in DEFAULT_IMPLEMENTATION:
        raise ValueError(
            f"implementation: no default backend on platform {platform!r} (pallas_gpu is "
            "written for CUDA and 'reference' materialises [B, H, T, T] float32 logits); pass "
            f"one of {IMPLEMENTATIONS} explicitly")
    implementation = DEFAULT_IMPLEMENTATION[platform]
    if implementation == "pallas_gpu" and window_sizes is not None:
        case = (window_sizes, seq_len, head_dim, dtype, has_segments, return_logit_stats)
        if cudnn_fits(*case):
            return "cudnn"
        if not _runs_hopper_kernels(hopper) and split_fits(*case):
            return "split"
    return implementation


def choose_primal_implementation(platform: str | None = None, *,
                                 window_sizes: WindowSizes | None = None,
                                 seq_len: int | None = None, head_dim: int | None = None,
                                 dtype=None, has_segments: bool = False,
                                 return_logit_stats: bool = False,
                                 hopper: bool | None = None) -> str:
    """The backend for the same call when nothing differentiates it (inference, evaluation,
    a prefill): ``choose_implementation``'s choice, except where another backend's forward
    alone is faster (the "primal" rows of this module's table). ``ls_attention`` runs the two
    through ``kernels.directional`` when they differ."""
    implementation = choose_implementation(
        platform, window_sizes=window_sizes, seq_len=seq_len, head_dim=head_dim, dtype=dtype,
        has_segments=has_segments, return_logit_stats=return_logit_stats, hopper=hopper)
    if (implementation == "cudnn" and head_dim % HOPPER_FORWARD_HEAD_DIM_MULTIPLE == 0
            and seq_len >= HOPPER_FORWARD_MIN_SEQ_LEN):
        if _runs_hopper_kernels(hopper):
            return "pallas_gpu"
    return implementation
