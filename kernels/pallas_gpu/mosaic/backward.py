"""Backward kernels for Hopper in Pallas' Mosaic GPU lowering: dQ, and dK/dV per kv head.

The same math as the Triton backward (``p = exp2(s * c - lse2)``, ``ds = p * (dp - delta)``,
``dQ = scale * ds . K``, ``dK = scale * ds^T . Q``, ``dV = p^T . dO``), laid out like the
Hopper forward (``ring.py``): two consumer warpgroups each own one block, a producer
warpgroup streams the other side's blocks of the band through a TMA ring.

* dQ (grid head x query tile x batch): a consumer owns ``block_q`` query rows (Q, dO, lse2,
  delta loaded once) and walks the key blocks of its band, streamed as K and V.
* dK/dV (grid kv head x key tile x batch): a consumer owns ``block_k`` keys (K, V loaded
  once) and walks the query blocks whose band reaches them, streamed as Q, dO, lse2 and
  delta, for each query head of the kv head's GQA group in turn (one stream through the
  ring; the group's sum stays in the accumulators).

Inside a step the products overlap the element-wise work: dQ
issues S = Q K^T and dP = dO V^T together and computes the probabilities while dP runs; dK/dV
issues S^T and dP^T together, then dV (the probabilities as its register operand) before it
reads dP^T, so the exponentials run under dP^T and dS^T under dV, and dK last. Pallas' GPU
interpreter takes neither a register operand in ``wgmma`` nor ``pl.run_state`` on an
accumulator, so in interpret mode (CPU tests) the same math runs one product at a time
(``ring.mma``); the tests also lower the GPU path on the CPU.

``delta = rowsum(O * dO)``: the dQ kernel computes it from O and dO tiles it loads anyway
(dO) or once per block (O) and writes it out for the dK/dV kernel, which runs after it, where
O's tile fits shared memory (``HopperBackwardConfig.dq_delta``); else it comes from the
caller, one XLA pass over O and dO. ``heads`` restricts a call to some query heads (the
others' rows are left unwritten, for a later launch to fill).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ls_jax.kernels.band import allowed, kv_block_range, q_block_range
from ls_jax.kernels.heads import merge_heads, take_heads
from ls_jax.kernels.pallas_gpu.common import LOG2_E, MASKED_SCORE, split_kv_loop, split_q_loop
from ls_jax.kernels.pallas_gpu.configs import HopperBackwardConfig
from ls_jax.kernels.pallas_gpu.mosaic.ring import (REGISTERS, STAGES, TILE_TRANSFORMS,
                                                   band_loops, consumer_block, launch, mma,
                                                   pick, produce, produce_kv, program_ids,
                                                   ring_slot, selected_heads, tile_allowed,
                                                   tile_iota, tile_union, zero_tile)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, rows_ref, dq_ref, delta_out_ref, scoped,
               *, heads, windows, group, block_q, block_k, stages, num_tiles, seq_len,
               score_scale, scale, interpret, consumers):
    """dQ; ``rows_ref`` is delta, or with ``delta_out_ref`` O: then delta = rowsum(O * dO)
    comes from the consumer's own tiles and goes out to ``delta_out_ref`` for dK/dV."""
    smem, loaded, freed = scoped
    q_smem2, do_smem2, lse_smem2, delta_smem2, o_smem2, k_smem, v_smem = smem
    own_loaded, k_loaded, v_loaded = loaded
    k_free, v_free = freed
    b, h, window, wg = program_ids(heads, windows)
    tile = num_tiles - 1 - lax.axis_index("tile")  # longest rows first
    dtype = q_ref.dtype
    head_dim = q_ref.shape[-1]
    num_q_blocks = seq_len // block_q
    union_first, union_end = tile_union(kv_block_range, tile, block_q, block_k, window, seq_len,
                                        consumers=consumers, num_blocks=num_q_blocks)
    consumer_registers, producer_registers = REGISTERS[consumers]

    def slot_of(j):
        return ring_slot(j, union_first, stages)

    @pl.when(wg < consumers)
    def _consumer():
        plgpu.set_max_registers(consumer_registers, action="increase")
        q_block = consumer_block(tile, wg, consumers, num_q_blocks)
        q_first = q_block * block_q
        rows = pl.ds(q_first, block_q)
        q_smem, do_smem = q_smem2.at[wg], do_smem2.at[wg]
        lse_smem, delta_smem = lse_smem2.at[wg], delta_smem2.at[wg]
        in_kernel = delta_out_ref is not None
        # the fourth copy: O for delta made here, else delta itself
        last = ((rows_ref.at[b, rows, h], o_smem2.at[wg]) if in_kernel
                else (rows_ref.at[b, h, rows], delta_smem))
        for n, (src, dst) in enumerate([(q_ref.at[b, rows, h], q_smem),
                                        (do_ref.at[b, rows, h], do_smem),
                                        (lse_ref.at[b, h, rows], lse_smem), last]):
            plgpu.copy_gmem_to_smem(src, dst, own_loaded.at[wg * 4 + n])
        for n in range(4):
            plgpu.barrier_wait(own_loaded.at[wg * 4 + n])
        lse_Q = plgpu.load(lse_smem, layout=plgpu.Layout.WGMMA.reduce(1))
        if in_kernel:  # delta = rowsum(O * dO) in float32, out for the dK/dV kernel
            o_QxD = plgpu.load(o_smem2.at[wg], layout=plgpu.Layout.WGMMA)
            do_QxD = plgpu.load(do_smem, layout=plgpu.Layout.WGMMA)
            delta_Q = (o_QxD.astype(jnp.float32) * do_QxD.astype(jnp.float32)).sum(axis=1)
            delta_smem[...] = delta_Q
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(delta_smem, delta_out_ref.at[b, h, rows])
        else:
            delta_Q = plgpu.load(delta_smem, layout=plgpu.Layout.WGMMA.reduce(1))
        ranges = split_kv_loop(q_block, block_q, block_k, window, seq_len)

        def skip(j, _):
            slot = slot_of(j)
            plgpu.barrier_wait(k_loaded.at[slot])
            plgpu.barrier_wait(v_loaded.at[slot])
            plgpu.barrier_arrive(k_free.at[slot])
            plgpu.barrier_arrive(v_free.at[slot])

        def probabilities(s_QxK, ok_QxK):
            if ok_QxK is not None:
                s_QxK = jnp.where(ok_QxK, s_QxK, MASKED_SCORE)
            return jnp.exp2(s_QxK * score_scale - lax.broadcast_in_dim(lse_Q, s_QxK.shape, [0]))

        def score_grads(p_QxK, dp_QxK):
            ds_QxK = p_QxK * (dp_QxK - lax.broadcast_in_dim(delta_Q, dp_QxK.shape, [0]))
            return ds_QxK.astype(dtype)

        def step(j, dq_QxD, masked: bool):
            slot = slot_of(j)
            k_block, v_block = k_smem.at[slot], v_smem.at[slot]
            plgpu.barrier_wait(k_loaded.at[slot])
            # (the masks are made outside the accumulators' scopes, where a constant window
            # would be captured and does not lower)
            ok_QxK = (tile_allowed(q_first, j * block_k, block_q, block_k, window)
                      if masked else None)
            if interpret:  # one product at a time (see ``ring.mma``)
                p_QxK = probabilities(mma(None, q_smem, k_block, transpose_b=True,
                                          interpret=True), ok_QxK)
                plgpu.barrier_wait(v_loaded.at[slot])
                dp_QxK = mma(None, do_smem, v_block, transpose_b=True, interpret=True)
                plgpu.barrier_arrive(v_free.at[slot])
                dq_QxD = mma(dq_QxD, score_grads(p_QxK, dp_QxK), k_block, transpose_b=False,
                             interpret=True)
            else:  # S and dP issued together: the exponentials run under dP's wgmma
                def accumulate(dq_ref):
                    def products(s_ref, dp_ref):
                        plgpu.wgmma(s_ref, q_smem, k_block.transpose((1, 0)))
                        plgpu.barrier_wait(v_loaded.at[slot])
                        plgpu.wgmma(dp_ref, do_smem, v_block.transpose((1, 0)))
                        p_QxK = probabilities(plgpu.wgmma_accumulator_load(s_ref, wait_n=1),
                                              ok_QxK)
                        dp_QxK = plgpu.wgmma_accumulator_load(dp_ref, wait_n=0)
                        plgpu.barrier_arrive(v_free.at[slot])
                        plgpu.wgmma(dq_ref, score_grads(p_QxK, dp_QxK), k_block)

                    scores = plgpu.ACC((block_q, block_k), jnp.float32)
                    pl.run_scoped(products, scores, scores)

                dq_QxD = pl.run_state(accumulate)(plgpu.ACC.init(dq_QxD))
            plgpu.barrier_arrive(k_free.at[slot])
            return dq_QxD

        dq_QxD = zero_tile(block_q, head_dim)
        dq_QxD = band_loops(union_first, union_end, ranges, skip, step, dq_QxD)
        q_smem[...] = (dq_QxD * scale).astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_smem, dq_ref.at[b, rows, h])
        plgpu.wait_smem_to_gmem(0)

    pl.when(wg == consumers)(functools.partial(
        produce_kv, k_ref, v_ref, k_smem, v_smem, (k_loaded, v_loaded), (k_free, v_free), b=b,
        kv_head=lax.div(h, jnp.int32(group)), block_k=block_k, first=union_first,
        end=union_end, stages=stages, registers=producer_registers))


