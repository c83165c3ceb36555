"""The one public attention entry point, its input validation and backend dispatch.

Every backend (pure-JAX reference, cuDNN composition, Pallas GPU, Pallas TPU) computes the
same function: causal attention where each query head has its own window. For head h with
window p (an int >= 1), query i sees keys j with i - p < j <= i; with window None it sees
every j <= i. With ``segment_ids`` a query only sees keys of its own segment as well.

A backend is a function

    fn(q, k, v, *, window_sizes, segment_ids, sm_scale, return_logit_stats, interpret)
        -> (out_BxTxHxD, max_abs_logit_H or None)

registered by name in ``_BACKENDS`` as "module:function" and imported on first use, so that
importing ``kernels`` never pulls in Triton or Mosaic.
"""

from __future__ import annotations

import importlib
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)

_BACKENDS = {
    "reference": "ls_jax.kernels.reference:reference_backend",
    "cudnn": "ls_jax.kernels.cudnn:cudnn_backend",
    "pallas_gpu": "ls_jax.kernels.pallas_gpu:pallas_gpu_backend",
    "pallas_tpu": "ls_jax.kernels.pallas_tpu:pallas_tpu_backend",
}
IMPLEMENTATIONS = tuple(_BACKENDS)
PALLAS_IMPLEMENTATIONS = ("pallas_gpu", "pallas_tpu")

# What `implementation=None` means on each JAX platform.
DEFAULT_IMPLEMENTATION = {
    "cpu": "reference",
    "gpu": "pallas_gpu",
    "cuda": "pallas_gpu",
    "rocm": "reference",
    "tpu": "pallas_tpu",
}


class LogitStats(NamedTuple):
    """Statistics of the pre-softmax logits ``sm_scale * q_i . k_j`` over allowed pairs.

    max_abs_logit: float32 [Hq], max over batch and allowed (i, j) of the absolute logit.
    """

    max_abs_logit: jax.Array


WindowSizes = tuple[int | None, ...]


def normalize_window_sizes(window_sizes: Any, num_heads: int) -> WindowSizes:
    """Checks ``window_sizes`` against ``num_heads`` and returns it as a hashable tuple."""
    if isinstance(window_sizes, (str, bytes)) or not isinstance(window_sizes, Sequence):
        raise ValueError(
            f"window_sizes: expected a tuple of {num_heads} entries (int >= 1 for a local "
            f"head, None for a global head), got {window_sizes!r}")
    if len(window_sizes) != num_heads:
        raise ValueError(
            f"window_sizes: expected one entry per query head ({num_heads}), got "
            f"{len(window_sizes)} entries: {tuple(window_sizes)!r}")
    out = []
    for h, p in enumerate(window_sizes):
        if p is None:
            out.append(None)
            continue
        if isinstance(p, bool) or not isinstance(p, (int, np.integer)):
            raise ValueError(
                f"window_sizes[{h}]: expected an int >= 1 or None, got {p!r} "
                f"({type(p).__name__})")
        if p < 1:
            raise ValueError(f"window_sizes[{h}]: expected an int >= 1 or None, got {int(p)}")
        out.append(int(p))
    return tuple(out)


