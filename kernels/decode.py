"""Attention over a key/value cache: a decode step (one new token per row) and a prefill chunk.

Where ``ls_attention`` takes queries and keys of one sequence (query i, key j, both at
position = index), a cache holds keys in *slots* whose positions are given explicitly: a
global head's cache has slot s = position s, a local head's ring buffer has slot s = the
latest position congruent to s modulo its size. So these entry points take the positions;
a decode step also takes them as a rule of each row's length (``SlotRule``: the two above),
which the Pallas kernel computes instead of reading.

Query i of row b, head h (window w, None = global) sees slot s iff

    k_pos[b, s] >= 0  and  k_pos[b, s] <= q_pos[b, i]  and  q_pos[b, i] - k_pos[b, s] < w

(k_pos = -1 marks an empty slot, q_pos = -1 a padding query, which sees nothing and gets
output 0). GQA as in ``ls_attention``: query head h reads kv head h // (Hq // Hkv).

Two entry points:

- ``decode_step_attention``: one new token per row. It writes the token's key and value
  into every cache group (a group: the slots of some kv heads, e.g. the global heads' full
  history and the local heads' ring) at the slot the caller names, and attends over every
  group at once, the new key included. On a GPU this is one attend launch and one merge
  launch per layer (``kernels/pallas_gpu/decode.py``). A model's groups may hold every layer's cache
  ([L, B, S, G, D]): the step then reads and writes the layer it is given, in place.
- ``cached_attention``: T queries per row over one cache (a prefill chunk after the first).

Backends: "reference" (float32 at HIGHEST precision: the oracle), "xla" (a masked softmax in
the cache's dtype with float32 accumulation) and, for decode steps, "pallas_gpu".
``choose_decode_implementation`` is the one place that picks a backend when none is named.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp

from ls_jax.kernels.api import SUPPORTED_DTYPES, normalize_window_sizes
from ls_jax.kernels.band import allowed, slot_positions, window_array
from ls_jax.kernels.dispatch import current_platform
from ls_jax.kernels.heads import kv_group_size, merge_heads, take_heads
from ls_jax.kernels.reference import default_scale

_HIGHEST = jax.lax.Precision.HIGHEST

DECODE_IMPLEMENTATIONS = ("reference", "xla", "pallas_gpu")


# -- which backend ----------------------------------------------------------------------------

# A decode step whose every head is global reads every row's whole cache: from this many rows
# on it is bound by those reads, and with heads narrower than ``ALL_GLOBAL_XLA_MAX_HEAD_DIM``
# XLA's fused dots stream them faster than our kernel, whose programs then move too few bytes
# per key block; with local heads the ring buffers keep our kernel's reads small.
ALL_GLOBAL_XLA_MIN_BATCH = 8
ALL_GLOBAL_XLA_MAX_HEAD_DIM = 32


def choose_decode_implementation(implementation: str | None, *, one_query: bool,
                                 head_dim: int, batch: int = 1, all_global: bool = False,
                                 platform: str | None = None) -> str:
    """The backend of a cache attention call: ``implementation`` when named, else by case.

    | case | backend | why |
    |---|---|---|
    | a decode step (one query per row) on CUDA, head_dim a power of two, except the next row | "pallas_gpu" | one attend launch per layer writes the new key/value into every cache group and attends over all heads, one more merges its splits; "xla" needs per group a scatter per cache array and a dot, a masked softmax and a second dot, and a step of a small model is bound by its launches |
    | a decode step with every head global, from ``ALL_GLOBAL_XLA_MIN_BATCH`` rows, head_dim at most ``ALL_GLOBAL_XLA_MAX_HEAD_DIM`` | "xla" | the step is bound by reading every row's whole cache, which XLA's fused dots stream faster for narrow heads |
    | a prefill chunk (several queries per row), whatever was named | "xla" or "reference" | the Pallas kernel holds one query per program; a chunk is a matrix product that XLA's dots do well |
    | anything else | "xla" | runs on every platform |

    ``batch``: rows of the step; ``all_global``: every query head's window is None.
    ``platform``: ``kernels.dispatch.current_platform()`` unless given (tests).
    """
    if implementation is not None and implementation not in DECODE_IMPLEMENTATIONS:
        raise ValueError(f"implementation: expected None or one of {DECODE_IMPLEMENTATIONS}, "
                         f"got {implementation!r}")
    if not one_query:  # a chunk: the Pallas kernel takes one query per row
        return "reference" if implementation == "reference" else "xla"
    if implementation is not None:
        return implementation
    platform = current_platform() if platform is None else platform
    pow2 = head_dim >= 1 and not head_dim & (head_dim - 1)  # Triton's block shapes
    if platform != "cuda" or not pow2:
        return "xla"
    streamed = (all_global and batch >= ALL_GLOBAL_XLA_MIN_BATCH
                and head_dim <= ALL_GLOBAL_XLA_MAX_HEAD_DIM)
    return "xla" if streamed else "pallas_gpu"


def _backend_dtype(implementation: str, cache_dtype):
    """(compute dtype, dot precision): "reference" float32 at HIGHEST; "xla" the cache's
    dtype (a bf16 cache stays bf16 in HBM) with float32 accumulation."""
    if implementation == "reference":
        return jnp.float32, _HIGHEST
    return cache_dtype, None


# -- a prefill chunk: T queries over one cache --------------------------------------------------

def visible_mask(q_pos_BxT, k_pos_BxS, windows_H) -> jax.Array:
    """bool [B, H, T, S]: query (b, i) of head h may read slot (b, s)."""
    q = q_pos_BxT[:, None, :, None]
    k = k_pos_BxS[:, None, None, :]
    w = jnp.asarray(windows_H)[None, :, None, None]
    return (k >= 0) & allowed(q, k, w)  # k = -1: an empty slot


def _masked_softmax_attention(q, k, v, q_pos, k_pos, window_sizes, scale, *, dtype,
                              precision):
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    r = Hq // Hkv
    # [B, T, Hkv, r, D] groups the query heads that share one kv head (no repeat of the cache)
    q_BxTxKxRxD = q.reshape(B, T, Hkv, r, D).astype(dtype)
    logits_BxKxRxTxS = scale * jnp.einsum(
        "btkrd,bskd->bkrts", q_BxTxKxRxD, k.astype(dtype), precision=precision,
        preferred_element_type=jnp.float32)
    mask_BxHxTxS = visible_mask(q_pos, k_pos, window_array(window_sizes))
    mask_BxKxRxTxS = mask_BxHxTxS.reshape(B, Hkv, r, T, -1)
    logits_BxKxRxTxS = jnp.where(mask_BxKxRxTxS, logits_BxKxRxTxS, -jnp.inf)
    m = jnp.max(logits_BxKxRxTxS, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(mask_BxKxRxTxS, jnp.exp(logits_BxKxRxTxS - m), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    out_BxKxRxTxD = jnp.einsum("bkrts,bskd->bkrtd", p.astype(dtype), v.astype(dtype),
                               precision=precision, preferred_element_type=jnp.float32)
    out_BxKxRxTxD = out_BxKxRxTxD / jnp.where(denom > 0, denom, 1.0)
    return out_BxKxRxTxD.transpose(0, 3, 1, 2, 4).reshape(B, T, Hq, D).astype(q.dtype)


def _check(q, k, v, q_pos, k_pos):
    for name, x in (("q", q), ("k", k), ("v", v)):
        if getattr(x, "ndim", None) != 4:
            raise ValueError(f"{name}: expected rank 4, got shape {getattr(x, 'shape', None)}")
        if x.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"{name}: expected dtype float32, bfloat16 or float16, got {x.dtype}")
    B, T, Hq, D = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v: expected the same shape, got {k.shape} and {v.shape}")
    Bk, S, Hkv, Dk = k.shape
    if (Bk, Dk) != (B, D):
        raise ValueError(f"k: expected [B={B}, S, Hkv, D={D}], got {k.shape}")
    kv_group_size(Hq, Hkv, arg="k heads (Hkv)", heads_arg="the query heads Hq")
    if tuple(q_pos.shape) != (B, T) or not jnp.issubdtype(q_pos.dtype, jnp.integer):
        raise ValueError(f"q_pos: expected int [B={B}, T={T}], got {q_pos.dtype} {q_pos.shape}")
    if tuple(k_pos.shape) != (B, S) or not jnp.issubdtype(k_pos.dtype, jnp.integer):
        raise ValueError(f"k_pos: expected int [B={B}, S={S}], got {k_pos.dtype} {k_pos.shape}")


def cached_attention(q, k, v, q_pos, k_pos, window_sizes, *, scale=None,
                     implementation=None):
    """Attention of queries [B, T, Hq, D] at positions q_pos [B, T] over cache slots
    k, v [B, S, Hkv, D] at positions k_pos [B, S] (-1: empty); see the module docstring.

    implementation: None, "reference", "xla" or "pallas_gpu" (``choose_decode_implementation``:
      a chunk of several queries runs "xla" unless "reference" is named).
    Returns [B, T, Hq, D] in q's dtype.
    """
    _check(q, k, v, q_pos, k_pos)
    window_sizes = normalize_window_sizes(window_sizes, q.shape[2])
    return cached_attention_validated(q, k, v, q_pos, k_pos, window_sizes,
                                      scale=default_scale(q.shape[-1]) if scale is None
                                      else scale, implementation=implementation)


def cached_attention_validated(q, k, v, q_pos, k_pos, window_sizes, *, scale: float,
                               implementation=None):
    """``cached_attention`` for a caller that has checked the arrays as it does and passes
    normalised ``window_sizes`` and a float ``scale`` (the library's layers)."""
    impl = choose_decode_implementation(implementation, one_query=False, head_dim=q.shape[-1])
    dtype, precision = _backend_dtype(impl, k.dtype)
    return _masked_softmax_attention(q, k, v, q_pos.astype(jnp.int32), k_pos.astype(jnp.int32),
                                     window_sizes, float(scale), dtype=dtype,
                                     precision=precision)


# -- a decode step: one new token per row, written into the cache and attended with it ------

@dataclasses.dataclass(frozen=True)
class SlotRule:
    """The positions a group's slots hold, as a rule of each row's length (the tokens written
    before this step), so that a kernel computes them instead of loading them.

    kind: "global" (slot s holds position s while s < length: ``global_positions``) or "ring"
      (slot s holds the latest position below length congruent to s modulo the group's S:
      ``ring_positions``).
    lengths_B: int [B].
    """

    kind: str
    lengths_B: jax.Array

    def positions(self, S: int) -> jax.Array:
        """int32 [B, S]: the positions as ``CacheGroup.k_pos`` gives them."""
        rule = global_positions if self.kind == "global" else ring_positions
        return rule(self.lengths_B.astype(jnp.int32), S)


SLOT_RULES = ("global", "ring")


def global_positions(lengths_B: jax.Array, max_len: int) -> jax.Array:
    """int32 [B, T_max]: slot s holds position s if s < length, else -1."""
    s = jnp.arange(max_len, dtype=jnp.int32)[None, :]
    return slot_positions("global", lengths_B[:, None], s, max_len)


def ring_positions(lengths_B: jax.Array, ring_size: int) -> jax.Array:
    """int32 [B, P]: slot s holds the latest position < length congruent to s mod P (-1: none)."""
    s = jnp.arange(ring_size, dtype=jnp.int32)[None, :]
    return slot_positions("ring", lengths_B[:, None], s, ring_size)


@dataclasses.dataclass(frozen=True)
class CacheGroup:
    """The cache slots of some kv heads, as ``decode_step_attention`` reads and writes them.

    k, v: [B, S, G, D], the slots of G kv heads.
    k_pos: int [B, S], the position each slot holds before this step (-1: empty), or a
      ``SlotRule`` that gives them.
    slot_B: int [B], the slot whose content this step's key and value replace (a slot outside
      [0, S) is not written; the row's query still sees its own key).
    kv_heads: which of the new token's kv heads the G cache heads hold, in order (static).
    """

    k: jax.Array
    v: jax.Array
    k_pos: jax.Array | SlotRule
    slot_B: jax.Array
    kv_heads: tuple[int, ...]


def _check_step(q, k_new, v_new, q_pos, groups, layer) -> None:
    for name, x in (("q", q), ("k_new", k_new), ("v_new", v_new)):
        if getattr(x, "ndim", None) != 3:
            raise ValueError(f"{name}: expected rank 3 [B, heads, D], got shape "
                             f"{getattr(x, 'shape', None)}")
        if x.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"{name}: expected dtype float32, bfloat16 or float16, got {x.dtype}")
    B, Hq, D = q.shape
    if k_new.shape != v_new.shape:
        raise ValueError(f"k_new and v_new: expected the same shape, got {k_new.shape} and "
                         f"{v_new.shape}")
    Bk, Hkv, Dk = k_new.shape
    if (Bk, Dk) != (B, D) or Hkv < 1 or Hq % Hkv:
        raise ValueError(f"k_new: expected [B={B}, Hkv dividing {Hq}, D={D}], got {k_new.shape}")
    if tuple(q_pos.shape) != (B,) or not jnp.issubdtype(q_pos.dtype, jnp.integer):
        raise ValueError(f"q_pos: expected int [B={B}], got {q_pos.dtype} {q_pos.shape}")
    held = sorted(h for g in groups for h in g.kv_heads)
    if held != list(range(Hkv)):
        raise ValueError(f"groups: expected every kv head 0..{Hkv - 1} in exactly one group, "
                         f"got kv_heads {[g.kv_heads for g in groups]}")
    stacked = layer is not None  # the groups hold L layers: k, v [L, B, S, G, D]
    int_scalar = isinstance(layer, int) or (getattr(layer, "shape", None) == ()
                                            and jnp.issubdtype(layer.dtype, jnp.integer))
    if stacked and (isinstance(layer, bool) or not int_scalar):
        raise ValueError(f"layer: expected None or an int scalar, got {layer!r}")
    for i, g in enumerate(groups):
        S = g.k.shape[-3] if getattr(g.k, "ndim", None) == 4 + stacked else None
        lead = (g.k.shape[0],) if S is not None and stacked else ()
        want = lead + (B, S, len(g.kv_heads), D)
        if S is None or g.k.shape != want or g.v.shape != want:
            raise ValueError(f"groups[{i}].k/v: expected [{'L, ' if stacked else ''}B={B}, S, "
                             f"G={len(g.kv_heads)}, D={D}], got {getattr(g.k, 'shape', None)} "
                             f"and {getattr(g.v, 'shape', None)}")
        if isinstance(layer, int) and not 0 <= layer < lead[0]:
            raise ValueError(f"layer: expected 0 <= layer < {lead[0]} (the layers of "
                             f"groups[{i}]), got {layer}")
        if g.k.dtype not in SUPPORTED_DTYPES or g.v.dtype != g.k.dtype:
            raise ValueError(f"groups[{i}].k/v: expected one dtype of float32, bfloat16 or "
                             f"float16, got {g.k.dtype} and {g.v.dtype}")
        if isinstance(g.k_pos, SlotRule):
            n = g.k_pos.lengths_B
            if g.k_pos.kind not in SLOT_RULES:
                raise ValueError(f"groups[{i}].k_pos: expected a SlotRule kind of "
                                 f"{SLOT_RULES}, got {g.k_pos.kind!r}")
            if tuple(n.shape) != (B,) or not jnp.issubdtype(n.dtype, jnp.integer):
                raise ValueError(f"groups[{i}].k_pos.lengths_B: expected int [B={B}], got "
                                 f"{n.dtype} {n.shape}")
        elif tuple(g.k_pos.shape) != (B, S) or not jnp.issubdtype(g.k_pos.dtype, jnp.integer):
            raise ValueError(f"groups[{i}].k_pos: expected int [B={B}, S={S}] or a SlotRule, "
                             f"got {g.k_pos.dtype} {g.k_pos.shape}")
        if tuple(g.slot_B.shape) != (B,) or not jnp.issubdtype(g.slot_B.dtype, jnp.integer):
            raise ValueError(f"groups[{i}].slot_B: expected int [B={B}], got "
                             f"{g.slot_B.dtype} {g.slot_B.shape}")


