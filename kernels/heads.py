"""Heads taken out of and put back into [B, T, H, D] arrays as runs of consecutive heads.

A group of heads (the global ones, the heads of one window) is taken as slices of its runs
and one concatenate, never a gather: XLA's gather, and the scatter-add that is its transpose
in the backward, cost far more than a copy (H100, run S: one cuDNN call over all 16 heads
behind a gather of q, k, v took 5.84 ms forward+backward against 4.89 ms without it, n=8192,
D=64). A group of every head in order is the array itself. Used by the cuDNN composition
(``kernels/cudnn.py``), "split" (``kernels/split.py``), the Pallas GPU backward's delta pass
(``kernels/pallas_gpu/backward.py``) and the KV-cache attention path (``ls_jax/attention.py``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["head_runs", "kv_for_heads", "merge_heads", "take_heads"]


def head_runs(indices) -> list[tuple[int, int]]:
    """[(start, stop)] maximal runs of consecutive values in ``indices``, in order."""
    runs: list[tuple[int, int]] = []
    for i in indices:
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def take_heads(x_BxTxNxD, heads, axis: int = 2):
    """x's heads ``heads`` (in that order) along ``axis``: slices of runs, one concatenate
    (no heads: an empty slice)."""
    if list(heads) == list(range(x_BxTxNxD.shape[axis])):
        return x_BxTxNxD
    if not len(heads):
        return jax.lax.slice_in_dim(x_BxTxNxD, 0, 0, axis=axis)
    parts = [jax.lax.slice_in_dim(x_BxTxNxD, a, b, axis=axis) for a, b in head_runs(heads)]
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=axis)


def merge_heads(parts, heads_of_parts, axis: int = 2):
    """The inverse of taking ``heads_of_parts[i]`` into ``parts[i]``: every head back at its
    place along ``axis``, as one concatenate of runs (slices of the parts)."""
    where = {}
    for i, heads in enumerate(heads_of_parts):
        for pos, h in enumerate(heads):
            where[h] = (i, pos)
    pieces: list[tuple[int, int, int]] = []  # (part, first position, stop position)
    for h in range(len(where)):
        i, pos = where[h]
        if pieces and pieces[-1][0] == i and pieces[-1][2] == pos:
            pieces[-1] = (i, pieces[-1][1], pos + 1)
        else:
            pieces.append((i, pos, pos + 1))
    out = [parts[i] if (a, b) == (0, parts[i].shape[axis])
           else jax.lax.slice_in_dim(parts[i], a, b, axis=axis) for i, a, b in pieces]
    return out[0] if len(out) == 1 else jnp.concatenate(out, axis=axis)


def kv_for_heads(k, v, heads, num_q_heads: int):
    """(k, v) for the query heads ``heads`` (in order) of a call with ``num_q_heads`` query
    heads: their kv groups kept whole where each touched kv head serves the same number of
    ``heads`` (the part runs as GQA), else one kv head per query head (a kv head shared
    unevenly is no GQA layout; the ``repeat_kv`` expansion restricted to ``heads``). Autodiff
    sums the gradients of kv heads that several parts read."""
    group = num_q_heads // k.shape[2]
    kv_of = [h // group for h in heads]
    touched = sorted(set(kv_of))
    counts = {g: kv_of.count(g) for g in touched}
    if len(set(counts.values())) == 1:
        kv_heads = touched  # heads in order, so head i of the part reads touched[i // count]
    else:
        kv_heads = kv_of
    return take_heads(k, kv_heads), take_heads(v, kv_heads)
