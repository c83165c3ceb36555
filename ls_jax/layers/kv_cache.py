"""The key/value cache of LS-attention decoding: full history for global heads, a ring buffer
of exactly the window for local heads.

Which kv heads are global. Query head h reads kv head h // (Hq // Hkv) (GQA). A kv head is
*global* when at least one of its query heads is global (window None); it keeps the whole
history, ``[B, T_max, n_global_kv, D]``, slot s = position s. Its local query heads (a layout
such as 1 global head with GQA groups of 2) read it through their window mask. A kv head all
of whose query heads are local is *local*; it keeps a ring buffer of ``P = min(max window of
its query heads, T_max)`` slots, ``[B, P, n_local_kv, D]``: slot s holds the latest position
congruent to s mod P. A window of p keys includes the current one, so P = p slots suffice.

Per row the cache records ``lengths_B``: the number of positions written (the next position
is ``lengths_B[b]``). Slot positions follow from it (``kernels.decode``'s ``SlotRule``:
``global_positions``, ``ring_positions``); slots not yet written have position -1. Shapes
are static; the cache is a pytree of arrays (``KVCache``), bf16 unless asked otherwise.
Every layer of a model has the same layout, so each array holds every layer's cache along a
leading axis L: the blocks' scan reads and writes layer l of it in place (the decode kernel
takes the layer index).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ls_jax.kernels.decode import CacheGroup, SlotRule, ring_positions
from ls_jax.kernels.heads import kv_group_size, split_heads, take_heads


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    """Static split of one layer's heads into the global cache and the ring buffer.

    global_kv / local_kv: kv head indices of each group (in order).
    q_order: query heads sorted by group: those of global kv heads, then those of local ones
      (within a group the r = Hq // Hkv query heads of one kv head stay together, so the group
      is itself a GQA layout).
    global_windows / local_windows: the windows of those query heads, in q_order.
    ring_window: the largest window of the local query heads (0 without local kv heads); a
      cache of T_max positions gives the ring ``ring_size(T_max)`` slots.

    One layout per layer, built once from the layer's validated arguments (``LSAttention``);
    nothing on the decoding path builds or checks it again.
    """

    n_head: int
    n_kv_head: int
    global_kv: tuple[int, ...]
    local_kv: tuple[int, ...]
    q_order: tuple[int, ...]
    global_windows: tuple[int | None, ...]
    local_windows: tuple[int, ...]
    ring_window: int

    @classmethod
    def build(cls, windows: tuple[int | None, ...], n_head: int, n_kv_head: int) -> "CacheLayout":
        """The layout of a layer's per-head ``windows`` (normalised: one int >= 1 or None per
        query head) over ``n_kv_head`` kv heads."""
        r = kv_group_size(n_head, n_kv_head)
        global_kv, local_kv = split_heads(windows).kv_split(n_kv_head)
        q_global = tuple(h for g in global_kv for h in range(g * r, (g + 1) * r))
        q_local = tuple(h for g in local_kv for h in range(g * r, (g + 1) * r))
        ring = max(windows[h] for h in q_local) if q_local else 0
        return cls(n_head, n_kv_head, global_kv, local_kv, q_global + q_local,
                   tuple(windows[h] for h in q_global), tuple(windows[h] for h in q_local), ring)

    def ring_size(self, max_len: int) -> int:
        """P, slots of the ring buffer in a cache of ``max_len`` positions."""
        return min(self.ring_window, max_len)

    @property
    def q_inverse(self) -> tuple[int, ...]:
        """Permutation taking q_order back to head order."""
        return tuple(int(i) for i in np.argsort(np.array(self.q_order)))


class CacheStep(NamedTuple):
    """What a layer's call that reads and writes its cache needs besides the new tokens and
    their positions (``Transformer.decode`` makes one per call, shared by every layer).

    old_lengths_B / new_lengths_B: positions held per row before / after the call (tokens at
      positions >= new_lengths_B are padding: written nowhere a later query reads).
    fresh: the cache is empty and the tokens sit at positions 0 .. C-1 in every row (the
      first prefill chunk).
    decode_implementation: the ``kernels.decode.cached_attention`` backend (None: "xla").
    """

    old_lengths_B: jax.Array
    new_lengths_B: jax.Array
    fresh: bool = False
    decode_implementation: str | None = None


class KVCache(NamedTuple):
    """Every layer's cache: k/v of the global kv heads [L, B, T_max, Gg, D], the rings
    [L, B, P, Gl, D], and the positions written per row."""

    k_global: jax.Array
    v_global: jax.Array
    k_local: jax.Array
    v_local: jax.Array
    lengths_B: jax.Array  # int32 [B]: positions written per row

    @property
    def max_len(self) -> int:
        return self.k_global.shape[2]

    @property
    def num_layers(self) -> int:
        return self.k_global.shape[0]

    def arrays(self) -> tuple[jax.Array, ...]:
        """The k/v arrays."""
        return (self.k_global, self.v_global, self.k_local, self.v_local)

    def nbytes(self) -> int:
        """Bytes of the k/v arrays as allocated."""
        return sum(x.size * x.dtype.itemsize for x in self.arrays())


def init_cache(layout: CacheLayout, num_layers: int, batch_size: int, max_len: int,
               head_dim: int, dtype=jnp.bfloat16) -> KVCache:
    """An empty cache for ``num_layers`` layers of this ``CacheLayout``."""
    g = (num_layers, batch_size, max_len, len(layout.global_kv), head_dim)
    l = (num_layers, batch_size, layout.ring_size(max_len), len(layout.local_kv), head_dim)
    return KVCache(jnp.zeros(g, dtype), jnp.zeros(g, dtype), jnp.zeros(l, dtype),
                   jnp.zeros(l, dtype), jnp.zeros((batch_size,), jnp.int32))


def write_global(cache_LxBxSxGxD, layer, new_BxCxGxD, positions_BxC):
    """Writes the new keys of ``layer`` at slot = position, per row (positions past T_max
    are dropped)."""
    B = cache_LxBxSxGxD.shape[1]
    rows = jnp.arange(B)[:, None]
    return cache_LxBxSxGxD.at[layer, rows, positions_BxC].set(
        new_BxCxGxD.astype(cache_LxBxSxGxD.dtype), mode="drop")


def update_ring(ring_BxPxGxD, new_BxCxGxD, old_lengths_B, new_lengths_B, start_B):
    """The ring after appending keys at positions start_B + arange(C): it holds positions
    new_length - P .. new_length - 1, taken from the old ring (positions < old_length) or from
    the new keys. Rows whose length does not change keep their ring."""
    P = ring_BxPxGxD.shape[1]
    both = jnp.concatenate([ring_BxPxGxD, new_BxCxGxD.astype(ring_BxPxGxD.dtype)], axis=1)
    pos_BxP = ring_positions(new_lengths_B, P)  # the position each slot must hold now
    from_new = pos_BxP >= old_lengths_B[:, None]
    idx_BxP = jnp.where(from_new, P + pos_BxP - start_B[:, None], jnp.mod(pos_BxP, P))
    idx_BxP = jnp.clip(idx_BxP, 0, both.shape[1] - 1)
    return jnp.take_along_axis(both, idx_BxP[:, :, None, None], axis=1)


def layer_of(cache_LxBxSxGxD, layer):
    """[B, S, G, D]: the cache of ``layer``."""
    return jax.lax.dynamic_index_in_dim(cache_LxBxSxGxD, layer, keepdims=False)


def write_layer(cache: KVCache, layout: CacheLayout, layer, k_BxCxGxD, v_BxCxGxD,
                positions_BxC, step: CacheStep) -> KVCache:
    """``cache`` with C new keys and values per row written into ``layer``: the global kv
    heads' at slot = position, the local kv heads' into the ring. A fresh chunk (positions
    0 .. C-1) is one slice update of the global cache."""
    k_glob, v_glob = (take_heads(x, layout.global_kv) for x in (k_BxCxGxD, v_BxCxGxD))
    C = k_BxCxGxD.shape[1]
    if step.fresh and C <= cache.max_len:
        k_global, v_global = (
            jax.lax.dynamic_update_slice(old, new[None].astype(old.dtype), (layer, 0, 0, 0, 0))
            for old, new in ((cache.k_global, k_glob), (cache.v_global, v_glob)))
    else:
        k_global = write_global(cache.k_global, layer, k_glob, positions_BxC)
        v_global = write_global(cache.v_global, layer, v_glob, positions_BxC)
    k_local, v_local = cache.k_local, cache.v_local
    if layout.local_kv:
        start_B = positions_BxC[:, 0]
        k_local, v_local = (
            old.at[layer].set(update_ring(layer_of(old, layer), take_heads(new, layout.local_kv),
                                          step.old_lengths_B, step.new_lengths_B, start_B))
            for old, new in ((cache.k_local, k_BxCxGxD), (cache.v_local, v_BxCxGxD)))
    return cache._replace(k_global=k_global, v_global=v_global, k_local=k_local,
                          v_local=v_local)


def decode_groups(layout: CacheLayout, cache: KVCache, positions_B,
                  old_lengths_B) -> list[CacheGroup]:
    """The cache groups a decode step (one new token per row at ``positions_B``) reads and
    writes through ``kernels.decode.decode_step_attention`` with the step's layer: the global
    kv heads' cache (the token goes to slot = position) and the ring (slot = position mod P),
    each with the rule of the positions its slots hold before the step (a ``SlotRule`` of the
    old lengths), the arrays of every layer."""
    groups = []
    if layout.global_kv:
        groups.append(CacheGroup(cache.k_global, cache.v_global,
                                 SlotRule("global", old_lengths_B), positions_B,
                                 layout.global_kv))
    if layout.local_kv:
        P = cache.k_local.shape[2]
        groups.append(CacheGroup(cache.k_local, cache.v_local, SlotRule("ring", old_lengths_B),
                                 jnp.mod(positions_B, P), layout.local_kv))
    return groups


def with_written(layout: CacheLayout, cache: KVCache, written) -> KVCache:
    """``cache`` with the (k, v) of each of its ``decode_groups`` as the decode step wrote
    them."""
    k_global, v_global = written[0] if layout.global_kv else (cache.k_global, cache.v_global)
    k_local, v_local = written[-1] if layout.local_kv else (cache.k_local, cache.v_local)
    return cache._replace(k_global=k_global, v_global=v_global, k_local=k_local,
                          v_local=v_local)