def _step_masked_softmax(q, k_new, v_new, q_pos, groups, window_sizes, scale, *, implementation,
                         layer):
    """"reference" / "xla" decode step on layer ``layer`` of the groups' [L, B, S, G, D]
    arrays: per group a scatter of the new key and value, then a masked softmax over the
    group's slots (the replaced slot left out) and the new key."""
    B, Hq, D = q.shape
    r = Hq // k_new.shape[1]
    rows = jnp.arange(B)
    real_B = q_pos >= 0
    windows = window_array(window_sizes)
    outs, heads_of_outs, written = [], [], []
    for g in groups:
        S = g.k.shape[-3]
        dtype, precision = _backend_dtype(implementation, g.k.dtype)
        # padding rows and slots outside the cache write nothing (index S: dropped)
        slot_B = jnp.where(real_B & (g.slot_B >= 0) & (g.slot_B < S), g.slot_B, S)
        k_self = take_heads(k_new, g.kv_heads, axis=1).astype(g.k.dtype)  # [B, G, D]
        v_self = take_heads(v_new, g.kv_heads, axis=1).astype(g.k.dtype)
        k_all = g.k.at[layer, rows, slot_B].set(k_self, mode="drop")
        v_all = g.v.at[layer, rows, slot_B].set(v_self, mode="drop")
        written.append((k_all, v_all))
        k, v = (jax.lax.dynamic_index_in_dim(x, layer, keepdims=False) for x in (k_all, v_all))
        q_heads = tuple(h for kv in g.kv_heads for h in range(kv * r, (kv + 1) * r))
        G = len(g.kv_heads)
        q_BxGxRxD = take_heads(q, q_heads, axis=1).reshape(B, G, r, D).astype(dtype)
        # the replaced slot's old content is gone: it is the new key now, counted below
        k_pos_BxS = jnp.where(jnp.arange(S)[None, :] == slot_B[:, None], -1, g.k_pos)
        w_GxR = jnp.asarray(windows[list(q_heads)]).reshape(G, r)
        mask_BxGxRxS = (k_pos_BxS[:, None, None, :] >= 0) & allowed(
            q_pos[:, None, None, None], k_pos_BxS[:, None, None, :], w_GxR[None, :, :, None])
        logits_BxGxRxS = scale * jnp.einsum("bgrd,bsgd->bgrs", q_BxGxRxD, k.astype(dtype),
                                            precision=precision,
                                            preferred_element_type=jnp.float32)
        self_BxGxR = scale * jnp.einsum("bgrd,bgd->bgr", q_BxGxRxD, k_self.astype(dtype),
                                        precision=precision, preferred_element_type=jnp.float32)
        logits_BxGxRxS = jnp.where(mask_BxGxRxS, logits_BxGxRxS, -jnp.inf)
        m_BxGxR = jnp.maximum(jnp.max(logits_BxGxRxS, axis=-1), self_BxGxR)
        p_BxGxRxS = jnp.where(mask_BxGxRxS, jnp.exp(logits_BxGxRxS - m_BxGxR[..., None]), 0.0)
        p_self_BxGxR = jnp.where(real_B[:, None, None], jnp.exp(self_BxGxR - m_BxGxR), 0.0)
        denom_BxGxR = jnp.sum(p_BxGxRxS, axis=-1) + p_self_BxGxR
        out_BxGxRxD = jnp.einsum("bgrs,bsgd->bgrd", p_BxGxRxS.astype(dtype), v.astype(dtype),
                                 precision=precision, preferred_element_type=jnp.float32)
        out_BxGxRxD = out_BxGxRxD + p_self_BxGxR[..., None] * v_self.astype(jnp.float32)[:, :, None]
        out_BxGxRxD = out_BxGxRxD / jnp.where(denom_BxGxR > 0, denom_BxGxR, 1.0)[..., None]
        outs.append(out_BxGxRxD.reshape(B, G * r, D).astype(q.dtype))
        heads_of_outs.append(q_heads)
    return merge_heads(outs, heads_of_outs, axis=1), tuple(written)


