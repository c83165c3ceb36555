"""Backward kernels for Hopper in Pallas' Mosaic GPU lowering: dQ, and dK/dV per kv head.

The same math as ``backward.py`` (``p = exp2(s * c - lse2)``, ``ds = p * (dp - delta)``,
``dQ = scale * ds . K``, ``dK = scale * ds^T . Q``, ``dV = p^T . dO``), laid out like the
Hopper forward (``mosaic_ring.py``): two consumer warpgroups each own one block, a producer
warpgroup streams the other side's blocks of the band through a TMA ring.

* dQ (grid head x query tile x batch): a consumer owns ``block_q`` query rows (Q, dO, lse2,
  delta loaded once) and walks the key blocks of its band, streamed as K and V.
* dK/dV (grid kv head x key tile x batch): a consumer owns ``block_k`` keys (K, V loaded
  once) and walks the query blocks whose band reaches them, streamed as Q, dO, lse2 and
  delta, for each query head of the kv head's GQA group in turn (one stream through the
  ring; the group's sum stays in the accumulators).

Inside a step the products overlap the element-wise work (run M, docs/kernel-notes.md): dQ
issues S = Q K^T and dP = dO V^T together and computes the probabilities while dP runs; dK/dV
issues S^T and dP^T together, then dV (the probabilities as its register operand) before it
reads dP^T, so the exponentials run under dP^T and dS^T under dV, and dK last. Pallas' GPU
interpreter takes neither a register operand in ``wgmma`` nor ``pl.run_state`` on an
accumulator, so in interpret mode (CPU tests) the same math runs one product at a time
(``mosaic_ring.mma``); ``tests/test_pallas_gpu.py`` also lowers the GPU path on the CPU.

With ``KernelConfig.mosaic_fused_dq`` the dK/dV kernel also computes dQ (FA3's way): each
step stores dS^T to shared memory while dK runs, ``dS . K`` reads it there (wgmma with a
transposed A), and the tile goes out through shared memory as a TMA reduction (add) into a
float32 accumulator, so dQ's additions land in no fixed order (not bit-reproducible). Five
products per tile instead of the two kernels' seven: 1.03-1.09x the f+b with every head
global at D=64 on an H100, 1.02x in long LS mixes, half as fast at D=128 (spills), run P; off
by default.

``delta = rowsum(O * dO)``: by default the dQ kernel computes it from O and dO tiles it loads
anyway (dO) or once per block (O) and writes it out for the dK/dV kernel, which runs after it;
else (``KernelConfig.delta_in_kernel`` off, and for the fused dQ) it comes from the caller, one
XLA pass over O and dO. ``heads`` restricts a call to some query heads (the others' rows are
left unwritten, for the Triton kernels to fill).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ls_jax.kernels.band import allowed, kv_block_range, q_block_range
from ls_jax.kernels.pallas_gpu.mosaic_ring import (REGISTERS, F32_TRANSFORMS, SMEM_BYTES,
                                                   SMEM_SPARE, TILE_TRANSFORMS,
                                                   band_loops, consumer_block,
                                                   interpreter_fits, launch, mma, pick,
                                                   produce, produce_kv, program_ids, ring_slot,
                                                   run_into, selected_heads, tile_allowed,
                                                   tile_iota, tile_union, zero_tile)
from ls_jax.kernels.pallas_gpu.tiles import LOG2_E, MASKED_SCORE, split_kv_loop, split_q_loop

FUSED_BLOCK_Q = 64  # the fused kernel's streamed query blocks, whatever mosaic_bwd_block_q


def dq_slots(head_dim: int) -> int:
    """Shared-memory tiles per consumer for the fused dQ's outgoing reductions: two at D <= 64
    (a reduction may still be reading one while the next block's dQ goes into the other),
    one at D=128 (two would not fit beside the blocks)."""
    return 2 if head_dim <= 64 else 1


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
            if interpret:  # one product at a time (see ``mosaic_ring.mma``)
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


def _dkdv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, dq_ref,
                 scoped, *, heads, windows, group, block_q, block_k, stages, num_tiles,
                 seq_len, score_scale, scale, interpret, consumers, group_sum):
    """dK/dV; with ``dq_ref`` (float32) also dQ: each step's ``ds . K`` added into it.

    Per query head (grid axis "heads" over ``heads``), or with ``group_sum`` per kv head
    (``heads`` every query head): a program then walks the query blocks of each of its
    group's query heads in turn, one stream through the ring, and sums their dK and dV in
    its accumulators."""
    smem, loaded, freed = scoped
    k_smem2, v_smem2, q_smem, do_smem, lse_smem, delta_smem, ds_smem2, dq_smem2 = smem
    own_loaded, q_loaded, do_loaded, lse_loaded, delta_loaded = loaded
    (free,) = freed
    slot_h = lax.axis_index("heads")  # h's index in ``heads`` (dq_ref has only those)
    if group_sum:
        b, wg = lax.axis_index("batch"), lax.axis_index("wg")
        kv_head = out_head = slot_h
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
        fused = dq_ref is not None
        if fused:
            ds_smem, dq_smem = ds_smem2.at[wg], dq_smem2.at[wg]
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

            def add_dq(i, dq_QxD):
                """This key block's share of query block i's dQ (unscaled) out to
                ``dq_ref`` through one of ``dq_slots`` shared-memory tiles: a TMA reduction
                (add) into the float32 accumulator; in interpret mode (no TMA reductions
                there) a plain store into the key block's own slice of it. A consumer's
                blocks are consecutive, so the slots go round with i."""
                slots = dq_smem.shape[0]
                out_smem = dq_smem.at[lax.rem(i, jnp.int32(slots))]
                # the copy that last used this slot has read it (the later ones may still
                # run)
                plgpu.wait_smem_to_gmem(slots - 1, wait_read_only=True)
                out_smem[...] = dq_QxD
                plgpu.commit_smem()
                rows = pl.ds(i * block_q, block_q)
                if interpret:
                    plgpu.copy_smem_to_gmem(out_smem, dq_ref.at[b, k_block, rows, slot_h])
                else:
                    plgpu.copy_smem_to_gmem(out_smem, dq_ref.at[b, rows, slot_h],
                                            reduction_op="add")

            def step(i, grads, masked: bool):
                slot = slot_of(i)
                q_block, do_block = q_smem.at[slot], do_smem.at[slot]
                plgpu.barrier_wait(q_loaded.at[slot])
                ok_KxQ = allowed(i * block_q + tile_iota(block_k, block_q, 1),
                                 k_first + tile_iota(block_k, block_q, 0),
                                 window_r) if masked else None
                plgpu.barrier_wait(do_loaded.at[slot])
                if interpret:  # one product at a time (see ``mosaic_ring.mma``)
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
                    if fused:
                        ds_smem[...] = dsT_KxQ
                        plgpu.commit_smem()
                        grads += (mma(None, ds_smem[...].T, k_smem, transpose_b=False,
                                      interpret=True),)
                else:  # S^T and dP^T issued together, dV before dP^T is read, dK last:
                    # the exponentials run under dP^T's wgmma and dS^T under dV's; fused,
                    # dS^T goes to shared memory while dK runs, and dQ = dS . K reads it
                    # from there
                    def accumulate(refs):
                        dk_ref, dv_ref = refs[:2]

                        def products(sT_ref, dpT_ref):
                            plgpu.wgmma(sT_ref, k_smem, q_block.transpose((1, 0)))
                            plgpu.wgmma(dpT_ref, v_smem, do_block.transpose((1, 0)))
                            pT_KxQ = probabilities(
                                plgpu.wgmma_accumulator_load(sT_ref, wait_n=1), ok_KxQ, slot)
                            plgpu.wgmma(dv_ref, pT_KxQ.astype(dtype), do_block)
                            dpT_KxQ = plgpu.wgmma_accumulator_load(dpT_ref, wait_n=1)
                            dsT_KxQ = score_grads(pT_KxQ, dpT_KxQ, slot)
                            plgpu.wgmma(dk_ref, dsT_KxQ, q_block)
                            if fused:
                                ds_smem[...] = dsT_KxQ
                                plgpu.commit_smem()

                        scores = plgpu.ACC((block_k, block_q), jnp.float32)
                        pl.run_scoped(products, scores, scores)
                        if fused:
                            plgpu.wgmma(refs[2], ds_smem.transpose((1, 0)), k_smem)

                    inits = grads + ((zero_tile(block_q, head_dim),) if fused else ())
                    grads = pl.run_state(accumulate)(tuple(map(plgpu.ACC.init, inits)))
                plgpu.barrier_arrive(free.at[slot])
                if fused:
                    add_dq(i, grads[2])
                    grads = grads[:2]
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


def _static(plan, q, k, heads, fused_dq: bool = False):
    B, Tp, H, Dp = q.shape
    heads, windows = selected_heads(plan, H, heads)
    cfg = plan.config
    consumers = cfg.mosaic_bwd_consumers
    if fused_dq or (plan.interpret and not interpreter_fits(consumers)):
        # the fused dQ: a redone last block would add its dQ twice; the interpreter: four
        # warpgroups may hang it on few processors (the same results with two)
        consumers = 2
    return heads, dict(
        heads=heads, windows=windows,
        group=H // k.shape[2], block_q=cfg.mosaic_bwd_block_q, block_k=cfg.mosaic_bwd_block_k,
        stages=cfg.mosaic_stages, seq_len=Tp, score_scale=plan.scale * LOG2_E,
        scale=plan.scale, interpret=plan.interpret, consumers=consumers)


def delta_fits(plan, dtype) -> bool:
    """Whether the dQ kernel has the shared memory to load O and compute delta itself: a third
    [block_q, D] tile per consumer beside Q, dO and the key/value ring (and the consumers' lse
    and delta rows), with ``SMEM_SPARE`` left. Not with 128-key blocks at D=128 (every head
    global, ``mosaic_dq_block_k``: 1,152 bytes over the limit itself)."""
    cfg = plan.config
    block_k = cfg.mosaic_dq_block_k or cfg.mosaic_bwd_block_k
    consumers, block_q = cfg.mosaic_bwd_consumers, cfg.mosaic_bwd_block_q
    tiles = 3 * consumers * block_q + 2 * cfg.mosaic_stages * block_k  # Q, dO, O; K, V ring
    row_bytes = 2 * consumers * block_q * 4  # float32 lse and delta
    return (tiles * plan.head_dim_padded * jnp.dtype(dtype).itemsize + row_bytes
            <= SMEM_BYTES - SMEM_SPARE)


def dq_call_mosaic(plan, q, k, v, do, lse2, delta=None, heads=None, *, out=None):
    """(dq [B, Tp, H, Dp] in q's dtype, delta float32 [B, H, Tp]) for ``heads`` (default all)
    on padded inputs. With ``delta`` None the kernel computes ``delta = rowsum(out * do)``
    from its own O and dO tiles (no separate pass over them) and returns it (rows of
    ``heads`` only, the others unwritten); a given ``delta`` is used and returned as is."""
    B, Tp, H, Dp = q.shape
    heads, static = _static(plan, q, k, heads)
    static["block_k"] = plan.config.mosaic_dq_block_k or static["block_k"]
    bq, bk, stages = static["block_q"], static["block_k"], static["stages"]
    consumers = static["consumers"]
    num_tiles = pl.cdiv(Tp, consumers * bq)
    in_kernel = delta is None
    if in_kernel and out is None:
        raise ValueError("dq_call_mosaic: expected out (to compute delta) when delta is None")

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
    run = launch(entry, out_type, num_heads=len(heads), num_tiles=num_tiles, batch=B,
                 interpret=plan.interpret, consumers=consumers)
    if in_kernel:
        return tuple(run(q, k, v, do, lse2, out))
    return run(q, k, v, do, lse2, delta), delta


def dkdv_call_mosaic(plan, q, k, v, do, lse2, delta, heads=None, *, fused_dq: bool = False,
                     sum_groups: bool = True):
    """(dk, dv), each [B, Tp, G, Dp] in k's dtype, per kv head, for ``heads`` (default all;
    a subset only with one kv head per query head) on padded inputs.

    With GQA each program sums its kv head's group in its accumulators (one stream over the
    group's query heads); with ``sum_groups`` off, and with the fused dQ, it computes one
    query head and XLA sums each group after the kernel (run U's way, for comparisons).

    fused_dq: also dQ, in the same pass (``ds . K`` of every tile added into a float32
    accumulator by TMA reductions, FA3's way: five products per tile instead of the two
    kernels' seven; the order of the additions varies from run to run, so dQ is not
    bit-reproducible): returns (dk, dv, dq), dq [B, Tp, len(heads), Dp] in q's dtype."""
    B, Tp, H, Dp = q.shape
    G = k.shape[2]
    if heads is not None and G < H:
        raise ValueError(f"dkdv_call_mosaic: heads={heads} needs one kv head per query head, "
                         f"got {G} kv heads for {H}")
    heads, static = _static(plan, q, k, heads, fused_dq)
    group_sum = G < H and sum_groups and not fused_dq
    static["group_sum"] = group_sum
    if fused_dq:  # 64-row query blocks: with 128 the consumers spill (run P: twice as slow)
        static["block_q"] = FUSED_BLOCK_Q
    bq, bk, stages = static["block_q"], static["block_k"], static["stages"]
    consumers = static["consumers"]
    num_tiles = pl.cdiv(Tp, consumers * bk)

    def entry(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, dq_ref=None):
        own = plgpu.SMEM((consumers, bk, Dp), k.dtype, transforms=TILE_TRANSFORMS)
        ring = plgpu.SMEM((stages, bq, Dp), q.dtype, transforms=TILE_TRANSFORMS)
        rows = plgpu.SMEM((stages, bq), jnp.float32)
        fused = [None, None]
        if dq_ref is not None:  # dS^T tiles (wgmma's A, read transposed), dQ tiles out
            fused = [plgpu.SMEM((consumers, bk, bq), q.dtype, transforms=TILE_TRANSFORMS),
                     plgpu.SMEM((consumers, dq_slots(Dp), bq, Dp), jnp.float32,
                                transforms=F32_TRANSFORMS)]
        pl.run_scoped(
            lambda *scoped: _dkdv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref,
                                         dk_ref, dv_ref, dq_ref, scoped, num_tiles=num_tiles,
                                         **static),
            [own, own, ring, ring, rows, rows, *fused],
            (plgpu.Barrier(num_barriers=2 * consumers),) + (
                plgpu.Barrier(num_barriers=stages),) * 4,
            (plgpu.Barrier(num_arrivals=consumers, num_barriers=stages),),
            collective_axes="wg")

    def run(out_type):
        return launch(entry, out_type, num_heads=G if group_sum else len(heads),
                      num_tiles=num_tiles, batch=B, interpret=plan.interpret,
                      consumers=consumers)

    def kv_heads(dk, dv):  # each group's query heads summed (after a per-query-head kernel)
        if G == H:
            return dk, dv
        return tuple(x.reshape(B, Tp, G, H // G, Dp).astype(jnp.float32).sum(axis=3)
                     .astype(k.dtype) for x in (dk, dv))

    if group_sum:
        shape = jax.ShapeDtypeStruct((B, Tp, G, Dp), k.dtype)
        return tuple(run([shape, shape])(q, k, v, do, lse2, delta))
    shape = jax.ShapeDtypeStruct((B, Tp, H, Dp), k.dtype)
    if not fused_dq:
        return kv_heads(*run([shape, shape])(q, k, v, do, lse2, delta))
    # the kernel writes into its buffers (``run_into``: aliased, not copied): dk and dv
    # uninitialised (``lax.empty``: no memset on a GPU; the kernel writes every row of its
    # heads), the accumulator zeros that it adds into; in interpret mode each key block has
    # its own slice of it, summed here
    acc_shape = (B, Tp, len(heads), Dp)
    if plan.interpret:
        acc_shape = (B, Tp // bk) + acc_shape[1:]
    dk, dv, acc = run_into(run(()), (q, k, v, do, lse2, delta),
                           (lax.empty(shape.shape, k.dtype), lax.empty(shape.shape, k.dtype),
                            jnp.zeros(acc_shape, jnp.float32)))
    if plan.interpret:
        acc = acc.sum(axis=1)
    return *kv_heads(dk, dv), (acc * plan.scale).astype(q.dtype)
