"""Forward Pallas GPU kernel: flash attention over each head's band, all heads in one launch.

One program computes one (batch, query head, query block). Its key/value loop visits only the
key blocks that intersect the head's band (``kernels.pallas_gpu_tiles.split_kv_loop``):
boundary tiles get an element mask, interior tiles none, and blocks outside the band are never
loaded. The window of each head is read from a small int32 array, so one compiled kernel
serves any mix of local and global heads. The order of programs comes from a schedule table
(longest first).

Inputs are padded by the caller to a whole number of blocks (sequence) and to a head size the
matrix units take; the kernel itself never masks loads.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels.pallas_gpu_tiles import (LOG2_E, MASKED_SCORE, MAX_FLOOR, band_mask_QxK,
                                      mask_scores, run_band_loop, split_kv_loop)


def _forward_kernel(schedule_ref, window_ref, q_ref, k_ref, v_ref, *refs, block_q: int,
                    block_k: int, num_q_blocks: int, group: int, seq_len: int,
                    score_scale: float, sm_scale: float, has_segments: bool,
                    with_stats: bool, loop_mode: str):
    if has_segments:
        segment_ref, *refs = refs
    out_ref, lse_ref, *refs = refs
    stat_ref = refs[0] if with_stats else None

    b = pl.program_id(0)
    item = schedule_ref[pl.program_id(1)]
    h = jax.lax.div(item, num_q_blocks)
    q_block = jax.lax.rem(item, num_q_blocks)
    kv_head = jax.lax.div(h, group)
    window = window_ref[h]
    q_first = q_block * block_q
    rows = pl.ds(q_first, block_q)

    q_QxD = q_ref[b, rows, h, :]
    seg_q = segment_ref[b, rows] if has_segments else None
    head_dim = q_QxD.shape[-1]

    def tile(j, carry, masking):
        acc_QxD, m_Q, l_Q, *min_Q = carry
        k_first = j * block_k
        cols = pl.ds(k_first, block_k)
        k_KxD = k_ref[b, cols, kv_head, :]
        s_QxK = plgpu.dot(q_QxD, k_KxD, trans_b=True)  # raw q.k; scaled inside exp2

        def ok_QxK():
            ok = band_mask_QxK(q_first, k_first, block_q, block_k, window)
            if has_segments:
                ok = ok & (seg_q[:, None] == segment_ref[b, cols][None, :])
            return ok

        s_QxK = mask_scores(s_QxK, ok_QxK, masking)
        m_new_Q = jnp.maximum(m_Q, jnp.max(s_QxK, axis=1))
        # scaled running max, floored so that a row that has seen only masked keys gets
        # p = exp2(MASKED_SCORE * c - floor) = 0 exactly, whatever the FMA rounding
        ms_Q = jnp.maximum(m_Q * score_scale, MAX_FLOOR)
        ms_new_Q = jnp.maximum(m_new_Q * score_scale, MAX_FLOOR)
        alpha_Q = jnp.exp2(ms_Q - ms_new_Q)
        p_QxK = jnp.exp2(s_QxK * score_scale - ms_new_Q[:, None])  # one FMA per element
        l_new_Q = l_Q * alpha_Q + jnp.sum(p_QxK, axis=1)
        v_KxD = v_ref[b, cols, kv_head, :]
        acc_QxD = acc_QxD * alpha_Q[:, None] + plgpu.dot(p_QxK.astype(v_KxD.dtype), v_KxD)
        if with_stats:  # masked scores are exactly MASKED_SCORE: keep them out of the min
            s_min = s_QxK if masking == "none" else jnp.where(
                s_QxK == MASKED_SCORE, -MASKED_SCORE, s_QxK)
            min_Q = [jnp.minimum(min_Q[0], jnp.min(s_min, axis=1))]
        return (acc_QxD, m_new_Q, l_new_Q, *min_Q)

    carry = (jnp.zeros((block_q, head_dim), jnp.float32),
             jnp.full((block_q,), MASKED_SCORE, jnp.float32),
             jnp.zeros((block_q,), jnp.float32))
    if with_stats:
        carry += (jnp.full((block_q,), -MASKED_SCORE, jnp.float32),)

    first, lo, hi, end = split_kv_loop(q_block, block_q, block_k, window, seq_len)
    carry = run_band_loop(first, lo, hi, end, tile, carry,
                          "masked" if has_segments else loop_mode)
    acc_QxD, m_Q, l_Q, *min_Q = carry

    out_ref[b, rows, h, :] = (acc_QxD * (1.0 / l_Q)[:, None]).astype(out_ref.dtype)
    lse_ref[b, h, rows] = jnp.maximum(m_Q * score_scale, MAX_FLOOR) + jnp.log2(l_Q)
    if with_stats:
        stat_ref[b, h, rows] = jnp.maximum(m_Q, -min_Q[0]) * sm_scale


def flash_forward(schedule, windows, q, k, v, segment_ids, *, block_q: int, block_k: int,
                  sm_scale: float, with_stats: bool, num_warps: int, num_stages: int,
                  loop_mode: str, interpret: bool):
    """Runs the forward kernel on padded inputs.

    Args:
      schedule: int32 [n_items], program order; item = head * num_q_blocks + q_block.
      windows: int32 [Hq], the window of each head (the padded length for global heads).
      q: [B, Tp, Hq, Dp]; k, v: [B, Tp, Hkv, Dp]; Tp a multiple of block_q and block_k.
      segment_ids: None or int32 [B, Tp].

    Returns:
      out [B, Tp, Hq, Dp] in q.dtype, lse2 float32 [B, Hq, Tp] (log2 domain: natural lse
      times log2(e)), and with ``with_stats`` float32 [B, Hq, Tp] max |logit| of each row.
    """
    B, Tp, Hq, Dp = q.shape
    Hkv = k.shape[2]
    kernel = functools.partial(
        _forward_kernel, block_q=block_q, block_k=block_k, num_q_blocks=Tp // block_q,
        group=Hq // Hkv, seq_len=Tp, score_scale=sm_scale * LOG2_E, sm_scale=sm_scale,
        has_segments=segment_ids is not None, with_stats=with_stats, loop_mode=loop_mode)
    out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype),
                 jax.ShapeDtypeStruct((B, Hq, Tp), jnp.float32)]
    if with_stats:
        out_shape.append(jax.ShapeDtypeStruct((B, Hq, Tp), jnp.float32))
    inputs = [schedule, windows, q, k, v] + ([] if segment_ids is None else [segment_ids])
    outs = pl.pallas_call(
        kernel,
        grid=(B, schedule.shape[0]),
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="ls_attention_fwd",
    )(*inputs)
    return (outs[0], outs[1], outs[2] if with_stats else None)
