"""The local heads' forward for Hopper as *strips* (Mosaic GPU): each key/value block read once.

The Triton forward gives every 64-row query block of a local head its own program, which
fetches the 2-3 key/value blocks of its band from L2; at p=128 every key/value block is
fetched by 3-4 query blocks. Here one program walks a *strip* of consecutive query blocks of
one head and batch element, and a producer warpgroup streams the strip's key/value blocks
through a ring of shared-memory slots once each:

* the consumers (``StripConfig.consumers`` warpgroups, 160 registers each with three) take
  the strip's query blocks in turn (consumer c: blocks c, c + C, ...), loading their own
  query blocks with TMA, the next one ahead into a second slot;
* a consumer waits for each streamed block once, in stream order (the lowering tracks a
  barrier's phase per thread, so no block may be skipped or waited twice), and releases it
  as soon as its next query block no longer needs it; the ring holds a consumer's band, the
  other consumers' blocks ahead of it and one prefetch: ``strip_stages`` slots;
* with ``StripConfig.one_pass`` (heads of one window, ``plan.make_plan`` checks), a query
  block whose band is whole (past the sequence's first blocks) takes its key blocks' scores
  in one pass: the tiles sit at fixed offsets from the query block, so their masks have static
  bounds; no running max and no rescaled accumulator. The first blocks take the online loop;
* outputs go out through a per-consumer shared-memory tile and TMA, as in
  ``forward.py``: out, lse2 (log2 domain) and, when asked, each row's max |logit|. It runs
  without Pallas' automatic barriers (``ring.launch``): those tiles, its only stores to
  shared memory, are written after the wait for the TMA's last read of them and handed to
  the TMA through ``commit_smem`` (both end in a warpgroup barrier), and a consumer loads
  its next Q into the slot whose products it has waited for.

Used for the local heads at D=64 where ``heuristics.forward_launches`` says so; the global
heads of a mix run first on ``forward.py`` and this kernel writes the local heads' rows into
the same buffers (refs under ``pl.run_state``: the custom call aliases them, no copy).

Interpret mode (CPU tests) runs it in Pallas' GPU interpreter, as ``forward.py``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ls_jax.kernels.band import band_blocks, cdiv, kv_block_range
from ls_jax.kernels.pallas_gpu.common import LOG2_E, MASKED_SCORE, MAX_FLOOR, split_kv_loop
from ls_jax.kernels.pallas_gpu.configs import STRIP_BLOCK, StripConfig
from ls_jax.kernels.pallas_gpu.mosaic.ring import (REGISTERS, TILE_TRANSFORMS, launch, mma,
                                                   mma_each, mma_sum, produce_kv, program_ids,
                                                   ring_slot, row_min, row_vector, run_into,
                                                   selected_heads, softmax_carry, softmax_step,
                                                   static_tile_allowed, store_rows,
                                                   strip_bounds, strip_share, tile_allowed,
                                                   walk_strip)


def strip_stages(window: int, consumers: int) -> int:
    """Ring slots: a consumer's band (window / block + 1 blocks), one block more per other
    consumer (their query blocks run ahead by one each) and one prefetch."""
    return cdiv(window, STRIP_BLOCK) + 1 + consumers + 1


def strip_smem_bytes(window: int, head_dim: int, itemsize: int, consumers: int) -> int:
    """Shared memory of one program: two query slots and an output tile per consumer, the
    key/value ring, and the consumers' lse and statistics rows."""
    tile = STRIP_BLOCK * head_dim * itemsize
    return (3 * consumers * tile + 2 * strip_stages(window, consumers) * tile
            + 2 * consumers * STRIP_BLOCK * 4)


