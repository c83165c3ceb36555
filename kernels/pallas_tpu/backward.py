"""Backward Pallas TPU (Mosaic) kernels: dQ over the row-major work list, dK/dV over the
column-major one.

Both recompute the probabilities from the forward's logsumexp: p = exp(s - lse), and use
delta = rowsum(dO * O) (minus the cotangent of lse, so that lse is differentiable too):
dS = p * (dP - delta) with dP = dO V^T; dQ = scale * dS K, dK = scale * dS^T Q, dV = p^T dO.

* dQ: grid (batch * chunk, step) over the forward's tiles; a run is one (query head, query
  block) row, accumulated in VMEM and written once.
* dK/dV: grid (batch * chunk, step) over (kv head, key block) columns; a run visits every
  query head of the kv head (GQA) and every query block that reaches the key block, so dK and
  dV of a kv head are summed in VMEM and written once, with no atomics and no per-query-head
  copies. The tile is computed transposed (keys on sublanes, queries on lanes), so lse and
  delta are used as lane-dense [1, block_q] rows as stored.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ls_jax.kernels.pallas_tpu.plan import (FIRST, LAST, AttentionPlan, index_maps,
                                            unpack_step, worklist_call)
from ls_jax.kernels.pallas_tpu.tiles import (
    NT_DIMS,
    NUM_LANES,
    NUM_SUBLANES,
    band_mask_KxQ,
    band_mask_QxK,
    run_tile,
    step_index,
    tile_mask,
    where,
)


def _split_inputs(refs, has_segments: bool):
    refs = list(refs)
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = refs[:6]
    del refs[:6]
    segs = (None, None)
    if has_segments:
        segs = tuple(refs[:2])
        del refs[:2]
    return (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref), segs, refs


def _dq_kernel(rows_ref, cols_ref, window_ref, *refs, plan: AttentionPlan,
               num_chunks: int):
    bq, bk = plan.block_q, plan.block_k
    (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref), (qseg_ref, kseg_ref), rest = \
        _split_inputs(refs, plan.has_segments)
    dq_ref, dq_scr = rest
    step = step_index(num_chunks)
    head, q_block, k_block, flags = unpack_step(rows_ref[step], cols_ref[step])

    @pl.when((flags & FIRST) != 0)
    def _init():
        dq_scr[...] = jnp.zeros(dq_scr.shape, jnp.float32)

    def tile(band_edge: bool):
        q, k = q_ref[...], k_ref[...]
        s_QxK = jax.lax.dot_general(q, k, NT_DIMS,
                                    preferred_element_type=jnp.float32) * plan.scale
        lse_Qx1 = jnp.expand_dims(lse_ref[0], -1)
        delta_Qx1 = jnp.expand_dims(delta_ref[0], -1)
        p_QxK = jnp.exp(s_QxK - lse_Qx1)
        band = band_mask_QxK(band_edge, q_block, k_block, bq, bk, window_ref[head])
        mask_QxK = tile_mask(band, qseg_ref, kseg_ref)
        if mask_QxK is not None:
            p_QxK = where(mask_QxK, p_QxK, 0.0)
        dp_QxK = jax.lax.dot_general(do_ref[...], v_ref[...], NT_DIMS,
                                     preferred_element_type=jnp.float32)
        ds_QxK = p_QxK * (dp_QxK - delta_Qx1)
        dq_scr[...] += jnp.dot(ds_QxK.astype(k.dtype), k, preferred_element_type=jnp.float32)

    run_tile(flags, tile)

    @pl.when((flags & LAST) != 0)
    def _finish():
        dq_ref[...] = (dq_scr[...] * plan.scale).astype(dq_ref.dtype)


def _dkdv_kernel(rows_ref, cols_ref, window_ref, *refs, plan: AttentionPlan,
                 num_chunks: int):
    bq, bk = plan.block_q, plan.block_k
    (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref), (kseg_ref, qseg_ref), rest = \
        _split_inputs(refs, plan.has_segments)
    dk_ref, dv_ref, dk_scr, dv_scr = rest
    step = step_index(num_chunks)
    head, q_block, k_block, flags = unpack_step(rows_ref[step], cols_ref[step])

    @pl.when((flags & FIRST) != 0)
    def _init():
        dk_scr[...] = jnp.zeros(dk_scr.shape, jnp.float32)
        dv_scr[...] = jnp.zeros(dv_scr.shape, jnp.float32)

    def tile(band_edge: bool):
        q, k, do = q_ref[...], k_ref[...], do_ref[...]
        s_KxQ = jax.lax.dot_general(k, q, NT_DIMS,
                                    preferred_element_type=jnp.float32) * plan.scale
        p_KxQ = jnp.exp(s_KxQ - lse_ref[...])  # [1, bq] row broadcast over the key rows
        band = band_mask_KxQ(band_edge, q_block, k_block, bq, bk, window_ref[head])
        mask_KxQ = tile_mask(band, kseg_ref, qseg_ref)
        if mask_KxQ is not None:
            p_KxQ = where(mask_KxQ, p_KxQ, 0.0)
        dv_scr[...] += jnp.dot(p_KxQ.astype(do.dtype), do, preferred_element_type=jnp.float32)
        dp_KxQ = jax.lax.dot_general(v_ref[...], do, NT_DIMS,
                                     preferred_element_type=jnp.float32)
        ds_KxQ = p_KxQ * (dp_KxQ - delta_ref[...])
        dk_scr[...] += jnp.dot(ds_KxQ.astype(q.dtype), q, preferred_element_type=jnp.float32)

    run_tile(flags, tile)

    @pl.when((flags & LAST) != 0)
    def _finish():
        dk_ref[...] = (dk_scr[...] * plan.scale).astype(dk_ref.dtype)
        dv_ref[...] = dv_scr[...].astype(dv_ref.dtype)


def _tile_input_specs(plan: AttentionPlan, maps) -> list:
    """Block specs of (q, k, v, dO, lse, delta) for one work-list step of either kernel."""
    bq, bk, Dp = plan.block_q, plan.block_k, plan.head_dim_padded
    return [pl.BlockSpec((None, None, bq, Dp), maps["q_rows"]),
            pl.BlockSpec((None, None, bk, Dp), maps["kv_rows"]),
            pl.BlockSpec((None, None, bk, Dp), maps["kv_rows"]),
            pl.BlockSpec((None, None, bq, Dp), maps["q_rows"]),
            pl.BlockSpec((None, None, 1, bq), maps["q_row_vector"]),
            pl.BlockSpec((None, None, 1, bq), maps["q_row_vector"])]


def dq_call(plan: AttentionPlan, q, k, v, do, lse_BxHx1xT, delta_BxHx1xT, seg_lanes=None,
            seg_sublanes=None):
    """dQ [B, H, T_pad, D_pad] in q's dtype. Operands padded as for ``forward_call``;
    lse and delta float32 [B, H, 1, T_pad]."""
    bq, bk, Dp = plan.block_q, plan.block_k, plan.head_dim_padded
    wl = plan.forward_worklist()
    maps = index_maps(plan, wl)
    in_specs = _tile_input_specs(plan, maps)
    operands = [q, k, v, do, lse_BxHx1xT, delta_BxHx1xT]
    if plan.has_segments:
        in_specs += [pl.BlockSpec((None, bq, NUM_LANES), maps["q_seg_lanes"]),
                     pl.BlockSpec((None, NUM_SUBLANES, bk), maps["k_seg_sublanes"])]
        operands += [seg_lanes, seg_sublanes]
    return worklist_call(
        _dq_kernel, plan, wl, in_specs=in_specs,
        out_specs=pl.BlockSpec((None, None, bq, Dp), maps["q_rows"]),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        scratch_shapes=[pltpu.VMEM((bq, Dp), jnp.float32)], matmuls_per_tile=3,
        name="ls_attention_tpu_dq",
    )(*operands)


def dkdv_call(plan: AttentionPlan, q, k, v, do, lse_BxHx1xT, delta_BxHx1xT, seg_lanes=None,
              seg_sublanes=None):
    """(dK, dV) [B, G, T_pad, D_pad] in k's dtype, summed over each kv head's query heads."""
    bq, bk, Dp = plan.block_q, plan.block_k, plan.head_dim_padded
    wl = plan.dkdv_worklist()
    maps = index_maps(plan, wl)
    in_specs = _tile_input_specs(plan, maps)
    operands = [q, k, v, do, lse_BxHx1xT, delta_BxHx1xT]
    if plan.has_segments:
        in_specs += [pl.BlockSpec((None, bk, NUM_LANES), maps["k_seg_lanes"]),
                     pl.BlockSpec((None, NUM_SUBLANES, bq), maps["q_seg_sublanes"])]
        operands += [seg_lanes, seg_sublanes]
    kv_spec = pl.BlockSpec((None, None, bk, Dp), maps["kv_rows"])
    return worklist_call(
        _dkdv_kernel, plan, wl, in_specs=in_specs,
        out_specs=[kv_spec, kv_spec],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        scratch_shapes=[pltpu.VMEM((bk, Dp), jnp.float32), pltpu.VMEM((bk, Dp), jnp.float32)],
        matmuls_per_tile=4, name="ls_attention_tpu_dkdv",
    )(*operands)
