"""Pure-JAX twin of the LS-attention kernels: the oracle for tests and the CPU path.

It materialises the [B, H, T, T] logits, so it is meant for checking and for small T. All
arithmetic is float32 (matmuls at HIGHEST precision); the output is cast to q's dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ls_jax.kernels.api import WindowSizes

_HIGHEST = jax.lax.Precision.HIGHEST


def effective_windows(window_sizes: WindowSizes, seq_len: int) -> np.ndarray:
    """int32 [H]: the window of each head with global heads as ``seq_len`` (sees everything)."""
    return np.array([seq_len if p is None else min(p, seq_len) for p in window_sizes], np.int32)


def allowed_mask(seq_len: int, window_sizes: WindowSizes, segment_ids=None) -> jax.Array:
    """bool [B or 1, H, T, T]: True where query i may attend to key j for head h."""
    i_T1 = jnp.arange(seq_len)[:, None]
    j_1S = jnp.arange(seq_len)[None, :]
    w_H11 = jnp.asarray(effective_windows(window_sizes, seq_len))[:, None, None]
    mask_1xHxTxS = ((j_1S <= i_T1) & (i_T1 - j_1S < w_H11))[None]
    if segment_ids is not None:
        same_Bx1xTxS = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]
        mask_1xHxTxS = mask_1xHxTxS & same_Bx1xTxS
    return mask_1xHxTxS


def repeat_kv(x_BxTxKxD: jax.Array, num_q_heads: int) -> jax.Array:
    """Expands GQA key/value heads so that query head h reads kv head h // (Hq // Hkv)."""
    return jnp.repeat(x_BxTxKxD, num_q_heads // x_BxTxKxD.shape[2], axis=2)


def scaled_logits(q_BxTxHxD, k_BxSxKxD, sm_scale: float) -> jax.Array:
    """float32 [B, H, T, S] pre-softmax logits ``sm_scale * q_i . k_j``."""
    k_BxSxHxD = repeat_kv(k_BxSxKxD, q_BxTxHxD.shape[2])
    return sm_scale * jnp.einsum(
        "bthd,bshd->bhts", q_BxTxHxD.astype(jnp.float32), k_BxSxHxD.astype(jnp.float32),
        precision=_HIGHEST)


def reference_attention_parts(q, k, v, window_sizes: WindowSizes, segment_ids=None,
                              sm_scale: float | None = None):
    """Returns (out [B,T,Hq,D] in q.dtype, lse float32 [B,Hq,T], max_abs_logit float32 [Hq]).

    ``lse`` is the natural-log logsumexp of the allowed logits of each query row (the residual
    a flash kernel saves for its backward pass).
    """
    B, T, Hq, D = q.shape
    if sm_scale is None:
        sm_scale = 1.0 / float(np.sqrt(D))
    logits_BxHxTxS = scaled_logits(q, k, sm_scale)
    mask_BxHxTxS = allowed_mask(T, window_sizes, segment_ids)
    masked_BxHxTxS = jnp.where(mask_BxHxTxS, logits_BxHxTxS, -jnp.inf)
    lse_BxHxT = jax.nn.logsumexp(masked_BxHxTxS, axis=-1)
    probs_BxHxTxS = jnp.where(mask_BxHxTxS, jnp.exp(masked_BxHxTxS - lse_BxHxT[..., None]), 0.0)
    v_BxSxHxD = repeat_kv(v, Hq).astype(jnp.float32)
    out_BxTxHxD = jnp.einsum("bhts,bshd->bthd", probs_BxHxTxS, v_BxSxHxD, precision=_HIGHEST)
    max_abs_H = jnp.max(jnp.where(mask_BxHxTxS, jnp.abs(logits_BxHxTxS), 0.0), axis=(0, 2, 3))
    return out_BxTxHxD.astype(q.dtype), lse_BxHxT, jax.lax.stop_gradient(max_abs_H)


def blockwise_max_abs_logit(q, k, window_sizes: WindowSizes, segment_ids=None,
                            sm_scale: float | None = None, block_q: int = 256) -> jax.Array:
    """float32 [Hq] max |logit| over allowed pairs, one query block at a time.

    Memory O(B * H * block_q * T) instead of O(B * H * T^2): the statistic for backends that
    cannot emit it themselves (cuDNN). Costs one extra pass over QK^T.
    """
    B, T, Hq, D = q.shape
    if sm_scale is None:
        sm_scale = 1.0 / float(np.sqrt(D))
    block_q = min(block_q, T)
    num_blocks = -(-T // block_q)
    pad = num_blocks * block_q - T
    q_pad = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0)))
    k_BxSxHxD = repeat_kv(k, Hq).astype(jnp.float32)
    w_H = jnp.asarray(effective_windows(window_sizes, T))
    j_S = jnp.arange(T)

    def one_block(start):
        q_blk = jax.lax.dynamic_slice_in_dim(q_pad, start, block_q, axis=1).astype(jnp.float32)
        logits_BxHxQxS = sm_scale * jnp.einsum("bqhd,bshd->bhqs", q_blk, k_BxSxHxD,
                                               precision=_HIGHEST)
        i_Q = start + jnp.arange(block_q)
        ok_HxQxS = ((j_S[None, None, :] <= i_Q[None, :, None])
                    & (i_Q[None, :, None] - j_S[None, None, :] < w_H[:, None, None])
                    & (i_Q[None, :, None] < T))
        ok = ok_HxQxS[None]
        if segment_ids is not None:
            seg_q = jax.lax.dynamic_slice_in_dim(
                jnp.pad(segment_ids, ((0, 0), (0, pad))), start, block_q, axis=1)
            ok = ok & (seg_q[:, None, :, None] == segment_ids[:, None, None, :])
        return jnp.max(jnp.where(ok, jnp.abs(logits_BxHxQxS), 0.0), axis=(0, 2, 3))

    per_block = jax.lax.map(one_block, jnp.arange(num_blocks) * block_q)
    return jax.lax.stop_gradient(jnp.max(per_block, axis=0))


def reference_backend(q, k, v, *, window_sizes, segment_ids, sm_scale, return_logit_stats,
                      interpret):
    del interpret  # not a Pallas backend
    out, _, max_abs = reference_attention_parts(q, k, v, window_sizes, segment_ids, sm_scale)
    return out, (max_abs if return_logit_stats else None)
