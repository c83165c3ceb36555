"""Block geometry of the LS band, shared by the Pallas kernels (and their structural tests).

Head h with window p lets query i see keys j with max(0, i - p + 1) <= j <= i; a global head
has p = None (equivalently p >= T). With queries cut into blocks of ``block_q`` and keys into
blocks of ``block_k``, these functions say which key blocks a query block must visit (forward,
dQ) and which query blocks reach a key block (dK/dV). They take Python ints or traced int32
scalars (for use inside kernels); ``window`` may be None (global) or an int.
"""

from __future__ import annotations

import jax.numpy as jnp


def _max(a, b):
    return max(a, b) if isinstance(a, int) and isinstance(b, int) else jnp.maximum(a, b)


def _min(a, b):
    return min(a, b) if isinstance(a, int) and isinstance(b, int) else jnp.minimum(a, b)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


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


def block_fully_inside(q_block, kv_block, block_q: int, block_k: int, window, seq_len: int):
    """True when every (i, j) of the tile is allowed and in range, so no element mask is needed."""
    q_first = q_block * block_q
    q_last = q_first + block_q - 1
    k_first = kv_block * block_k
    k_last = k_first + block_k - 1
    inside = (k_last <= q_first) & (q_last < seq_len) & (k_last < seq_len)
    if window is not None:
        inside = inside & (q_last - k_first < window)
    return inside


def max_kv_blocks(block_q: int, block_k: int, window, seq_len: int) -> int:
    """Most key blocks any query block of this head visits (the length of a shrunken grid)."""
    n_q = cdiv(seq_len, block_q)
    return max(kv_block_range(i, block_q, block_k, window, seq_len)[1]
               - kv_block_range(i, block_q, block_k, window, seq_len)[0] for i in range(n_q))


def max_q_blocks(block_q: int, block_k: int, window, seq_len: int) -> int:
    """Most query blocks that reach any key block of this head."""
    n_k = cdiv(seq_len, block_k)
    return max(q_block_range(j, block_q, block_k, window, seq_len)[1]
               - q_block_range(j, block_q, block_k, window, seq_len)[0] for j in range(n_k))


def band_flops(batch: int, seq_len: int, window_sizes, head_dim: int, backward: bool = False) -> float:
    """FLOPs of the work inside the band only (allowed (i, j) pairs), for effective TF/s.

    Forward: 2 matmuls of 2*D flops per allowed pair. Backward adds 5 matmuls-worth (dS, dP
    via dO V^T, dQ, dK, dV recomputing S): the usual 2.5x of forward, so fwd+bwd = 3.5x.
    """
    pairs = 0
    for p in window_sizes:
        w = seq_len if p is None else min(p, seq_len)
        # rows i < w see i + 1 keys, the rest see w keys
        pairs += w * (w + 1) // 2 + (seq_len - w) * w
    fwd = 4.0 * head_dim * pairs * batch
    return fwd * 3.5 if backward else fwd


def kv_full_block_range(q_block, block_q: int, block_k: int, window, seq_len: int):
    """[first, end) key blocks where every (i, j) of the tile is allowed (no element mask).

    The range may be empty (end <= first). Ignores the tail of the sequence: for a padded
    sequence pass the padded length, since padding keys are never visible to real queries.
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

    The mirror of ``kv_full_block_range`` for the dK/dV loop over query blocks; may be empty.
    """
    k_first = kv_block * block_k
    # q_first >= k_last = k_first + block_k - 1, and q_last - k_first < window
    first = cdiv(k_first + block_k - 1, block_q)
    end = cdiv(seq_len, block_q) if window is None else (k_first + window) // block_q
    return first, end
