"""In-kernel pieces shared by the Pallas TPU forward and backward kernels.

TPU layout rules followed here: a block's last two dimensions are multiples of (8, 128) or the
whole array dimension; per-row statistics (running max, sum) are kept replicated over the 128
lanes, shape [rows, 128], and widened with ``jnp.tile`` (so block sizes and the padded head
dimension are multiples of 128). Segment ids come in two broadcast layouts: "lanes" [T, 128]
(one id per row, for the operand on the sublane axis of a tile) and "sublanes" [8, T] (one id
per column, for the operand on the lane axis).

A masked logit becomes the finite ``MASK_VALUE``; its probability is set to 0 explicitly, so a
row whose first tiles are all masked keeps a zero sum and accumulator until its first real key
(every real query sees at least its own key).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from ls_jax.kernels.band import tile_allowed_KxQ, tile_allowed_QxK
from ls_jax.kernels.pallas_tpu.plan import ACTIVE, MASKED, batch_and_chunk

NUM_LANES = 128
NUM_SUBLANES = 8
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)

# contract the last dimension of both operands: a [m, d] x b [n, d] -> [m, n]
NT_DIMS = (((1,), (1,)), ((), ()))


def widen(x_Nx128: jax.Array, width: int) -> jax.Array:
    """[N, 128] lane-replicated statistic -> [N, width] (width a multiple of 128)."""
    repeats, rem = divmod(width, NUM_LANES)
    if rem:
        raise ValueError(f"width: expected a multiple of {NUM_LANES}, got {width}")
    return x_Nx128 if repeats == 1 else jnp.tile(x_Nx128, (1, repeats))


def segment_mask(rows_seg_Nx128: jax.Array, cols_seg_8xM: jax.Array) -> jax.Array:
    """bool [N, M]: same segment, from a lanes-layout block (rows) and a sublanes-layout block
    (columns)."""
    cols = cols_seg_8xM.shape[1]
    return widen(rows_seg_Nx128, cols) == cols_seg_8xM[:1, :]


def where(mask, x, fill: float):
    """``jnp.where(mask, x, fill)`` with ``fill`` in x's dtype: a Python float would enter the
    kernel as float64 under ``jax_enable_x64``, which Mosaic cannot lower."""
    return jnp.where(mask, x, jnp.asarray(fill, x.dtype))


def tile_mask(band_mask, rows_seg_ref, cols_seg_ref):
    """A tile's mask: its band mask (None for an interior tile) and, with segment ids, the
    same-segment mask; None when every pair of the tile is allowed."""
    if rows_seg_ref is None:
        return band_mask
    same = segment_mask(rows_seg_ref[...], cols_seg_ref[...])
    return same if band_mask is None else band_mask & same


def band_mask_QxK(band_edge: bool, q_block, k_block, block_q: int, block_k: int, window):
    """bool [block_q, block_k] band mask (``kernels.band``) of a band-edge tile; None for a
    tile inside the band."""
    if not band_edge:
        return None
    return tile_allowed_QxK(q_block * block_q, k_block * block_k, block_q, block_k, window)


def band_mask_KxQ(band_edge: bool, q_block, k_block, block_q: int, block_k: int, window):
    """The transposed tile (keys on rows) of ``band_mask_QxK``, for the dK/dV kernel."""
    if not band_edge:
        return None
    return tile_allowed_KxQ(q_block * block_q, k_block * block_k, block_q, block_k, window)


def max_abs_1x1(x_QxK: jax.Array) -> jax.Array:
    """float32 [1, 1]: max |x| (x already zeroed outside the allowed pairs)."""
    return jnp.max(jnp.max(jnp.abs(x_QxK), axis=1, keepdims=True), axis=0, keepdims=True)


def run_tile(flags, tile) -> None:
    """Runs ``tile(band_edge)`` on an active work-list step: the masked variant on band-edge
    tiles, the unmasked fast path on tiles inside the band."""
    active = (flags & ACTIVE) != 0
    edge = (flags & MASKED) != 0
    pl.when(active & edge)(lambda: tile(True))
    pl.when(active & jnp.logical_not(edge))(lambda: tile(False))


def step_index(num_chunks: int):
    """Inside a kernel: the current step's position in the flattened work-list tables."""
    _, c = batch_and_chunk(pl.program_id(0), num_chunks)
    return c * pl.num_programs(1) + pl.program_id(1)
