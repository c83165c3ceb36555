"""Pieces the Mosaic GPU kernels share: their launch, the producer's TMA ring, the consumers'
band loops, and a tensor-core multiply-accumulate that also runs in Pallas' GPU interpreter.

Every Mosaic kernel here has the same shape: two or three *consumer* warpgroups (the
config's ``consumers``) each own one block (of query rows in the
forward and dQ, of key rows in dK/dV) and a *producer* warpgroup streams the other side's
blocks (key/value blocks, or query/dO blocks) through a ring of shared-memory slots
(``STAGES``; the strips size their own). The producer loads the union of the consumers' ranges; a
consumer steps through the blocks outside its own range without computing (``band_loops``'
``skip``), so each slot's barriers see every arrival and wait in order.

Barriers: per slot, a "loaded" barrier per buffer (TMA completion) and one "free" barrier
with one arrival per consumer. Pallas' Mosaic GPU lowering tracks a barrier's phase per
thread, so a consumer waits on every loaded barrier of every step, its own or not, and the
producer waits for the last releases before it exits (the GPU interpreter checks that every
completed phase was observed).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax._src.state import types as state_types
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ls_jax.kernels.band import allowed
from ls_jax.kernels.pallas_gpu.common import LOG2_E, MASKED_SCORE, MAX_FLOOR
from ls_jax.kernels.platform_call import on_platform

STAGES = 2  # slots of the Hopper forward's and backward's rings: one loading, one in use
# registers per thread after ``plgpu.set_max_registers``, by number of consumers: the producer
# gives up what the consumers take; (2 * 232 + 40) * 128 threads = 64512 of the SM's 65536,
# and (3 * 160 + 24) * 128 = 64512 with three consumers. The warpgroups share what the
# program was launched with (``launch_registers``): a budget above it leaves the consumers'
# increase waiting for registers no one gives back, and the program hangs.
REGISTERS = {2: (232, 40), 3: (160, 24)}
WARPGROUP_THREADS = 128


def launch_registers(warpgroups: int) -> int:
    """Registers per thread a program of ``warpgroups`` warpgroups starts with: the SM's 65536
    shared out, in the multiples of 8 registers are allocated in (168, 128, 96 for 3, 4, 5
    warpgroups, as ptxas reports for our kernels)."""
    return 65536 // (WARPGROUP_THREADS * warpgroups) // 8 * 8


# shared-memory layout of every [rows, D] tile: 8x64 tiles, 128-byte swizzle (what wgmma and
# TMA take for 16-bit data)
TILE_TRANSFORMS = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))


def selected_heads(plan, heads: tuple[int, ...]):
    """(heads, their effective windows) as static tuples."""
    heads = tuple(heads)
    return heads, tuple(plan.windows[h] for h in heads)


def launch(body, out_type, *, num_heads: int, num_tiles: int, batch: int, interpret: bool,
           warpgroups: int, auto_barriers: bool = True):
    """``plgpu.kernel`` over the grid (head, tile, batch) with ``warpgroups`` warpgroups "wg"
    (consumers and producers), in Pallas' GPU interpreter when ``interpret``. Without
    ``auto_barriers`` neither a store to shared memory nor a TMA load into it waits for the
    warpgroup's other threads: only for a body whose stored tiles are read back by the
    threads that stored them, in the same layout, or handed to the TMA and tensor cores
    through ``commit_smem``, and whose loads go into tiles whose last reads (products) it has
    waited for, as a ring's release after a product does."""
    extra = {}
    if interpret:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
        extra["interpret"] = InterpretGPUParams()
    kernel = plgpu.kernel(
        body, out_type=out_type, grid=(num_heads, num_tiles, batch),
        grid_names=("heads", "tile", "batch"),
        num_threads=warpgroups, thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True,
                                             unsafe_no_auto_barriers=not auto_barriers),
        **extra)
    # a launch without outputs takes refs (run_into), which it wraps whole
    return on_platform("cuda", kernel) if out_type else kernel


def run_into(kernel, inputs, buffers):
    """``kernel(*inputs, *buffers)`` for a kernel launched without outputs, with ``buffers``
    passed as refs under ``pl.run_state``: it writes into them (the custom call aliases them,
    no copy) and their final values come back, as a tuple."""
    def fill(refs):
        kernel(*inputs, *refs)
    return on_platform("cuda", pl.run_state(fill))(tuple(buffers))


