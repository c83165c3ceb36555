"""The "pallas_gpu" backend: block-sparse LS-attention on NVIDIA GPUs, forward and backward.

Every pass (forward; backward) visits only the blocks that intersect each head's band
(``kernels/band.py``) and runs the launches ``heuristics.py`` decides (``configs.Launches``):
each computes some heads with one lowering, ``triton/`` (any CUDA GPU) or ``mosaic/`` (Hopper),
the later ones writing into the buffers of the first. ``plan.py`` holds the static plan;
this file the padding, the execution of the launches and the ``jax.custom_vjp`` wiring.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ls_jax.kernels.band import WindowSizes
from ls_jax.kernels.pallas_gpu.configs import Launches
from ls_jax.kernels.pallas_gpu.mosaic import backward as hopper_backward
from ls_jax.kernels.pallas_gpu.mosaic import forward as hopper_forward
from ls_jax.kernels.pallas_gpu.mosaic import strip, strip_backward
from ls_jax.kernels.pallas_gpu.plan import AttentionPlan, fit_launches, make_plan, padded_head_dim
from ls_jax.kernels.pallas_gpu.triton import backward as triton_backward
from ls_jax.kernels.pallas_gpu.triton import forward as triton_forward
from ls_jax.kernels.reference import default_scale


def forward_call(plan: AttentionPlan, q, k, v, segment_ids):
    """(out [B, Tp, H, Dp], lse2 float32 [B, H, Tp] (log2 domain), max |logit| per row float32
    [B, H, Tp] or None) on padded inputs, by the plan's forward launches in order."""
    outs = ()
    for launch in plan.launches.forward:
        if launch.lowering == "hopper":
            outs = hopper_forward.forward_call(plan, launch.config, launch.heads, q, k, v)
        elif launch.lowering == "strip":
            outs = strip.forward_call(plan, launch.config, launch.heads, q, k, v,
                                      tuple(x for x in outs if x is not None))
        else:
            outs = triton_forward.forward_call(plan, launch.config, launch.heads, q, k, v,
                                               segment_ids,
                                               tuple(x for x in outs if x is not None))
    return outs


def backward_call(plan: AttentionPlan, q, k, v, segment_ids, do, out, lse2):
    """(dq, dk, dv) on padded inputs, by the plan's backward launches in order: each computes
    dQ (and delta) for its heads, then dK/dV for their kv heads."""
    dq = dkdv = None
    for launch in plan.launches.backward:
        if launch.lowering == "hopper":
            dq, delta = hopper_backward.dq_call(plan, launch.config, launch.heads, q, k, v, do,
                                                lse2, out=out)
            dkdv = hopper_backward.dkdv_call(plan, launch.config, launch.heads, q, k, v, do,
                                             lse2, delta)
        elif launch.lowering == "strip":
            dq, *dkdv = strip_backward.backward_call(
                plan, launch.config, launch.heads, q, k, v, do, lse2, out,
                () if dq is None else (dq, *dkdv))
        else:
            dq, delta = triton_backward.dq_call(plan, launch.config, launch.heads, q, k, v,
                                                segment_ids, do, out, lse2, prefilled=dq)
            dkdv = triton_backward.dkdv_call(plan, launch.config, launch.heads, q, k, v,
                                             segment_ids, do, lse2, delta, prefilled=dkdv)
    return (dq, *dkdv)


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


def _prepare(q, k, v, window_sizes: WindowSizes, segment_ids, scale, launches, logit_stats,
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
                     logit_stats=logit_stats, interpret=interpret, batch=B,
                     has_segments=segment_ids is not None, launches=launches)
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
                         return_logit_stats=False, launches: Launches | None = None,
                         interpret=False):
    """Differentiable LS-attention; returns (out [B,T,H,D], max_abs_logit [H] or None).

    Inputs are as for ``kernels.ls_attention`` (already validated). ``launches`` replaces
    the heuristics' choice (tests and benchmarks); ``interpret`` runs the kernels in Pallas
    interpret mode.
    """
    B, T, H, D = q.shape
    plan, qp, kp, vp, seg = _prepare(q, k, v, window_sizes, segment_ids, scale, launches,
                                     return_logit_stats, interpret)
    out, stats = _padded_attention(plan, qp, kp, vp, seg)
    out = out[:, :T, :, :D]
    if not return_logit_stats:
        return out, None
    return out, jax.lax.stop_gradient(jnp.max(stats[:, :, :T], axis=(0, 2)))


