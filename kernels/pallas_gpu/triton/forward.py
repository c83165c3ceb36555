"""Forward Triton kernel: flash attention over each head's band, the launch's heads at once.

A program's key/value loop visits only the key blocks that intersect its head's band
(``common.split_kv_loop``, from the ranges of ``kernels.band``): boundary tiles get an element
mask, interior tiles none, and blocks outside the band are never loaded. Each head's effective
window comes from a small int32 table; the order of programs from ``plan.program_order``
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

from ls_jax.kernels.pallas_gpu.common import LOG2_E, MASKED_SCORE, MAX_FLOOR, split_kv_loop
from ls_jax.kernels.pallas_gpu.configs import TritonConfig
from ls_jax.kernels.pallas_gpu.plan import AttentionPlan, program_order
from ls_jax.kernels.pallas_gpu.triton.tiles import (TilePath, allowed_QxK, compiler_params,
                                                    mask_scores, run_band_loop)
from ls_jax.kernels.platform_call import on_platform


class _ForwardProgram:
    """One program's refs and static parameters."""

    def __init__(self, refs, *, b, h, kv_head, window, seq_len, score_scale, scale,
                 has_segments, with_stats):
        (self.q_ref, self.k_ref, self.v_ref, self.segment_ref, self.out_ref, self.lse_ref,
         self.stat_ref) = refs
        self.b, self.h, self.kv_head, self.window = b, h, kv_head, window
        self.seq_len, self.score_scale, self.scale = seq_len, score_scale, scale
        self.has_segments, self.with_stats = has_segments, with_stats

    def init_state(self, block_q, head_dim):
        state = (jnp.zeros((block_q, head_dim), jnp.float32),
                 jnp.full((block_q,), MASKED_SCORE, jnp.float32),
                 jnp.zeros((block_q,), jnp.float32))
        if self.with_stats:
            state += (jnp.full((block_q,), -MASKED_SCORE, jnp.float32),)
        return state

    def step(self, q_QxD, q_first, j, path: TilePath, masking, state):
        """One online-softmax update of ``state`` with key block ``j``."""
        acc_QxD, m_Q, l_Q, *min_Q = state
        b, bq, bk, c = self.b, path.block_q, path.block_k, self.score_scale
        k_first = j * bk
        cols = pl.ds(k_first, bk)
        k_KxD = self.k_ref[b, cols, self.kv_head, :]
        s_QxK = plgpu.dot(q_QxD, k_KxD, trans_b=True)  # raw q.k; scaled inside exp2

        segments = self.segment_ref if self.has_segments else None
        s_QxK = mask_scores(
            s_QxK, lambda: allowed_QxK(q_first, k_first, bq, bk, self.window, segments, b),
            masking)
        m_new_Q = jnp.maximum(m_Q, jnp.max(s_QxK, axis=1))
        # scaled running max, floored so that a row that has seen only masked keys gets
        # p = exp2(MASKED_SCORE * c - floor) = 0 exactly, whatever the FMA rounding
        ms_Q = jnp.maximum(m_Q * c, MAX_FLOOR)
        ms_new_Q = jnp.maximum(m_new_Q * c, MAX_FLOOR)
        alpha_Q = jnp.exp2(ms_Q - ms_new_Q)
        p_QxK = jnp.exp2(s_QxK * c - ms_new_Q[:, None])  # one FMA per element
        l_new_Q = l_Q * alpha_Q + jnp.sum(p_QxK, axis=1)
        v_KxD = self.v_ref[b, cols, self.kv_head, :]
        acc_QxD = acc_QxD * alpha_Q[:, None] + plgpu.dot(p_QxK.astype(v_KxD.dtype), v_KxD)
        if self.with_stats:  # masked scores are exactly MASKED_SCORE: keep them out of the min
            s_min = s_QxK if isinstance(masking, str) and masking == "none" else jnp.where(
                s_QxK == MASKED_SCORE, -MASKED_SCORE, s_QxK)
            min_Q = [jnp.minimum(min_Q[0], jnp.min(s_min, axis=1))]
        return (acc_QxD, m_new_Q, l_new_Q, *min_Q)

    def write(self, q_first, block_q, state):
        acc_QxD, m_Q, l_Q, *min_Q = state
        b, h, rows = self.b, self.h, pl.ds(q_first, block_q)
        self.out_ref[b, rows, h, :] = (acc_QxD * (1.0 / l_Q)[:, None]).astype(
            self.out_ref.dtype)
        self.lse_ref[b, h, rows] = jnp.maximum(m_Q * self.score_scale, MAX_FLOOR) + jnp.log2(l_Q)
        if self.with_stats:
            self.stat_ref[b, h, rows] = jnp.maximum(m_Q, -min_Q[0]) * self.scale

    def one_block(self, path: TilePath, q_block):
        """Query block ``q_block``: one loop over exactly the key blocks of its band."""
        bq, bk = path.block_q, path.block_k
        q_first = q_block * bq
        q_QxD = self.q_ref[self.b, pl.ds(q_first, bq), self.h, :]

        def tile(j, state, masking):
            return self.step(q_QxD, q_first, j, path, masking, state)

        first, lo, hi, end = split_kv_loop(q_block, bq, bk, self.window, self.seq_len)
        state = run_band_loop(first, lo, hi, end, tile, self.init_state(bq, q_QxD.shape[-1]),
                              path.loop_mode)
        self.write(q_first, bq, state)