def _dkdv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref,
                 scoped, *, heads, windows, group, block_q, block_k, stages, num_tiles,
                 seq_len, score_scale, scale, interpret, consumers, group_sum):
    """dK/dV per query head (grid axis "heads" over ``heads``), or with ``group_sum`` per kv head
    (``heads`` every query head): a program then walks the query blocks of each of its
    group's query heads in turn, one stream through the ring, and sums their dK and dV in
    its accumulators."""
    smem, loaded, freed = scoped
    k_smem2, v_smem2, q_smem, do_smem, lse_smem, delta_smem = smem
    own_loaded, q_loaded, do_loaded, lse_loaded, delta_loaded = loaded
    (free,) = freed
    if group_sum:
        b, wg = lax.axis_index("batch"), lax.axis_index("wg")
        kv_head = out_head = lax.axis_index("heads")
        members = group
    else:
        b, h, window, wg = program_ids(heads, windows)
        kv_head, out_head = lax.div(h, jnp.int32(group)), h
        members = 1
    tile = lax.axis_index("tile")  # the first key tiles have the longest columns
    dtype = q_ref.dtype
    head_dim = q_ref.shape[-1]
    num_k_blocks = seq_len // block_k
    consumer_registers, producer_registers = REGISTERS[consumers]

    def member(r):
        """The r-th query head the program computes, its window, and the query blocks
        [first, end) its consumers need together."""
        if group_sum:
            h_r = kv_head * group + r
            window_r = pick(h_r, windows)
        else:
            h_r, window_r = h, window
        first, end = tile_union(q_block_range, tile, block_q, block_k, window_r, seq_len,
                                consumers=consumers, num_blocks=num_k_blocks)
        return h_r, window_r, first, end

    def over_members(body, carry):
        """``body(r, carry)`` for each member: one call, or a loop over the group."""
        if members == 1:
            return body(0, carry)
        return lax.fori_loop(0, members, body, carry)

    @pl.when(wg < consumers)
    def _consumer():
        plgpu.set_max_registers(consumer_registers, action="increase")
        k_block = consumer_block(tile, wg, consumers, num_k_blocks)
        k_first = k_block * block_k
        cols = pl.ds(k_first, block_k)
        k_smem, v_smem = k_smem2.at[wg], v_smem2.at[wg]
        plgpu.copy_gmem_to_smem(k_ref.at[b, cols, kv_head], k_smem, own_loaded.at[2 * wg])
        plgpu.copy_gmem_to_smem(v_ref.at[b, cols, kv_head], v_smem, own_loaded.at[2 * wg + 1])
        plgpu.barrier_wait(own_loaded.at[2 * wg])
        plgpu.barrier_wait(own_loaded.at[2 * wg + 1])
        if group_sum:  # every slot starts free (see ``_producer``)
            for slot in range(stages):
                plgpu.barrier_arrive(free.at[slot])

        def one_head(r, carry):
            streamed, grads = carry  # blocks streamed before this head's
            h_r, window_r, union_first, union_end = member(r)

            def slot_of(i):
                return ring_slot(i + streamed, union_first, stages)

            # the query blocks are [first, end); masks on [first, lo) (diagonal) and
            # [hi, end) (window edge), none on [lo, hi)
            ranges = split_q_loop(k_block, block_q, block_k, window_r, seq_len)

            def skip(i, _):
                slot = slot_of(i)
                for barrier in (q_loaded, do_loaded, lse_loaded, delta_loaded):
                    plgpu.barrier_wait(barrier.at[slot])
                plgpu.barrier_arrive(free.at[slot])

            def probabilities(sT_KxQ, ok_KxQ, slot):
                if ok_KxQ is not None:
                    sT_KxQ = jnp.where(ok_KxQ, sT_KxQ, MASKED_SCORE)
                plgpu.barrier_wait(lse_loaded.at[slot])
                lse_Q = plgpu.load(lse_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
                return jnp.exp2(sT_KxQ * score_scale
                                - lax.broadcast_in_dim(lse_Q, sT_KxQ.shape, [1]))

            def score_grads(pT_KxQ, dpT_KxQ, slot):
                plgpu.barrier_wait(delta_loaded.at[slot])
                delta_Q = plgpu.load(delta_smem.at[slot],
                                     layout=plgpu.Layout.WGMMA.reduce(0))
                dsT_KxQ = pT_KxQ * (dpT_KxQ
                                    - lax.broadcast_in_dim(delta_Q, dpT_KxQ.shape, [1]))
                return dsT_KxQ.astype(dtype)

            def step(i, grads, masked: bool):
                slot = slot_of(i)
                q_block, do_block = q_smem.at[slot], do_smem.at[slot]
                plgpu.barrier_wait(q_loaded.at[slot])
                ok_KxQ = allowed(i * block_q + tile_iota(block_k, block_q, 1),
                                 k_first + tile_iota(block_k, block_q, 0),
                                 window_r) if masked else None
                plgpu.barrier_wait(do_loaded.at[slot])
                if interpret:  # one product at a time (see ``ring.mma``)
                    dk_KxD, dv_KxD = grads[:2]
                    pT_KxQ = probabilities(mma(None, k_smem, q_block, transpose_b=True,
                                               interpret=True), ok_KxQ, slot)
                    dv_KxD = mma(dv_KxD, pT_KxQ.astype(dtype), do_block, transpose_b=False,
                                 interpret=True)
                    dpT_KxQ = mma(None, v_smem, do_block, transpose_b=True, interpret=True)
                    dsT_KxQ = score_grads(pT_KxQ, dpT_KxQ, slot)
                    dk_KxD = mma(dk_KxD, dsT_KxQ, q_block, transpose_b=False,
                                 interpret=True)
                    grads = dk_KxD, dv_KxD
                else:  # S^T and dP^T issued together, dV before dP^T is read, dK last:
                    # the exponentials run under dP^T's wgmma and dS^T under dV's
                    def accumulate(refs):
                        dk_ref, dv_ref = refs

                        def products(sT_ref, dpT_ref):
                            plgpu.wgmma(sT_ref, k_smem, q_block.transpose((1, 0)))
                            plgpu.wgmma(dpT_ref, v_smem, do_block.transpose((1, 0)))
                            pT_KxQ = probabilities(
                                plgpu.wgmma_accumulator_load(sT_ref, wait_n=1), ok_KxQ, slot)
                            plgpu.wgmma(dv_ref, pT_KxQ.astype(dtype), do_block)
                            dpT_KxQ = plgpu.wgmma_accumulator_load(dpT_ref, wait_n=1)
                            dsT_KxQ = score_grads(pT_KxQ, dpT_KxQ, slot)
                            plgpu.wgmma(dk_ref, dsT_KxQ, q_block)

                        scores = plgpu.ACC((block_k, block_q), jnp.float32)
                        pl.run_scoped(products, scores, scores)

                    grads = pl.run_state(accumulate)(tuple(map(plgpu.ACC.init, grads)))
                plgpu.barrier_arrive(free.at[slot])
                return grads

            grads = band_loops(union_first, union_end, ranges, skip, step, grads)
            return streamed + union_end - union_first, grads

        zeros = zero_tile(block_k, head_dim)
        _, (dk_KxD, dv_KxD) = over_members(one_head, (jnp.int32(0), (zeros, zeros)))
        k_smem[...] = (dk_KxD * scale).astype(dtype)
        v_smem[...] = dv_KxD.astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(k_smem, dk_ref.at[b, cols, out_head])
        plgpu.copy_smem_to_gmem(v_smem, dv_ref.at[b, cols, out_head])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == consumers)
    def _producer():
        plgpu.set_max_registers(producer_registers, action="decrease")

        def load(h_r, i, slot):
            rows = pl.ds(i * block_q, block_q)
            plgpu.copy_gmem_to_smem(q_ref.at[b, rows, h_r], q_smem.at[slot], q_loaded.at[slot])
            plgpu.copy_gmem_to_smem(do_ref.at[b, rows, h_r], do_smem.at[slot],
                                    do_loaded.at[slot])
            plgpu.copy_gmem_to_smem(lse_ref.at[b, h_r, rows], lse_smem.at[slot],
                                    lse_loaded.at[slot])
            plgpu.copy_gmem_to_smem(delta_ref.at[b, h_r, rows], delta_smem.at[slot],
                                    delta_loaded.at[slot])

        def wait_free(slot):
            plgpu.barrier_wait(free.at[slot])

        if not group_sum:
            h_0, _, first, end = member(0)
            produce(first, end, stages, functools.partial(load, h_0), wait_free)
            return

        # one stream over the group's heads: the consumers released every slot once at
        # their start, so each load waits for its slot, and the last ``stages`` releases
        # are waited for at the end (every phase of a barrier is observed)
        def one_head(r, streamed):
            h_r, _, first, end = member(r)

            def one(i, n):
                slot = lax.rem(n, jnp.int32(stages))
                wait_free(slot)
                load(h_r, i, slot)
                return n + 1

            return lax.fori_loop(first, end, one, streamed)

        total = lax.fori_loop(0, members, one_head, jnp.int32(0))

        def drain(n, _):
            wait_free(lax.rem(n, jnp.int32(stages)))

        lax.fori_loop(total, total + stages, drain, None)


