"""A backend's forward and backward as two calls with fixed-shape residuals.

``kernels/sharded.py`` runs the forward and the backward of a call as two custom-partitioned
ops, so what the forward leaves for the backward must have shapes that the partitioner can
split like the inputs, whatever windows a shard holds. For a flash-style kernel that is its
output and one float32 statistic per query row:

    forward(q, k, v, *, window_sizes, segment_ids, scale, interpret, return_logit_stats)
        -> (out [B, T, H, D], rows float32 [B, H, T], max_abs_logit [H] or None)
    backward(q, k, v, out, rows, do, *, window_sizes, segment_ids, scale, interpret)
        -> (dq, dk, dv)

``rows`` is the backend's own row logsumexp (its log base is the backend's business). The
pair computes what the backend's ``jax.custom_vjp`` computes, with its padding redone on each
side (padded query rows get a statistic of +inf: their probabilities are 0, so they add
nothing to dK and dV). ``residual_pair`` returns None for a backend without such a pair
("reference", "cudnn", "split"): its partitioned backward runs the forward again per shard.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax.numpy as jnp

__all__ = ["ResidualPair", "residual_pair"]


class ResidualPair(NamedTuple):
    forward: Callable
    backward: Callable


def _pad_rows(rows_BxHxT, padded_len: int):
    T = rows_BxHxT.shape[-1]
    return jnp.pad(rows_BxHxT, ((0, 0), (0, 0), (0, padded_len - T)), constant_values=jnp.inf)


# -- pallas_gpu: rows are its log2-domain logsumexp (lse2) ----------------------------------

def _gpu_forward(q, k, v, *, window_sizes, segment_ids, scale, interpret, return_logit_stats):
    from ls_jax.kernels.pallas_gpu import backend
    B, T, H, D = q.shape
    plan, qp, kp, vp, seg = backend._prepare(q, k, v, window_sizes, segment_ids, scale, None,
                                             return_logit_stats, interpret)
    out, lse2, stats = backend.forward_call(plan, qp, kp, vp, seg)
    max_abs = jnp.max(stats[:, :, :T], axis=(0, 2)) if return_logit_stats else None
    return out[:, :T, :, :D], lse2[:, :, :T], max_abs


def _gpu_backward(q, k, v, out, rows, do, *, window_sizes, segment_ids, scale, interpret):
    from ls_jax.kernels.pallas_gpu import backend
    B, T, H, D = q.shape
    plan, qp, kp, vp, seg = backend._prepare(q, k, v, window_sizes, segment_ids, scale, None,
                                             False, interpret)
    Tp, Dp = plan.seq_len_padded, plan.head_dim_padded
    pad = ((0, 0), (0, Tp - T), (0, 0), (0, Dp - D))
    dq, dk, dv = backend.backward_call(plan, qp, kp, vp, seg, jnp.pad(do.astype(q.dtype), pad),
                                       jnp.pad(out, pad), _pad_rows(rows, Tp))
    return tuple(x[:, :T, :, :D] for x in (dq, dk, dv))


# -- pallas_tpu: rows are its natural-log logsumexp ------------------------------------------

def _tpu_forward(q, k, v, *, window_sizes, segment_ids, scale, interpret, return_logit_stats):
    from ls_jax.kernels.pallas_tpu import pallas_tpu_attention_parts
    return pallas_tpu_attention_parts(q, k, v, window_sizes, segment_ids, scale,
                                      logit_stats=return_logit_stats, interpret=interpret)


def _tpu_backward(q, k, v, out, rows, do, *, window_sizes, segment_ids, scale, interpret):
    from ls_jax.kernels.pallas_tpu import backend
    from ls_jax.kernels.pallas_tpu.plan import make_plan
    B, T, H, D = q.shape
    plan = make_plan(seq_len=T, head_dim=D, windows=tuple(window_sizes),
                     num_kv_heads=k.shape[2], scale=scale, has_segments=segment_ids is not None,
                     logit_stats=False, interpret=backend.interpret_params(interpret))
    dtype = jnp.float32 if q.dtype == jnp.float16 else q.dtype
    q_, k_, v_, o_, do_ = (backend._to_kernel_layout(x.astype(dtype), plan)
                           for x in (q, k, v, out, do))
    segs = ((None, None) if segment_ids is None
            else backend._segment_layouts(segment_ids, plan))
    lse = _pad_rows(rows, plan.seq_len_padded)[:, :, None, :]
    dq, dk, dv, _ = backend._attention_bwd(plan, (q_, k_, v_, segs, o_, lse),
                                           (do_, jnp.zeros_like(lse), None))
    return tuple(backend._from_kernel_layout(x, plan).astype(q.dtype) for x in (dq, dk, dv))


_PAIRS = {
    "pallas_gpu": ResidualPair(_gpu_forward, _gpu_backward),
    "pallas_tpu": ResidualPair(_tpu_forward, _tpu_backward),
}


def residual_pair(implementation: str) -> ResidualPair | None:
    """The backend's (forward, backward) with output and row-statistic residuals, or None."""
    return _PAIRS.get(implementation)