def _forward_kernel(schedule_ref, window_ref, q_ref, k_ref, v_ref, *refs, path: TilePath,
                    num_slots: int, group: int, seq_len: int, score_scale: float,
                    scale: float, has_segments: bool, with_stats: bool, num_prefilled: int):
    segment_ref = None
    if has_segments:
        segment_ref, *refs = refs
    refs = refs[num_prefilled:]  # outputs of an earlier launch, aliased to ours (unread)
    out_ref, lse_ref, *refs = refs
    stat_ref = refs[0] if with_stats else None

    b = pl.program_id(0)
    item = schedule_ref[pl.program_id(1)]
    h = jax.lax.div(item, jnp.int32(num_slots))
    program = _ForwardProgram(
        (q_ref, k_ref, v_ref, segment_ref, out_ref, lse_ref, stat_ref), b=b, h=h,
        kv_head=jax.lax.div(h, jnp.int32(group)), window=window_ref[h], seq_len=seq_len,
        score_scale=score_scale, scale=scale, has_segments=has_segments,
        with_stats=with_stats)
    program.one_block(path, jax.lax.rem(item, jnp.int32(num_slots)))


def forward_call(plan: AttentionPlan, config: TritonConfig, heads: tuple[int, ...], q, k, v,
                 segment_ids, prefilled=()):
    """Runs the forward kernel over the query ``heads`` on padded inputs.

    Args:
      q: [B, Tp, H, Dp]; k, v: [B, Tp, G, Dp]; Tp a multiple of every block.
      segment_ids: None or int32 [B, Tp].
      prefilled: () or the (out, lse2[, stat]) of an earlier launch, into which this one
        writes its heads' rows (aliased, not copied); without it the other heads' rows are
        left unwritten.

    Returns:
      out [B, Tp, H, Dp] in q.dtype, lse2 float32 [B, H, Tp] (log2 domain: natural lse
      times log2(e)), and with ``plan.logit_stats`` float32 [B, H, Tp] max |logit| of each row
      (else None).
    """
    B, Tp, H, Dp = q.shape
    G = k.shape[2]
    schedule = jnp.asarray(program_order(tuple((w,) for w in plan.windows), heads, Tp,
                                         config.block_q, config.block_k, False))
    has_segments = segment_ids is not None
    path = TilePath(config.block_q, config.block_k,
                    "masked" if has_segments else "split" if config.split_loop else "cond")
    kernel = functools.partial(
        _forward_kernel, path=path, num_slots=Tp // config.block_q, group=H // G,
        seq_len=Tp, score_scale=plan.scale * LOG2_E, scale=plan.scale,
        has_segments=has_segments, with_stats=plan.logit_stats,
        num_prefilled=len(prefilled))
    out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype),
                 jax.ShapeDtypeStruct((B, H, Tp), jnp.float32)]
    if plan.logit_stats:
        out_shape.append(jax.ShapeDtypeStruct((B, H, Tp), jnp.float32))
    inputs = [schedule, jnp.asarray(plan.windows, jnp.int32), q, k, v]
    inputs += [] if segment_ids is None else [segment_ids]
    aliases = {len(inputs) + i: i for i in range(len(prefilled))}
    inputs += list(prefilled)
    outs = on_platform("cuda", pl.pallas_call(
        kernel,
        grid=(B, schedule.shape[0]),
        out_shape=out_shape,
        compiler_params=compiler_params(config),
        interpret=plan.interpret,
        input_output_aliases=aliases,
        name="ls_attention_fwd",
    ))(*inputs)
    return (outs[0], outs[1], outs[2] if plan.logit_stats else None)
