"""Pure-JAX twin of the LS-attention kernels: the oracle for tests and the CPU path.

It materialises the [B, H, T, S] logits, so it is meant for checking and for small T. All
arithmetic is float32 (matmuls at HIGHEST precision), float64 for float64 inputs (the one
backend that takes them, under ``jax_enable_x64``); the output is cast to q's dtype. Which
pairs are allowed comes from ``kernels.band`` (shape letters: ``kernels/api.py``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ls_jax.kernels.band import WindowSizes, allowed, window_array

_HIGHEST = jax.lax.Precision.HIGHEST


def default_scale(head_dim: int) -> float:
    """The logit scale when none is given: 1 / sqrt(D)."""
    return 1.0 / float(np.sqrt(head_dim))


def allowed_mask(seq_len: int, window_sizes: WindowSizes, segment_ids=None) -> jax.Array:
    """bool [B or 1, H, T, S]: True where query i may attend to key j for head h."""
    i_1x1xTx1 = jnp.arange(seq_len)[None, None, :, None]
    j_1x1x1xS = jnp.arange(seq_len)[None, None, None, :]
    w_1xHx1x1 = jnp.asarray(window_array(window_sizes))[None, :, None, None]
    seg_i = seg_j = None
    if segment_ids is not None:
        seg_i, seg_j = segment_ids[:, None, :, None], segment_ids[:, None, None, :]
    return allowed(i_1x1xTx1, j_1x1x1xS, w_1xHx1x1, seg_i, seg_j)


def repeat_kv(x_BxSxGxD: jax.Array, num_q_heads: int) -> jax.Array:
    """Expands GQA key/value heads so that query head h reads kv head h // (H // G)."""
    return jnp.repeat(x_BxSxGxD, num_q_heads // x_BxSxGxD.shape[2], axis=2)


def compute_dtype(dtype):
    """The arithmetic's dtype: float32, or float64 for float64 inputs."""
    return jnp.promote_types(dtype, jnp.float32)


def scaled_logits(q_BxTxHxD, k_BxSxGxD, scale: float) -> jax.Array:
    """float32 (float64 for float64 q) [B, H, T, S] pre-softmax logits ``scale * q_i . k_j``."""
    acc = compute_dtype(q_BxTxHxD.dtype)
    k_BxSxHxD = repeat_kv(k_BxSxGxD, q_BxTxHxD.shape[2])
    return scale * jnp.einsum(
        "bthd,bshd->bhts", q_BxTxHxD.astype(acc), k_BxSxHxD.astype(acc), precision=_HIGHEST)


def reference_attention_parts(q, k, v, window_sizes: WindowSizes, segment_ids=None,
                              scale: float | None = None):
    """Returns (out [B,T,H,D] in q.dtype, lse float32 [B,H,T], max_abs_logit float32 [H]).

    ``lse`` is the natural-log logsumexp of the allowed logits of each query row (the residual
    a flash kernel saves for its backward pass).
    """
    B, T, H, D = q.shape
    if scale is None:
        scale = default_scale(D)
    logits_BxHxTxS = scaled_logits(q, k, scale)
    mask_BxHxTxS = allowed_mask(T, window_sizes, segment_ids)
    masked_BxHxTxS = jnp.where(mask_BxHxTxS, logits_BxHxTxS, -jnp.inf)
    lse_BxHxT = jax.nn.logsumexp(masked_BxHxTxS, axis=-1)
    probs_BxHxTxS = jnp.where(mask_BxHxTxS, jnp.exp(masked_BxHxTxS - lse_BxHxT[..., None]), 0.0)
    v_BxSxHxD = repeat_kv(v, H).astype(compute_dtype(q.dtype))
    out_BxTxHxD = jnp.einsum("bhts,bshd->bthd", probs_BxHxTxS, v_BxSxHxD, precision=_HIGHEST)
    max_abs_H = jnp.max(jnp.where(mask_BxHxTxS, jnp.abs(logits_BxHxTxS), 0.0), axis=(0, 2, 3))
    return out_BxTxHxD.astype(q.dtype), lse_BxHxT, jax.lax.stop_gradient(max_abs_H)


def blockwise_max_abs_logit(q, k, window_sizes: WindowSizes, segment_ids=None,
                            scale: float | None = None, block_q: int = 256) -> jax.Array:
    """float32 [H] max |logit| over allowed pairs, one query block at a time.

    Memory O(B * H * block_q * T) instead of O(B * H * T^2): the statistic for backends that
    cannot emit it themselves (cuDNN). Costs one extra pass over QK^T.
    """
    B, T, H, D = q.shape
    if scale is None:
        scale = default_scale(D)
    block_q = min(block_q, T)
    num_blocks = -(-T // block_q)
    pad = num_blocks * block_q - T
    q_pad = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0)))
    k_BxSxHxD = repeat_kv(k, H).astype(jnp.float32)
    w_1xHx1x1 = jnp.asarray(window_array(window_sizes))[None, :, None, None]
    j_1x1x1xS = jnp.arange(T)[None, None, None, :]
    seg_pad = None if segment_ids is None else jnp.pad(segment_ids, ((0, 0), (0, pad)))

    def one_block(start):
        q_blk = jax.lax.dynamic_slice_in_dim(q_pad, start, block_q, axis=1).astype(jnp.float32)
        logits_BxHxQxS = scale * jnp.einsum("bqhd,bshd->bhqs", q_blk, k_BxSxHxD,
                                            precision=_HIGHEST)
        i_1x1xQx1 = (start + jnp.arange(block_q))[None, None, :, None]
        seg_i = seg_j = None
        if segment_ids is not None:
            seg_i = jax.lax.dynamic_slice_in_dim(seg_pad, start, block_q, axis=1)[
                :, None, :, None]
            seg_j = segment_ids[:, None, None, :]
        ok = allowed(i_1x1xQx1, j_1x1x1xS, w_1xHx1x1, seg_i, seg_j) & (i_1x1xQx1 < T)
        return jnp.max(jnp.where(ok, jnp.abs(logits_BxHxQxS), 0.0), axis=(0, 2, 3))

    per_block = jax.lax.map(one_block, jnp.arange(num_blocks) * block_q)
    return jax.lax.stop_gradient(jnp.max(per_block, axis=0))


def reference_backend(q, k, v, *, window_sizes, segment_ids, scale, return_logit_stats,
                      interpret):
    del interpret  # not a Pallas backend
    out, _, max_abs = reference_attention_parts(q, k, v, window_sizes, segment_ids, scale)
    return out, (max_abs if return_logit_stats else None)