def decode_step_attention(q_BxHxD, k_new_BxGxD, v_new_BxGxD, q_pos_B,
                          groups: Sequence[CacheGroup], window_sizes, *, scale=None,
                          layer=None, implementation=None, interpret=False):
    """One decode step: each row's new token (query q_BxHxD, key and value k/v_new_BxGxD, at
    position q_pos_B; -1: a padding row) is written into every cache group at the group's
    ``slot_B``, and its query heads attend over their kv head's group and the new key.

    Query head h (window w) reads kv head h // (Hq // Hkv), which exactly one group holds; it
    sees the group's slots that the module docstring's rule allows, except the replaced slot,
    and the new key (offset 0 is inside every window). A padding row writes nothing and gets
    output 0.

    layer: None, or an int scalar: then each group's k and v are [L, B, S, G, D], the caches
      of L layers (a model's), and the step reads and writes their layer ``layer`` in place.
    implementation: None (``choose_decode_implementation``), "reference", "xla" or
      "pallas_gpu" (``interpret=True``: Pallas interpret mode, on CPU).
    Returns (out [B, Hq, D] in q's dtype, ((k, v) of each group after the write)).
    """
    groups = tuple(groups)
    _check_step(q_BxHxD, k_new_BxGxD, v_new_BxGxD, q_pos_B, groups, layer)
    window_sizes = normalize_window_sizes(window_sizes, q_BxHxD.shape[1])
    D = q_BxHxD.shape[-1]
    return decode_step_attention_validated(
        q_BxHxD, k_new_BxGxD, v_new_BxGxD, q_pos_B, groups, window_sizes,
        scale=float(default_scale(D) if scale is None else scale), layer=layer,
        implementation=implementation, interpret=interpret)


