"""Forward kernel for Hopper, written for Pallas' Mosaic GPU lowering: warp-specialised, TMA-fed.

The same computation as ``kernels/pallas_gpu/forward.py`` (flash attention over each head's
band, base-2 online softmax, optional logit statistics), for the cases where Hopper's
asynchronous units pay: bfloat16/float16, head size a multiple of 64, no segment ids.

Structure of one program (grid: head x query tile x batch, three warpgroups):

* warpgroup 2 (the *producer*, 40 registers) streams the key/value blocks of the tile's band
  into a ring of ``stages`` shared-memory slots with TMA, each slot guarded by a "loaded"
  barrier (TMA transaction count) and a "free" barrier (both consumers arrived);
* warpgroups 0 and 1 (the *consumers*) each own ``block_q`` query rows of the tile (so a tile
  is ``2 * block_q`` rows) and run the online softmax with asynchronous ``wgmma``; a shared
  two-arrival barrier makes them take turns on the tensor cores (one computes QK^T or PV
  while the other does its softmax).

A local head's band is a few key blocks: the producer loads the union of the two consumers'
ranges (``kernels.band.kv_block_range``), and a consumer steps through the blocks outside its
own range without computing (it still waits on and releases each slot, and keeps its turn in
the ping-pong) so every barrier stays in phase. Inside its range a consumer runs a masked loop
at the window edge, an unmasked loop over the blocks fully inside the band and a masked loop
on the diagonal (the ranges of the Triton kernels: ``tiles.split_kv_loop``). Query tiles run
from the last (longest) to the first, so a global head's long rows start first.

Outputs are those of ``forward.forward_call``: out, lse2 (log2 domain) and the per-row
max |logit| when asked, so the Triton backward kernels take them unchanged.

Interpret mode (CPU tests) runs this kernel in Pallas' GPU interpreter (threads, barriers and
TMA simulated), which does not take a register operand in ``wgmma``: there the P.V product is
a plain dot (``_pv_update``); everything else is the code the GPU runs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ls_jax.kernels.band import allowed, kv_block_range
from ls_jax.kernels.pallas_gpu.mosaic_ring import (CONSUMER_REGISTERS, CONSUMERS,
                                                   TILE_TRANSFORMS, band_loops, launch, mma,
                                                   produce_kv, program_ids, ring_slot,
                                                   selected_heads, tile_iota, tile_union)
from ls_jax.kernels.pallas_gpu.tiles import LOG2_E, MASKED_SCORE, MAX_FLOOR, split_kv_loop

def _kernel(q_ref, k_ref, v_ref, out_ref, lse_ref, stat_ref, scoped, *, heads, windows, group,
            block_q, block_k, stages, num_tiles, seq_len, score_scale, scale, with_stats,
            interpret):
    smem, loaded, freed, turn = scoped
    q_smem2, k_smem, v_smem, lse_smem2, stat_smem2 = smem
    k_loaded, v_loaded, q_loaded = loaded
    k_free, v_free = freed
    b, h, window, wg = program_ids(heads, windows)
    tile = num_tiles - 1 - lax.axis_index("tile")  # longest rows first
    dtype = q_ref.dtype
    head_dim = q_ref.shape[-1]
    c = score_scale

    # key blocks of the whole tile: the union of the two consumers' ranges
    union_first, union_end = tile_union(kv_block_range, tile, block_q, block_k, window, seq_len)

    def take_turn():
        plgpu.barrier_arrive(turn)
        plgpu.barrier_wait(turn)

    def slot_of(j):
        return ring_slot(j, union_first, stages)

    @pl.when(wg < CONSUMERS)
    def _consumer():
        plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
        q_block = 2 * tile + wg
        q_first = q_block * block_q
        q_smem = q_smem2.at[wg]
        plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(q_first, block_q), h], q_smem,
                                q_loaded.at[wg])
        plgpu.barrier_wait(q_loaded.at[wg])

        ranges = split_kv_loop(q_block, block_q, block_k, window, seq_len)

        def row_vector(value):
            return plgpu.layout_cast(jnp.full((block_q,), value, jnp.float32),
                                     plgpu.Layout.WGMMA.reduce(1))

        carry = (plgpu.layout_cast(jnp.zeros((block_q, head_dim), jnp.float32),
                                   plgpu.Layout.WGMMA),
                 row_vector(MAX_FLOOR), row_vector(0.0))
        if with_stats:
            carry += (row_vector(-MASKED_SCORE),)

        def skip(j, _):
            """A block of the other consumer's range: release it, keep the turn order."""
            slot = slot_of(j)
            plgpu.barrier_wait(k_loaded.at[slot])
            plgpu.barrier_arrive(k_free.at[slot])
            plgpu.barrier_wait(v_loaded.at[slot])
            plgpu.barrier_arrive(v_free.at[slot])
            take_turn()
            take_turn()

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
                ok_QxK = allowed(q_first + tile_iota(block_q, block_k, 0),
                                 j * block_k + tile_iota(block_q, block_k, 1), window)
                s_QxK = jnp.where(ok_QxK, s_QxK, MASKED_SCORE)
            # scaled running max, floored (see tiles.py: a fully masked row gets p = 0)
            m_new_Q = jnp.maximum(m_Q, jnp.maximum(s_QxK.max(axis=1) * c, MAX_FLOOR))
            alpha_Q = jnp.exp2(m_Q - m_new_Q)
            p_QxK = jnp.exp2(s_QxK * c - lax.broadcast_in_dim(m_new_Q, s_QxK.shape, [0]))
            acc_QxD = acc_QxD * lax.broadcast_in_dim(alpha_Q, acc_QxD.shape, [0])
            l_Q = l_Q * alpha_Q + p_QxK.sum(axis=1)
            if with_stats:
                s_min = jnp.where(ok_QxK, s_QxK, -MASKED_SCORE) if masked else s_QxK
                min_Q = [jnp.minimum(min_Q[0], s_min.min(axis=1))]
            p_QxK = p_QxK.astype(dtype)
            plgpu.barrier_arrive(turn)  # softmax done: the other consumer may compute
            plgpu.barrier_wait(v_loaded.at[slot])
            plgpu.barrier_wait(turn)  # the tensor cores are ours again
            acc_QxD = mma(acc_QxD, p_QxK, v_smem.at[slot], transpose_b=False,
                          interpret=interpret)
            plgpu.barrier_arrive(v_free.at[slot])
            return (acc_QxD, m_new_Q, l_Q, *min_Q)

        pl.when(wg == 1)(take_turn)  # consumer 1 starts half a step behind
        carry = band_loops(union_first, union_end, ranges, skip, step, carry)
        pl.when(wg == 0)(take_turn)

        acc_QxD, m_Q, l_Q, *min_Q = carry
        inv_l_Q = 1.0 / l_Q
        q_smem[...] = (acc_QxD * lax.broadcast_in_dim(inv_l_Q, acc_QxD.shape, [0])).astype(dtype)
        lse_smem = lse_smem2.at[wg]
        lse_smem[...] = m_Q + jnp.log2(l_Q)
        if with_stats:  # max |logit| = max(max, -min) * scale; m_Q is max * scale * log2(e)
            stat_smem = stat_smem2.at[wg]
            stat_smem[...] = jnp.maximum(m_Q * (1.0 / LOG2_E), -min_Q[0] * scale)
        plgpu.commit_smem()
        rows = pl.ds(q_first, block_q)
        plgpu.copy_smem_to_gmem(q_smem, out_ref.at[b, rows, h])
        plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[b, h, rows])
        if with_stats:
            plgpu.copy_smem_to_gmem(stat_smem, stat_ref.at[b, h, rows])
        plgpu.wait_smem_to_gmem(0)

    pl.when(wg == CONSUMERS)(functools.partial(
        produce_kv, k_ref, v_ref, k_smem, v_smem, (k_loaded, v_loaded), (k_free, v_free), b=b,
        kv_head=lax.div(h, jnp.int32(group)), block_k=block_k, first=union_first,
        end=union_end, stages=stages))