def _kernel(q_ref, k_ref, v_ref, out_ref, lse_ref, stat_ref, scoped, *, heads, windows, group,
            strip, stages, consumers, seq_len, score_scale, scale, with_stats, one_pass,
            interpret):
    smem, (k_loaded, v_loaded, q_loaded), (k_free, v_free) = scoped
    q_smem, k_smem, v_smem, o_smem, lse_smem, stat_smem = smem
    b, h, window, wg = program_ids(heads, windows)
    block = STRIP_BLOCK
    strip_first, strip_end, stream_first, stream_end = strip_bounds(
        kv_block_range, lax.axis_index("tile"), strip, block, window, seq_len)
    dtype = q_ref.dtype
    head_dim = q_ref.shape[-1]
    c = score_scale
    consumer_registers, producer_registers = REGISTERS[consumers]

    def slot_of(j):
        return ring_slot(j, stream_first, stages)

    @pl.when(wg < consumers)
    def _consumer():
        plgpu.set_max_registers(consumer_registers, action="increase")
        count, q_block_of = strip_share(strip_first, strip_end, wg, consumers)

        def load_q(t):
            slot = lax.rem(t, jnp.int32(2))
            plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(q_block_of(t) * block, block), h],
                                    q_smem.at[wg, slot], q_loaded.at[wg * 2 + slot])

        pl.when(count > 0)(functools.partial(load_q, jnp.int32(0)))

        def wait_block(j, _):
            plgpu.barrier_wait(k_loaded.at[slot_of(j)])
            plgpu.barrier_wait(v_loaded.at[slot_of(j)])

        def release_block(j, _):
            plgpu.barrier_arrive(k_free.at[slot_of(j)])
            plgpu.barrier_arrive(v_free.at[slot_of(j)])

        def query_block(t, i, wait_streamed):
            q_first = i * block
            slot = lax.rem(t, jnp.int32(2))
            pl.when(t + 1 < count)(functools.partial(load_q, t + 1))
            plgpu.barrier_wait(q_loaded.at[wg * 2 + slot])
            q_tile = q_smem.at[wg, slot]
            first, lo, hi, end = split_kv_loop(i, block, block, window, seq_len)
            wait_streamed(end)

            def step(j, carry, masked: bool):
                acc_QxD, m_Q, l_Q, *min_Q = carry
                ring = slot_of(j)
                s_QxK = mma(None, q_tile, k_smem.at[ring], transpose_b=True,
                            interpret=interpret)
                if masked:
                    ok_QxK = tile_allowed(q_first, j * block, block, block, window)
                if with_stats:  # the row minimum before the exponentials (160 registers)
                    min_Q = row_min(s_QxK, ok_QxK if masked else None, min_Q)
                if masked:
                    s_QxK = jnp.where(ok_QxK, s_QxK, MASKED_SCORE)
                p_QxK, acc_QxD, m_new_Q, l_Q = softmax_step(s_QxK, acc_QxD, m_Q, l_Q, c)
                acc_QxD = mma(acc_QxD, p_QxK.astype(dtype), v_smem.at[ring],
                              transpose_b=False, interpret=interpret)
                return (acc_QxD, m_new_Q, l_Q, *min_Q)

            def store(carry):
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last block's stores read
                store_rows(carry, o_smem.at[wg], lse_smem.at[wg],
                           stat_smem.at[wg] if with_stats else None, out_ref, lse_ref,
                           stat_ref, b=b, h=h, q_first=q_first, scale=scale)

            def online():
                carry = softmax_carry(block, head_dim, with_stats)
                carry = lax.fori_loop(first, lo, functools.partial(step, masked=True), carry)
                carry = lax.fori_loop(lo, hi, functools.partial(step, masked=False), carry)
                carry = lax.fori_loop(hi, end, functools.partial(step, masked=True), carry)
                store(carry)

            def whole_band():
                # the band's key blocks are i - blocks + 1 .. i: static offsets, so each tile's
                # mask bounds are static too, and its scores are softmaxed in one pass
                slots = [slot_of(first + d) for d in range(blocks)]

                def masked(d, s_QxK):  # under the later blocks' products
                    ok_QxK = static_tile_allowed((blocks - 1 - d) * block, block, block,
                                                 windows[0])
                    min_Q = row_min(s_QxK, ok_QxK, [row_vector(block, -MASKED_SCORE)]
                                    ) if with_stats else []
                    if ok_QxK is not None:
                        s_QxK = jnp.where(ok_QxK, s_QxK, MASKED_SCORE)
                    return s_QxK, min_Q

                s_QxK, mins = zip(*mma_each(q_tile, [k_smem.at[r] for r in slots], masked,
                                            interpret=interpret))
                min_Q = [functools.reduce(jnp.minimum, [m[0] for m in mins])] if with_stats else []
                m_Q = functools.reduce(jnp.maximum, [s.max(axis=1) for s in s_QxK])
                m_Q = jnp.maximum(m_Q * c, MAX_FLOOR)

                def probabilities(d):  # under the earlier blocks' products
                    p_QxK = jnp.exp2(s_QxK[d] * c - lax.broadcast_in_dim(m_Q, (block, block),
                                                                         [0]))
                    return p_QxK.astype(dtype), p_QxK.sum(axis=1)

                acc_QxD, sums = mma_sum(probabilities, [v_smem.at[r] for r in slots], block,
                                        interpret=interpret)
                store((acc_QxD, m_Q, functools.reduce(jnp.add, sums), *min_Q))

            if one_pass:  # the band is whole past the sequence's first blocks
                blocks = band_blocks(windows[0], block)
                whole = end - first == blocks
                pl.when(whole)(whole_band)
                pl.when(jnp.logical_not(whole))(online)
            else:
                online()

        # a block's successor (i + consumers) needs the key blocks from its band's first
        walk_strip(count, q_block_of,
                   lambda i: kv_block_range(i + consumers, block, block, window, seq_len)[0],
                   stream_first, stream_end, wait_block, release_block, query_block)
        plgpu.wait_smem_to_gmem(0)

    pl.when(wg == consumers)(functools.partial(
        produce_kv, k_ref, v_ref, k_smem, v_smem, (k_loaded, v_loaded), (k_free, v_free), b=b,
        kv_head=lax.div(h, jnp.int32(group)), block_k=block, first=stream_first,
        end=stream_end, stages=stages, registers=producer_registers))


