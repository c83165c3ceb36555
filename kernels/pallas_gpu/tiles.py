"""In-kernel pieces shared by the Pallas GPU forward and backward kernels.

The kernels keep the raw dot products ``q . k`` and apply ``c = scale * log2(e)`` inside
``exp2`` (``exp2(s * c - m * c)`` is one FMA and one MUFU op per element); the saved
logsumexp is base 2 (``lse2 = lse * log2(e)``). A key the query may not see gets the finite
score ``MASKED_SCORE``, and the scaled running max a row's exponents are taken against is
floored at ``MAX_FLOOR``: so a masked entry gives ``exp2(MASKED_SCORE * c - max) = 0`` exactly,
also while the row has seen only masked keys (without the floor, an FMA's rounding of two
huge equal terms can leave +-1e22 in the exponent). ``MASKED_SCORE * c`` stays finite for any
c up to ~1e8. Every real query row sees at least its own key, so no row ends with only masked
scores.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ls_jax.kernels.band import (kv_block_range, kv_full_block_range, q_block_range,
                                 q_full_block_range, tile_allowed_KxQ, tile_allowed_QxK)
from ls_jax.kernels.pallas_gpu.plan import LOOP_MODES, ClassPaths

MASKED_SCORE = -1e30
MAX_FLOOR = -1e20  # far below any real scaled logit, far above MASKED_SCORE * c
LOG2_E = math.log2(math.e)


def clamp(x, lo, hi):
    return jnp.minimum(jnp.maximum(x, lo), hi)


def split_kv_loop(q_block, block_q: int, block_k: int, window, seq_len: int):
    """Three consecutive key-block ranges [first, lo), [lo, hi), [hi, end) of one query block.

    The middle one holds only tiles fully inside the band (no element mask); the outer two
    hold the boundary tiles (window edge in front, diagonal at the back). Together they are
    exactly the key blocks that intersect the band, so nothing outside it is loaded.
    """
    first, end = kv_block_range(q_block, block_q, block_k, window, seq_len)
    full_first, full_end = kv_full_block_range(q_block, block_q, block_k, window, seq_len)
    lo = clamp(full_first, first, end)
    hi = clamp(full_end, lo, end)
    return first, lo, hi, end


def split_q_loop(kv_block, block_q: int, block_k: int, window, seq_len: int):
    """Three consecutive query-block ranges of one key block (dK/dV): the front one holds the
    diagonal tiles, the middle one the tiles fully inside the band, the back one the window
    edge. Together they are exactly the query blocks whose band reaches the key block."""
    first, end = q_block_range(kv_block, block_q, block_k, window, seq_len)
    full_first, full_end = q_full_block_range(kv_block, block_q, block_k, window, seq_len)
    lo = clamp(full_first, first, end)
    hi = clamp(full_end, lo, end)
    return first, lo, hi, end


def allowed_QxK(q_first, k_first, block_q: int, block_k: int, window, segment_ref=None,
                batch=None):
    """bool [block_q, block_k]: the band (``kernels.band``) and, with a segment-id ref
    [B, T], the same segment."""
    seg_Q1 = seg_1K = None
    if segment_ref is not None:
        seg_Q1 = segment_ref[batch, pl.ds(q_first, block_q)][:, None]
        seg_1K = segment_ref[batch, pl.ds(k_first, block_k)][None, :]
    return tile_allowed_QxK(q_first, k_first, block_q, block_k, window, seg_Q1, seg_1K)


def allowed_KxQ(q_first, k_first, block_q: int, block_k: int, window, segment_ref=None,
                batch=None):
    """bool [block_k, block_q]: the transpose of ``allowed_QxK`` (for the dK/dV tiles)."""
    seg_K1 = seg_1Q = None
    if segment_ref is not None:
        seg_K1 = segment_ref[batch, pl.ds(k_first, block_k)][:, None]
        seg_1Q = segment_ref[batch, pl.ds(q_first, block_q)][None, :]
    return tile_allowed_KxQ(q_first, k_first, block_q, block_k, window, seg_K1, seg_1Q)


def mask_scores(s, ok_fn, masking):
    """Applies the element mask ``ok_fn()`` to scores ``s`` as ``masking`` says.

    masking: "none" (interior tile), "always" (boundary tile), or a traced bool scalar that
    says at run time whether this tile needs the mask (one loop over all tiles).
    """
    if isinstance(masking, str):
        if masking == "none":
            return s
        return jnp.where(ok_fn(), s, MASKED_SCORE)
    return jax.lax.cond(masking, lambda x: jnp.where(ok_fn(), x, MASKED_SCORE),
                        lambda x: x, s)


def run_band_loop(first, lo, hi, end, tile, carry, mode: str):
    """Runs ``carry = tile(j, carry, masking)`` for j in [first, end).

    [lo, hi) are the interior tiles (no element mask). mode "split": three loops, masks
    compiled only into the outer two; "cond": one loop, the mask behind a run-time branch
    (one software pipeline for short loops); "masked": one loop, every tile masked (needed
    when a segment mask applies everywhere).
    """
    if mode == "masked":
        return jax.lax.fori_loop(first, end, lambda j, c: tile(j, c, "always"), carry)
    if mode == "cond":
        return jax.lax.fori_loop(
            first, end, lambda j, c: tile(j, c, (j < lo) | (j >= hi)), carry)
    if mode != "split":
        raise ValueError(f"loop mode: expected one of {LOOP_MODES}, got {mode!r}")
    carry = jax.lax.fori_loop(first, lo, lambda j, c: tile(j, c, "always"), carry)
    carry = jax.lax.fori_loop(lo, hi, lambda j, c: tile(j, c, "none"), carry)
    return jax.lax.fori_loop(hi, end, lambda j, c: tile(j, c, "always"), carry)


def run_by_class(head_class, paths: ClassPaths, one_block):
    """Calls ``one_block(path)`` with the path of class ``head_class`` (a traced int32),
    branching at run time only when both classes are present."""
    if paths.narrow is None:
        one_block(paths.wide)
    elif paths.wide is None:
        one_block(paths.narrow)
    else:
        jax.lax.cond(head_class == 0, lambda: one_block(paths.wide),
                     lambda: one_block(paths.narrow))
