"""Backward Pallas GPU kernels: dQ, and dK/dV, each skipping the blocks outside the band.

Both recompute the probabilities from the raw scores ``s = q . k`` and the saved log2-domain
logsumexp ``lse2``: ``p = exp2(s * c - lse2)`` with ``c = scale * log2(e)``; then
``dp = dO . V^T``, ``ds = p * (dp - delta)`` with ``delta_i = sum_d O_id dO_id``, and
``dQ = scale * ds . K``, ``dK = scale * ds^T . Q``, ``dV = p^T . dO``.

- dQ: one program per (batch, query head, query block), looping over the key blocks of the
  head's band exactly like the forward kernel. By default it also computes ``delta`` from
  its O and dO tiles and writes it out for the dK/dV kernel (no separate pass over O, dO).
- dK/dV: one program per (batch, kv head, key block), looping over the query heads that share
  the kv head (GQA) and, for each, over only the query blocks whose band reaches the key block
  (about ceil(p / block_q) + 1 of them for a local head).

Like the forward, each kernel compiles one static tile path per class of head present (wide,
narrow: ``kernels.pallas_gpu.plan.ClassPaths``) behind a run-time branch, and runs its
programs in the plan's schedule order (longest first).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ls_jax.kernels.heads import merge_heads, take_heads
from ls_jax.kernels.pallas_gpu.backward_mosaic import (delta_fits, dkdv_call_mosaic,
                                                       dq_call_mosaic)
from ls_jax.kernels.pallas_gpu.mosaic_ring import mosaic_fits
from ls_jax.kernels.pallas_gpu.plan import AttentionPlan, ClassPaths, TilePath
from ls_jax.kernels.pallas_gpu.tiles import (LOG2_E, allowed_KxQ, allowed_QxK, mask_scores,
                                             run_band_loop, run_by_class, split_kv_loop,
                                             split_q_loop)


class _DqProgram:
    def __init__(self, refs, *, b, h, kv_head, window, seq_len, score_scale, scale,
                 has_segments):
        (self.q_ref, self.k_ref, self.v_ref, self.segment_ref, self.do_ref, self.o_ref,
         self.lse_ref, self.delta_ref, self.dq_ref, self.delta_out_ref) = refs
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
        if self.o_ref is None:  # delta computed outside
            delta_Q = self.delta_ref[b, h, rows]
        else:
            o_QxD = self.o_ref[b, rows, h, :]
            delta_Q = jnp.sum(o_QxD.astype(jnp.float32) * do_QxD.astype(jnp.float32), axis=1)
            self.delta_out_ref[b, h, rows] = delta_Q
        row_data = (self.q_ref[b, rows, h, :], do_QxD, self.lse_ref[b, h, rows], delta_Q)

        def tile(j, dq_QxD, masking):
            return self.step(row_data, q_first, j, path, masking, dq_QxD)

        first, lo, hi, end = split_kv_loop(q_block, bq, bk, self.window, self.seq_len)
        dq_QxD = run_band_loop(first, lo, hi, end, tile, jnp.zeros(do_QxD.shape, jnp.float32),
                               "masked" if self.has_segments else path.loop_mode)
        self.dq_ref[b, rows, h, :] = (dq_QxD * self.scale).astype(self.dq_ref.dtype)


def _dq_kernel(schedule_ref, head_ref, q_ref, k_ref, v_ref, *refs, paths: ClassPaths,
               num_slots: int, group: int, seq_len: int, score_scale: float, scale: float,
               has_segments: bool, delta_in_kernel: bool, num_prefilled: int = 0):
    segment_ref = o_ref = delta_ref = delta_out_ref = None
    if has_segments:
        segment_ref, *refs = refs
    refs = refs[:3] + refs[3 + num_prefilled:]  # aliased inputs (unread) sit before the outputs
    if delta_in_kernel:
        do_ref, o_ref, lse_ref, dq_ref, delta_out_ref = refs
    else:
        do_ref, lse_ref, delta_ref, dq_ref = refs

    b = pl.program_id(0)
    item = schedule_ref[pl.program_id(1)]
    h = jax.lax.div(item, num_slots)
    program = _DqProgram(
        (q_ref, k_ref, v_ref, segment_ref, do_ref, o_ref, lse_ref, delta_ref, dq_ref,
         delta_out_ref), b=b, h=h, kv_head=jax.lax.div(h, group), window=head_ref[0, h],
        seq_len=seq_len, score_scale=score_scale, scale=scale,
        has_segments=has_segments)
    slot = jax.lax.rem(item, num_slots)
    run_by_class(head_ref[1, h], paths, lambda path: program.one_block(path, slot))


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
            return run_band_loop(first, lo, hi, end, tile, grads,
                                 "masked" if self.has_segments else path.loop_mode)

        grads = (jnp.zeros(kv[0].shape, jnp.float32), jnp.zeros(kv[1].shape, jnp.float32))
        if self.group == 1:
            grads = one_query_head(0, grads)
        else:
            grads = jax.lax.fori_loop(0, self.group, one_query_head, grads)
        dk_KxD, dv_KxD = grads
        self.dk_ref[b, cols, self.kv_head, :] = (dk_KxD * self.scale).astype(
            self.dk_ref.dtype)
        self.dv_ref[b, cols, self.kv_head, :] = dv_KxD.astype(self.dv_ref.dtype)


def _dkdv_kernel(schedule_ref, window_ref, kv_class_ref, q_ref, k_ref, v_ref, *refs,
                 paths: ClassPaths, num_slots: int, group: int, seq_len: int,
                 score_scale: float, scale: float, has_segments: bool, num_prefilled: int = 0):
    segment_ref = None
    if has_segments:
        segment_ref, *refs = refs
    refs = refs[:3] + refs[3 + num_prefilled:]  # aliased inputs (unread) sit before the outputs
    do_ref, lse_ref, delta_ref, dk_ref, dv_ref = refs

    b = pl.program_id(0)
    item = schedule_ref[pl.program_id(1)]
    kv_head = jax.lax.div(item, num_slots)
    program = _DkdvProgram(
        (window_ref, q_ref, k_ref, v_ref, segment_ref, do_ref, lse_ref, delta_ref, dk_ref,
         dv_ref), b=b, kv_head=kv_head, group=group, seq_len=seq_len,
        score_scale=score_scale, scale=scale, has_segments=has_segments)
    slot = jax.lax.rem(item, num_slots)
    run_by_class(kv_class_ref[kv_head], paths, lambda path: program.one_block(path, slot))


def _common(plan: AttentionPlan, q, k):
    return dict(group=q.shape[2] // k.shape[2], seq_len=q.shape[1],
                score_scale=plan.scale * LOG2_E, scale=plan.scale)


def _compiler_params(plan: AttentionPlan):
    return plgpu.CompilerParams(num_warps=plan.config.bwd_num_warps,
                                num_stages=plan.config.bwd_num_stages)


def dq_call(plan: AttentionPlan, q, k, v, segment_ids, do, out, lse2, *, delta=None,
            prefilled=None, heads=None):
    """Runs the dQ kernel on padded inputs; returns (dq [B, Tp, H, Dp] in q's dtype, delta
    float32 [B, H, Tp]).

    q, do, out: [B, Tp, H, Dp]; k, v: [B, Tp, G, Dp]; lse2: float32 [B, H, Tp]. With
    ``plan.config.delta_in_kernel`` the kernel computes ``delta = rowsum(out * do)`` from its
    tiles, else one XLA reduction does, before the kernel; a given ``delta`` is used as is.
    ``heads``: compute only these query heads, into ``prefilled`` (a dq whose other heads
    another kernel wrote; aliased to the output).
    """
    B, Tp, H, Dp = q.shape
    programs = plan.query_plan("dq")
    schedule = jnp.asarray(programs.schedule_of(heads))
    head_table = jnp.stack([jnp.asarray(plan.window_table(), jnp.int32),
                            jnp.asarray(programs.head_class)])
    seg = [] if segment_ids is None else [segment_ids]
    delta_in_kernel = plan.config.delta_in_kernel and delta is None
    aliased = [] if prefilled is None else [prefilled]

    def call(out_shape, *args):
        inputs = (schedule, head_table, q, k, v, *seg, do, *args)
        return pl.pallas_call(
            functools.partial(_dq_kernel, paths=programs.paths, num_slots=programs.num_slots,
                              delta_in_kernel=delta_in_kernel,
                              has_segments=segment_ids is not None,
                              num_prefilled=len(aliased), **_common(plan, q, k)),
            grid=(B, schedule.shape[0]), compiler_params=_compiler_params(plan),
            interpret=plan.interpret, name="ls_attention_bwd_dq", out_shape=out_shape,
            input_output_aliases={len(inputs) + i: i for i in range(len(aliased))},
        )(*inputs, *aliased)

    dq_shape = jax.ShapeDtypeStruct(q.shape, q.dtype)
    if delta_in_kernel:
        return call([dq_shape, jax.ShapeDtypeStruct((B, H, Tp), jnp.float32)], out, lse2)
    if delta is None:
        delta = row_delta(out, do)
    return call(dq_shape, lse2, delta), delta


def row_delta(out, do, heads: tuple[int, ...] | None = None):
    """float32 [B, H, Tp]: ``delta = rowsum(O * dO)`` (one XLA reduction); with ``heads``, only
    those heads' rows (the others zero), reading only their O and dO."""
    def rowsum(o, d):
        return jnp.einsum("bthd,bthd->bht", o.astype(jnp.float32), d.astype(jnp.float32))

    if heads is None:
        return rowsum(out, do)
    B, Tp, H, _ = out.shape
    others = [h for h in range(H) if h not in heads]
    part = rowsum(take_heads(out, heads), take_heads(do, heads))
    return merge_heads([part, jnp.zeros((B, len(others), Tp), jnp.float32)], [heads, others],
                       axis=1)