def _static(plan, config: HopperBackwardConfig, heads: tuple[int, ...], q, k):
    heads, windows = selected_heads(plan, heads)
    return dict(
        heads=heads, windows=windows, group=q.shape[2] // k.shape[2], block_q=config.block_q,
        block_k=config.block_k, stages=STAGES, seq_len=q.shape[1],
        score_scale=plan.scale * LOG2_E, scale=plan.scale, interpret=plan.interpret,
        consumers=config.consumers)


def dq_smem_bytes(config: HopperBackwardConfig, head_dim: int, itemsize: int) -> int:
    """Shared memory of one dQ program: Q, dO (and O, for delta) tiles per consumer, the
    key/value ring, and the consumers' lse and delta rows."""
    tiles = (3 if config.dq_delta else 2) * config.consumers * config.block_q
    tiles += 2 * STAGES * config.dq_block_k
    return tiles * head_dim * itemsize + 2 * config.consumers * config.block_q * 4


def dq_call(plan, config: HopperBackwardConfig, heads: tuple[int, ...], q, k, v, do, lse2, *,
            out):
    """(dq [B, Tp, H, Dp] in q's dtype, delta float32 [B, H, Tp]) for the query ``heads`` on
    padded inputs. With ``config.dq_delta`` the kernel computes ``delta = rowsum(out * do)``
    from its own O and dO tiles (no separate pass over them; rows of ``heads`` only, the
    others unwritten); else one XLA pass does, before the kernel."""
    B, Tp, H, Dp = q.shape
    static = _static(plan, config, heads, q, k)
    static["block_k"] = config.dq_block_k
    bq, bk, stages = static["block_q"], static["block_k"], static["stages"]
    consumers = static["consumers"]
    num_tiles = pl.cdiv(Tp, consumers * bq)
    in_kernel = config.dq_delta

    def entry(q_ref, k_ref, v_ref, do_ref, lse_ref, rows_ref, dq_ref, delta_out_ref=None):
        rows = plgpu.SMEM((consumers, bq), jnp.float32)
        tiles = plgpu.SMEM((consumers, bq, Dp), q.dtype, transforms=TILE_TRANSFORMS)
        pl.run_scoped(
            lambda *scoped: _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, rows_ref, dq_ref,
                                       delta_out_ref, scoped, num_tiles=num_tiles, **static),
            # Q, dO, lse, delta, O (for delta; a placeholder row when delta is given), K, V
            [tiles, tiles, rows, rows, tiles if in_kernel else rows,
             plgpu.SMEM((stages, bk, Dp), q.dtype, transforms=TILE_TRANSFORMS),
             plgpu.SMEM((stages, bk, Dp), q.dtype, transforms=TILE_TRANSFORMS)],
            (plgpu.Barrier(num_barriers=4 * consumers), plgpu.Barrier(num_barriers=stages),
             plgpu.Barrier(num_barriers=stages)),
            (plgpu.Barrier(num_arrivals=consumers, num_barriers=stages),) * 2,
            collective_axes="wg")

    dq_type = jax.ShapeDtypeStruct(q.shape, q.dtype)
    out_type = [dq_type, jax.ShapeDtypeStruct((B, H, Tp), jnp.float32)] if in_kernel else dq_type
    run = launch(entry, out_type, num_heads=len(static["heads"]), num_tiles=num_tiles,
                 batch=B, interpret=plan.interpret, warpgroups=consumers + 1)
    if in_kernel:
        return tuple(run(q, k, v, do, lse2, out))
    delta = row_delta(out, do, heads)
    return run(q, k, v, do, lse2, delta), delta


