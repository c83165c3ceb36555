"""The static plan of a Pallas TPU attention call: padded geometry, block sizes, work lists,
and the grid plumbing both kernels' pallas_calls share (index maps, scalar tables).

Same style as ``kernels/pallas_gpu/plan.py``: a frozen ``AttentionPlan`` holds everything
static about one call and is built by ``make_plan``; per-kernel work lists are cached
functions of it. Which tiles a list holds comes from ``kernels.band``.

Work lists: one grid axis that enumerates exactly the band's tiles.

Splash attention runs a grid (head, query block, key block) and skips the steps outside the
mask; a skipped step issues no DMA but is still a pipeline step, and with a MultiHeadMask that
mixes local and global heads the key axis keeps its full length T / block_k for every head.
Here the (head, query block, key block) triple is flattened instead: a work list holds, one
entry per grid step, the tile that step computes, and only tiles that intersect the head's band
are listed. A local head with window p therefore costs about ceil(p / block_k) + 1 steps per
query block, a global head the lower triangle, and one pallas_call covers every head.

Two orders of the same tiles:

* row-major (forward, dQ): runs of (query head, query block) rows; within a run the key
  blocks ascend. The output block (head, query block) is the same for the whole run, so it
  stays in VMEM and is written back once, when the run ends.
* column-major (dK/dV): runs of (kv head, key block) columns; within a run, every query head
  of that kv head (GQA) and every query block that reaches the key block.

Each step has a query ``head``, a ``q_block``, a ``k_block`` and ``flags`` (FIRST: first step
of a run, initialise the accumulators; LAST: last step, write the output block; MASKED: the
tile crosses the band's edge, apply the element mask; ACTIVE: compute, cleared on padding
steps). The kernels get them packed in two int32 words per step, passed by scalar prefetch
(SMEM, 8 bytes a step): ``head << 16 | q_block`` and ``flags << 16 | k_block``.

The runs are cut into ``num_chunks`` contiguous chunks of nearly equal length (a leading
"parallel" grid axis, so that a 2-TensorCore chip can split the work even with batch 1);
every chunk is padded to the longest with copies of its own last step with flags 0. A padding
step points at the blocks the chunk already holds, so it starts no DMA, computes nothing, and
writes no output block that another chunk owns.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ls_jax.kernels.band import (WindowSizes, cdiv, effective_windows, is_global,
                                 kv_block_range,
                                 kv_full_block_range, q_block_range, q_full_block_range)
from ls_jax.kernels.platform_call import on_platform

FIRST = 1
LAST = 2
MASKED = 4
ACTIVE = 8

# Scalar prefetch tables live in SMEM (1 MiB on TPU generations up to v6e). Half of it is the
# most one kernel's tables may take; beyond that, use larger blocks.
SMEM_TABLE_BUDGET_BYTES = 512 * 1024
WORDS_PER_STEP = 2
FIELD_BITS = 16  # low half of a word: q_block or k_block; high half: head or flags
FIELD_MASK = (1 << FIELD_BITS) - 1


def unpack_step(row_word, col_word):
    """(head, q_block, k_block, flags) of one step from its two table words (in a kernel or
    index map the words are int32 scalars read from SMEM)."""
    return (row_word >> FIELD_BITS, row_word & FIELD_MASK,
            col_word & FIELD_MASK, col_word >> FIELD_BITS)


@dataclasses.dataclass(frozen=True, eq=False)
class WorkList:
    """The steps of one kernel; every array is int32 [num_chunks, steps_per_chunk]."""

    head: np.ndarray
    q_block: np.ndarray
    k_block: np.ndarray
    flags: np.ndarray

    @property
    def num_chunks(self) -> int:
        return self.head.shape[0]

    @property
    def steps_per_chunk(self) -> int:
        return self.head.shape[1]

    @property
    def grid_steps(self) -> int:
        """Grid steps per batch element (chunks x steps per chunk), padding included."""
        return self.head.size

    @property
    def active_steps(self) -> int:
        """Tiles actually computed per batch element."""
        return int(np.count_nonzero(self.flags & ACTIVE))

    @property
    def smem_bytes(self) -> int:
        return WORDS_PER_STEP * 4 * self.head.size

    def tables(self) -> tuple[np.ndarray, np.ndarray]:
        """The packed int32 tables [num_chunks * steps_per_chunk], in the kernels' scalar
        prefetch order: (head << 16 | q_block, flags << 16 | k_block)."""
        limit = FIELD_MASK >> 1  # keeps the packed words non-negative int32
        for name in ("head", "q_block", "k_block"):
            if getattr(self, name).max() > limit:
                raise ValueError(
                    f"{name}: indices up to {limit} fit the 16-bit fields of the step tables, "
                    f"got {int(getattr(self, name).max())}; use fewer heads or larger blocks")
        rows = (self.head.astype(np.int32) << FIELD_BITS) | self.q_block
        cols = (self.flags.astype(np.int32) << FIELD_BITS) | self.k_block
        return rows.reshape(-1).astype(np.int32), cols.reshape(-1).astype(np.int32)

    def block_fetches(self, which: str, q_heads_per_kv_head: int) -> int:
        """DMAs of one operand per batch element: steps whose block differs from the previous
        step of the same chunk (the pipeline fetches a block only when its index changes).

        which: "q" (blocks of query-side operands: q, dO, lse, ...) or "k" (k, v).
        """
        if which == "q":
            key_CxEx2 = np.stack([self.head, self.q_block], axis=-1)
        elif which == "k":
            key_CxEx2 = np.stack([self.head // q_heads_per_kv_head, self.k_block], axis=-1)
        else:
            raise ValueError(f"which: expected 'q' or 'k', got {which!r}")
        changed_CxE = np.ones(self.head.shape, bool)
        changed_CxE[:, 1:] = np.any(key_CxEx2[:, 1:] != key_CxEx2[:, :-1], axis=-1)
        return int(np.count_nonzero(changed_CxE))


def _runs_to_worklist(runs: list[list[tuple[int, int, int, int]]], num_chunks: int) -> WorkList:
    """Packs runs of (head, q_block, k_block, masked) steps into chunked, padded tables."""
    if not isinstance(num_chunks, int) or num_chunks < 1:
        raise ValueError(f"num_chunks: expected an int >= 1, got {num_chunks!r}")
    num_chunks = min(num_chunks, len(runs))
    run_lengths = np.array([len(r) for r in runs])
    ends = np.cumsum(run_lengths)
    total = int(ends[-1])
    # chunk c ends after the run whose cumulative length is closest to (c + 1) / C of the total
    cuts = [0]
    for c in range(1, num_chunks):
        best = int(np.argmin(np.abs(ends - total * c / num_chunks))) + 1
        lo, hi = cuts[-1] + 1, len(runs) - (num_chunks - c)
        cuts.append(min(max(best, lo), hi))
    cuts.append(len(runs))
    chunks = []
    for c in range(num_chunks):
        steps = []
        for run in runs[cuts[c]:cuts[c + 1]]:
            for n, (h, i, j, masked) in enumerate(run):
                flags = ACTIVE | (MASKED if masked else 0)
                flags |= FIRST if n == 0 else 0
                flags |= LAST if n == len(run) - 1 else 0
                steps.append((h, i, j, flags))
        chunks.append(steps)
    length = max(len(s) for s in chunks)
    table_Cx4xE = np.zeros((num_chunks, 4, length), np.int32)
    for c, steps in enumerate(chunks):
        h, i, j, _ = steps[-1]
        steps = steps + [(h, i, j, 0)] * (length - len(steps))
        table_Cx4xE[c] = np.array(steps, np.int32).T
    arrays = [np.ascontiguousarray(table_Cx4xE[:, t]) for t in range(4)]
    for a in arrays:
        a.flags.writeable = False
    return WorkList(*arrays)


@functools.lru_cache(maxsize=256)
def row_worklist(windows: WindowSizes, seq_len: int, block_q: int, block_k: int,
                 num_chunks: int = 1) -> WorkList:
    """Forward / dQ steps: for each query head and query block, the key blocks of its band.

    windows: ``kernels.band.WindowSizes`` (int >= 1 local, None global); seq_len: the (padded)
    length the blocks tile.
    """
    runs = []
    for h, w in enumerate(windows):
        for i in range(cdiv(seq_len, block_q)):
            first, end = kv_block_range(i, block_q, block_k, w, seq_len)
            full_first, full_end = kv_full_block_range(i, block_q, block_k, w, seq_len)
            runs.append([(h, i, j, not full_first <= j < full_end) for j in range(first, end)])
    return _runs_to_worklist(runs, num_chunks)


@functools.lru_cache(maxsize=256)
def column_worklist(windows: WindowSizes, num_kv_heads: int, seq_len: int, block_q: int, block_k: int,
                    num_chunks: int = 1) -> WorkList:
    """dK/dV steps: for each kv head and key block, every (query head of that kv head, query
    block) tile whose band reaches the key block."""
    group = len(windows) // num_kv_heads
    runs = []
    for kh in range(num_kv_heads):
        for j in range(cdiv(seq_len, block_k)):
            run = []
            for h in range(kh * group, (kh + 1) * group):
                first, end = q_block_range(j, block_q, block_k, windows[h], seq_len)
                full_first, full_end = q_full_block_range(j, block_q, block_k, windows[h],
                                                          seq_len)
                run += [(h, i, j, not full_first <= i < full_end) for i in range(first, end)]
            runs.append(run)
    return _runs_to_worklist(runs, num_chunks)


def default_block_size(windows: WindowSizes, seq_len: int) -> int:
    """One block size for queries and keys: 128 * ceil(p / 128) for the smallest local window
    p < seq_len, clamped to [128, 512] (a local head wastes about block / (block + p) of each
    tile), 512 when every head is global; never more than the sequence rounded up to 128.
    Untuned: no TPU was available to time it."""
    local = [p for p in windows if not is_global(p, seq_len)]
    block = 512 if not local else min(max(128 * cdiv(min(local), 128), 128), 512)
    return min(block, 128 * cdiv(seq_len, 128))


def _check_block(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 128 \
            or value % 128:
        raise ValueError(
            f"{name}: expected a positive multiple of 128 (the TPU lane width), got {value!r}")
    return int(value)


@dataclasses.dataclass(frozen=True)
class AttentionPlan:
    """Everything static about one call: shapes after padding, blocks, per-head windows.

    Query and key sequences are padded to ``seq_len_padded`` (a multiple of both blocks) and
    the head dimension to ``head_dim_padded`` (a multiple of 128) with zeros. Padding keys are
    never visible to real queries (they come after them, and the band is causal); padding
    queries see only their own band and are sliced away.
    """

    seq_len: int
    head_dim: int
    windows: WindowSizes  # per query head: int >= 1 (local) or None (global)
    num_kv_heads: int
    block_q: int
    block_k: int
    scale: float
    has_segments: bool
    logit_stats: bool
    num_chunks: int = 1
    interpret: object = None  # None (compile for TPU), True or a pltpu.InterpretParams

    @property
    def num_q_heads(self) -> int:
        return len(self.windows)

    @property
    def q_heads_per_kv_head(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def seq_len_padded(self) -> int:
        return cdiv(self.seq_len, int(np.lcm(self.block_q, self.block_k))) * int(
            np.lcm(self.block_q, self.block_k))

    @property
    def head_dim_padded(self) -> int:
        return 128 * cdiv(self.head_dim, 128)

    @property
    def num_q_blocks(self) -> int:
        return self.seq_len_padded // self.block_q

    def window_table(self) -> np.ndarray:
        """int32 [H]: each head's effective window over the padded length."""
        return np.array(effective_windows(self.windows, self.seq_len_padded), np.int32)

    def forward_worklist(self) -> WorkList:
        """Also the dQ kernel's: same tiles, same row-major order."""
        return row_worklist(self.windows, self.seq_len_padded, self.block_q, self.block_k,
                            self.num_chunks)

    def dkdv_worklist(self) -> WorkList:
        return column_worklist(self.windows, self.num_kv_heads, self.seq_len_padded,
                               self.block_q, self.block_k, self.num_chunks)