def pallas_gpu_attention_parts(q, k, v, window_sizes: WindowSizes, *, segment_ids=None,
                               scale=None, launches: Launches | None = None,
                               interpret=False):
    """Forward only: (out [B,T,H,D], lse float32 [B,H,T] natural log, max_abs_logit [H]).

    The same quantities as ``kernels.reference.reference_attention_parts``, for tests.
    """
    out, lse2, max_abs = forward_with_rows(q, k, v, window_sizes=window_sizes,
                                           segment_ids=segment_ids, scale=scale,
                                           interpret=interpret, return_logit_stats=True,
                                           launches=launches)
    return out, lse2 * float(np.log(2.0)), max_abs


# -- the forward and the backward as two calls (``kernels/backends.py``'s residual pair) ----

def forward_with_rows(q, k, v, *, window_sizes, segment_ids, scale, interpret,
                      return_logit_stats, launches: Launches | None = None):
    """(out [B, T, H, D], rows float32 [B, H, T]: the log2-domain logsumexp, max_abs_logit [H]
    or None) of validated inputs; ``launches`` as for ``pallas_gpu_attention``."""
    T = q.shape[1]
    plan, qp, kp, vp, seg = _prepare(q, k, v, window_sizes, segment_ids, scale, launches,
                                     return_logit_stats, interpret)
    out, lse2, stats = forward_call(plan, qp, kp, vp, seg)
    max_abs = jnp.max(stats[:, :, :T], axis=(0, 2)) if return_logit_stats else None
    return out[:, :T, :, :q.shape[3]], lse2[:, :, :T], max_abs


def backward_with_rows(q, k, v, out, rows, do, *, window_sizes, segment_ids, scale,
                       interpret):
    """(dq, dk, dv) from ``forward_with_rows``'s output and rows; padded query rows get a
    statistic of +inf (probability 0: they add nothing to dK and dV)."""
    B, T, H, D = q.shape
    plan, qp, kp, vp, seg = _prepare(q, k, v, window_sizes, segment_ids, scale, None, False,
                                     interpret)
    Tp, Dp = plan.seq_len_padded, plan.head_dim_padded
    pad = ((0, 0), (0, Tp - T), (0, 0), (0, Dp - D))
    rows = jnp.pad(rows, ((0, 0), (0, 0), (0, Tp - T)), constant_values=jnp.inf)
    dq, dk, dv = backward_call(plan, qp, kp, vp, seg, jnp.pad(do.astype(q.dtype), pad),
                               jnp.pad(out, pad), rows)
    return tuple(x[:, :T, :, :D] for x in (dq, dk, dv))


def describe_launches(*, batch: int, seq_len: int, head_dim: int, windows: WindowSizes,
                      num_kv_heads: int, dtype, has_segments: bool, gpu, interpret=False
                      ) -> tuple[str, ...]:
    """One line per launch of the forward and the backward that ``heuristics.launches``
    decides for this case on ``gpu`` (a ``heuristics.Gpu``)."""
    from ls_jax.kernels.heads import head_span
    from ls_jax.kernels.pallas_gpu import heuristics
    case = heuristics.Case(dtype=dtype, head_dim=padded_head_dim(head_dim),
                           windows=tuple(windows), seq_len=seq_len, batch=batch,
                           num_kv_heads=num_kv_heads, has_segments=has_segments, gpu=gpu,
                           interpret=bool(interpret))
    launches = fit_launches(heuristics.launches(case), seq_len, bool(interpret))

    def line(name, launch):
        return f"{name}: {launch.lowering} over heads {head_span(launch.heads)}, {launch.config}"
    return (tuple(line("forward", l) for l in launches.forward)
            + tuple(line("backward", l) for l in launches.backward))


def pallas_gpu_backend(q, k, v, *, window_sizes, segment_ids, scale, return_logit_stats,
                       interpret, launches: Launches | None = None):
    """The "pallas_gpu" backend (``kernels.backends.get_backend``). A symbolic batch
    (``jax.export`` with a batch to be named at run time) runs one batch element at a time:
    the kernels' launch grids count batch elements, and a Pallas GPU grid is static."""
    if not isinstance(q.shape[0], int):
        def one(xs):
            q, k, v, *seg = (x[None] for x in xs)
            out, stats = pallas_gpu_backend(
                q, k, v, window_sizes=window_sizes, segment_ids=seg[0] if seg else None,
                scale=scale, return_logit_stats=return_logit_stats, interpret=interpret,
                launches=launches)
            return out[0], stats
        xs = (q, k, v) + (() if segment_ids is None else (segment_ids,))
        out, stats = jax.lax.map(one, xs)
        return out, (None if stats is None else jnp.max(stats, axis=0))
    return pallas_gpu_attention(q, k, v, window_sizes, segment_ids=segment_ids, scale=scale,
                                return_logit_stats=return_logit_stats, launches=launches,
                                interpret=interpret)
