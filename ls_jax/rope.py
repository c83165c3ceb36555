"""Rotary position embeddings (RoPE), the option beside learned absolute positions."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def apply_rope(x_BxTxHxD: jax.Array, positions_BxT: jax.Array, theta: float = 10_000.0) -> jax.Array:
    """Rotates pairs (x[..., :D/2], x[..., D/2:]) by angle position / theta^(2k/D)."""
    D = x_BxTxHxD.shape[-1]
    half = D // 2
    inv_freq_K = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle_BxTxK = positions_BxT.astype(jnp.float32)[..., None] * inv_freq_K
    sin_BxTx1xK = jnp.sin(angle_BxTxK)[:, :, None, :]
    cos_BxTx1xK = jnp.cos(angle_BxTxK)[:, :, None, :]
    x1, x2 = jnp.split(x_BxTxHxD.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos_BxTx1xK - x2 * sin_BxTx1xK,
                           x2 * cos_BxTx1xK + x1 * sin_BxTx1xK], axis=-1)
    return out.astype(x_BxTxHxD.dtype)
