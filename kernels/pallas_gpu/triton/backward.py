"""Backward Pallas GPU kernels: dQ, and dK/dV, each skipping the blocks outside the band.

Both recompute the probabilities from the raw scores ``s = q . k`` and the saved log2-domain
logsumexp ``lse2``: ``p = exp2(s * c - lse2)`` with ``c = scale * log2(e)``; then
``dp = dO . V^T``, ``ds = p * (dp - delta)`` with ``delta_i = sum_d O_id dO_id``, and
``dQ = scale * ds . K``, ``dK = scale * ds^T . Q``, ``dV = p^T . dO``.

- dQ: one program per (batch, query head, query block), looping over the key blocks of the
  head's band exactly like the forward kernel. It also computes ``delta`` from its O and dO
  tiles and writes it out for the dK/dV kernel (no separate pass over O, dO).
- dK/dV: one program per (batch, kv head, key block), looping over the query heads that share
  the kv head (GQA) and, for each, over only the query blocks whose band reaches the key block
  (about ceil(p / block_q) + 1 of them for a local head).

Like the forward, each kernel runs its programs in ``plan.program_order`` (longest first).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ls_jax.kernels.pallas_gpu.common import LOG2_E, split_kv_loop, split_q_loop
from ls_jax.kernels.pallas_gpu.configs import TritonConfig
from ls_jax.kernels.pallas_gpu.plan import AttentionPlan, program_order
from ls_jax.kernels.pallas_gpu.triton.tiles import (TilePath, allowed_KxQ, allowed_QxK,
                                                    compiler_params, mask_scores,
                                                    run_band_loop)
from ls_jax.kernels.platform_call import on_platform


class _DqProgram:
    def __init__(self, refs, *, b, h, kv_head, window, seq_len, score_scale, scale,
                 has_segments):
        (self.q_ref, self.k_ref, self.v_ref, self.segment_ref, self.do_ref, self.o_ref,
         self.lse_ref, self.dq_ref, self.delta_out_ref) = refs
        self.b, self.h, self.kv_head, self.window = b, h, kv_head, window
        self.seq_len, self.score_scale, self.scale = seq_len, score_scale, scale
        self.has_segments = has_segments

    def step(self, rows, q_first, j, path: TilePath, masking, dq_QxD):
        """dq += ds . K for key block ``j``."""
        q_QxD, do_QxD, lse_Q, delta_Q = rows
        b, bq, bk = self.b, path.block_q, path.block_k
        k_first = j * bk
        cols = pl.ds(k_first, bk)
        k_KxD = self.k_ref[b, cols, self.kv_head, :]
        v_KxD = self.v_ref[b, cols, self.kv_head, :]
        s_QxK = plgpu.dot(q_QxD, k_KxD, trans_b=True)

        segments = self.segment_ref if self.has_segments else None
        s_QxK = mask_scores(
            s_QxK, lambda: allowed_QxK(q_first, k_first, bq, bk, self.window, segments, b),
            masking)
        p_QxK = jnp.exp2(s_QxK * self.score_scale - lse_Q[:, None])
        dp_QxK = plgpu.dot(do_QxD, v_KxD, trans_b=True)
        ds_QxK = p_QxK * (dp_QxK - delta_Q[:, None])
        return dq_QxD + plgpu.dot(ds_QxK.astype(k_KxD.dtype), k_KxD)

    def one_block(self, path: TilePath, q_block):
        b, h, bq, bk = self.b, self.h, path.block_q, path.block_k
        q_first = q_block * bq
        rows = pl.ds(q_first, bq)
        do_QxD = self.do_ref[b, rows, h, :]
        o_QxD = self.o_ref[b, rows, h, :]
        delta_Q = jnp.sum(o_QxD.astype(jnp.float32) * do_QxD.astype(jnp.float32), axis=1)
        self.delta_out_ref[b, h, rows] = delta_Q
        row_data = (self.q_ref[b, rows, h, :], do_QxD, self.lse_ref[b, h, rows], delta_Q)

        def tile(j, dq_QxD, masking):
            return self.step(row_data, q_first, j, path, masking, dq_QxD)

        first, lo, hi, end = split_kv_loop(q_block, bq, bk, self.window, self.seq_len)
        dq_QxD = run_band_loop(first, lo, hi, end, tile, jnp.zeros(do_QxD.shape, jnp.float32),
                               path.loop_mode)
        self.dq_ref[b, rows, h, :] = (dq_QxD * self.scale).astype(self.dq_ref.dtype)


def _program_refs(schedule_ref, refs, *, num_slots: int, has_segments: bool,
                  num_prefilled: int):
    """What both backward kernels start from: (segment ids' ref or None, the refs after q, k
    and v, the batch row, the head (kv head for dK/dV) and the block slot of this program)."""
    segment_ref = None
    if has_segments:
        segment_ref, *refs = refs
    refs = refs[:3] + refs[3 + num_prefilled:]  # aliased inputs (unread) sit before the outputs
    item = schedule_ref[pl.program_id(1)]
    return (segment_ref, refs, pl.program_id(0), jax.lax.div(item, jnp.int32(num_slots)),
            jax.lax.rem(item, jnp.int32(num_slots)))


def _dq_kernel(schedule_ref, window_ref, q_ref, k_ref, v_ref, *refs, path: TilePath,
               num_slots: int, group: int, seq_len: int, score_scale: float, scale: float,
               has_segments: bool, num_prefilled: int):
    segment_ref, refs, b, h, slot = _program_refs(
        schedule_ref, refs, num_slots=num_slots, has_segments=has_segments,
        num_prefilled=num_prefilled)
    do_ref, o_ref, lse_ref, dq_ref, delta_out_ref = refs
    program = _DqProgram(
        (q_ref, k_ref, v_ref, segment_ref, do_ref, o_ref, lse_ref, dq_ref, delta_out_ref),
        b=b, h=h, kv_head=jax.lax.div(h, jnp.int32(group)), window=window_ref[h],
        seq_len=seq_len, score_scale=score_scale, scale=scale, has_segments=has_segments)
    program.one_block(path, slot)


class _DkdvProgram:
    def __init__(self, refs, *, b, kv_head, group, seq_len, score_scale, scale,
                 has_segments):
        (self.window_ref, self.q_ref, self.k_ref, self.v_ref, self.segment_ref, self.do_ref,
         self.lse_ref, self.delta_ref, self.dk_ref, self.dv_ref) = refs
        self.b, self.kv_head, self.group = b, kv_head, group
        self.seq_len, self.score_scale, self.scale = seq_len, score_scale, scale
        self.has_segments = has_segments

    def step(self, kv, k_first, i, h, window, path: TilePath, masking, grads):
        """dK, dV += the contributions of query block ``i`` of query head ``h``."""
        k_KxD, v_KxD = kv
        dk_KxD, dv_KxD = grads
        b, bq, bk = self.b, path.block_q, path.block_k
        q_first = i * bq
        rows = pl.ds(q_first, bq)
        q_QxD = self.q_ref[b, rows, h, :]
        do_QxD = self.do_ref[b, rows, h, :]
        lse_Q = self.lse_ref[b, h, rows]
        delta_Q = self.delta_ref[b, h, rows]
        sT_KxQ = plgpu.dot(k_KxD, q_QxD, trans_b=True)

        segments = self.segment_ref if self.has_segments else None
        sT_KxQ = mask_scores(
            sT_KxQ, lambda: allowed_KxQ(q_first, k_first, bq, bk, window, segments, b), masking)
        pT_KxQ = jnp.exp2(sT_KxQ * self.score_scale - lse_Q[None, :])
        dv_KxD = dv_KxD + plgpu.dot(pT_KxQ.astype(do_QxD.dtype), do_QxD)
        dpT_KxQ = plgpu.dot(v_KxD, do_QxD, trans_b=True)
        dsT_KxQ = pT_KxQ * (dpT_KxQ - delta_Q[None, :])
        dk_KxD = dk_KxD + plgpu.dot(dsT_KxQ.astype(q_QxD.dtype), q_QxD)
        return dk_KxD, dv_KxD

    def one_block(self, path: TilePath, k_block):
        b, bq, bk = self.b, path.block_q, path.block_k
        k_first = k_block * bk
        cols = pl.ds(k_first, bk)
        kv = (self.k_ref[b, cols, self.kv_head, :], self.v_ref[b, cols, self.kv_head, :])

        def one_query_head(g, grads):
            h = self.kv_head * self.group + g
            window = self.window_ref[h]

            def tile(i, grads, masking):
                return self.step(kv, k_first, i, h, window, path, masking, grads)

            first, lo, hi, end = split_q_loop(k_block, bq, bk, window, self.seq_len)
            return run_band_loop(first, lo, hi, end, tile, grads, path.loop_mode)

        grads = (jnp.zeros(kv[0].shape, jnp.float32), jnp.zeros(kv[1].shape, jnp.float32))
        if self.group == 1:
            grads = one_query_head(0, grads)
        else:
            grads = jax.lax.fori_loop(0, self.group, one_query_head, grads)
        dk_KxD, dv_KxD = grads
        self.dk_ref[b, cols, self.kv_head, :] = (dk_KxD * self.scale).astype(
            self.dk_ref.dtype)
        self.dv_ref[b, cols, self.kv_head, :] = dv_KxD.astype(self.dv_ref.dtype)


def _dkdv_kernel(schedule_ref, window_ref, q_ref, k_ref, v_ref, *refs, path: TilePath,
                 num_slots: int, group: int, seq_len: int, score_scale: float, scale: float,
                 has_segments: bool, num_prefilled: int):
    segment_ref, refs, b, kv_head, slot = _program_refs(
        schedule_ref, refs, num_slots=num_slots, has_segments=has_segments,
        num_prefilled=num_prefilled)
    do_ref, lse_ref, delta_ref, dk_ref, dv_ref = refs
    program = _DkdvProgram(
        (window_ref, q_ref, k_ref, v_ref, segment_ref, do_ref, lse_ref, delta_ref, dk_ref,
         dv_ref), b=b, kv_head=kv_head, group=group, seq_len=seq_len,
        score_scale=score_scale, scale=scale, has_segments=has_segments)
    program.one_block(path, slot)


def _path(config: TritonConfig, kernel: str, has_segments: bool) -> TilePath:
    """The tiles of the "dq" or "dkdv" kernel; boundary tiles masked behind a run-time branch
    (every tile with segment ids)."""
    return TilePath(getattr(config, f"{kernel}_block_q"), getattr(config, f"{kernel}_block_k"),
                    "masked" if has_segments else "cond")


def _common(plan: AttentionPlan, q, k, segment_ids, num_prefilled: int):
    return dict(group=q.shape[2] // k.shape[2], seq_len=q.shape[1],
                score_scale=plan.scale * LOG2_E, scale=plan.scale,
                has_segments=segment_ids is not None, num_prefilled=num_prefilled)


def dq_call(plan: AttentionPlan, config: TritonConfig, heads: tuple[int, ...], q, k, v,
            segment_ids, do, out, lse2, *, prefilled=None):
    """Runs the dQ kernel over the query ``heads`` on padded inputs; returns (dq [B, Tp, H, Dp]
    in q's dtype, delta float32 [B, H, Tp]), delta = rowsum(out * do) computed from the
    kernel's own tiles (rows of ``heads`` only).

    q, do, out: [B, Tp, H, Dp]; k, v: [B, Tp, G, Dp]; lse2: float32 [B, H, Tp].
    prefilled: None or a dq whose other heads an earlier launch wrote (aliased to the output).
    """
    B, Tp, H, Dp = q.shape
    path = _path(config, "dq", segment_ids is not None)
    schedule = jnp.asarray(program_order(tuple((w,) for w in plan.windows), heads, Tp,
                                         path.block_q, path.block_k, False))
    seg = [] if segment_ids is None else [segment_ids]
    aliased = [] if prefilled is None else [prefilled]
    inputs = (schedule, jnp.asarray(plan.windows, jnp.int32), q, k, v, *seg, do, out, lse2)
    return tuple(on_platform("cuda", pl.pallas_call(
        functools.partial(_dq_kernel, path=path, num_slots=Tp // path.block_q,
                          **_common(plan, q, k, segment_ids, len(aliased))),
        grid=(B, schedule.shape[0]), compiler_params=compiler_params(config),
        interpret=plan.interpret, name="ls_attention_bwd_dq",
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                   jax.ShapeDtypeStruct((B, H, Tp), jnp.float32)],
        input_output_aliases={len(inputs) + i: i for i in range(len(aliased))},
    ))(*inputs, *aliased))


def dkdv_call(plan: AttentionPlan, config: TritonConfig, heads: tuple[int, ...], q, k, v,
              segment_ids, do, lse2, delta, *, prefilled=None):
    """Runs the dK/dV kernel on padded inputs for the kv heads of the query ``heads`` (whole
    GQA groups, or one kv head per query head); returns dk and dv [B, Tp, G, Dp] in k's dtype,
    summed over each kv head's query heads. delta: float32 [B, H, Tp] from ``dq_call``.
    prefilled: None or the (dk, dv) an earlier launch wrote its kv heads into (aliased)."""
    B, Tp, H, _ = q.shape
    G = k.shape[2]
    group = H // G
    path = _path(config, "dkdv", segment_ids is not None)
    kv_heads = tuple(sorted({h // group for h in heads}))
    group_windows = tuple(plan.windows[g * group:(g + 1) * group] for g in range(G))
    schedule = jnp.asarray(program_order(group_windows, kv_heads, Tp, path.block_q,
                                         path.block_k, True))
    seg = [] if segment_ids is None else [segment_ids]
    aliased = [] if prefilled is None else list(prefilled)
    inputs = (schedule, jnp.asarray(plan.windows, jnp.int32), q, k, v, *seg, do, lse2, delta)
    return tuple(on_platform("cuda", pl.pallas_call(
        functools.partial(_dkdv_kernel, path=path, num_slots=Tp // path.block_k,
                          **_common(plan, q, k, segment_ids, len(aliased))),
        grid=(B, schedule.shape[0]),
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype),
                   jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=compiler_params(config),
        interpret=plan.interpret,
        input_output_aliases={len(inputs) + i: i for i in range(len(aliased))},
        name="ls_attention_bwd_dkdv",
    ))(*inputs, *aliased))