def pick(i, values: tuple[int, ...]):
    """int32 scalar: ``values[i]`` for a traced index ``i`` into a short static tuple."""
    if values == tuple(range(len(values))):
        return i
    value = jnp.int32(values[0])
    if len(set(values)) > 1:
        for k, v in enumerate(values[1:], start=1):
            value = jnp.where(i == k, jnp.int32(v), value)
    return value


def ring_slot(j, first, stages: int):
    """The ring slot of block ``j`` when the stream starts at block ``first``."""
    return lax.rem(j - first, jnp.int32(stages))


def produce(first, end, stages: int, load, wait_free):
    """The producer: blocks [first, end) into the ring. ``load(j, slot)`` issues block j's
    TMA copies into ``slot``; ``wait_free(slot)`` waits until both consumers released it."""
    for s in range(stages):  # fill the ring
        pl.when(s < end - first)(functools.partial(load, first + s, s))

    def refill(j, _):
        slot = ring_slot(j, first, stages)
        wait_free(slot)
        load(j, slot)

    lax.fori_loop(first + stages, end, refill, None)

    def drain(j, _):  # the last blocks' releases: every phase of a barrier is observed
        wait_free(ring_slot(j, first, stages))

    lax.fori_loop(jnp.maximum(end - stages, first), end, drain, None)


def produce_kv(k_ref, v_ref, k_smem, v_smem, loaded, free, *, b, kv_head, block_k, first,
               end, stages: int, registers: int):
    """The producer of the forward and dQ kernels: key and value blocks [first, end) of
    batch ``b``, kv head ``kv_head`` into the ring. loaded, free: (k, v) barrier arrays."""
    plgpu.set_max_registers(registers, action="decrease")

    def load(j, slot):
        cols = (b, pl.ds(j * block_k, block_k), kv_head)
        plgpu.copy_gmem_to_smem(k_ref.at[cols], k_smem.at[slot], loaded[0].at[slot])
        plgpu.copy_gmem_to_smem(v_ref.at[cols], v_smem.at[slot], loaded[1].at[slot])

    def wait_free(slot):
        plgpu.barrier_wait(free[0].at[slot])
        plgpu.barrier_wait(free[1].at[slot])

    produce(first, end, stages, load, wait_free)