def make_plan(*, seq_len: int, head_dim: int, windows: WindowSizes, num_kv_heads: int,
              scale: float, has_segments: bool, logit_stats: bool, block_q=None,
              block_k=None, num_chunks: int = 1, interpret=None) -> AttentionPlan:
    """Validates the tunables, fills in default blocks and checks the tables fit in SMEM.

    With both blocks left to the default, a plan whose tables would not fit doubles its
    blocks until they do (long sequences with many global heads).
    """
    auto = block_q is None and block_k is None
    default = default_block_size(windows, seq_len)
    block_q = default if block_q is None else _check_block("block_q", block_q)
    block_k = default if block_k is None else _check_block("block_k", block_k)
    if isinstance(num_chunks, bool) or not isinstance(num_chunks, int) or num_chunks < 1:
        raise ValueError(f"num_chunks: expected an int >= 1, got {num_chunks!r}")
    while True:
        plan = AttentionPlan(seq_len=seq_len, head_dim=head_dim, windows=tuple(windows),
                             num_kv_heads=num_kv_heads, block_q=block_q, block_k=block_k,
                             scale=float(scale), has_segments=has_segments,
                             logit_stats=logit_stats, num_chunks=num_chunks,
                             interpret=interpret)
        too_big = [(name, wl) for name, wl in (("forward/dQ", plan.forward_worklist()),
                                               ("dK/dV", plan.dkdv_worklist()))
                   if wl.smem_bytes > SMEM_TABLE_BUDGET_BYTES]
        if not too_big:
            return plan
        if not auto or block_q >= seq_len:
            name, wl = too_big[0]
            raise ValueError(
                f"block_q/block_k: the {name} work list of {wl.grid_steps} steps needs "
                f"{wl.smem_bytes} bytes of SMEM tables, more than the "
                f"{SMEM_TABLE_BUDGET_BYTES} allowed; use larger blocks (got "
                f"block_q={block_q}, block_k={block_k}, T={seq_len})")
        block_q = block_k = 2 * block_q


