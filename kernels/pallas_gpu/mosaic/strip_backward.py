"""The local heads' backward for Hopper as fused strips (Mosaic GPU): five products a tile.

The Triton backward runs two kernels (dQ; dK/dV), each recomputing the probabilities and dP:
seven products a tile, and every Q, K, V and dO block read by both. Here one consumer walks a
*sub-strip* of consecutive key blocks of one head and batch element, and for each key block j
and each query block i of its band computes, from one S^T and one dP^T,

    dV_j += P^T dO_i,   dK_j += dS^T Q_i,   dQ_i += dS K_j.

dK_j and dV_j stay in registers while the consumer walks j's band. dQ_i gathers the
contributions of the key blocks j <= i in a ring of float32 tiles in shared memory: the
first key block whose band reaches i starts it from zeros, the diagonal block (j = i)
finishes it and writes it out. So that every query block of a sub-strip is whole in
it, a consumer first walks the key blocks before its sub-strip whose bands reach its first
query block, for dQ only (the warm-up); the query blocks past the sub-strip get only dK/dV
contributions (the next sub-strip's warm-up computes their dQ).

The consumers take the sub-strips of the (head, batch element) rows in turn, row after row, so
a row may hold any number of them (the heuristics fill one wave of the SMs whatever the number
of rows) and a program's two consumers may be on two rows. A program holds the two independent
consumer warpgroups and nothing else: each issues its own TMA loads, so the pair of them has
every register of the SM (a consumer's live tiles need them; a warpgroup beside it would take
them). A consumer streams the query side (Q, dO, lse2) of its sub-strip through a ring
of shared-memory slots once: query block i's slot takes block i + slots once i's last key block
(the diagonal) is done with it. It loads its K and V blocks too: with two K/V slots the next
key block's while it computes the current one; with one (``StripBackwardConfig.kv_slots``, for
bands too wide for two) the next V after the current one's last dP^T and the next K after its
last dQ, and it waits on them. Nothing is shared between the consumers, so a dQ ring needs no
other warpgroup's order.
For heads of one window, the offset of a query block from the key block picks its mask, whose
bounds are then static: one compare an element for each bound that cuts the tile (a tile inside
the band has none). The mask applies to the exponent after the scale and lse2 (one fma an
entry). The products accumulate in the Triton kernels' order (dQ over key blocks, dK and dV
over query blocks, ascending). delta = rowsum(O * dO) of query block i is the consumer's own:
at i's first key block it reads i's O tile and its dO tile from shared memory, and writes the
row into the query ring beside lse2. The consumer loads the O tiles itself, a ring of them
ahead of its first key blocks: ``StripBackwardConfig.o_slots`` tiles of their own (O of block i
+ o_slots loads once i's delta is made), or, where they do not fit shared memory, in the dQ
tiles (a union): the key block ``dq_tiles`` before i sends that tile's last share out and then
loads i's O into it, so the load runs under at least one step, and i's first share replaces it.
The float32 dQ tiles are swizzled like the bf16 ones, so that their wgmma-layout loads and
stores are free of bank conflicts. The stores to shared memory go without Pallas' automatic
barriers: a consumer reads its dQ tiles back in the layout it wrote them (each thread its own
entries), hands the staging tile to the tensor cores and the TMA through ``commit_smem``, after
waiting for the TMA's last read of it, and loads K and V into a slot only once it has waited
for the products that read it (``ring.launch``).

Interpret mode (CPU tests) runs it in Pallas' GPU interpreter, where each product is a plain
dot of the same operands (``ring.mma``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ls_jax.kernels.band import allowed, band_blocks, cdiv, kv_block_range, q_block_range
from ls_jax.kernels.pallas_gpu.common import LOG2_E, MASKED_SCORE
from ls_jax.kernels.pallas_gpu.configs import STRIP_BLOCK, StripBackwardConfig
from ls_jax.kernels.pallas_gpu.mosaic.ring import (TILE_TRANSFORMS, launch, mma, pick,
                                                   ring_slot, run_into, selected_heads,
                                                   static_tile_allowed, tile_iota, zero_tile)

CONSUMERS = 2  # warpgroups a program holds, each on its own sub-strip (255 registers each)
# the float32 dQ tiles: 8x32 tiles, 128-byte swizzle, so that a consumer reads and writes
# them in the wgmma layout without bank conflicts
DQ_TRANSFORMS = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))


def dq_tiles(stages: int) -> int:
    """float32 dQ tiles a consumer keeps: one per query block of a band but the diagonal one,
    which its key block finishes (at least one)."""
    return max(stages - 1, 1)


def smem_bytes(window: int, head_dim: int, itemsize: int, kv_slots: int, o_slots: int) -> int:
    """Shared memory of one program: per consumer, its K and V blocks (``kv_slots`` of each),
    the query-side ring (Q, dO tiles, lse2 and delta rows) of ``band_blocks`` slots, the dS^T
    staging tile, the float32 dQ ring and ``o_slots`` O tiles (none: they take the dQ tiles'
    place in turn)."""
    tile = STRIP_BLOCK * head_dim * itemsize
    stages = band_blocks(window, STRIP_BLOCK)
    per_consumer = (2 * kv_slots * tile + stages * (2 * tile + 2 * STRIP_BLOCK * 4) + tile
                    + dq_tiles(stages) * STRIP_BLOCK * head_dim * 4 + o_slots * tile)
    return CONSUMERS * per_consumer


def _kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, o_ref, dq_ref, dk_ref, dv_ref, scoped,
            *, heads, windows, num_rows, sub, stages, dq_slots, kv_slots, o_slots, o_ring,
            seq_len, score_scale, scale, interpret):
    smem, loaded = scoped
    k_own, v_own, q_ring, do_ring, lse_ring, delta_ring, ds_tile, (dq_acc, o_tiles) = smem
    q_loaded, do_loaded, lse_loaded, o_loaded, kv_loaded = loaded
    block = STRIP_BLOCK
    num_blocks = seq_len // block
    dtype = q_ref.dtype
    head_dim = q_ref.shape[-1]
    # the consumers take the sub-strips of the (head, batch element) rows in turn, row after
    # row: row r is batch element r // len(heads), head heads[r % len(heads)]
    c = lax.axis_index("wg")
    subs = cdiv(num_blocks, sub)  # sub-strips a row
    piece = CONSUMERS * lax.axis_index("tile") + c  # the consumer's sub-strip, over all rows
    has_work = piece < num_rows * subs
    # a consumer past the last sub-strip (no work) keeps the last row, so its indices are valid
    row = jnp.minimum(lax.div(piece, jnp.int32(subs)), num_rows - 1)
    head_slot = lax.rem(row, jnp.int32(len(heads)))
    b = lax.div(row, jnp.int32(len(heads)))
    h, window = pick(head_slot, heads), pick(head_slot, windows)
    if len(heads) == 1:  # h traced: the one-slot V load captures it inside a pl.run_state
        h = h + 0 * head_slot  # body, whose constant operands the Mosaic GPU lowering rejects
    # the consumer's key blocks [first, end); the warm-up's from kv_start; the query stream
    first = lax.rem(piece, jnp.int32(subs)) * sub
    end = jnp.minimum(first + sub, num_blocks)
    kv_start, _ = kv_block_range(first, block, block, window, seq_len)
    _, last_end = q_block_range(end - 1, block, block, window, seq_len)
    stream_end = jnp.where(has_work, last_end, first)

    one_window = len(set(windows)) == 1

    def slot_of(i):
        return ring_slot(i, first, stages)

    def band_masked(offset: int, x_KxQ):
        """``x_KxQ`` of key block j against query block j + offset, its entries outside the
        band ``MASKED_SCORE`` (heads of one window: static bounds, none inside the band)."""
        ok_KxQ = static_tile_allowed(offset * block, block, block, windows[0],
                                     keys_on_rows=True)
        return x_KxQ if ok_KxQ is None else jnp.where(ok_KxQ, x_KxQ, MASKED_SCORE)

    ds = ds_tile.at[c]

    def kv_slot(j):
        return ring_slot(j, kv_start, kv_slots)

    def barrier(barriers, i):
        return barriers.at[c * stages + slot_of(i)]

    def kv_barrier(j, n):  # n: 0 for K, 1 for V
        return kv_loaded.at[(c * kv_slots + kv_slot(j)) * 2 + n]

    def load_k(j):
        plgpu.copy_gmem_to_smem(k_ref.at[b, pl.ds(j * block, block), h],
                                k_own.at[c, kv_slot(j)], kv_barrier(j, 0))

    def load_v(j):
        plgpu.copy_gmem_to_smem(v_ref.at[b, pl.ds(j * block, block), h],
                                v_own.at[c, kv_slot(j)], kv_barrier(j, 1))

    def load_query(i):
        """Query block i's Q, dO and lse2 into its ring slot."""
        rows = pl.ds(i * block, block)
        slot = slot_of(i)
        plgpu.copy_gmem_to_smem(q_ref.at[b, rows, h], q_ring.at[c, slot],
                                barrier(q_loaded, i))
        plgpu.copy_gmem_to_smem(do_ref.at[b, rows, h], do_ring.at[c, slot],
                                barrier(do_loaded, i))
        plgpu.copy_gmem_to_smem(lse_ref.at[b, h, rows], lse_ring.at[c, slot],
                                barrier(lse_loaded, i))

    def wait_streamed(i, _):
        for barriers in (q_loaded, do_loaded, lse_loaded):
            plgpu.barrier_wait(barrier(barriers, i))

    def o_tile(i):  # query block i's O tile (none of their own: in i's dQ tile), barrier
        n = lax.rem(i - first, jnp.int32(o_ring))
        return o_tiles.at[c, n, 0], o_loaded.at[c * o_ring + n]

    def load_o(i):
        """O of query block i into its tile, if the consumer's stream has the block."""
        @pl.when(i < stream_end)
        def _load():
            plgpu.copy_gmem_to_smem(o_ref.at[b, pl.ds(i * block, block), h], *o_tile(i))

    def make_delta(i, slot):
        """delta = rowsum(O * dO) of query block i in float32, into its ring slot; then
        (O tiles of their own) the next O into i's tile."""
        tile, loaded = o_tile(i)
        plgpu.barrier_wait(loaded)
        o_QxD = plgpu.load(tile, layout=plgpu.Layout.WGMMA)
        do_QxD = plgpu.load(do_ring.at[c, slot], layout=plgpu.Layout.WGMMA)
        delta_ring.at[c, slot][...] = (o_QxD.astype(jnp.float32)
                                       * do_QxD.astype(jnp.float32)).sum(axis=1)
        plgpu.commit_smem()  # the reads of i's O done: its tile may take the next
        if o_slots:
            load_o(i + o_slots)

    def stage_ds(value):
        """``value`` into the staging tile, once its previous contents are out."""
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        ds[...] = value
        plgpu.commit_smem()

    def step(i, grads, *, j, last, k_tile, v_tile, full: bool):
        """Query block i against key block j: dK/dV (when ``full``) and i's dQ."""
        slot = slot_of(i)
        q_blk, do_blk = q_ring.at[c, slot], do_ring.at[c, slot]
        if one_window:  # i - j picks the mask; its bounds are static
            def masked(x_KxQ):
                return lax.switch(i - j, [functools.partial(band_masked, offset)
                                          for offset in range(stages)], x_KxQ)
        else:  # the band rule on query minus key positions (one difference of iotas)
            gap_KxQ = (tile_iota(block, block, 1) - tile_iota(block, block, 0)
                       + (i - j) * block)

            def masked(x_KxQ):
                return jnp.where(allowed(gap_KxQ, 0, window), x_KxQ, MASKED_SCORE)
        starts = j == kv_block_range(i, block, block, window, seq_len)[0]
        pl.when(starts)(functools.partial(make_delta, i, slot))  # i's first key block
        lse_Q = plgpu.load(lse_ring.at[c, slot], layout=plgpu.Layout.WGMMA.reduce(0))
        delta_Q = plgpu.load(delta_ring.at[c, slot], layout=plgpu.Layout.WGMMA.reduce(0))
        dq_slot = dq_acc.at[c, lax.rem(i - first, jnp.int32(dq_slots))]

        def dq_start():  # i's first key block starts dQ from zeros, a later one adds
            return lax.cond(starts, lambda: zero_tile(block, head_dim),
                            lambda: plgpu.load(dq_slot, layout=plgpu.Layout.WGMMA))

        def probabilities(sT_KxQ):  # masked after the scale and lse2: one fma an entry
            return jnp.exp2(masked(sT_KxQ * score_scale
                                   - lax.broadcast_in_dim(lse_Q, sT_KxQ.shape, [1])))

        def score_grads(pT_KxQ, dpT_KxQ):
            dsT_KxQ = pT_KxQ * (dpT_KxQ - lax.broadcast_in_dim(delta_Q, dpT_KxQ.shape, [1]))
            return dsT_KxQ.astype(dtype)

        if interpret:  # one product at a time (see ``ring.mma``)
            pT_KxQ = probabilities(mma(None, k_tile, q_blk, transpose_b=True,
                                       interpret=True))
            dpT_KxQ = mma(None, v_tile, do_blk, transpose_b=True, interpret=True)
            dsT_KxQ = score_grads(pT_KxQ, dpT_KxQ)
            if full:
                dk_KxD, dv_KxD = grads
                dv_KxD = mma(dv_KxD, pT_KxQ.astype(dtype), do_blk, transpose_b=False,
                             interpret=True)
                dk_KxD = mma(dk_KxD, dsT_KxQ, q_blk, transpose_b=False, interpret=True)
                grads = dk_KxD, dv_KxD
            stage_ds(dsT_KxQ)
            dq_QxD = mma(dq_start(), dsT_KxQ.T, k_tile, transpose_b=False, interpret=True)
        else:  # S^T and dP^T together, dV under dP^T, then dK; dQ once they are done
            def products(sT_ref, dpT_ref, grad_refs=None):
                plgpu.wgmma(sT_ref, k_tile, q_blk.transpose((1, 0)))
                plgpu.wgmma(dpT_ref, v_tile, do_blk.transpose((1, 0)))
                pT_KxQ = probabilities(plgpu.wgmma_accumulator_load(sT_ref, wait_n=1))
                if full:
                    plgpu.wgmma(grad_refs[1], pT_KxQ.astype(dtype), do_blk)
                dpT_KxQ = plgpu.wgmma_accumulator_load(dpT_ref, wait_n=1 if full else 0)
                if kv_slots == 1:  # the last read of this V is done
                    pl.when(jnp.logical_and(i == last, j + 1 < end))(
                        functools.partial(load_v, j + 1))
                dsT_KxQ = score_grads(pT_KxQ, dpT_KxQ)
                if full:
                    plgpu.wgmma(grad_refs[0], dsT_KxQ, q_blk)
                stage_ds(dsT_KxQ)

            scores = plgpu.ACC((block, block), jnp.float32)
            if full:
                def accumulate(grad_refs):
                    pl.run_scoped(functools.partial(products, grad_refs=grad_refs),
                                  scores, scores)

                grads = pl.run_state(accumulate)(tuple(map(plgpu.ACC.init, grads)))
            else:
                pl.run_scoped(products, scores, scores)

            # the accumulators of the scores are out of scope: dQ's fits beside dK, dV
            def accumulate_dq(dq_ref):
                plgpu.wgmma(dq_ref, ds.transpose((1, 0)), k_tile)

            dq_QxD = pl.run_state(accumulate_dq)(plgpu.ACC.init(dq_start()))

        @pl.when(jnp.logical_and(i < end, i == j))  # i's last contribution: out
        def _finish():
            stage_ds((dq_QxD * scale).astype(dtype))  # (fences off the reads of i's tile)
            plgpu.copy_smem_to_gmem(ds, dq_ref.at[b, pl.ds(i * block, block), h])
            if not o_slots:  # i's dQ tile takes the O tile of the block that reuses it
                load_o(i + dq_slots)

        @pl.when(jnp.logical_and(i < end, i != j))
        def _keep():
            dq_slot[...] = dq_QxD

        # j is i's last key block: its slot takes the block ``stages`` on (the step's
        # products are done, its reads of the slot fenced off by ``stage_ds``)
        pl.when(jnp.logical_and(i == j, i + stages < stream_end))(
            functools.partial(load_query, i + stages))
        return grads

    def key_block(j, waited, *, full: bool):
        q_first, q_end = q_block_range(j, block, block, window, seq_len)
        lax.fori_loop(waited, q_end, wait_streamed, None)
        plgpu.barrier_wait(kv_barrier(j, 0))
        plgpu.barrier_wait(kv_barrier(j, 1))
        if kv_slots > 1:  # the next key block into the other slot, read out before j
            pl.when(j + 1 < end)(functools.partial(load_k, j + 1))
            pl.when(j + 1 < end)(functools.partial(load_v, j + 1))
        zeros = zero_tile(block, head_dim)
        grads = lax.fori_loop(jnp.maximum(q_first, first), q_end,
                              functools.partial(step, j=j, last=q_end - 1, full=full,
                                                k_tile=k_own.at[c, kv_slot(j)],
                                                v_tile=v_own.at[c, kv_slot(j)]),
                              (zeros, zeros))
        if kv_slots == 1:  # K read out (on the GPU, V's load is issued in the last step)
            if interpret:
                pl.when(j + 1 < end)(functools.partial(load_v, j + 1))
            pl.when(j + 1 < end)(functools.partial(load_k, j + 1))
        if full:
            cols = pl.ds(j * block, block)
            dk_KxD, dv_KxD = grads
            stage_ds((dk_KxD * scale).astype(dtype))
            plgpu.copy_smem_to_gmem(ds, dk_ref.at[b, cols, h])
            stage_ds(dv_KxD.astype(dtype))
            plgpu.copy_smem_to_gmem(ds, dv_ref.at[b, cols, h])
        return jnp.maximum(waited, q_end)

    @pl.when(has_work)
    def _walk():
        for n in range(stages):  # the query ring filled
            pl.when(first + n < stream_end)(functools.partial(load_query, first + n))
        load_k(kv_start)
        load_v(kv_start)
        for n in range(o_ring):  # the ring of O tiles filled
            load_o(first + n)
        waited = lax.fori_loop(kv_start, first, functools.partial(key_block, full=False),
                               first)
        lax.fori_loop(first, end, functools.partial(key_block, full=True), waited)
        plgpu.wait_smem_to_gmem(0)


