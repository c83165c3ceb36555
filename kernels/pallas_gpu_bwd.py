"""Backward Pallas GPU kernels: dQ, and dK/dV, each skipping the blocks outside the band.

Both recompute the probabilities from the raw scores ``s = q . k`` and the saved log2-domain
logsumexp ``lse2``: ``p = exp2(s * c - lse2)`` with ``c = sm_scale * log2(e)``; then
``dp = dO . V^T``, ``ds = p * (dp - delta)`` with ``delta_i = sum_d O_id dO_id``, and
``dQ = sm_scale * ds . K``, ``dK = sm_scale * ds^T . Q``, ``dV = p^T . dO``.

- dQ: one program per (batch, query head, query block), looping over the key blocks of the
  head's band exactly like the forward kernel.
- dK/dV: one program per (batch, kv head, key block), looping over the query heads that share
  the kv head (GQA) and, for each, over only the query blocks whose band reaches the key block
  (about ceil(p / block_q) + 1 of them for a local head).

Both take a schedule table (longest programs first) and per-head windows, like the forward.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels.pallas_gpu_tiles import (LOG2_E, band_mask_KxQ, band_mask_QxK, mask_scores,
                                      run_band_loop, split_kv_loop, split_q_loop)


def _dq_kernel(schedule_ref, window_ref, q_ref, k_ref, v_ref, *refs, block_q: int,
               block_k: int, num_q_blocks: int, group: int, seq_len: int,
               score_scale: float, sm_scale: float, has_segments: bool,
               loop_mode: str):
    if has_segments:
        segment_ref, *refs = refs
    do_ref, lse_ref, delta_ref, dq_ref = refs

    b = pl.program_id(0)
    item = schedule_ref[pl.program_id(1)]
    h = jax.lax.div(item, num_q_blocks)
    q_block = jax.lax.rem(item, num_q_blocks)
    kv_head = jax.lax.div(h, group)
    window = window_ref[h]
    q_first = q_block * block_q
    rows = pl.ds(q_first, block_q)

    q_QxD = q_ref[b, rows, h, :]
    do_QxD = do_ref[b, rows, h, :]
    lse_Q = lse_ref[b, h, rows]
    delta_Q = delta_ref[b, h, rows]
    seg_q = segment_ref[b, rows] if has_segments else None

    def tile(j, dq_QxD, masking):
        k_first = j * block_k
        cols = pl.ds(k_first, block_k)
        k_KxD = k_ref[b, cols, kv_head, :]
        v_KxD = v_ref[b, cols, kv_head, :]
        s_QxK = plgpu.dot(q_QxD, k_KxD, trans_b=True)

        def ok_QxK():
            ok = band_mask_QxK(q_first, k_first, block_q, block_k, window)
            if has_segments:
                ok = ok & (seg_q[:, None] == segment_ref[b, cols][None, :])
            return ok

        s_QxK = mask_scores(s_QxK, ok_QxK, masking)
        p_QxK = jnp.exp2(s_QxK * score_scale - lse_Q[:, None])
        dp_QxK = plgpu.dot(do_QxD, v_KxD, trans_b=True)
        ds_QxK = p_QxK * (dp_QxK - delta_Q[:, None])
        return dq_QxD + plgpu.dot(ds_QxK.astype(k_KxD.dtype), k_KxD)

    first, lo, hi, end = split_kv_loop(q_block, block_q, block_k, window, seq_len)
    dq_QxD = run_band_loop(first, lo, hi, end, tile, jnp.zeros(q_QxD.shape, jnp.float32),
                           "masked" if has_segments else loop_mode)
    dq_ref[b, rows, h, :] = (dq_QxD * sm_scale).astype(dq_ref.dtype)


def _dkdv_kernel(schedule_ref, window_ref, q_ref, k_ref, v_ref, *refs, block_q: int,
                 block_k: int, num_k_blocks: int, group: int, seq_len: int,
                 score_scale: float, sm_scale: float, has_segments: bool,
                 loop_mode: str):
    if has_segments:
        segment_ref, *refs = refs
    do_ref, lse_ref, delta_ref, dk_ref, dv_ref = refs

    b = pl.program_id(0)
    item = schedule_ref[pl.program_id(1)]
    kv_head = jax.lax.div(item, num_k_blocks)
    k_block = jax.lax.rem(item, num_k_blocks)
    k_first = k_block * block_k
    cols = pl.ds(k_first, block_k)

    k_KxD = k_ref[b, cols, kv_head, :]
    v_KxD = v_ref[b, cols, kv_head, :]
    seg_k = segment_ref[b, cols] if has_segments else None

    def one_query_head(g, carry):
        h = kv_head * group + g
        window = window_ref[h]

        def tile(i, carry, masking):
            dk_KxD, dv_KxD = carry
            q_first = i * block_q
            rows = pl.ds(q_first, block_q)
            q_QxD = q_ref[b, rows, h, :]
            do_QxD = do_ref[b, rows, h, :]
            lse_Q = lse_ref[b, h, rows]
            delta_Q = delta_ref[b, h, rows]
            sT_KxQ = plgpu.dot(k_KxD, q_QxD, trans_b=True)

            def ok_KxQ():
                ok = band_mask_KxQ(q_first, k_first, block_q, block_k, window)
                if has_segments:
                    ok = ok & (seg_k[:, None] == segment_ref[b, rows][None, :])
                return ok

            sT_KxQ = mask_scores(sT_KxQ, ok_KxQ, masking)
            pT_KxQ = jnp.exp2(sT_KxQ * score_scale - lse_Q[None, :])
            dv_KxD = dv_KxD + plgpu.dot(pT_KxQ.astype(do_QxD.dtype), do_QxD)
            dpT_KxQ = plgpu.dot(v_KxD, do_QxD, trans_b=True)
            dsT_KxQ = pT_KxQ * (dpT_KxQ - delta_Q[None, :])
            dk_KxD = dk_KxD + plgpu.dot(dsT_KxQ.astype(q_QxD.dtype), q_QxD)
            return dk_KxD, dv_KxD

        first, lo, hi, end = split_q_loop(k_block, block_q, block_k, window, seq_len)
        return run_band_loop(first, lo, hi, end, tile, carry,
                             "masked" if has_segments else loop_mode)

    carry = (jnp.zeros(k_KxD.shape, jnp.float32), jnp.zeros(v_KxD.shape, jnp.float32))
    if group == 1:
        carry = one_query_head(0, carry)
    else:
        carry = jax.lax.fori_loop(0, group, one_query_head, carry)
    dk_KxD, dv_KxD = carry
    dk_ref[b, cols, kv_head, :] = (dk_KxD * sm_scale).astype(dk_ref.dtype)
    dv_ref[b, cols, kv_head, :] = dv_KxD.astype(dv_ref.dtype)


def flash_backward(dq_schedule, dkdv_schedule, windows, q, k, v, segment_ids, do, lse2, delta,
                   *, dq_blocks: tuple[int, int], dkdv_blocks: tuple[int, int],
                   sm_scale: float, num_warps: int, num_stages: int, loop_mode: str,
                   interpret: bool):
    """Runs the dQ and dK/dV kernels on padded inputs.

    Args:
      dq_schedule: int32 [n], item = head * num_q_blocks + q_block (dq_blocks' block_q).
      dkdv_schedule: int32 [m], item = kv_head * num_k_blocks + k_block (dkdv_blocks' block_k).
      windows: int32 [Hq]. q, do: [B, Tp, Hq, Dp]; k, v: [B, Tp, Hkv, Dp].
      lse2, delta: float32 [B, Hq, Tp]. dq_blocks, dkdv_blocks: (block_q, block_k).

    Returns:
      dq [B, Tp, Hq, Dp], dk and dv [B, Tp, Hkv, Dp], in the input dtypes.
    """

    B, Tp, Hq, Dp = q.shape
    Hkv = k.shape[2]
    has_segments = segment_ids is not None
    seg = [] if segment_ids is None else [segment_ids]
    params = plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    common = dict(group=Hq // Hkv, seq_len=Tp, score_scale=sm_scale * LOG2_E,
                  sm_scale=sm_scale, has_segments=has_segments, loop_mode=loop_mode)

    dq = pl.pallas_call(
        functools.partial(_dq_kernel, block_q=dq_blocks[0], block_k=dq_blocks[1],
                          num_q_blocks=Tp // dq_blocks[0], **common),
        grid=(B, dq_schedule.shape[0]),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=params,
        interpret=interpret,
        name="ls_attention_bwd_dq",
    )(dq_schedule, windows, q, k, v, *seg, do, lse2, delta)

    dk, dv = pl.pallas_call(
        functools.partial(_dkdv_kernel, block_q=dkdv_blocks[0], block_k=dkdv_blocks[1],
                          num_k_blocks=Tp // dkdv_blocks[1], **common),
        grid=(B, dkdv_schedule.shape[0]),
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype),
                   jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=params,
        interpret=interpret,
        name="ls_attention_bwd_dkdv",
    )(dkdv_schedule, windows, q, k, v, *seg, do, lse2, delta)
    return dq, dk, dv
