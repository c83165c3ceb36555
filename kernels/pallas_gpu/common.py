"""Numerics and band ranges shared by the Triton and Mosaic GPU kernels.

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

import jax.numpy as jnp

from ls_jax.kernels.band import (kv_block_range, kv_full_block_range, q_block_range,
                                 q_full_block_range)

MASKED_SCORE = -1e30
MAX_FLOOR = -1e20  # far below any real scaled logit, far above MASKED_SCORE * c
LOG2_E = math.log2(math.e)


def triton_block(n: int) -> int:
    """The smallest power of two >= ``n`` and >= 16: Triton's block shapes are powers of two,
    and its dot takes no dimension below 16."""
    return max(16, 1 << max(n - 1, 0).bit_length())


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
