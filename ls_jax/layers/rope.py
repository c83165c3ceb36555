"""Rotary position embeddings (RoPE), the option beside learned absolute positions."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def apply_rope(x_BxTxHxD: jax.Array, positions_BxT: jax.Array, theta: float = 10_000.0) -> jax.Array:
    """Rotates pairs (x[..., :D/2], x[..., D/2:]) by angle position / theta^(2r/D), r < R = D/2."""
    D = x_BxTxHxD.shape[-1]
    half = D // 2
    inv_freq_R = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle_BxTxR = positions_BxT.astype(jnp.float32)[..., None] * inv_freq_R
    sin_BxTx1xR = jnp.sin(angle_BxTxR)[:, :, None, :]
    cos_BxTx1xR = jnp.cos(angle_BxTxR)[:, :, None, :]
    x1, x2 = jnp.split(x_BxTxHxD.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos_BxTx1xR - x2 * sin_BxTx1xR,
                           x2 * cos_BxTx1xR + x1 * sin_BxTx1xR], axis=-1)
    return out.astype(x_BxTxHxD.dtype)