def strip_bounds(block_range, tile, strip: int, block: int, window, seq_len: int):
    """(strip_first, strip_end, stream_first, stream_end) of strip ``tile`` (the program's grid
    index "tile"): its own blocks [strip_first, strip_end) (``strip`` a program) and the
    streamed blocks [stream_first, stream_end) they need together; ``block_range`` gives an
    own block's streamed range (``kernels.band.kv_block_range`` for the forward's query
    blocks; one ``block`` size on both sides)."""
    strip_first = tile * strip
    strip_end = jnp.minimum(strip_first + strip, seq_len // block)
    stream_first, _ = block_range(strip_first, block, block, window, seq_len)
    _, stream_end = block_range(strip_end - 1, block, block, window, seq_len)
    return strip_first, strip_end, stream_first, stream_end


def strip_share(strip_first, strip_end, wg, consumers: int):
    """(count, own_block): consumer ``wg`` takes the strip's blocks strip_first + wg,
    strip_first + wg + consumers, ...: ``count`` of them, the t-th ``own_block(t)``."""
    count = lax.div(strip_end - strip_first - wg + consumers - 1, jnp.int32(consumers))

    def own_block(t):
        return strip_first + wg + consumers * t

    return count, own_block


def walk_strip(count, own_block, next_first, stream_first, stream_end, wait_block,
               release_block, visit):
    """A strip consumer's walk over its own blocks ``own_block(t)``, t < count (it takes every
    ``consumers``-th block of the strip), while a producer streams the strip's other side
    [stream_first, stream_end) through the ring once (``forward_strip.py``).

    ``visit(t, i, wait_streamed)`` computes own block i; it calls ``wait_streamed(end)`` once,
    before it reads the ring, to wait for the streamed blocks up to ``end`` (exclusive). A
    consumer waits for every streamed block once, in stream order (the lowering tracks a
    barrier's phase per thread, so no block may be skipped or waited twice), and after each
    own block releases (``release_block``) the blocks its next one, starting at
    ``next_first(i)``, does not need; at the end it waits for and releases the rest. A
    consumer holds every block it has waited for until its block is done, so at a strip's
    start the last consumer holds the stream from the strip's first block: the ring needs
    ``forward_strip.strip_stages`` slots (tests/test_strip_ring.py replays the protocol)."""
    def one(t, carry):
        waited, released = carry  # stream blocks [.., waited) waited, [.., released) freed
        i = own_block(t)
        after = []  # ``waited`` once visit has waited (set inside visit, in its place)

        def wait_streamed(end):
            lax.fori_loop(waited, end, wait_block, None)
            after.append(jnp.maximum(waited, end))

        visit(t, i, wait_streamed)
        (waited,) = after
        first = next_first(i)
        keep = jnp.minimum(jnp.where(t + 1 < count, first, stream_end), waited)
        lax.fori_loop(released, keep, release_block, None)
        return waited, jnp.maximum(released, keep)

    waited, released = lax.fori_loop(0, count, one, (stream_first, stream_first))
    lax.fori_loop(waited, stream_end, wait_block, None)  # every phase observed
    lax.fori_loop(released, stream_end, release_block, None)


def program_ids(heads: tuple[int, ...], windows: tuple[int, ...]):
    """(batch, head, window, warpgroup) of the running program: grid axis "heads" indexes the
    static tuple of heads the call computes."""
    slot = lax.axis_index("heads")
    return (lax.axis_index("batch"), pick(slot, heads), pick(slot, windows),
            lax.axis_index("wg"))


def tile_union(block_range, tile, block_q: int, block_k: int, window, seq_len: int,
               consumers: int, num_blocks: int | None = None):
    """[first, end): the streamed blocks the consumers of ``tile`` (its blocks
    ``consumers * tile`` to ``consumers * tile + consumers - 1``, the last tile cut at
    ``num_blocks`` owned blocks when given) need together; ``block_range`` is
    ``kernels.band.kv_block_range`` or ``q_block_range`` (both ranges grow with the block
    index)."""
    first, _ = block_range(consumers * tile, block_q, block_k, window, seq_len)
    last = consumers * tile + consumers - 1
    if num_blocks is not None:
        last = jnp.minimum(last, num_blocks - 1)
    _, end = block_range(last, block_q, block_k, window, seq_len)
    return first, end


def consumer_block(tile, wg, consumers: int, num_blocks: int):
    """The block consumer ``wg`` of ``tile`` owns, ``consumers * tile + wg``; in a last tile
    the blocks do not fill, its extra consumers redo the last block (and store the same rows)
    rather than branch around the ring's barriers."""
    block = consumers * tile + wg
    return block if num_blocks % consumers == 0 else jnp.minimum(block, num_blocks - 1)


def band_loops(union_first, union_end, ranges, skip, step, carry):
    """A consumer's walk over the streamed blocks [union_first, union_end).

    ranges = (first, lo, hi, end): its own blocks are [first, end), of which [lo, hi) need no
    element mask; ``step(j, carry, masked)`` computes block j, ``skip(j, None)`` only keeps
    the barriers in step for a block of the other consumer's range.
    """
    first, lo, hi, end = ranges
    lax.fori_loop(union_first, first, skip, None)
    carry = lax.fori_loop(first, lo, functools.partial(step, masked=True), carry)
    carry = lax.fori_loop(lo, hi, functools.partial(step, masked=False), carry)
    carry = lax.fori_loop(hi, end, functools.partial(step, masked=True), carry)
    lax.fori_loop(end, union_end, skip, None)
    return carry


def mma(acc, a, b_smem, *, transpose_b: bool, interpret: bool):
    """``acc + a @ b`` (``a @ b`` when acc is None) in float32 on the tensor cores (wgmma):
    ``a`` a shared-memory ref or a register array, ``b_smem`` a shared-memory ref, used
    transposed when ``transpose_b``. Pallas' GPU interpreter takes neither a register
    operand in wgmma nor ``pl.run_state`` on an accumulator: there it is a plain dot of the
    same operands."""
    if interpret:
        a_val = a[...] if _is_ref(a) else a
        b_val = b_smem[...]
        out = jnp.dot(a_val, b_val.T if transpose_b else b_val,
                      preferred_element_type=jnp.float32)
        return out if acc is None else acc + out
    b = b_smem.transpose((1, 0)) if transpose_b else b_smem

    def accumulate(acc_ref):
        plgpu.wgmma(acc_ref, a, b)

    if acc is None:
        def fresh(acc_ref):
            plgpu.wgmma(acc_ref, a, b)
            return acc_ref[...]
        rows = a.shape[0]
        cols = b_smem.shape[0] if transpose_b else b_smem.shape[1]
        return pl.run_scoped(fresh, plgpu.ACC((rows, cols), jnp.float32))
    return pl.run_state(accumulate)(plgpu.ACC.init(acc))


def mma_each(a, b_smems, visit, *, interpret: bool):
    """``[visit(d, a @ b_d.T)]`` in float32 over the tiles ``b_smems``: the products are issued
    together, and ``visit`` runs on each as soon as it is done, under the later ones."""
    if interpret:
        return [visit(d, mma(None, a, b, transpose_b=True, interpret=True))
                for d, b in enumerate(b_smems)]
    bs = [b.transpose((1, 0)) for b in b_smems]

    def products(*acc_refs):
        for acc_ref, b in zip(acc_refs, bs):
            plgpu.wgmma(acc_ref, a, b)
        return [visit(d, plgpu.wgmma_accumulator_load(acc_ref, wait_n=len(bs) - 1 - d))
                for d, acc_ref in enumerate(acc_refs)]

    shape = (a.shape[0], bs[0].shape[1])
    return pl.run_scoped(products, *[plgpu.ACC(shape, jnp.float32)] * len(bs))


def mma_sum(operand, b_smems, rows: int, *, interpret: bool):
    """``(sum_d a_d @ b_d, [x_d])`` in float32 where ``(a_d, x_d) = operand(d)``: each product
    is issued as soon as its operand is made, so the next one is made under it (x_d: what
    else ``operand`` derives from the same values)."""
    if interpret:
        made = [operand(d) for d in range(len(b_smems))]
        return functools.reduce(jnp.add, [
            mma(None, a, b, transpose_b=False, interpret=True)
            for (a, _), b in zip(made, b_smems)]), [x for _, x in made]

    def chain(acc_ref):
        extras = []
        for d, b in enumerate(b_smems):
            a, x = operand(d)
            extras.append(x)
            plgpu.wgmma(acc_ref, a, b)
        return acc_ref[...], extras

    return pl.run_scoped(chain, plgpu.ACC((rows, b_smems[0].shape[1]), jnp.float32))


def _is_ref(x) -> bool:
    return isinstance(x, state_types.TransformedRef) or isinstance(
        getattr(x, "aval", None), state_types.AbstractRef)


def tile_iota(rows: int, cols: int, dimension: int):
    """int32 [rows, cols] iota along ``dimension`` in the wgmma accumulator layout."""
    return plgpu.broadcasted_iota(jnp.int32, (rows, cols), dimension,
                                  layout=plgpu.Layout.WGMMA)


def tile_allowed(q_first, k_first, rows: int, cols: int, window):
    """bool [rows, cols] in the wgmma accumulator layout: ``band.allowed`` on the tile of
    queries q_first + r and keys k_first + c (``band.tile_allowed_QxK``'s Mosaic twin)."""
    return allowed(q_first + tile_iota(rows, cols, 0), k_first + tile_iota(rows, cols, 1),
                   window)


def static_tile_allowed(shift: int, rows: int, cols: int, window: int, *,
                        keys_on_rows: bool = False):
    """``tile_allowed`` for a static ``shift = q_first - k_first`` and window: only the bounds
    that cut the tile are tested, on the column-minus-row iota (the same for every tile
    shifted alike); None for a tile inside the band. With ``keys_on_rows`` the tile is
    transposed (keys on the rows, queries along the columns: the dK/dV orientation)."""
    gap = tile_iota(rows, cols, 1) - tile_iota(rows, cols, 0)  # column - row
    # query minus key position: shift - gap, or shift + gap with keys on the rows; allowed
    # when in [0, window): gap in [low, high]
    low, high = (-shift, window - shift - 1) if keys_on_rows else (shift - window + 1, shift)
    ok = None
    if low > -(rows - 1):
        ok = gap >= low
    if high < cols - 1:
        ok = gap <= high if ok is None else ok & (gap <= high)
    return ok


def zero_tile(rows: int, cols: int):
    """float32 zeros [rows, cols] in the wgmma accumulator layout (an accumulator's start)."""
    return plgpu.layout_cast(jnp.zeros((rows, cols), jnp.float32), plgpu.Layout.WGMMA)


def row_vector(rows: int, value: float):
    """float32 [rows] filled with ``value``, in the layout of a wgmma tile's row reduction."""
    return plgpu.layout_cast(jnp.full((rows,), value, jnp.float32),
                             plgpu.Layout.WGMMA.reduce(1))


def softmax_carry(rows: int, head_dim: int, with_stats: bool):
    """The online softmax's initial carry for ``rows`` query rows in the wgmma layouts: the
    accumulator (zeros), the running max (floored), the row sum, and with the statistics the
    running row minimum of the scores."""
    carry = (zero_tile(rows, head_dim), row_vector(rows, MAX_FLOOR), row_vector(rows, 0.0))
    return carry + (row_vector(rows, -MASKED_SCORE),) if with_stats else carry


def store_rows(carry, o_smem, lse_smem, stat_smem, out_ref, lse_ref, stat_ref, *, b, h,
               q_first, scale: float):
    """A finished query block of the Mosaic forwards out to HBM through shared memory: out
    (the accumulator over the row sum), lse2 and, when the carry holds the row minimum,
    max |logit| = max(max, -min) * scale (the running max is max * scale * log2(e)). The
    caller waits for the copies (``plgpu.wait_smem_to_gmem``), and before it for earlier
    copies out of the same shared memory."""
    acc_QxD, m_Q, l_Q, *min_Q = carry
    o_smem[...] = (acc_QxD * lax.broadcast_in_dim(1.0 / l_Q, acc_QxD.shape, [0])
                   ).astype(o_smem.dtype)
    lse_smem[...] = m_Q + jnp.log2(l_Q)
    if min_Q:
        stat_smem[...] = jnp.maximum(m_Q * (1.0 / LOG2_E), -min_Q[0] * scale)
    plgpu.commit_smem()
    rows = pl.ds(q_first, acc_QxD.shape[0])
    plgpu.copy_smem_to_gmem(o_smem, out_ref.at[b, rows, h])
    plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[b, h, rows])
    if min_Q:
        plgpu.copy_smem_to_gmem(stat_smem, stat_ref.at[b, h, rows])


