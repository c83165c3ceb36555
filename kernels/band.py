"""The LS band: which (query, key) pairs a head sees, and which blocks of a tiled grid that hits.

This file is the one home of the rule; the reference, the cuDNN composition, both Pallas
backends and their plans use it, and nothing else restates it.

* Element predicate: for a head with window p, query i sees key j iff ``0 <= i - j < p``
  (p keys, the current one included); with segment ids, also iff ``seg[i] == seg[j]``.
* A global head (window ``None``) sees every key j <= i. Where a kernel wants an int, its
  *effective window* is the (padded) sequence length, and any p >= that length is global too.
* Block ranges: with queries cut into blocks of ``block_q`` rows and keys into blocks of
  ``block_k``, which key blocks a query block's band intersects (forward, dQ), which query
  blocks reach a key block (dK/dV), and the sub-ranges whose tiles lie fully inside the band
  (no element mask needed).
* Cache slots: the position a decode cache's slot holds, from the row's length
  (``slot_positions``: the global cache and the ring).

Functions take Python ints or traced int32 scalars (for use inside kernels); ``window`` may be
None (global) or an int.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# The validated form of a window list (``kernels.api.normalize_window_sizes``): one entry per
# query head, an int >= 1 for a local head, None for a global one.
WindowSizes = tuple[int | None, ...]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _max(a, b):
    return max(a, b) if isinstance(a, int) and isinstance(b, int) else jnp.maximum(a, b)


def _min(a, b):
    return min(a, b) if isinstance(a, int) and isinstance(b, int) else jnp.minimum(a, b)


# ---------------------------------------------------------------------------------------------
# Windows


def effective_window(window: int | None, seq_len: int) -> int:
    """The window as an int: a global head (None, or p >= seq_len) sees ``seq_len`` keys."""
    return seq_len if window is None else min(int(window), seq_len)


def effective_windows(window_sizes: WindowSizes, seq_len: int) -> tuple[int, ...]:
    """``effective_window`` of every head (pass the padded length inside a padded kernel)."""
    return tuple(effective_window(p, seq_len) for p in window_sizes)


def window_array(window_sizes: WindowSizes) -> np.ndarray:
    """int32 [H]: each head's window for code that compares positions at run time (the decode
    kernels, the reference's mask); a global head gets int32 max, i.e. it sees every earlier
    position, whatever the length (a symbolic one too)."""
    return np.array(effective_windows(window_sizes, np.iinfo(np.int32).max), np.int32)


def slot_positions(kind: str, length, slot, S: int):
    """int32 position that ``slot`` of an S-slot cache group holds for a row of ``length``
    tokens (-1: empty), under ``kernels.decode.SlotRule`` kind ``kind``: "global" (slot =
    position) or "ring" (the latest position congruent to the slot mod S). Elementwise, so
    the decode kernel computes a block's positions with it in registers."""
    if kind == "global":
        return jnp.where(slot < length, slot, -1)
    last = length - 1
    back = jax.lax.rem(last - slot, jnp.int32(S))  # lax.rem keeps the dividend's sign
    pos = last - jnp.where(back < 0, back + S, back)
    return jnp.where(pos >= 0, pos, -1)


def is_global(window: int | None, seq_len: int) -> bool:
    """True when the head sees every earlier key of a length-``seq_len`` sequence."""
    return window is None or window >= seq_len


# ---------------------------------------------------------------------------------------------
# Element predicate


def allowed(i, j, window, seg_i=None, seg_j=None):
    """bool (broadcast of i, j): query position i sees key position j under ``window`` (an int
    or int array; use ``effective_window`` for a global head) and, given segment ids of the
    query and key positions, only within its own segment."""
    d = i - j
    ok = (d >= 0) & (d < window)
    if seg_i is not None:
        ok = ok & (seg_i == seg_j)
    return ok


def tile_allowed_QxK(q_first, k_first, block_q: int, block_k: int, window, seg_Q1=None,
                     seg_1K=None):
    """bool [block_q, block_k]: ``allowed`` on the tile of queries q_first + r, keys k_first + c.

    seg_Q1 / seg_1K: optional segment ids of the tile's queries / keys, broadcastable to
    [block_q, block_k] (e.g. [block_q, 1] and [1, block_k]).
    """
    i_QxK = q_first + jax.lax.broadcasted_iota(jnp.int32, (block_q, block_k), 0)
    j_QxK = k_first + jax.lax.broadcasted_iota(jnp.int32, (block_q, block_k), 1)
    return allowed(i_QxK, j_QxK, window, seg_Q1, seg_1K)


