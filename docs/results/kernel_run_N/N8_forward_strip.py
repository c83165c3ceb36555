"""Prototype (run N, calls N8-N9; not part of the package): the local heads' forward as
Mosaic GPU *strips*. Run from scratch/ with PYTHONPATH at the checkout (N8_bench_strip.py).
N8 ran this code with two consumers (the default here); N9's four consumers hung on the GPU.

One program walks ``strip`` consecutive 64-row query blocks of one (head, batch element); its
two consumers take alternate blocks; the producer streams each 64-key block of the strip's
band ONCE through a ring of ``stages`` slots. A consumer waits for each block once (in order,
as the per-thread barrier phases require) and releases it when its next query block no longer
needs it, so a key/value block is read from L2 once per strip instead of once per query block.
Consumers load their own query blocks, the next one ahead into a second slot. No statistics.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ls_jax.kernels.band import allowed, kv_block_range
from ls_jax.kernels.pallas_gpu.mosaic_ring import (TILE_TRANSFORMS, launch, mma, pick,
                                                   produce_kv, tile_iota)
from ls_jax.kernels.pallas_gpu.tiles import LOG2_E, MASKED_SCORE, MAX_FLOOR, split_kv_loop

REGISTERS = {2: (232, 40), 3: (160, 24), 4: (120, 24)}


def _kernel(q_ref, k_ref, v_ref, out_ref, lse_ref, scoped, *, heads, windows, group, block,
            strip, stages, seq_len, score_scale, interpret, consumers):
    CONSUMERS = consumers
    (q_smem, k_smem, v_smem, o_smem, lse_smem), (k_loaded, v_loaded, q_loaded), (
        k_free, v_free) = scoped
    b, slot_h = lax.axis_index("batch"), lax.axis_index("heads")
    h, window = pick(slot_h, heads), pick(slot_h, windows)
    s = lax.axis_index("tile")
    wg = lax.axis_index("wg")
    num_blocks = seq_len // block
    strip_first = s * strip
    strip_end = jnp.minimum(strip_first + strip, num_blocks)
    stream_first, _ = kv_block_range(strip_first, block, block, window, seq_len)
    _, stream_end = kv_block_range(strip_end - 1, block, block, window, seq_len)
    dtype = q_ref.dtype
    D = q_ref.shape[-1]
    c = score_scale

    def slot_of(j):
        return lax.rem(j - stream_first, jnp.int32(stages))

    @pl.when(wg < CONSUMERS)
    def _consumer():
        plgpu.set_max_registers(REGISTERS[CONSUMERS][0], action="increase")
        # my query blocks: strip_first + wg, + CONSUMERS, ...
        count = lax.div(strip_end - strip_first - wg + CONSUMERS - 1, jnp.int32(CONSUMERS))

        def load_q(t):
            i = strip_first + wg + CONSUMERS * t
            qs = lax.rem(t, jnp.int32(2))
            plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(i * block, block), h],
                                    q_smem.at[wg, qs], q_loaded.at[wg * 2 + qs])

        pl.when(count > 0)(functools.partial(load_q, jnp.int32(0)))

        def wait_block(j, _):
            plgpu.barrier_wait(k_loaded.at[slot_of(j)])
            plgpu.barrier_wait(v_loaded.at[slot_of(j)])

        def release_block(j, _):
            plgpu.barrier_arrive(k_free.at[slot_of(j)])
            plgpu.barrier_arrive(v_free.at[slot_of(j)])

        def query_block(t, carry):
            waited, released = carry
            i = strip_first + wg + CONSUMERS * t
            qs = lax.rem(t, jnp.int32(2))
            pl.when(t + 1 < count)(functools.partial(load_q, t + 1))
            plgpu.barrier_wait(q_loaded.at[wg * 2 + qs])
            q_tile = q_smem.at[wg, qs]
            first, lo, hi, end = split_kv_loop(i, block, block, window, seq_len)
            lax.fori_loop(waited, end, wait_block, None)
            waited = jnp.maximum(waited, end)

            def row_vector(value):
                return plgpu.layout_cast(jnp.full((block,), value, jnp.float32),
                                         plgpu.Layout.WGMMA.reduce(1))

            q_first = i * block

            def step(j, carry, masked):
                acc, m, l = carry
                slot = slot_of(j)
                s_QxK = mma(None, q_tile, k_smem.at[slot], transpose_b=True,
                            interpret=interpret)
                if masked:
                    ok = allowed(q_first + tile_iota(block, block, 0),
                                 j * block + tile_iota(block, block, 1), window)
                    s_QxK = jnp.where(ok, s_QxK, MASKED_SCORE)
                m_new = jnp.maximum(m, jnp.maximum(s_QxK.max(axis=1) * c, MAX_FLOOR))
                alpha = jnp.exp2(m - m_new)
                p = jnp.exp2(s_QxK * c - lax.broadcast_in_dim(m_new, s_QxK.shape, [0]))
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                l = l * alpha + p.sum(axis=1)
                acc = mma(acc, p.astype(dtype), v_smem.at[slot], transpose_b=False,
                          interpret=interpret)
                return acc, m_new, l

            carry = (plgpu.layout_cast(jnp.zeros((block, D), jnp.float32), plgpu.Layout.WGMMA),
                     row_vector(MAX_FLOOR), row_vector(0.0))
            carry = lax.fori_loop(first, lo, functools.partial(step, masked=True), carry)
            carry = lax.fori_loop(lo, hi, functools.partial(step, masked=False), carry)
            acc, m, l = lax.fori_loop(hi, end, functools.partial(step, masked=True), carry)

            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last block's copies read
            o_smem.at[wg][...] = (acc * lax.broadcast_in_dim(1.0 / l, acc.shape, [0])
                                  ).astype(dtype)
            lse_smem.at[wg][...] = m + jnp.log2(l)
            plgpu.commit_smem()
            rows = pl.ds(q_first, block)
            plgpu.copy_smem_to_gmem(o_smem.at[wg], out_ref.at[b, rows, h])
            plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[b, h, rows])

            # blocks my next query block does not need go back to the producer
            next_first, _ = kv_block_range(i + CONSUMERS, block, block, window, seq_len)
            keep = jnp.minimum(jnp.where(t + 1 < count, next_first, stream_end), waited)
            lax.fori_loop(released, keep, release_block, None)
            return waited, jnp.maximum(released, keep)

        waited, released = lax.fori_loop(0, count, query_block, (stream_first, stream_first))
        lax.fori_loop(waited, stream_end, wait_block, None)  # every phase observed
        lax.fori_loop(released, stream_end, release_block, None)
        plgpu.wait_smem_to_gmem(0)

    pl.when(wg == CONSUMERS)(functools.partial(
        produce_kv, k_ref, v_ref, k_smem, v_smem, (k_loaded, v_loaded), (k_free, v_free), b=b,
        kv_head=lax.div(h, jnp.int32(group)), block_k=block, first=stream_first,
        end=stream_end, stages=stages, registers=REGISTERS[CONSUMERS][1]))


def strip_forward(q, k, v, heads, windows, *, scale, strip=16, block=64, stages=None,
                  interpret=False, consumers=2):
    CONSUMERS = consumers
    """out, lse2 of ``heads`` (their rows; other heads' rows unwritten). windows: each head's
    window (< T). q [B, T, H, D], T a multiple of ``block``."""
    B, T, H, D = q.shape
    G = k.shape[2]
    assert T % block == 0
    if stages is None:  # the blocks a consumer holds, the other consumer's one more, prefetch
        stages = -(-max(windows) // block) + 1 + CONSUMERS + (1 if CONSUMERS < 4 else 0)
    num_strips = -(-(T // block) // strip)

    def entry(q_ref, k_ref, v_ref, out_ref, lse_ref):
        scratch = [
            plgpu.SMEM((CONSUMERS, 2, block, D), q.dtype, transforms=TILE_TRANSFORMS),
            plgpu.SMEM((stages, block, D), q.dtype, transforms=TILE_TRANSFORMS),
            plgpu.SMEM((stages, block, D), q.dtype, transforms=TILE_TRANSFORMS),
            plgpu.SMEM((CONSUMERS, block, D), q.dtype, transforms=TILE_TRANSFORMS),
            plgpu.SMEM((CONSUMERS, block), jnp.float32),
        ]
        body = functools.partial(
            _kernel, q_ref, k_ref, v_ref, out_ref, lse_ref, heads=tuple(heads),
            windows=tuple(windows), group=H // G, block=block, strip=strip, stages=stages,
            seq_len=T, score_scale=scale * LOG2_E, interpret=interpret, consumers=CONSUMERS)
        pl.run_scoped(
            lambda *scoped: body(scoped), scratch,
            (plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages),
             plgpu.Barrier(num_barriers=2 * CONSUMERS)),
            (plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages),) * 2,
            collective_axes="wg")

    out_type = [jax.ShapeDtypeStruct(q.shape, q.dtype),
                jax.ShapeDtypeStruct((B, H, T), jnp.float32)]
    return launch(entry, out_type, num_heads=len(heads), num_tiles=num_strips, batch=B,
                  interpret=interpret, consumers=CONSUMERS)(q, k, v)
