"""The "pallas_gpu" backend: block-sparse LS-attention on NVIDIA GPUs, forward and backward.

Every head of a layer is computed in one launch per pass (forward; dQ; dK/dV), each head with
its own window, and every pass visits only the blocks that intersect the head's band
(``kernels/band.py``). Files: ``plan.py`` (tile configuration, head classes, program
schedules), ``forward.py`` and ``backward.py`` (the kernels), ``tiles.py`` (in-kernel pieces);
this file holds the padding and the ``jax.custom_vjp`` wiring.

Lowering: Pallas' Triton lowering (see docs/kernel-notes.md for why).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ls_jax.kernels.band import WindowSizes
from ls_jax.kernels.pallas_gpu.backward import backward_call
from ls_jax.kernels.pallas_gpu.forward import forward_call
from ls_jax.kernels.pallas_gpu.plan import AttentionPlan, KernelConfig, make_plan
from ls_jax.kernels.reference import default_scale


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _padded_attention(plan: AttentionPlan, q, k, v, segment_ids):
    out, _, stats = forward_call(plan, q, k, v, segment_ids)
    return out, stats


def _padded_attention_fwd(plan: AttentionPlan, q, k, v, segment_ids):
    out, lse2, stats = forward_call(plan, q, k, v, segment_ids)
    return (out, stats), (q, k, v, segment_ids, out, lse2)


def _padded_attention_bwd(plan: AttentionPlan, residuals, cotangents):
    q, k, v, segment_ids, out, lse2 = residuals
    do, _ = cotangents
    dq, dk, dv = backward_call(plan, q, k, v, segment_ids, do.astype(q.dtype), out, lse2)
    return dq, dk, dv, None


_padded_attention.defvjp(_padded_attention_fwd, _padded_attention_bwd)


def _prepare(q, k, v, window_sizes: WindowSizes, segment_ids, scale, config, logit_stats,
             interpret):
    """The call's plan and the inputs padded to it (T to whole blocks, D to a matrix-unit
    size)."""
    B, T, H, D = q.shape
    # eager calls check the platform here; traced ones are checked by the lowering platform
    # (so jax.export(..., platforms=("cuda",)) works off a GPU)
    if not interpret and not isinstance(q, jax.core.Tracer) and jax.default_backend() != "gpu":
        raise ValueError(
            "implementation='pallas_gpu' needs a CUDA GPU (JAX backend 'gpu'), got backend "
            f"{jax.default_backend()!r}; pass interpret=True to run it in Pallas interpret "
            "mode, or use implementation='reference'")
    plan = make_plan(seq_len=T, head_dim=D, windows=window_sizes, num_kv_heads=k.shape[2],
                     dtype=q.dtype, scale=default_scale(D) if scale is None else scale,
                     config=config, logit_stats=logit_stats, interpret=interpret, batch=B)
    Tp, Dp = plan.seq_len_padded, plan.head_dim_padded
    if Tp != T or Dp != D:
        pad = ((0, 0), (0, Tp - T), (0, 0), (0, Dp - D))
        q, k, v = (jnp.pad(x, pad) for x in (q, k, v))
    if segment_ids is not None:
        # padded queries get their own segment; they are sliced off and their dO is zero
        segment_ids = jnp.pad(segment_ids.astype(jnp.int32), ((0, 0), (0, Tp - T)),
                              constant_values=-1)
    return plan, q, k, v, segment_ids


def pallas_gpu_attention(q, k, v, window_sizes: WindowSizes, *, segment_ids=None, scale=None,
                         return_logit_stats=False, config: KernelConfig | None = None,
                         interpret=False):
    """Differentiable LS-attention; returns (out [B,T,H,D], max_abs_logit [H] or None).

    Inputs are as for ``kernels.ls_attention`` (already validated). ``config`` overrides the
    tile sizes (tests use small ones); ``interpret`` runs the kernels in Pallas interpret mode.
    """
    B, T, H, D = q.shape
    plan, qp, kp, vp, seg = _prepare(q, k, v, window_sizes, segment_ids, scale, config,
                                     return_logit_stats, interpret)
    out, stats = _padded_attention(plan, qp, kp, vp, seg)
    out = out[:, :T, :, :D]
    if not return_logit_stats:
        return out, None
    return out, jax.lax.stop_gradient(jnp.max(stats[:, :, :T], axis=(0, 2)))


def pallas_gpu_attention_parts(q, k, v, window_sizes: WindowSizes, *, segment_ids=None,
                               scale=None, config: KernelConfig | None = None,
                               interpret=False):
    """Forward only: (out [B,T,H,D], lse float32 [B,H,T] natural log, max_abs_logit [H]).

    The same quantities as ``kernels.reference.reference_attention_parts``, for tests.
    """
    B, T, H, D = q.shape
    plan, qp, kp, vp, seg = _prepare(q, k, v, window_sizes, segment_ids, scale, config, True,
                                     interpret)
    out, lse2, stats = forward_call(plan, qp, kp, vp, seg)
    lse = lse2[:, :, :T] * float(np.log(2.0))
    return out[:, :T, :, :D], lse, jnp.max(stats[:, :, :T], axis=(0, 2))


def pallas_gpu_backend(q, k, v, *, window_sizes, segment_ids, scale, return_logit_stats,
                       interpret, config: KernelConfig | None = None):
    """The "pallas_gpu" backend (``kernels.api.get_backend``)."""
    return pallas_gpu_attention(q, k, v, window_sizes, segment_ids=segment_ids, scale=scale,
                                return_logit_stats=return_logit_stats, config=config,
                                interpret=interpret)