def backward_call(plan, config: StripBackwardConfig, heads: tuple[int, ...], q, k, v, do,
                  lse2, out, prefilled=()):
    """(dq, dk, dv), each [B, Tp, H, Dp] in q's dtype, for the local ``heads`` (one kv head
    per query head; their windows' buffers fit shared memory: ``smem_bytes``) on padded
    inputs (Tp a multiple of ``STRIP_BLOCK``); ``out`` is the forward's, from which the kernel
    makes delta = rowsum(O * dO). prefilled: () or the (dq, dk, dv) of earlier launches, into
    which this one writes its heads' rows (other rows kept); without it the other heads' rows
    are left unwritten."""
    B, Tp, H, Dp = q.shape
    heads, windows = selected_heads(plan, heads)
    stages = max(band_blocks(w, STRIP_BLOCK) for w in windows)
    dq_slots = dq_tiles(stages)
    sub, kv_slots, o_slots = config.sub_blocks, config.kv_slots, config.o_slots
    o_ring = o_slots or dq_slots  # the O tiles: their own, or the dQ tiles
    num_rows = B * len(heads)
    num_tiles = cdiv(num_rows * cdiv(Tp // STRIP_BLOCK, sub), CONSUMERS)
    tile = plgpu.SMEM((CONSUMERS, STRIP_BLOCK, Dp), q.dtype, transforms=TILE_TRANSFORMS)
    kv = plgpu.SMEM((CONSUMERS, kv_slots, STRIP_BLOCK, Dp), q.dtype, transforms=TILE_TRANSFORMS)
    ring = plgpu.SMEM((CONSUMERS, stages, STRIP_BLOCK, Dp), q.dtype, transforms=TILE_TRANSFORMS)
    rows = plgpu.SMEM((CONSUMERS, stages, STRIP_BLOCK), jnp.float32)
    acc = plgpu.SMEM((CONSUMERS, dq_slots, STRIP_BLOCK, Dp), jnp.float32,
                     transforms=DQ_TRANSFORMS)
    if o_slots:  # O tiles of their own
        dq_and_o = (acc, plgpu.SMEM((CONSUMERS, o_slots, 1, STRIP_BLOCK, Dp), q.dtype,
                                    transforms=TILE_TRANSFORMS))
    else:  # each float32 dQ tile holds two 16-bit tiles, the first O's: both groups of the
        # union start at its start, and leading indices are outermost in a tiled layout, so O
        # tile [c, n, 0] takes the bytes of dQ tile [c, n] (in a slot, their lifetimes are
        # apart)
        dq_and_o = plgpu.RefUnion(acc, plgpu.SMEM((CONSUMERS, dq_slots, 2, STRIP_BLOCK, Dp),
                                                  q.dtype, transforms=TILE_TRANSFORMS))
    static = dict(heads=heads, windows=windows, num_rows=num_rows, sub=sub, stages=stages,
                  dq_slots=dq_slots, kv_slots=kv_slots, o_slots=o_slots, o_ring=o_ring,
                  seq_len=Tp, score_scale=plan.scale * LOG2_E, scale=plan.scale,
                  interpret=plan.interpret)

    def entry(q_ref, k_ref, v_ref, do_ref, lse_ref, o_ref, dq_ref, dk_ref, dv_ref):
        pl.run_scoped(
            lambda *scoped: _kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, o_ref, dq_ref,
                                    dk_ref, dv_ref, scoped, **static),
            [kv, kv, ring, ring, rows, rows, tile, dq_and_o],
            (plgpu.Barrier(num_barriers=CONSUMERS * stages),) * 3
            + (plgpu.Barrier(num_barriers=CONSUMERS * o_ring),
               plgpu.Barrier(num_barriers=2 * CONSUMERS * kv_slots)),
            collective_axes="wg")

    def run(out_type):
        return launch(entry, out_type, num_heads=1, num_tiles=num_tiles, batch=1,
                      interpret=plan.interpret, warpgroups=CONSUMERS, auto_barriers=False)

    inputs = (q, k, v, do, lse2, out)
    if prefilled:  # write into the earlier launches' buffers (aliased, not copied)
        return tuple(run_into(run(()), inputs, prefilled))
    return tuple(run([jax.ShapeDtypeStruct(q.shape, q.dtype)] * 3)(*inputs))
