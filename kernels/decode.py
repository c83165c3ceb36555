"""Attention of a few new queries over a key/value cache (decoding and chunked prefill).

Where ``ls_attention`` takes queries and keys of one sequence (query i, key j, both at
position = index), a cache holds keys in *slots* whose positions are given explicitly: a
global head's cache has slot s = position s, a local head's ring buffer has slot s = the
latest position congruent to s modulo its size. So this entry point takes the positions:

    cached_attention(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, q_pos_BxT, k_pos_BxS, window_sizes)

Query i of row b, head h (window w, None = global) sees slot s iff

    k_pos[b, s] >= 0  and  k_pos[b, s] <= q_pos[b, i]  and  q_pos[b, i] - k_pos[b, s] < w

(k_pos = -1 marks an empty slot). GQA as in ``ls_attention``: query head h reads kv head
h // (Hq // Hkv). A query with no visible slot (a padding query) gets output 0.

Backends: "reference" (float32 at HIGHEST precision: the oracle), "xla" (the same masked
softmax in the inputs' dtype with float32 accumulation: what runs by default), and
"pallas_gpu" (kernels/pallas_gpu/decode.py: one new query per row, the decode step).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ls_jax.kernels.api import SUPPORTED_DTYPES, normalize_window_sizes
from ls_jax.kernels.band import allowed, window_array
from ls_jax.kernels.heads import kv_group_size
from ls_jax.kernels.reference import default_scale

_HIGHEST = jax.lax.Precision.HIGHEST

DECODE_IMPLEMENTATIONS = ("reference", "xla", "pallas_gpu")


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


def reference_cached_attention(q, k, v, q_pos, k_pos, *, window_sizes, scale, interpret):
    """float32 at HIGHEST precision: the oracle."""
    del interpret
    return _masked_softmax_attention(q, k, v, q_pos, k_pos, window_sizes, scale,
                                     dtype=jnp.float32, precision=_HIGHEST)


def xla_cached_attention(q, k, v, q_pos, k_pos, *, window_sizes, scale, interpret):
    """The cache's dtype (bf16 caches stay bf16 in HBM), float32 accumulation and softmax."""
    del interpret
    return _masked_softmax_attention(q, k, v, q_pos, k_pos, window_sizes, scale,
                                     dtype=k.dtype, precision=None)


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


def get_decode_backend(implementation: str):
    """The decode backend function called ``implementation`` (the Pallas one imported lazily)."""
    if implementation == "reference":
        return reference_cached_attention
    if implementation == "xla":
        return xla_cached_attention
    if implementation == "pallas_gpu":
        from ls_jax.kernels.pallas_gpu.decode import pallas_gpu_cached_attention
        return pallas_gpu_cached_attention
    raise ValueError(f"implementation: expected None or one of {DECODE_IMPLEMENTATIONS}, "
                     f"got {implementation!r}")


def cached_attention(q, k, v, q_pos, k_pos, window_sizes, *, scale=None,
                     implementation=None, interpret=False):
    """Attention of queries [B, T, Hq, D] at positions q_pos [B, T] over cache slots
    k, v [B, S, Hkv, D] at positions k_pos [B, S] (-1: empty); see the module docstring.

    implementation: None ("xla"), "reference", "xla" or "pallas_gpu" (T == 1 only; with
      ``interpret=True`` it runs in Pallas interpret mode on CPU).
    Returns [B, T, Hq, D] in q's dtype.
    """
    _check(q, k, v, q_pos, k_pos)
    window_sizes = normalize_window_sizes(window_sizes, q.shape[2])
    if scale is None:
        scale = default_scale(q.shape[-1])
    fn = get_decode_backend(implementation or "xla")
    return fn(q, k, v, q_pos.astype(jnp.int32), k_pos.astype(jnp.int32),
              window_sizes=window_sizes, scale=float(scale), interpret=interpret)