def step_counts(windows: WindowSizes, num_kv_heads: int, seq_len: int, block_q: int,
                block_k: int, num_chunks: int = 1) -> dict[str, int]:
    """Structural cost of the three kernels per batch element, from the work lists (no kernel
    runs): grid steps, computed tiles, and DMAs of k (a block is fetched only when its index
    changes from one step to the next). ``seq_len`` is padded to a multiple of both blocks."""
    lcm = int(np.lcm(block_q, block_k))
    seq_len = cdiv(seq_len, lcm) * lcm
    windows = tuple(windows)
    rows = row_worklist(windows, seq_len, block_q, block_k, num_chunks)
    cols = column_worklist(windows, num_kv_heads, seq_len, block_q, block_k, num_chunks)
    return {
        "fwd_grid_steps": rows.grid_steps,
        "fwd_computed_tiles": rows.active_steps,
        "fwd_k_fetches": rows.block_fetches("k", len(windows) // num_kv_heads),
        "dq_grid_steps": rows.grid_steps,
        "dkv_grid_steps": cols.grid_steps,
        "bwd_grid_steps": rows.grid_steps + cols.grid_steps,
    }


# ---------------------------------------------------------------------------------------------
# Grid plumbing shared by the forward and backward pallas_calls.
#
# Grid (batch * chunk, step): the leading "parallel" axis enumerates (batch b, chunk c) as
# b * num_chunks + c, and step s of chunk c computes the tile listed at c * steps_per_chunk + s
# of the scalar-prefetch tables. The BlockSpec index maps read the same tables, so the
# pipeline DMAs exactly the blocks of the listed tiles.

NUM_TABLES = 3  # packed steps (head | q_block, flags | k_block), window per query head


def _div(x, n: int):
    """x // n for a non-negative int32 scalar x (a grid index or table entry): the constant
    takes x's dtype, so the division is int32 also under ``jax_enable_x64``."""
    return jax.lax.div(x, jnp.asarray(n, x.dtype))


def batch_and_chunk(g, num_chunks: int):
    """(batch, chunk) of the leading grid index g = batch * num_chunks + chunk."""
    if num_chunks == 1:
        return g, 0
    return _div(g, num_chunks), jax.lax.rem(g, jnp.asarray(num_chunks, g.dtype))


def index_maps(plan: AttentionPlan, worklist: WorkList) -> dict:
    """BlockSpec index maps over grid (batch * chunk, step) reading the prefetched tables."""
    group = plan.q_heads_per_kv_head
    num_chunks, steps_per_chunk = worklist.num_chunks, worklist.steps_per_chunk
    zero = np.int32(0)  # a block index the maps return as int32 also under jax_enable_x64

    def locate(g, s, rows, cols):
        b, c = batch_and_chunk(g, num_chunks)
        step = c * steps_per_chunk + s
        return (b, *unpack_step(rows[step], cols[step])[:3])

    def q_rows(g, s, rows, cols, window):  # [B, H, T, D] blocks of query rows
        b, head, qb, _ = locate(g, s, rows, cols)
        return b, head, qb, zero

    def kv_rows(g, s, rows, cols, window):  # [B, G, T, D] blocks of key rows
        b, head, _, kb = locate(g, s, rows, cols)
        return b, _div(head, group), kb, zero

    def q_row_vector(g, s, rows, cols, window):  # [B, H, 1, T] per-query statistics
        b, head, qb, _ = locate(g, s, rows, cols)
        return b, head, zero, qb

    def q_seg_lanes(g, s, rows, cols, window):  # [B, T, 128]
        b, _, qb, _ = locate(g, s, rows, cols)
        return b, qb, zero

    def q_seg_sublanes(g, s, rows, cols, window):  # [B, 8, T]
        b, _, qb, _ = locate(g, s, rows, cols)
        return b, zero, qb

    def k_seg_lanes(g, s, rows, cols, window):  # [B, T, 128]
        b, _, _, kb = locate(g, s, rows, cols)
        return b, kb, zero

    def k_seg_sublanes(g, s, rows, cols, window):  # [B, 8, T]
        b, _, _, kb = locate(g, s, rows, cols)
        return b, zero, kb

    def q_block_stat(g, s, rows, cols, window):  # [B, H, nq * 8, 128]
        b, head, qb, _ = locate(g, s, rows, cols)
        return b, head, qb, zero

    return dict(q_rows=q_rows, kv_rows=kv_rows, q_row_vector=q_row_vector,
                q_seg_lanes=q_seg_lanes, q_seg_sublanes=q_seg_sublanes,
                k_seg_lanes=k_seg_lanes, k_seg_sublanes=k_seg_sublanes,
                q_block_stat=q_block_stat)


def worklist_call(kernel, plan: AttentionPlan, worklist: WorkList, *, in_specs, out_specs,
                  out_shape, scratch_shapes, matmuls_per_tile: int, name: str):
    """The pallas_call of ``kernel(rows_ref, cols_ref, window_ref, *refs, plan, num_chunks)``
    over ``worklist``; call the result with the operands (the tables are prepended).

    Its cost estimate, for XLA's scheduling and cost analysis: ``matmuls_per_tile`` products
    of [block, D_pad] x [D_pad, block] and one exponential per element on each computed tile,
    and every operand read and output written once (a lower bound on the bytes).

    Every operand and output has the batch first (``out_shape`` gives it for the operands'
    batch), and the grid's leading axis enumerates batch x chunk. Under ``jax.vmap`` the
    mapped axis joins the batch (one call over the larger batch) instead of going through
    Pallas' batching rule, which prepends a grid axis without extending
    ``dimension_semantics``.
    """
    tables = [jnp.asarray(t) for t in worklist.tables()] + [jnp.asarray(plan.window_table())]
    body = functools.partial(kernel, plan=plan, num_chunks=worklist.num_chunks)
    params = pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"))

    @jax.custom_batching.custom_vmap
    def call(*operands):
        batch = operands[0].shape[0]
        grid_spec = pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=NUM_TABLES,
            grid=(batch * worklist.num_chunks, worklist.steps_per_chunk),
            in_specs=in_specs, out_specs=out_specs, scratch_shapes=scratch_shapes)
        shapes = jax.tree.map(lambda s: jax.ShapeDtypeStruct((batch, *s.shape[1:]), s.dtype),
                              out_shape)
        tile = plan.block_q * plan.block_k
        tiles = batch * worklist.active_steps
        cost = None  # a symbolic batch (jax.export): no estimate, whose fields are ints
        if isinstance(batch, int):
            cost = pl.CostEstimate(
                flops=tiles * matmuls_per_tile * 2 * tile * plan.head_dim_padded,
                transcendentals=tiles * tile,
                bytes_accessed=sum(x.size * x.dtype.itemsize
                                   for x in (*operands, *jax.tree.leaves(shapes))))
        return on_platform("tpu", pl.pallas_call(body, grid_spec=grid_spec, out_shape=shapes,
                              compiler_params=params, cost_estimate=cost,
                              interpret=False if plan.interpret is None else plan.interpret,
                              name=name))(*tables, *operands)

    @call.def_vmap
    def _call_vmapped(axis_size, in_batched, *operands):
        operands = [x if mapped else jnp.broadcast_to(x, (axis_size, *x.shape))
                    for x, mapped in zip(operands, in_batched)]
        outs = call(*(x.reshape(-1, *x.shape[2:]) for x in operands))
        outs = jax.tree.map(lambda y: y.reshape(axis_size, -1, *y.shape[1:]), outs)
        return outs, jax.tree.map(lambda _: True, outs)

    return call