def row_delta(out, do, heads: tuple[int, ...]):
    """float32 [B, H, Tp]: ``delta = rowsum(O * dO)`` for the rows of ``heads`` (the others
    zero), one XLA reduction reading only their O and dO."""
    def rowsum(o, d):
        return jnp.einsum("bthd,bthd->bht", o.astype(jnp.float32), d.astype(jnp.float32))

    B, Tp, H, _ = out.shape
    if tuple(heads) == tuple(range(H)):
        return rowsum(out, do)
    others = [h for h in range(H) if h not in heads]
    part = rowsum(take_heads(out, heads), take_heads(do, heads))
    return merge_heads([part, jnp.zeros((B, len(others), Tp), jnp.float32)],
                       [list(heads), others], axis=1)


def dkdv_call(plan, config: HopperBackwardConfig, heads: tuple[int, ...], q, k, v, do, lse2,
              delta):
    """(dk, dv), each [B, Tp, G, Dp] in k's dtype, for the kv heads of the query ``heads`` on
    padded inputs: with GQA every head (each program sums its kv head's group in its
    accumulators, one stream over the group's query heads), else any subset."""
    B, Tp, H, Dp = q.shape
    G = k.shape[2]
    if G < H and tuple(heads) != tuple(range(H)):
        raise ValueError(f"dkdv_call: heads={heads} needs one kv head per query head, got "
                         f"{G} kv heads for {H}")
    static = _static(plan, config, heads, q, k)
    group_sum = G < H
    static["group_sum"] = group_sum
    bq, bk, stages = static["block_q"], static["block_k"], static["stages"]
    consumers = static["consumers"]
    num_tiles = pl.cdiv(Tp, consumers * bk)

    def entry(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref):
        own = plgpu.SMEM((consumers, bk, Dp), k.dtype, transforms=TILE_TRANSFORMS)
        ring = plgpu.SMEM((stages, bq, Dp), q.dtype, transforms=TILE_TRANSFORMS)
        rows = plgpu.SMEM((stages, bq), jnp.float32)
        pl.run_scoped(
            lambda *scoped: _dkdv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref,
                                         dk_ref, dv_ref, scoped, num_tiles=num_tiles,
                                         **static),
            [own, own, ring, ring, rows, rows],
            (plgpu.Barrier(num_barriers=2 * consumers),) + (
                plgpu.Barrier(num_barriers=stages),) * 4,
            (plgpu.Barrier(num_arrivals=consumers, num_barriers=stages),),
            collective_axes="wg")

    shape = jax.ShapeDtypeStruct((B, Tp, G, Dp), k.dtype)
    return tuple(launch(entry, [shape, shape], num_heads=G if group_sum else len(heads),
                        num_tiles=num_tiles, batch=B, interpret=plan.interpret,
                        warpgroups=consumers + 1)(q, k, v, do, lse2, delta))