def validate_inputs(q, k, v, window_sizes, segment_ids, sm_scale) -> tuple[WindowSizes, float]:
    """Raises ValueError naming the argument, the expectation and the given value."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise ValueError(f"{name}: expected an array of shape [B, T, H, D], got {type(x).__name__}")
        if x.ndim != 4:
            raise ValueError(
                f"{name}: expected rank 4 [B, T, H, D], got rank {x.ndim} with shape {tuple(x.shape)}")
        if x.dtype not in SUPPORTED_DTYPES:
            raise ValueError(
                f"{name}: expected dtype float32, bfloat16 or float16, got {x.dtype}")
    B, T, Hq, D = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v: expected the same shape, got k {tuple(k.shape)} and v {tuple(v.shape)}")
    Bk, Tk, Hkv, Dk = k.shape
    if (Bk, Tk, Dk) != (B, T, D):
        raise ValueError(
            f"k: expected shape [B={B}, T={T}, Hkv, D={D}] to match q {tuple(q.shape)}, "
            f"got {tuple(k.shape)}")
    if not (k.dtype == v.dtype == q.dtype):
        raise ValueError(f"q, k, v: expected one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if Hkv < 1 or Hq % Hkv:
        raise ValueError(
            f"k: expected a number of kv heads that divides the query heads Hq={Hq}, got Hkv={Hkv}")
    if T < 1 or D < 1 or B < 1:
        raise ValueError(f"q: expected non-empty B, T, D, got shape {tuple(q.shape)}")
    if segment_ids is not None:
        if not hasattr(segment_ids, "shape") or tuple(segment_ids.shape) != (B, T):
            raise ValueError(
                f"segment_ids: expected shape [B={B}, T={T}], got "
                f"{getattr(segment_ids, 'shape', type(segment_ids).__name__)}")
        if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
            raise ValueError(f"segment_ids: expected an integer dtype, got {segment_ids.dtype}")
    windows = normalize_window_sizes(window_sizes, Hq)
    if sm_scale is None:
        sm_scale = 1.0 / float(np.sqrt(D))
    elif isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float, np.floating)) \
            or not np.isfinite(sm_scale) or sm_scale <= 0:
        raise ValueError(f"sm_scale: expected a finite float > 0 or None, got {sm_scale!r}")
    return windows, float(sm_scale)


def default_implementation(platform: str | None = None) -> str:
    """The backend ``implementation=None`` picks on ``platform`` (default: JAX's default backend)."""
    platform = platform or jax.default_backend()
    return DEFAULT_IMPLEMENTATION.get(platform, "reference")


def get_backend(implementation: str):
    if implementation not in _BACKENDS:
        raise ValueError(
            f"implementation: expected None or one of {IMPLEMENTATIONS}, got {implementation!r}")
    module_name, fn_name = _BACKENDS[implementation].split(":")
    return getattr(importlib.import_module(module_name), fn_name)


def ls_attention(q, k, v, window_sizes, *, segment_ids=None, sm_scale=None,
                 return_logit_stats=False, implementation=None, interpret=False):
    """Causal attention with a window per query head (LS-attention), in one call for all heads.

    Args:
      q: [B, T, Hq, D] queries (float32, bfloat16 or float16).
      k, v: [B, T, Hkv, D] keys and values, Hkv divides Hq (GQA: query head h reads kv head
        h // (Hq // Hkv)).
      window_sizes: length-Hq tuple; an int p >= 1 makes head h local (query i sees keys
        i - p < j <= i), None makes it global (j <= i). Must be static (Python values).
      segment_ids: optional int [B, T]; queries only see keys with the same segment id.
      sm_scale: logit scale, default 1 / sqrt(D).
      return_logit_stats: also return ``LogitStats`` (no gradient flows through them).
      implementation: None (best for the platform), "reference", "cudnn", "pallas_gpu" or
        "pallas_tpu".
      interpret: run a Pallas backend in Pallas interpret mode (on CPU). For "pallas_tpu" this
        may also be a ``pltpu.InterpretParams``.

    Returns:
      [B, T, Hq, D] in q's dtype, or ``(out, LogitStats)`` with ``return_logit_stats=True``.
    """
    windows, scale = validate_inputs(q, k, v, window_sizes, segment_ids, sm_scale)
    if implementation is None:
        if interpret:
            raise ValueError(
                "interpret: True needs an explicit implementation, one of "
                f"{PALLAS_IMPLEMENTATIONS}; got implementation=None")
        implementation = default_implementation()
    elif interpret and implementation not in PALLAS_IMPLEMENTATIONS:
        raise ValueError(
            f"interpret: only the Pallas backends {PALLAS_IMPLEMENTATIONS} have an interpret "
            f"mode; got interpret={interpret!r} with implementation={implementation!r}")
    backend = get_backend(implementation)
    out, max_abs_logit = backend(
        q, k, v, window_sizes=windows, segment_ids=segment_ids, sm_scale=scale,
        return_logit_stats=return_logit_stats, interpret=interpret)
    if not return_logit_stats:
        return out
    return out, LogitStats(max_abs_logit=jax.lax.stop_gradient(max_abs_logit.astype(jnp.float32)))
