"""Forward Pallas GPU kernel: flash attention over each head's band, all heads in one launch.

A program's key/value loop visits only the key blocks that intersect its head's band
(``kernels.pallas_gpu.tiles.split_kv_loop``, from the ranges of ``kernels.band``): boundary
tiles get an element mask, interior tiles none, and blocks outside the band are never loaded.
Per-head data comes from a small int32 table ``head [2, H]``: row 0 the effective window, row
1 the head's class (wide or narrow). Each class present is a static ``TilePath`` compiled into
the same kernel behind a run-time branch, so wide heads can use other tiles than narrow ones,
all in one launch. The order of programs comes from the plan's schedule (longest first).

Inputs are padded by the caller to a whole number of blocks (sequence) and to a head size the
matrix units take; the kernel itself never masks loads.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ls_jax.kernels.pallas_gpu.forward_mosaic import forward_call_mosaic
from ls_jax.kernels.pallas_gpu.forward_strip import forward_call_strip, strip_fits
from ls_jax.kernels.pallas_gpu.mosaic_ring import mosaic_fits
from ls_jax.kernels.pallas_gpu.plan import AttentionPlan, ClassPaths, TilePath
from ls_jax.kernels.pallas_gpu.tiles import (LOG2_E, MASKED_SCORE, MAX_FLOOR, allowed_QxK,
                                             mask_scores, run_band_loop, run_by_class,
                                             split_kv_loop)


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
                              "masked" if self.has_segments else path.loop_mode)
        self.write(q_first, bq, state)


def _forward_kernel(schedule_ref, head_ref, q_ref, k_ref, v_ref, *refs, paths: ClassPaths,
                    num_slots: int, group: int, seq_len: int, score_scale: float,
                    scale: float, has_segments: bool, with_stats: bool, num_prefilled: int):
    segment_ref = None
    if has_segments:
        segment_ref, *refs = refs
    refs = refs[num_prefilled:]  # outputs of the Mosaic forward, aliased to ours (unread)
    out_ref, lse_ref, *refs = refs
    stat_ref = refs[0] if with_stats else None

    b = pl.program_id(0)
    item = schedule_ref[pl.program_id(1)]
    h = jax.lax.div(item, num_slots)
    slot = jax.lax.rem(item, num_slots)
    head_class = head_ref[1, h]
    program = _ForwardProgram(
        (q_ref, k_ref, v_ref, segment_ref, out_ref, lse_ref, stat_ref), b=b, h=h,
        kv_head=jax.lax.div(h, group), window=head_ref[0, h], seq_len=seq_len,
        score_scale=score_scale, scale=scale, has_segments=has_segments,
        with_stats=with_stats)
    run_by_class(head_class, paths, lambda path: program.one_block(path, slot))


def forward_call(plan: AttentionPlan, q, k, v, segment_ids):
    """Runs the forward kernel on padded inputs.

    Args:
      plan: the call's ``AttentionPlan``; its forward ``ProgramPlan`` gives the program order
        (item = head * num_slots + q_block, in the block size of the head's class) and the
        class of each head.
      q: [B, Tp, H, Dp]; k, v: [B, Tp, G, Dp]; Tp a multiple of every block.
      segment_ids: None or int32 [B, Tp].

    Returns:
      out [B, Tp, H, Dp] in q.dtype, lse2 float32 [B, H, Tp] (log2 domain: natural lse
      times log2(e)), and with ``plan.logit_stats`` float32 [B, H, Tp] max |logit| of each row.

    With ``config.fwd_lowering`` "mosaic", calls that fit it (``mosaic_ring.mosaic_fits``)
    run the Hopper kernel of ``forward_mosaic.py`` instead (same outputs); with "mixed" only
    their global heads do (a first launch) and this kernel computes the local heads into the
    same buffers (a second launch, outputs aliased to the first's). With
    ``config.local_fwd_lowering`` "strip", local heads this kernel would run go to
    ``forward_strip.py`` instead where it fits (the same outputs, the same aliasing).
    """
    B, Tp, H, Dp = q.shape
    prefilled, heads = (), None  # heads: the ones this kernel computes (None: all)
    lowering = plan.config.fwd_lowering
    hopper = mosaic_fits(q.dtype, Dp, segment_ids is not None, plan.interpret)
    wide = plan.global_heads()
    if lowering != "triton" and hopper:
        if lowering == "mosaic" or len(wide) == H:
            return forward_call_mosaic(plan, q, k, v)
        if wide:  # "mixed": the global heads on the Hopper kernel, the local ones below
            prefilled = tuple(x for x in forward_call_mosaic(plan, q, k, v, heads=wide)
                              if x is not None)
            heads = plan.local_heads()
    if plan.config.local_fwd_lowering == "strip" and hopper and (heads or not wide):
        local = plan.local_heads()  # every head left is local: strips, into the same buffers
        if strip_fits(Dp, [plan.window_table()[h] for h in local]):
            return forward_call_strip(plan, q, k, v, local, prefilled)
    G = k.shape[2]
    programs = plan.query_plan("fwd")
    c = plan.config
    # per-head table: row 0 the effective window, row 1 the head's class
    head_table = jnp.stack([jnp.asarray(plan.window_table(), jnp.int32),
                            jnp.asarray(programs.head_class)])
    schedule = jnp.asarray(programs.schedule_of(heads))
    kernel = functools.partial(
        _forward_kernel, paths=programs.paths, num_slots=programs.num_slots, group=H // G,
        seq_len=Tp, score_scale=plan.scale * LOG2_E, scale=plan.scale,
        has_segments=segment_ids is not None, with_stats=plan.logit_stats,
        num_prefilled=len(prefilled))
    out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype),
                 jax.ShapeDtypeStruct((B, H, Tp), jnp.float32)]
    if plan.logit_stats:
        out_shape.append(jax.ShapeDtypeStruct((B, H, Tp), jnp.float32))
    inputs = [schedule, head_table, q, k, v] + ([] if segment_ids is None else [segment_ids])
    aliases = {len(inputs) + i: i for i in range(len(prefilled))}
    inputs += list(prefilled)
    outs = pl.pallas_call(
        kernel,
        grid=(B, schedule.shape[0]),
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=c.fwd_num_warps,
                                             num_stages=c.fwd_num_stages),
        interpret=plan.interpret,
        input_output_aliases=aliases,
        name="ls_attention_fwd",
    )(*inputs)
    return (outs[0], outs[1], outs[2] if plan.logit_stats else None)