def softmax_step(s_QxK, acc_QxD, m_Q, l_Q, c):
    """One base-2 online-softmax update of the Mosaic forwards on (masked) raw scores, ``c``
    the scale times log2(e): (p, the accumulator rescaled, the new running max, the new row
    sum). The scaled running max is floored (see tiles.py: a fully masked row gets p = 0)."""
    m_new_Q = jnp.maximum(m_Q, jnp.maximum(s_QxK.max(axis=1) * c, MAX_FLOOR))
    alpha_Q = jnp.exp2(m_Q - m_new_Q)
    p_QxK = jnp.exp2(s_QxK * c - lax.broadcast_in_dim(m_new_Q, s_QxK.shape, [0]))
    acc_QxD = acc_QxD * lax.broadcast_in_dim(alpha_Q, acc_QxD.shape, [0])
    return p_QxK, acc_QxD, m_new_Q, l_Q * alpha_Q + p_QxK.sum(axis=1)


def row_min(s_QxK, ok_QxK, min_Q):
    """The logit statistics' running row minimum of the raw scores (``ok_QxK``: the tile's
    mask, None for a tile inside the band), as a one-element list (the carry's tail)."""
    s_min = s_QxK if ok_QxK is None else jnp.where(ok_QxK, s_QxK, -MASKED_SCORE)
    return [jnp.minimum(min_Q[0], s_min.min(axis=1))]
