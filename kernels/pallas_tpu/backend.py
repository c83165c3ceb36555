"""The "pallas_tpu" backend: block-sparse LS-attention as Pallas TPU (Mosaic) kernels.

One pallas_call per pass (forward; dQ; dK/dV) covers every head of the layer, each with its own
window, and its grid only lists the tiles that intersect each head's band (work lists, see
``kernels/pallas_tpu/plan.py``): a local head costs about ceil(p / block) + 1 steps per query
block whatever T is, a global head the lower triangle. Design notes: docs/tpu-kernel.md.

This file holds the layout (to [B, H, T, D], padded), the ``interpret`` argument, and the
``jax.custom_vjp`` wiring; the kernels are in ``forward.py`` and ``backward.py``, their shared
grid plumbing in ``plan.py`` and in-kernel pieces in ``tiles.py``. On a machine without a
TPU it runs in one of Pallas' two interpreters (``interpret_params``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

from ls_jax.kernels.band import WindowSizes
from ls_jax.kernels.pallas_tpu.backward import dkdv_call, dq_call
from ls_jax.kernels.pallas_tpu.forward import forward_call
from ls_jax.kernels.pallas_tpu.plan import AttentionPlan, make_plan
from ls_jax.kernels.pallas_tpu.tiles import NUM_LANES, NUM_SUBLANES
from ls_jax.kernels.reference import default_scale


def interpret_params(interpret) -> pltpu.InterpretParams | bool | None:
    """What the kernels' ``pallas_call`` gets for the ``interpret`` argument.

    False/None -> None: compile for TPU (Mosaic). True -> True: Pallas' interpreter, the
    kernel as a jitted loop over its grid in plain XLA ops; pure, so it composes with every
    JAX transformation (vmap, checkpoint, x64). A ``pltpu.InterpretParams``: Pallas' TPU
    interpreter, which also simulates the TPU memory spaces, DMAs and cores (race detection,
    grid-point recording); its host callbacks are effects, which ``jax.checkpoint`` cannot
    differentiate.
    """
    if interpret is None or interpret is False:
        return None
    if interpret is True:
        return True
    if isinstance(interpret, pltpu.InterpretParams):
        return interpret
    raise ValueError(
        "interpret: expected a bool or a jax.experimental.pallas.tpu.InterpretParams, got "
        f"{interpret!r}")


def _to_kernel_layout(x_BxTxHxD, plan: AttentionPlan):
    """[B, T, H, D] -> [B, H, T_pad, D_pad], zero padded."""
    x = jnp.transpose(x_BxTxHxD, (0, 2, 1, 3))
    return jnp.pad(x, ((0, 0), (0, 0), (0, plan.seq_len_padded - plan.seq_len),
                       (0, plan.head_dim_padded - plan.head_dim)))


def _from_kernel_layout(x_BxHxTxD, plan: AttentionPlan):
    return jnp.transpose(x_BxHxTxD[:, :, :plan.seq_len, :plan.head_dim], (0, 2, 1, 3))


def _segment_layouts(segment_ids_BxT, plan: AttentionPlan):
    """int32 segment ids padded to T_pad, as [B, T_pad, 128] lanes and [B, 8, T_pad] sublanes.

    Padding positions get id -1; they are only ever compared with other positions by padding
    queries, whose outputs are dropped (real queries never see the padding keys after them).
    """
    seg = jnp.pad(segment_ids_BxT.astype(jnp.int32),
                  ((0, 0), (0, plan.seq_len_padded - plan.seq_len)), constant_values=-1)
    B, Tp = seg.shape
    return (jax.lax.broadcast_in_dim(seg, (B, Tp, NUM_LANES), (0, 1)),
            jax.lax.broadcast_in_dim(seg, (B, NUM_SUBLANES, Tp), (0, 2)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(plan: AttentionPlan, q, k, v, segs):
    """Padded [B, H, T_pad, D_pad] operands -> (o, lse [B, H, 1, T_pad], max_abs or None)."""
    return forward_call(plan, q, k, v, *segs)


def _attention_fwd(plan, q, k, v, segs):
    o, lse, max_abs = forward_call(plan, q, k, v, *segs)
    return (o, lse, max_abs), (q, k, v, segs, o, lse)


def _attention_bwd(plan, residuals, cotangents):
    q, k, v, segs, o, lse = residuals
    do, dlse, _ = cotangents  # max |logit| is a statistic: no gradient
    do = do.astype(q.dtype)
    # d lse_i / d s_ij = p_ij, so lse's cotangent enters dS = p * (dP - delta) as -dlse
    delta_BxHx1xT = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1)[:, :, None, :]
    delta_BxHx1xT = delta_BxHx1xT - dlse
    dq = dq_call(plan, q, k, v, do, lse, delta_BxHx1xT, *segs)
    dk, dv = dkdv_call(plan, q, k, v, do, lse, delta_BxHx1xT, *segs)
    return dq, dk, dv, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def pallas_tpu_attention_parts(q, k, v, window_sizes: WindowSizes, segment_ids=None,
                               scale=None, *, block_q=None, block_k=None, num_chunks: int = 1,
                               logit_stats: bool = True, interpret=False):
    """Returns (out [B, T, H, D] in q's dtype, lse float32 [B, H, T] natural log,
    max_abs_logit float32 [H] or None), differentiable in q, k, v (through out and lse).

    Inputs are as for ``kernels.ls_attention`` (already validated). block_q, block_k:
    multiples of 128 (default: ``plan.default_block_size``); num_chunks: number of independent
    pieces of each work list (a "parallel" grid axis for multi-core chips). float16 is
    computed in float32 (cast back at the end). ``interpret``: see ``interpret_params``.
    """
    B, T, H, D = q.shape
    plan = make_plan(seq_len=T, head_dim=D, windows=tuple(window_sizes),
                     num_kv_heads=k.shape[2], scale=default_scale(D) if scale is None else scale,
                     has_segments=segment_ids is not None, logit_stats=logit_stats,
                     block_q=block_q, block_k=block_k, num_chunks=num_chunks,
                     interpret=interpret_params(interpret))
    compute_dtype = jnp.float32 if q.dtype == jnp.float16 else q.dtype
    q_, k_, v_ = (_to_kernel_layout(x.astype(compute_dtype), plan) for x in (q, k, v))
    segs = (None, None) if segment_ids is None else _segment_layouts(segment_ids, plan)
    o, lse, max_abs = _attention(plan, q_, k_, v_, segs)
    out = _from_kernel_layout(o, plan).astype(q.dtype)
    lse_BxHxT = lse[:, :, 0, :T]
    if max_abs is not None:
        max_abs = jax.lax.stop_gradient(jnp.max(max_abs, axis=(0, 2, 3)))
    return out, lse_BxHxT, max_abs


# -- the forward and the backward as two calls (``kernels/backends.py``'s residual pair) ----

def forward_with_rows(q, k, v, *, window_sizes, segment_ids, scale, interpret,
                      return_logit_stats):
    """(out [B, T, H, D], rows float32 [B, H, T]: the natural-log logsumexp, max_abs_logit [H]
    or None) of validated inputs."""
    return pallas_tpu_attention_parts(q, k, v, window_sizes, segment_ids, scale,
                                      logit_stats=return_logit_stats, interpret=interpret)


def backward_with_rows(q, k, v, out, rows, do, *, window_sizes, segment_ids, scale,
                       interpret):
    """(dq, dk, dv) from ``forward_with_rows``'s output and rows; padded query rows get a
    statistic of +inf (probability 0: they add nothing to dK and dV)."""
    T, D = q.shape[1], q.shape[3]
    plan = make_plan(seq_len=T, head_dim=D, windows=tuple(window_sizes),
                     num_kv_heads=k.shape[2], scale=scale, has_segments=segment_ids is not None,
                     logit_stats=False, interpret=interpret_params(interpret))
    dtype = jnp.float32 if q.dtype == jnp.float16 else q.dtype
    q_, k_, v_, o_, do_ = (_to_kernel_layout(x.astype(dtype), plan) for x in (q, k, v, out, do))
    segs = (None, None) if segment_ids is None else _segment_layouts(segment_ids, plan)
    rows = jnp.pad(rows, ((0, 0), (0, 0), (0, plan.seq_len_padded - T)),
                   constant_values=jnp.inf)
    lse = rows[:, :, None, :]
    dq, dk, dv, _ = _attention_bwd(plan, (q_, k_, v_, segs, o_, lse),
                                   (do_, jnp.zeros_like(lse), None))
    return tuple(_from_kernel_layout(x, plan).astype(q.dtype) for x in (dq, dk, dv))


def describe_launches(*, seq_len: int, head_dim: int, windows: WindowSizes,
                      num_kv_heads: int, has_segments: bool, **_) -> tuple[str, ...]:
    """One line per pass: the blocks ``plan.make_plan`` picks for this case and the steps of
    each kernel's work list (the tiles inside some head's band)."""
    plan = make_plan(seq_len=seq_len, head_dim=head_dim, windows=tuple(windows),
                     num_kv_heads=num_kv_heads, scale=1.0, has_segments=has_segments,
                     logit_stats=False)
    blocks = f"block_q={plan.block_q}, block_k={plan.block_k}"
    rows = plan.forward_worklist().grid_steps
    columns = plan.dkdv_worklist().grid_steps
    return (f"forward: one pallas_call over all heads, {blocks}, {rows} grid steps per batch "
            "element",
            f"backward: dQ ({rows} grid steps) and dK/dV ({columns}), {blocks}")


def pallas_tpu_backend(q, k, v, *, window_sizes, segment_ids, scale, return_logit_stats,
                       interpret, block_q=None, block_k=None, num_chunks: int = 1):
    """The "pallas_tpu" backend (``kernels.backends.get_backend``).

    Without ``interpret``, the lowering platform decides: traced (under ``jax.jit`` or
    ``jax.export(..., platforms=("tpu",))``) it emits the Mosaic kernels whatever JAX's
    default backend is, so a machine without a TPU can export for one, and lowering them for
    another platform fails in JAX's Pallas lowering. Called eagerly off a TPU, it raises.
    """
    if interpret_params(interpret) is None and not isinstance(q, jax.core.Tracer) \
            and jax.default_backend() != "tpu":
        raise ValueError(
            "interpret: implementation='pallas_tpu' compiles for TPU, but the JAX backend is "
            f"{jax.default_backend()!r}; pass interpret=True (or a pltpu.InterpretParams) to "
            "run it in Pallas interpret mode on CPU, or export it with jax.export(..., "
            "platforms=('tpu',))")
    out, _, max_abs = pallas_tpu_attention_parts(
        q, k, v, window_sizes, segment_ids, scale, block_q=block_q, block_k=block_k,
        num_chunks=num_chunks, logit_stats=return_logit_stats, interpret=interpret)
    return out, max_abs
