"""Pieces the Mosaic GPU kernels share: when they apply, their launch, the producer's TMA ring,
the consumers' band loops, and a tensor-core multiply-accumulate that also runs in Pallas' GPU
interpreter.

Every Mosaic kernel here has the same shape: two *consumer* warpgroups (three in the forward
at D <= 64, ``KernelConfig.mosaic_consumers``) each own one block (of query rows in the
forward and dQ, of key rows in dK/dV) and a *producer* warpgroup streams the other side's
blocks (key/value blocks, or query/dO blocks) through a ring of ``stages`` shared-memory
slots. The producer loads the union of the consumers' ranges; a
consumer steps through the blocks outside its own range without computing (``band_loops``'
``skip``), so each slot's barriers see every arrival and wait in order.

Barriers: per slot, a "loaded" barrier per buffer (TMA completion) and one "free" barrier
with one arrival per consumer. Pallas' Mosaic GPU lowering tracks a barrier's phase per
thread, so a consumer waits on every loaded barrier of every step, its own or not, and the
producer waits for the last releases before it exits (the GPU interpreter checks that every
completed phase was observed).
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
from jax import lax
from jax._src.state import types as state_types
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

CONSUMERS = 2
# registers per thread after ``plgpu.set_max_registers``, by number of consumers: the producer
# gives up what the consumers take; (2 * 232 + 40) * 128 threads = 64512 of the SM's 65536,
# and (3 * 160 + 24) * 128 = 64512 with three consumers (the forward at D <= 64)
REGISTERS = {2: (232, 40), 3: (160, 24)}
CONSUMER_REGISTERS, PRODUCER_REGISTERS = REGISTERS[CONSUMERS]

# the lowering's constraints (why a call may not take this path: ``mosaic_fits``)
MOSAIC_DTYPES = (jnp.bfloat16, jnp.float16)
MOSAIC_HEAD_DIM = 64  # head size must be a multiple of this (128-byte swizzled rows)


def is_hopper() -> bool:
    """True when JAX's first device is a Hopper GPU (compute capability 9.x): the kernel's
    wgmma instructions exist only there."""
    device = jax.devices()[0]
    return device.platform == "gpu" and str(getattr(device, "compute_capability", "")
                                               ).startswith("9.")


def mosaic_fits(dtype, head_dim: int, has_segments: bool, interpret: bool = False) -> bool:
    """True when the Mosaic GPU kernels can run the call (else the Triton ones do):
    bfloat16/float16, head size a multiple of 64, no segment ids, on a Hopper GPU (or in
    interpret mode)."""
    return (jnp.dtype(dtype) in tuple(map(jnp.dtype, MOSAIC_DTYPES))
            and head_dim % MOSAIC_HEAD_DIM == 0 and not has_segments
            and (interpret or is_hopper()))


# shared-memory layout of every [rows, D] tile: 8x64 tiles, 128-byte swizzle (what wgmma and
# TMA take for 16-bit data)
TILE_TRANSFORMS = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))


def selected_heads(plan, num_heads: int, heads):
    """(heads, their effective windows) as static tuples: ``heads`` None means all."""
    heads = tuple(range(num_heads)) if heads is None else tuple(heads)
    return heads, tuple(plan.window_table()[h] for h in heads)


def interpreter_fits(consumers: int) -> bool:
    """Whether Pallas' GPU interpreter can run ``consumers + 1`` warpgroups at once here: it
    runs each as an XLA CPU execution that blocks in host callbacks at barriers, and the CPU
    client runs one more at once than it counts processors (``PJRT_NPROC``, default the
    machine's; seen on 2 cores: three warpgroups ran, four hung)."""
    processors = int(os.environ.get("PJRT_NPROC") or os.cpu_count() or 1)
    return consumers <= processors  # consumers + producer <= processors + 1 at once


def launch(body, out_type, *, num_heads: int, num_tiles: int, batch: int, interpret: bool,
           consumers: int = CONSUMERS, programs: int = 0):
    """``plgpu.kernel`` over the grid (head, tile, batch), or over ``programs`` persistent
    programs (grid axis "program", ``WorkList``) when it is > 0, with the ``consumers`` and
    the producer as warpgroups "wg" (in Pallas' GPU interpreter when ``interpret``)."""
    extra = {}
    if interpret:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
        extra["interpret"] = InterpretGPUParams()
    grid, names = ((programs,), ("program",)) if programs else (
        (num_heads, num_tiles, batch), ("heads", "tile", "batch"))
    return plgpu.kernel(
        body, out_type=out_type, grid=grid, grid_names=names, num_threads=consumers + 1,
        thread_name="wg", compiler_params=plgpu.CompilerParams(approx_math=True), **extra)


def pick(i, values: tuple[int, ...]):
    """int32 scalar: ``values[i]`` for a traced index ``i`` into a short static tuple."""
    if values == tuple(range(len(values))):
        return i
    value = jnp.int32(values[0])
    if len(set(values)) > 1:
        for k, v in enumerate(values[1:], start=1):
            value = jnp.where(i == k, jnp.int32(v), value)
    return value


def ring_slot(j, first, stages: int, streamed=0):
    """The ring slot of block ``j`` of a stream that starts at block ``first`` after
    ``streamed`` blocks of earlier tiles (a persistent program's, ``WorkList``)."""
    count = j - first if isinstance(streamed, int) and streamed == 0 else streamed + j - first
    return lax.rem(count, jnp.int32(stages))


def produce(first, end, stages: int, load, wait_free, streamed=0, drain: bool = True):
    """The producer: blocks [first, end) into the ring, after ``streamed`` blocks of earlier
    tiles. ``load(j, slot)`` issues block j's TMA copies into ``slot``; ``wait_free(slot)``
    waits until every consumer released it. ``drain`` ends the stream: it waits for the last
    releases (every phase of a barrier is observed); else the stream goes on with the next
    tile's blocks, and the count of blocks streamed so far is returned."""

    def block(j, _):
        count = j - first + streamed
        slot = lax.rem(count, jnp.int32(stages))
        pl.when(count >= stages)(functools.partial(wait_free, slot))  # a full ring: refill
        load(j, slot)

    lax.fori_loop(first, end, block, None)
    streamed = streamed + end - first
    if not drain:
        return streamed
    drain_ring(streamed, stages, wait_free)
    return None


def drain_ring(streamed, stages: int, wait_free):
    """Waits for the releases of the last ``stages`` of ``streamed`` blocks."""
    lax.fori_loop(jnp.maximum(streamed - stages, 0), streamed,
                  lambda count, _: wait_free(lax.rem(count, jnp.int32(stages))), None)


def produce_kv(k_ref, v_ref, k_smem, v_smem, loaded, free, *, b, kv_head, block_k, first,
               end, stages: int, registers: int | None = PRODUCER_REGISTERS, streamed=0,
               drain: bool = True):
    """The producer of the forward and dQ kernels: key and value blocks [first, end) of
    batch ``b``, kv head ``kv_head`` into the ring (``produce``; ``registers`` None leaves
    the register budget as it is). loaded, free: (k, v) barrier arrays."""
    if registers is not None:
        plgpu.set_max_registers(registers, action="decrease")

    def load(j, slot):
        cols = (b, pl.ds(j * block_k, block_k), kv_head)
        plgpu.copy_gmem_to_smem(k_ref.at[cols], k_smem.at[slot], loaded[0].at[slot])
        plgpu.copy_gmem_to_smem(v_ref.at[cols], v_smem.at[slot], loaded[1].at[slot])

    return produce(first, end, stages, load, functools.partial(wait_kv_free, free),
                   streamed=streamed, drain=drain)


def wait_kv_free(free, slot):
    """Waits until every consumer released the key and the value buffer of ``slot``."""
    plgpu.barrier_wait(free[0].at[slot])
    plgpu.barrier_wait(free[1].at[slot])


def program_ids(heads: tuple[int, ...], windows: tuple[int, ...]):
    """(batch, head, window, warpgroup) of the running program: grid axis "heads" indexes the
    static tuple of heads the call computes."""
    slot = lax.axis_index("heads")
    return (lax.axis_index("batch"), pick(slot, heads), pick(slot, windows),
            lax.axis_index("wg"))


@dataclasses.dataclass(frozen=True)
class WorkList:
    """The tiles of one forward launch, and which program runs which.

    An item is one (head, query tile, batch element). With ``programs`` 0 the launch is a
    grid (head, tile, batch), one item per program, tiles from the last (longest) to the
    first. With ``programs`` P > 0 it is *persistent*: P programs (one per SM) loop over every
    item, the global heads' first (``num_wide``, at the front of ``heads``), then the others.
    Each part runs from the last tile to the first, then head, then batch element (the
    batch-major order of the grid measured worse: a lone global head's long tiles of the last
    batch element start late, H100 run N). Program p takes items p, 2P - 1 - p, 2P + p, ...
    (a snake over rounds of P items, which evens out the long and short tiles). The local
    heads' short tiles fill in behind the global heads' long ones in the same launch, and one
    program's producer prefetches its next tile (Q and key/value blocks) while its consumers
    finish the current one.
    """

    heads: tuple[int, ...]
    windows: tuple[int, ...]
    num_wide: int
    num_tiles: int
    batch: int
    programs: int = 0

    @property
    def size(self) -> int:
        return len(self.heads) * self.num_tiles * self.batch

    @property
    def wide_items(self) -> int:
        return self.num_wide * self.num_tiles * self.batch

    def run(self, body, carry, part: str = "all"):
        """``carry = body((b, head, window, tile), carry)`` over the running program's items:
        "all", or in a persistent launch only the global heads' ("wide") or the others'
        ("narrow"; a program runs all its wide items before its narrow ones)."""
        if not self.programs:
            assert part == "all", part
            slot = lax.axis_index("heads")
            tile = self.num_tiles - 1 - lax.axis_index("tile")
            item = (lax.axis_index("batch"), pick(slot, self.heads), pick(slot, self.windows),
                    tile)
            return body(item, carry)
        p, programs = lax.axis_index("program"), self.programs

        def item_index(r):
            forward = lax.rem(r, jnp.int32(2)) == 0
            return r * programs + jnp.where(forward, p, programs - 1 - p)

        def rounds_below(limit: int):
            """How many of this program's items have an index below ``limit``."""
            if limit == 0:
                return jnp.int32(0)
            rounds = -(-limit // programs)
            return rounds - 1 + (item_index(jnp.int32(rounds - 1)) < limit).astype(jnp.int32)

        lo = rounds_below(self.wide_items) if part == "narrow" else 0
        hi = rounds_below(self.wide_items if part == "wide" else self.size)
        return lax.fori_loop(lo, hi, lambda r, c: body(self.item(item_index(r)), c), carry)

    def item(self, i):
        """(b, head, window, tile) of item ``i`` of the persistent order."""
        wide_items = self.wide_items

        def part(r, first_slot: int, num_heads: int):
            per_tile = jnp.int32(num_heads * self.batch)
            within = lax.rem(r, per_tile)
            return (first_slot + lax.div(within, jnp.int32(self.batch)),
                    lax.rem(within, jnp.int32(self.batch)),
                    self.num_tiles - 1 - lax.div(r, per_tile))

        parts = []
        if self.num_wide:
            parts.append(part(i, 0, self.num_wide))
        if self.num_wide < len(self.heads):
            parts.append(part(jnp.maximum(i - wide_items, 0), self.num_wide,
                              len(self.heads) - self.num_wide))
        slot, b, tile = parts[0] if len(parts) == 1 else (
            jnp.where(i < wide_items, x, y) for x, y in zip(*parts))
        return b, pick(slot, self.heads), pick(slot, self.windows), tile


def tile_union(block_range, tile, block_q: int, block_k: int, window, seq_len: int,
               consumers: int = CONSUMERS, num_blocks: int | None = None):
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


def _is_ref(x) -> bool:
    return isinstance(x, state_types.TransformedRef) or isinstance(
        getattr(x, "aval", None), state_types.AbstractRef)


def tile_iota(rows: int, cols: int, dimension: int):
    """int32 [rows, cols] iota along ``dimension`` in the wgmma accumulator layout."""
    return plgpu.broadcasted_iota(jnp.int32, (rows, cols), dimension,
                                  layout=plgpu.Layout.WGMMA)
