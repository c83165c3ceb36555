"""Forward Pallas TPU (Mosaic) kernel: flash attention over a row-major work list.

Grid (batch * chunk, step): the leading "parallel" axis enumerates (batch b, chunk c) as
b * num_chunks + c (so a 2-TensorCore chip can split it even at batch 1), and step s of chunk c
computes the tile (head, query block, key block) listed at c * steps_per_chunk + s of the
scalar-prefetch tables (``kernels/pallas_tpu/plan.py``). The BlockSpec index maps read the
same tables, so the pipeline DMAs exactly the q/k/v blocks of the listed tiles, and a query
block is fetched once per run of its key blocks. Online softmax state lives in VMEM scratch
across a run; its last step writes the output block, the logsumexp (natural log, lane-dense
[1, block_q] row) and, if asked, the block's max |logit|.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ls_jax.kernels.pallas_tpu.plan import (FIRST, LAST, AttentionPlan, index_maps,
                                            unpack_step, worklist_call)
from ls_jax.kernels.pallas_tpu.tiles import (
    MASK_VALUE,
    NT_DIMS,
    NUM_LANES,
    NUM_SUBLANES,
    band_mask_QxK,
    max_abs_1x1,
    run_tile,
    step_index,
    tile_mask,
    where,
    widen,
)


def _forward_kernel(rows_ref, cols_ref, window_ref, *refs, plan: AttentionPlan,
                    num_chunks: int):
    bq, bk, dp = plan.block_q, plan.block_k, plan.head_dim_padded
    refs = list(refs)
    q_ref, k_ref, v_ref = refs[:3]
    del refs[:3]
    qseg_ref = kseg_ref = None
    if plan.has_segments:
        qseg_ref, kseg_ref = refs[:2]
        del refs[:2]
    o_ref, lse_ref = refs[:2]
    del refs[:2]
    maxabs_ref = refs.pop(0) if plan.logit_stats else None
    m_scr, l_scr, acc_scr = refs[:3]
    maxabs_scr = refs[3] if plan.logit_stats else None

    step = step_index(num_chunks)
    head, q_block, k_block, flags = unpack_step(rows_ref[step], cols_ref[step])

    @pl.when((flags & FIRST) != 0)
    def _init():
        m_scr[...] = jnp.full(m_scr.shape, MASK_VALUE, jnp.float32)
        l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
        acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)
        if maxabs_scr is not None:
            maxabs_scr[...] = jnp.zeros(maxabs_scr.shape, jnp.float32)

    def tile(band_edge: bool):
        s_QxK = jax.lax.dot_general(q_ref[...], k_ref[...], NT_DIMS,
                                    preferred_element_type=jnp.float32) * plan.scale
        band = band_mask_QxK(band_edge, q_block, k_block, bq, bk, window_ref[head])
        mask_QxK = tile_mask(band, qseg_ref, kseg_ref)
        if mask_QxK is not None:
            s_QxK = where(mask_QxK, s_QxK, MASK_VALUE)
        if maxabs_scr is not None:
            allowed = s_QxK if mask_QxK is None else where(mask_QxK, s_QxK, 0.0)
            maxabs_scr[...] = jnp.maximum(maxabs_scr[...], max_abs_1x1(allowed))
        m_prev_Qx128 = m_scr[...]
        m_next_Qx128 = jnp.maximum(m_prev_Qx128, jnp.max(s_QxK, axis=1, keepdims=True))
        p_QxK = jnp.exp(s_QxK - widen(m_next_Qx128, bk))
        if mask_QxK is not None:
            p_QxK = where(mask_QxK, p_QxK, 0.0)
        alpha_Qx128 = jnp.exp(m_prev_Qx128 - m_next_Qx128)
        l_scr[...] = alpha_Qx128 * l_scr[...] + jnp.sum(p_QxK, axis=1, keepdims=True)
        v = v_ref[...]
        acc_scr[...] = acc_scr[...] * widen(alpha_Qx128, dp) + jnp.dot(
            p_QxK.astype(v.dtype), v, preferred_element_type=jnp.float32)
        m_scr[...] = m_next_Qx128

    run_tile(flags, tile)

    @pl.when((flags & LAST) != 0)
    def _finish():
        l_Qx128 = l_scr[...]
        o_ref[...] = (acc_scr[...] * widen(1.0 / l_Qx128, dp)).astype(o_ref.dtype)
        lse_Qx128 = m_scr[...] + jnp.log(l_Qx128)
        lse_ref[...] = jnp.transpose(lse_Qx128)[:1, :]  # lanes are equal: row 0 is the row
        if maxabs_ref is not None:
            maxabs_ref[...] = maxabs_scr[...]


def forward_call(plan: AttentionPlan, q_BxHxTxD, k_BxGxTxD, v_BxGxTxD, seg_lanes_BxTx128=None,
                 seg_sublanes_Bx8xT=None):
    """Runs the forward kernel on padded [B, H, T_pad, D_pad] operands.

    Returns (o [B, H, T_pad, D_pad] in q's dtype, lse float32 [B, H, 1, T_pad],
    max_abs float32 [B, H, num_q_blocks * 8, 128] or None).
    """
    B, H, Tp, Dp = q_BxHxTxD.shape
    bq, bk = plan.block_q, plan.block_k
    wl = plan.forward_worklist()
    maps = index_maps(plan, wl)
    in_specs = [pl.BlockSpec((None, None, bq, Dp), maps["q_rows"]),
                pl.BlockSpec((None, None, bk, Dp), maps["kv_rows"]),
                pl.BlockSpec((None, None, bk, Dp), maps["kv_rows"])]
    operands = [q_BxHxTxD, k_BxGxTxD, v_BxGxTxD]
    if plan.has_segments:
        in_specs += [pl.BlockSpec((None, bq, NUM_LANES), maps["q_seg_lanes"]),
                     pl.BlockSpec((None, NUM_SUBLANES, bk), maps["k_seg_sublanes"])]
        operands += [seg_lanes_BxTx128, seg_sublanes_Bx8xT]
    out_shape = [jax.ShapeDtypeStruct((B, H, Tp, Dp), q_BxHxTxD.dtype),
                 jax.ShapeDtypeStruct((B, H, 1, Tp), jnp.float32)]
    out_specs = [pl.BlockSpec((None, None, bq, Dp), maps["q_rows"]),
                 pl.BlockSpec((None, None, 1, bq), maps["q_row_vector"])]
    scratch = [pltpu.VMEM((bq, NUM_LANES), jnp.float32),  # running max
               pltpu.VMEM((bq, NUM_LANES), jnp.float32),  # running sum
               pltpu.VMEM((bq, Dp), jnp.float32)]  # output accumulator
    if plan.logit_stats:
        out_shape.append(jax.ShapeDtypeStruct((B, H, plan.num_q_blocks * NUM_SUBLANES,
                                               NUM_LANES), jnp.float32))
        out_specs.append(pl.BlockSpec((None, None, NUM_SUBLANES, NUM_LANES),
                                      maps["q_block_stat"]))
        scratch.append(pltpu.VMEM((NUM_SUBLANES, NUM_LANES), jnp.float32))
    outs = worklist_call(_forward_kernel, plan, wl, in_specs=in_specs,
                         out_specs=out_specs, out_shape=out_shape, scratch_shapes=scratch,
                         matmuls_per_tile=2, name="ls_attention_tpu_fwd")(*operands)
    o, lse = outs[:2]
    return o, lse, (outs[2] if plan.logit_stats else None)