def tile_allowed_KxQ(q_first, k_first, block_q: int, block_k: int, window, seg_K1=None,
                     seg_1Q=None):
    """bool [block_k, block_q]: the transposed tile (keys on rows), for the dK/dV kernels."""
    j_KxQ = k_first + jax.lax.broadcasted_iota(jnp.int32, (block_k, block_q), 0)
    i_KxQ = q_first + jax.lax.broadcasted_iota(jnp.int32, (block_k, block_q), 1)
    return allowed(i_KxQ, j_KxQ, window, seg_1Q, seg_K1)


# ---------------------------------------------------------------------------------------------
# Block ranges


def kv_block_range(q_block, block_q: int, block_k: int, window, seq_len: int):
    """[first, end) key blocks that intersect the band of query block ``q_block``."""
    q_first = q_block * block_q
    q_last = _min(q_first + block_q, seq_len) - 1
    end = q_last // block_k + 1
    first = 0 if window is None else _max(q_first - window + 1, 0) // block_k
    return first, end


def q_block_range(kv_block, block_q: int, block_k: int, window, seq_len: int):
    """[first, end) query blocks whose band reaches key block ``kv_block``."""
    k_first = kv_block * block_k
    first = k_first // block_q
    if window is None:
        return first, cdiv(seq_len, block_q)
    k_last = _min(k_first + block_k, seq_len) - 1
    return first, _min(k_last + window - 1, seq_len - 1) // block_q + 1


def band_blocks(window: int, block: int) -> int:
    """Blocks a block's band meets on the other side, away from the sequence's start (both
    sides blocks of ``block`` positions): the key blocks of a query block, and as many query
    blocks reach a key block (its last key is seen up to window - 1 rows below it)."""
    return cdiv(window - 1, block) + 1


def kv_full_block_range(q_block, block_q: int, block_k: int, window, seq_len: int):
    """[first, end) key blocks where every (i, j) of the tile is allowed (no element mask).

    The range may be empty (end <= first) and may run past the last block (clamp it to
    ``kv_block_range``). Ignores the tail of the sequence: for a padded sequence pass the
    padded length, since padding keys are never visible to real queries.
    """
    del seq_len  # a global head has no window edge; kept for a signature like the others
    q_first = q_block * block_q
    # every query of the block must see k_first..k_last: k_last <= q_first (causal) and
    # q_last - k_first < window, i.e. k_first >= q_first + block_q - window
    first = 0 if window is None else cdiv(_max(q_first + block_q - window, 0), block_k)
    end = (q_first + 1) // block_k
    return first, end


def q_full_block_range(kv_block, block_q: int, block_k: int, window, seq_len: int):
    """[first, end) query blocks where every (i, j) of the tile is allowed (no element mask).

    The mirror of ``kv_full_block_range`` for the dK/dV loop over query blocks; may be empty
    and may run past the last block (clamp it to ``q_block_range``).
    """
    k_first = kv_block * block_k
    # q_first >= k_last = k_first + block_k - 1, and q_last - k_first < window
    first = cdiv(k_first + block_k - 1, block_q)
    end = cdiv(seq_len, block_q) if window is None else (k_first + window) // block_q
    return first, end


# ---------------------------------------------------------------------------------------------
# Work inside the band


def band_flops(batch: int, seq_len: int, window_sizes, head_dim: int, backward: bool = False) -> float:
    """FLOPs of the work inside the band only (allowed (i, j) pairs), for effective TF/s.

    Forward: 2 matmuls of 2*D flops per allowed pair. Backward adds 5 matmuls-worth (dS, dP
    via dO V^T, dQ, dK, dV recomputing S): the usual 2.5x of forward, so fwd+bwd = 3.5x.
    """
    pairs = 0
    for w in effective_windows(window_sizes, seq_len):
        # rows i < w see i + 1 keys, the rest see w keys
        pairs += w * (w + 1) // 2 + (seq_len - w) * w
    fwd = 4.0 * head_dim * pairs * batch
    return fwd * 3.5 if backward else fwd