def dkdv_call(plan: AttentionPlan, q, k, v, segment_ids, do, lse2, delta, *, prefilled=None,
              kv_heads=None):
    """Runs the dK/dV kernel on padded inputs; returns dk and dv [B, Tp, G, Dp] in k's dtype,
    summed over each kv head's query heads. delta: float32 [B, H, Tp] from ``dq_call``.
    ``kv_heads``: compute only these kv heads, into ``prefilled`` = (dk, dv) (aliased)."""
    B = q.shape[0]
    programs = plan.key_plan()
    schedule = jnp.asarray(programs.schedule_of(kv_heads))
    seg = [] if segment_ids is None else [segment_ids]
    aliased = [] if prefilled is None else list(prefilled)
    inputs = (schedule, jnp.asarray(plan.window_table(), jnp.int32),
              jnp.asarray(programs.head_class), q, k, v, *seg, do, lse2, delta)
    return pl.pallas_call(
        functools.partial(_dkdv_kernel, paths=programs.paths, num_slots=programs.num_slots,
                          has_segments=segment_ids is not None, num_prefilled=len(aliased),
                          **_common(plan, q, k)),
        grid=(B, schedule.shape[0]),
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype),
                   jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=_compiler_params(plan),
        interpret=plan.interpret,
        input_output_aliases={len(inputs) + i: i for i in range(len(aliased))},
        name="ls_attention_bwd_dkdv",
    )(*inputs, *aliased)


