"""What ``ls_attention(..., implementation=None)`` runs: ``choose_implementation`` for a call
that is differentiated (training) and ``choose_primal_implementation`` for one that is not
(inference, evaluation, a prefill). Where the two differ, ``kernels/directional.py`` runs each
in its place from one call site. Which kernels "pallas_gpu" itself launches is decided in
``pallas_gpu/heuristics.py``; the measurements behind each row are in docs/performance.md.

| platform | case | backend | why |
|---|---|---|---|
| cpu | any | "reference" | the pure-JAX twin (dense [B, H, T, S] logits; CPU runs are small) |
| tpu | any | "pallas_tpu" | the only block-sparse TPU path |
| cuda | every head global, no logit statistics, no segment ids, 16-bit, D a multiple of 8 and <= 128 (``cudnn_fits``) | "cudnn" | full causal attention with nothing to skip: cuDNN's fused forward+backward is at least as fast as ours |
| cuda, Hopper | any heads, D beyond our Hopper kernels' (``HOPPER_MAX_HEAD_DIM``) and within cuDNN's there, no logit statistics, no segment ids, 16-bit (``cudnn_fits``) | "cudnn" | there our kernels run only on Triton, and cuDNN (per window: the composition) is faster forward and backward |
| cuda, not differentiated | as the first "cudnn" row, on Hopper, D a multiple of 64, T >= ``HOPPER_FORWARD_MIN_SEQ_LEN`` | "pallas_gpu" | our Hopper forward alone is faster than cuDNN's forward there |
| cuda, no Hopper kernels | an LS mix at T >= ``SPLIT_MIN_SEQ_LEN``, 64 < D <= 128, at least ``SPLIT_MIN_GLOBAL_SHARE`` of the heads global, cuDNN takes the call (``split_fits``) | "split" (cuDNN causal for the global heads, ours for the local ones) | the global heads' O(T^2) backward dominates, and cuDNN's beats our Triton one; on Hopper our kernels keep these mixes |
| cuda | anything else | "pallas_gpu" | any local head: ours skips the blocks outside each band; logit statistics, segment ids and float32 are ours alone |
| rocm or other | any | error | the Pallas GPU kernels are written for CUDA, and "reference" materialises [B, H, T, S] float32 logits: the caller must choose |

The D range is the one ``jax.nn.dot_product_attention(implementation="cudnn")`` accepts: a
multiple of 8, up to 128 on every CUDA card and up to 256 on Hopper.
"""

from __future__ import annotations

from fractions import Fraction

import jax
import jax.numpy as jnp

from ls_jax.kernels.backends import IMPLEMENTATIONS
from ls_jax.kernels.band import WindowSizes, is_global
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


# The "split" rule (the table above). Without our Hopper kernels, cuDNN's causal backward for
# the global heads pays for the second launch once they dominate the work: long sequences,
# wide heads, and at least one head in eight global.
SPLIT_MIN_SEQ_LEN = 32768
SPLIT_MIN_HEAD_DIM_EXCLUSIVE = 64
SPLIT_MIN_GLOBAL_SHARE = Fraction(1, 8)
# The primal rule (the table above): our Hopper forward takes D a multiple of 64, and beats
# cuDNN's forward from this length (shorter calls are launch-bound; not measured below it).
HOPPER_FORWARD_HEAD_DIM_MULTIPLE = 64
HOPPER_FORWARD_MIN_SEQ_LEN = 1024
# what jax.nn.dot_product_attention(implementation="cudnn") takes: on every CUDA card, and on
# Hopper (where JAX allows wider heads)
CUDNN_MAX_HEAD_DIM = 128
CUDNN_HOPPER_MAX_HEAD_DIM = 256
CUDNN_HEAD_DIM_MULTIPLE = 8


def cudnn_takes(head_dim: int, dtype, has_segments: bool, return_logit_stats: bool,
                hopper: bool = False) -> bool:
    """True for a call that cuDNN computes in one pass (no statistics, no segments, its dtypes
    and head sizes; ``hopper``: the wider range of a Hopper GPU)."""
    max_head_dim = CUDNN_HOPPER_MAX_HEAD_DIM if hopper else CUDNN_MAX_HEAD_DIM
    return not (return_logit_stats or has_segments
                or jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16)
                or head_dim % CUDNN_HEAD_DIM_MULTIPLE or head_dim > max_head_dim)


def _beyond_hopper_kernels(head_dim: int) -> bool:
    """Whether the head size is wider than our Hopper kernels take."""
    from ls_jax.kernels.pallas_gpu.heuristics import HOPPER_MAX_HEAD_DIM
    return head_dim > HOPPER_MAX_HEAD_DIM


def cudnn_fits(window_sizes: WindowSizes, seq_len: int, head_dim: int, dtype,
               has_segments: bool, return_logit_stats: bool, *, hopper: bool) -> bool:
    """True for a call where cuDNN alone is faster than our kernel (the table in this module's
    docstring): cuDNN takes the call, and every head is global (full causal) or, on Hopper,
    the heads are wider than our Hopper kernels take."""
    if not cudnn_takes(head_dim, dtype, has_segments, return_logit_stats, hopper):
        return False
    return (all(is_global(p, seq_len) for p in window_sizes)
            or (hopper and _beyond_hopper_kernels(head_dim)))


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
        from ls_jax.kernels.pallas_gpu.heuristics import current_gpu
        return current_gpu().hopper
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
        hopper = _runs_hopper_kernels(hopper)
        if cudnn_fits(*case, hopper=hopper):
            return "cudnn"
        if not hopper and split_fits(*case):
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
            and not _beyond_hopper_kernels(head_dim) and seq_len >= HOPPER_FORWARD_MIN_SEQ_LEN):
        if _runs_hopper_kernels(hopper):
            return "pallas_gpu"
    return implementation