def forward_call_mosaic(plan, q, k, v, heads: tuple[int, ...] | None = None):
    """The Mosaic GPU forward on padded inputs: same arguments (no segment ids) and outputs as
    ``forward.forward_call``. Needs ``mosaic_ring.mosaic_fits`` and Tp a multiple of
    2 * block_q and of block_k (``make_plan`` pads so).

    heads: the query heads to compute (default all); the other heads' rows of the outputs are
    left unwritten, for the Triton forward to fill in (``forward.forward_call``).
    """
    B, Tp, H, Dp = q.shape
    G = k.shape[2]
    cfg = plan.config
    block_q, block_k, stages = cfg.mosaic_block_q, cfg.mosaic_block_k, cfg.mosaic_stages
    num_tiles = Tp // (CONSUMERS * block_q)
    assert num_tiles * CONSUMERS * block_q == Tp and Tp % block_k == 0, (Tp, block_q, block_k)
    with_stats = plan.logit_stats
    interpret = plan.interpret
    heads, windows = selected_heads(plan, H, heads)

    def entry(q_ref, k_ref, v_ref, out_ref, lse_ref, *stat):
        rows = plgpu.SMEM((CONSUMERS, block_q), jnp.float32)
        scratch = [
            plgpu.SMEM((CONSUMERS, block_q, Dp), q.dtype, transforms=TILE_TRANSFORMS),
            plgpu.SMEM((stages, block_k, Dp), q.dtype, transforms=TILE_TRANSFORMS),
            plgpu.SMEM((stages, block_k, Dp), q.dtype, transforms=TILE_TRANSFORMS),
            rows,
            rows if with_stats else None,
        ]
        body = functools.partial(
            _kernel, q_ref, k_ref, v_ref, out_ref, lse_ref, stat[0] if with_stats else None,
            heads=heads, windows=windows, group=H // G, block_q=block_q, block_k=block_k,
            stages=stages, num_tiles=num_tiles, seq_len=Tp, score_scale=plan.scale * LOG2_E,
            scale=plan.scale, with_stats=with_stats, interpret=interpret)
        pl.run_scoped(
            lambda *scoped: body(scoped),
            scratch,
            (plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages),
             plgpu.Barrier(num_barriers=CONSUMERS)),
            (plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages),) * 2,
            plgpu.Barrier(num_arrivals=CONSUMERS),
            collective_axes="wg",
        )

    out_type = [jax.ShapeDtypeStruct(q.shape, q.dtype),
                jax.ShapeDtypeStruct((B, H, Tp), jnp.float32)]
    if with_stats:
        out_type.append(jax.ShapeDtypeStruct((B, H, Tp), jnp.float32))
    outs = launch(entry, out_type, num_heads=len(heads), num_tiles=num_tiles, batch=B,
                  interpret=interpret)(q, k, v)
    return outs[0], outs[1], outs[2] if with_stats else None