def backward_call(plan: AttentionPlan, q, k, v, segment_ids, do, out, lse2):
    """(dq, dk, dv) on padded inputs, by the lowering ``plan.config.bwd_lowering`` picks.

    "triton": the two kernels above. "mosaic": ``backward_mosaic.py`` for every head (dK/dV
    summed over each GQA group in the kernel). "mixed": the Mosaic kernels for the
    global heads, then the Triton kernels for the local heads into the same buffers; only
    with one kv head per query head (a GQA group may mix both kinds), else all Triton. Calls
    the Mosaic kernels cannot run (``mosaic_ring.mosaic_fits``) take the Triton kernels.
    """
    B, Tp, H, Dp = q.shape
    G = k.shape[2]
    lowering = plan.config.bwd_lowering
    if lowering != "triton" and mosaic_fits(q.dtype, Dp, segment_ids is not None,
                                            plan.interpret):
        wide = plan.global_heads()
        fused = plan.config.mosaic_fused_dq
        # delta: with delta_in_kernel the dQ kernels compute it (each its own heads' rows;
        # the Mosaic one where O's tile fits its shared memory), else one XLA pass (the
        # fused dQ needs it before its one kernel)
        in_kernel = plan.config.delta_in_kernel
        mosaic_delta = in_kernel and not fused and delta_fits(plan, q.dtype)
        if lowering == "mosaic" or len(wide) == H:
            delta = None if mosaic_delta else row_delta(out, do)  # (never None when fused)
            if fused:
                dk, dv, dq = dkdv_call_mosaic(plan, q, k, v, do, lse2, delta, fused_dq=True)
            else:
                dq, delta = dq_call_mosaic(plan, q, k, v, do, lse2, delta, out=out)
                dk, dv = dkdv_call_mosaic(plan, q, k, v, do, lse2, delta)
            return dq, dk, dv
        if wide and G == H:
            local = plan.local_heads()
            # (the global heads' rows only where the Triton dQ kernel makes the others')
            delta = None if mosaic_delta else row_delta(out, do, wide if in_kernel else None)
            if fused:  # the global heads' dQ into a buffer the Triton kernel fills
                *dkdv, dq_wide = dkdv_call_mosaic(plan, q, k, v, do, lse2, delta, heads=wide,
                                                  fused_dq=True)
                rest = lax.empty((B, Tp, len(local), Dp), q.dtype)
                dq = merge_heads([dq_wide, rest], [wide, local])
            else:
                dq, delta = dq_call_mosaic(plan, q, k, v, do, lse2, delta, heads=wide, out=out)
                dkdv = dkdv_call_mosaic(plan, q, k, v, do, lse2, delta, heads=wide)
            # the Triton dQ kernel computes the local heads' delta (in_kernel) or takes the
            # pass's, and its delta is what the Triton dK/dV kernel reads
            dq, delta = dq_call(plan, q, k, v, segment_ids, do, out, lse2,
                                delta=None if in_kernel else delta, prefilled=dq, heads=local)
            dk, dv = dkdv_call(plan, q, k, v, segment_ids, do, lse2, delta, prefilled=dkdv,
                               kv_heads=local)
            return dq, dk, dv
    dq, delta = dq_call(plan, q, k, v, segment_ids, do, out, lse2)
    dk, dv = dkdv_call(plan, q, k, v, segment_ids, do, lse2, delta)
    return dq, dk, dv