def forward_call(plan, config: StripConfig, heads: tuple[int, ...], q, k, v, prefilled=()):
    """The strip forward of ``heads`` (local heads; ``heuristics.strip_fits`` their windows) on
    padded inputs (Tp a multiple of ``STRIP_BLOCK``): outputs as the Triton forward's.

    prefilled: () or the (out, lse2[, stat]) of an earlier launch (the global heads'), into
    which this one writes its heads' rows (other rows kept); without it the other heads' rows
    are left unwritten.
    """
    B, Tp, H, Dp = q.shape
    G = k.shape[2]
    with_stats = plan.logit_stats
    interpret = plan.interpret
    consumers = config.consumers
    assert Tp % STRIP_BLOCK == 0, Tp
    heads, windows = selected_heads(plan, heads)
    stages = strip_stages(max(windows), consumers)
    num_blocks = Tp // STRIP_BLOCK
    strip = config.strip_blocks
    num_strips = cdiv(num_blocks, strip)
    tile = plgpu.SMEM((consumers, STRIP_BLOCK, Dp), q.dtype, transforms=TILE_TRANSFORMS)
    rows = plgpu.SMEM((consumers, STRIP_BLOCK), jnp.float32)

    def entry(q_ref, k_ref, v_ref, out_ref, lse_ref, *stat):
        scratch = [
            plgpu.SMEM((consumers, 2, STRIP_BLOCK, Dp), q.dtype, transforms=TILE_TRANSFORMS),
            plgpu.SMEM((stages, STRIP_BLOCK, Dp), q.dtype, transforms=TILE_TRANSFORMS),
            plgpu.SMEM((stages, STRIP_BLOCK, Dp), q.dtype, transforms=TILE_TRANSFORMS),
            tile, rows, rows if with_stats else None,
        ]
        body = functools.partial(
            _kernel, q_ref, k_ref, v_ref, out_ref, lse_ref, stat[0] if with_stats else None,
            heads=heads, windows=windows, group=H // G, strip=strip, stages=stages,
            consumers=consumers, seq_len=Tp, score_scale=plan.scale * LOG2_E,
            scale=plan.scale, with_stats=with_stats, one_pass=config.one_pass,
            interpret=interpret)
        pl.run_scoped(
            lambda *scoped: body(scoped), scratch,
            (plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages),
             plgpu.Barrier(num_barriers=2 * consumers)),
            (plgpu.Barrier(num_arrivals=consumers, num_barriers=stages),) * 2,
            collective_axes="wg")

    def run(out_type):
        return launch(entry, out_type, num_heads=len(heads), num_tiles=num_strips, batch=B,
                      interpret=interpret, warpgroups=consumers + 1, auto_barriers=False)

    if prefilled:  # write into the earlier launch's buffers (aliased, not copied)
        outs = run_into(run(()), (q, k, v), prefilled)
    else:
        out_type = [jax.ShapeDtypeStruct(q.shape, q.dtype),
                    jax.ShapeDtypeStruct((B, H, Tp), jnp.float32)]
        if with_stats:
            out_type.append(jax.ShapeDtypeStruct((B, H, Tp), jnp.float32))
        outs = run(out_type)(q, k, v)
    return outs[0], outs[1], outs[2] if with_stats else None