def decode_step_attention_validated(q_BxHxD, k_new_BxGxD, v_new_BxGxD, q_pos_B, groups,
                                    window_sizes, *, scale: float, layer=None,
                                    implementation=None, interpret=False):
    """``decode_step_attention`` for a caller that has checked the arrays and groups as it
    does and passes normalised ``window_sizes`` and a float ``scale`` (the library's layers,
    once per layer and step)."""
    D = q_BxHxD.shape[-1]
    impl = choose_decode_implementation(
        implementation, one_query=True, head_dim=D, batch=q_BxHxD.shape[0],
        all_global=all(w is None for w in window_sizes))
    q_pos_B = q_pos_B.astype(jnp.int32)
    one_layer = layer is None  # as the only layer of [1, B, S, G, D] arrays (a bitcast)
    groups = tuple(dataclasses.replace(
        g, k=g.k[None] if one_layer else g.k, v=g.v[None] if one_layer else g.v,
        slot_B=g.slot_B.astype(jnp.int32)) for g in groups)
    layer = jnp.asarray(0 if one_layer else layer, jnp.int32)
    if impl == "pallas_gpu":
        from ls_jax.kernels.pallas_gpu.decode import pallas_gpu_decode_step

        # a SlotRule group passes its lengths: the kernel computes the positions
        ruled = [isinstance(g.k_pos, SlotRule) for g in groups]
        out, written = pallas_gpu_decode_step(
            q_BxHxD, k_new_BxGxD, v_new_BxGxD, q_pos_B,
            tuple((g.k, g.v, (g.k_pos.lengths_B if r else g.k_pos).astype(jnp.int32), g.slot_B)
                  for g, r in zip(groups, ruled)),
            kv_heads=tuple(g.kv_heads for g in groups),
            position_rules=tuple(g.k_pos.kind if r else None for g, r in zip(groups, ruled)),
            window_sizes=window_sizes, scale=scale, layer=layer, interpret=interpret)
    else:
        groups = tuple(dataclasses.replace(
            g, k_pos=(g.k_pos.positions(g.k.shape[-3]) if isinstance(g.k_pos, SlotRule)
                      else g.k_pos.astype(jnp.int32))) for g in groups)
        out, written = _step_masked_softmax(q_BxHxD, k_new_BxGxD, v_new_BxGxD, q_pos_B, groups,
                                            window_sizes, scale, implementation=impl,
                                            layer=layer)
    if one_layer:
        written = tuple((k[0], v[0]) for k, v in written)
    return out, written
