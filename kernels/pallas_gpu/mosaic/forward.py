"""Forward kernel for Hopper, written for Pallas' Mosaic GPU lowering: warp-specialised, TMA-fed.

The same computation as the Triton forward (``triton/forward.py``) (flash attention over each head's
band, base-2 online softmax, optional logit statistics), for the cases where Hopper's
asynchronous units pay: bfloat16/float16, head size a multiple of 64, no segment ids.

Structure of one program (grid: head x query tile x batch; ``C + 1`` warpgroups, C the
``HopperForwardConfig.consumers``, 2 or 3):

* warpgroup C (the *producer*, 40 or 24 registers) streams the key/value blocks of the tile's
  band into a ring of ``stages`` shared-memory slots with TMA, each slot guarded by a
  "loaded" barrier (TMA transaction count) and a "free" barrier (every consumer arrived);
* warpgroups 0 to C - 1 (the *consumers*) each own ``block_q`` query rows of the tile (so a
  tile is ``C * block_q`` rows) and run the online softmax with asynchronous ``wgmma``.
  Two consumers (232 registers each) take turns on the tensor cores through a shared
  two-arrival barrier (one computes QK^T or PV while the other does its softmax); three
  (160 registers each, where the launch has programs enough: ``heuristics.hopper_forward``)
  run free: a third warp per scheduler hides more of the softmax's latency. When the query
  blocks do not fill the last tile, its extra consumers redo the last block and store the
  same rows.

A local head's band is a few key blocks: the producer loads the union of the consumers'
ranges (``kernels.band.kv_block_range``), and a consumer steps through the blocks outside its
own range without computing (it still waits on and releases each slot, and keeps its turn in
the ping-pong) so every barrier stays in phase. Inside its range a consumer runs a masked loop
at the window edge, an unmasked loop over the blocks fully inside the band and a masked loop
on the diagonal (``common.split_kv_loop``, the Triton kernels' ranges). Query tiles run
from the last (longest) to the first, so a global head's long rows start first.

Outputs are those of the Triton forward: out, lse2 (log2 domain) and the per-row max |logit|
when asked, so either backward takes them unchanged.

Interpret mode (CPU tests) runs this kernel in Pallas' GPU interpreter (threads, barriers and
TMA simulated), which does not take a register operand in ``wgmma``: there the P.V product is
a plain dot (``ring.mma``); everything else is the code the GPU runs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ls_jax.kernels.band import kv_block_range
from ls_jax.kernels.pallas_gpu.common import LOG2_E, MASKED_SCORE, split_kv_loop
from ls_jax.kernels.pallas_gpu.configs import HopperForwardConfig
from ls_jax.kernels.pallas_gpu.mosaic.ring import (REGISTERS, STAGES, TILE_TRANSFORMS,
                                                   band_loops, consumer_block, launch, mma,
                                                   produce_kv, program_ids, ring_slot, row_min,
                                                   selected_heads, softmax_carry, softmax_step,
                                                   store_rows, tile_allowed, tile_union)

def _kernel(q_ref, k_ref, v_ref, out_ref, lse_ref, stat_ref, scoped, *, heads, windows, group,
            block_q, block_k, stages, num_tiles, consumers, seq_len, score_scale, scale,
            with_stats, interpret):
    smem, loaded, freed, turn = scoped
    q_smem2, k_smem, v_smem, lse_smem2, stat_smem2 = smem
    k_loaded, v_loaded, q_loaded = loaded
    k_free, v_free = freed
    b, h, window, wg = program_ids(heads, windows)
    tile = num_tiles - 1 - lax.axis_index("tile")  # longest rows first
    dtype = q_ref.dtype
    head_dim = q_ref.shape[-1]
    c = score_scale

    # key blocks of the whole tile: the union of the consumers' ranges
    num_q_blocks = seq_len // block_q
    union_first, union_end = tile_union(kv_block_range, tile, block_q, block_k, window, seq_len,
                                        consumers=consumers, num_blocks=num_q_blocks)
    consumer_registers, producer_registers = REGISTERS[consumers]
    ping_pong = consumers == 2  # three consumers run free

    def take_turn():
        if ping_pong:
            plgpu.barrier_arrive(turn)
            plgpu.barrier_wait(turn)

    def slot_of(j):
        return ring_slot(j, union_first, stages)

    @pl.when(wg < consumers)
    def _consumer():
        plgpu.set_max_registers(consumer_registers, action="increase")
        q_block = consumer_block(tile, wg, consumers, num_q_blocks)
        q_first = q_block * block_q
        q_smem = q_smem2.at[wg]
        plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(q_first, block_q), h], q_smem,
                                q_loaded.at[wg])
        plgpu.barrier_wait(q_loaded.at[wg])

        ranges = split_kv_loop(q_block, block_q, block_k, window, seq_len)

        carry = softmax_carry(block_q, head_dim, with_stats)

        def skip(j, _):
            """A block of another consumer's range: release it, keep the turn order."""
            slot = slot_of(j)
            plgpu.barrier_wait(k_loaded.at[slot])
            plgpu.barrier_arrive(k_free.at[slot])
            plgpu.barrier_wait(v_loaded.at[slot])
            plgpu.barrier_arrive(v_free.at[slot])
            take_turn()
            take_turn()

        # The statistics' running row minimum of the scores. With three consumers (160
        # registers) at D=64 it is taken before the exponentials, while one score tile is live
        # (after them it spills); otherwise after them, off the path from the row maximum to
        # the exponentials.
        early_min = consumers > 2 and head_dim <= 64

        def step(j, carry, masked: bool):
            acc_QxD, m_Q, l_Q, *min_Q = carry
            slot = slot_of(j)
            plgpu.barrier_wait(k_loaded.at[slot])

            def scores(s_ref):
                plgpu.wgmma(s_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
                take_turn()  # overlaps the other consumer's softmax with this wgmma
                return s_ref[...]

            s_QxK = pl.run_scoped(scores, plgpu.ACC((block_q, block_k), jnp.float32))
            plgpu.barrier_arrive(k_free.at[slot])
            if masked:
                ok_QxK = tile_allowed(q_first, j * block_k, block_q, block_k, window)
            if with_stats and early_min:
                min_Q = row_min(s_QxK, ok_QxK if masked else None, min_Q)
            if masked:
                s_QxK = jnp.where(ok_QxK, s_QxK, MASKED_SCORE)
            p_QxK, acc_QxD, m_new_Q, l_Q = softmax_step(s_QxK, acc_QxD, m_Q, l_Q, c)
            if with_stats and not early_min:
                min_Q = row_min(s_QxK, ok_QxK if masked else None, min_Q)
            p_QxK = p_QxK.astype(dtype)
            if ping_pong:
                plgpu.barrier_arrive(turn)  # softmax done: the other consumer may compute
            plgpu.barrier_wait(v_loaded.at[slot])
            if ping_pong:
                plgpu.barrier_wait(turn)  # the tensor cores are ours again
            acc_QxD = mma(acc_QxD, p_QxK, v_smem.at[slot], transpose_b=False,
                          interpret=interpret)
            plgpu.barrier_arrive(v_free.at[slot])
            return (acc_QxD, m_new_Q, l_Q, *min_Q)

        if ping_pong:
            pl.when(wg == 1)(take_turn)  # consumer 1 starts half a step behind
        carry = band_loops(union_first, union_end, ranges, skip, step, carry)
        if ping_pong:
            pl.when(wg == 0)(take_turn)

        store_rows(carry, q_smem, lse_smem2.at[wg], stat_smem2.at[wg] if with_stats else None,
                   out_ref, lse_ref, stat_ref, b=b, h=h, q_first=q_first, scale=scale)
        plgpu.wait_smem_to_gmem(0)

    pl.when(wg == consumers)(functools.partial(
        produce_kv, k_ref, v_ref, k_smem, v_smem, (k_loaded, v_loaded), (k_free, v_free), b=b,
        kv_head=lax.div(h, jnp.int32(group)), block_k=block_k, first=union_first,
        end=union_end, stages=stages, registers=producer_registers))


def forward_call(plan, config: HopperForwardConfig, heads: tuple[int, ...], q, k, v):
    """The Hopper forward over the query ``heads`` on padded inputs (no segment ids;
    ``heuristics.hopper_runs``), Tp a multiple of the config's blocks (``make_plan`` pads so).
    Outputs as the Triton forward's; the other heads' rows are left unwritten, for a later
    launch to fill in.
    """
    B, Tp, H, Dp = q.shape
    G = k.shape[2]
    block_q, block_k, stages = config.block_q, config.block_k, STAGES
    with_stats = plan.logit_stats
    interpret = plan.interpret
    consumers = config.consumers
    num_tiles = pl.cdiv(Tp, consumers * block_q)
    assert Tp % block_q == 0 and Tp % block_k == 0, (Tp, block_q, block_k)
    heads, windows = selected_heads(plan, heads)

    def entry(q_ref, k_ref, v_ref, out_ref, lse_ref, *stat):
        rows = plgpu.SMEM((consumers, block_q), jnp.float32)
        scratch = [
            plgpu.SMEM((consumers, block_q, Dp), q.dtype, transforms=TILE_TRANSFORMS),
            plgpu.SMEM((stages, block_k, Dp), q.dtype, transforms=TILE_TRANSFORMS),
            plgpu.SMEM((stages, block_k, Dp), q.dtype, transforms=TILE_TRANSFORMS),
            rows,
            rows if with_stats else None,
        ]
        body = functools.partial(
            _kernel, q_ref, k_ref, v_ref, out_ref, lse_ref, stat[0] if with_stats else None,
            heads=heads, windows=windows, group=H // G, block_q=block_q, block_k=block_k,
            stages=stages, num_tiles=num_tiles, consumers=consumers, seq_len=Tp,
            score_scale=plan.scale * LOG2_E, scale=plan.scale, with_stats=with_stats,
            interpret=interpret)
        pl.run_scoped(
            lambda *scoped: body(scoped),
            scratch,
            (plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages),
             plgpu.Barrier(num_barriers=consumers)),
            (plgpu.Barrier(num_arrivals=consumers, num_barriers=stages),) * 2,
            plgpu.Barrier(num_arrivals=2),  # the ping-pong's turn (two consumers)
            collective_axes="wg",
        )

    out_type = [jax.ShapeDtypeStruct(q.shape, q.dtype),
                jax.ShapeDtypeStruct((B, H, Tp), jnp.float32)]
    if with_stats:
        out_type.append(jax.ShapeDtypeStruct((B, H, Tp), jnp.float32))
    outs = launch(entry, out_type, num_heads=len(heads), num_tiles=num_tiles, batch=B,
                  interpret=interpret, warpgroups=consumers + 1)(q, k, v)
    return outs[0], outs[1], outs[2] if with_stats else None
