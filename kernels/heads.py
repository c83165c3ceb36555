"""Heads of a call: which are global and which local (``split_heads``, the one place that
decides it), how many query heads share a kv head (``kv_group_size``, the one check of a
head count), and taking groups of heads out of and back into [B, T, H, D] arrays.

A group of heads (the global ones, the heads of one window) is taken as slices of its runs
and one concatenate, never a gather: XLA's gather, and the scatter-add that is its transpose
in the backward, cost far more than a copy. A group of every head in order is the array
itself. Used by the cuDNN composition (``kernels/cudnn.py``), "split"
(``kernels/split.py``), the Pallas GPU kernels and the KV cache (``ls_jax/layers/kv_cache.py``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ls_jax.kernels.band import WindowSizes, is_global

__all__ = ["HeadSplit", "head_runs", "kv_for_heads", "kv_group_size", "merge_heads",
           "split_heads", "take_heads"]


def kv_group_size(num_heads, num_kv_heads, *, arg: str = "n_kv_head",
                  heads_arg: str = "n_head") -> int:
    """Query heads per kv head (GQA: query head h reads kv head h // group). ValueError naming
    ``arg`` unless ``num_kv_heads`` is an int that divides ``num_heads``; the check of every
    layer, cache and kernel entry point."""
    if (isinstance(num_kv_heads, bool) or not isinstance(num_kv_heads, (int, np.integer))
            or num_kv_heads < 1 or num_heads % num_kv_heads):
        raise ValueError(f"{arg}: expected a divisor of {heads_arg}={num_heads}, "
                         f"got {num_kv_heads!r}")
    return num_heads // num_kv_heads


@dataclasses.dataclass(frozen=True)
class HeadSplit:
    """A call's query heads split into global ones (they see every earlier key) and local ones
    (a window shorter than that), each in head order; ``split_heads`` makes it."""

    windows: WindowSizes
    global_heads: tuple[int, ...]
    local_heads: tuple[int, ...]

    def local_groups(self) -> tuple[tuple[int, tuple[int, ...]], ...]:
        """((window, its local heads), ...): one entry per distinct local window, in the order
        of its first head."""
        groups: dict[int, list[int]] = {}
        for h in self.local_heads:
            groups.setdefault(self.windows[h], []).append(h)
        return tuple((p, tuple(heads)) for p, heads in groups.items())

    def kv_split(self, num_kv_heads: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(global kv heads, local kv heads): a kv head is global when any of its query heads
        is (it must keep every key), local when all of them are."""
        group = kv_group_size(len(self.windows), num_kv_heads)
        global_kv = tuple(sorted({h // group for h in self.global_heads}))
        return global_kv, tuple(g for g in range(num_kv_heads) if g not in global_kv)


def split_heads(window_sizes: WindowSizes, seq_len: int | None = None) -> HeadSplit:
    """The global/local split of heads with these windows (validated: int >= 1 or None): a
    head is global when its window is None or, given ``seq_len``, at least that long."""
    glob = tuple(h for h, p in enumerate(window_sizes)
                 if p is None or (seq_len is not None and is_global(p, seq_len)))
    local = tuple(h for h in range(len(window_sizes)) if h not in glob)
    return HeadSplit(tuple(window_sizes), glob, local)


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


def head_span(heads) -> str:
    """"0-15" for a run of consecutive heads, else "0,2,5" (plans and messages)."""
    heads = tuple(heads)
    if len(heads) > 1 and heads == tuple(range(heads[0], heads[-1] + 1)):
        return f"{heads[0]}-{heads[-1]}"
    return ",".join(map(str, heads))
