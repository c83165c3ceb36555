"""``LSAttention``: multi-head attention whose heads are split into global and local ones.

Heads ``0 .. n_global_heads - 1`` attend causally to every earlier token; the rest attend to the
last ``window`` tokens (query i sees keys i - window < j <= i). With ``n_global_heads ==
n_head`` it is plain causal multi-head self-attention. The attention itself is one call of
``kernels.ls_attention`` for all heads, which picks the Pallas kernel for the platform.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from ls_jax.kernels import ls_attention, normalize_window_sizes
from ls_jax.rope import apply_rope


def layer_window_sizes(n_head: int, n_global_heads: int, window: int) -> tuple[int | None, ...]:
    """None for the first ``n_global_heads`` heads (global), ``window`` for the others (local)."""
    if not 0 <= n_global_heads <= n_head:
        raise ValueError(
            f"n_global_heads: expected an int in [0, n_head={n_head}], got {n_global_heads}")
    return (None,) * n_global_heads + (window,) * (n_head - n_global_heads)


class LSAttention(nnx.Module):
    """LS-attention layer: [B, T, d_model] -> [B, T, d_model].

    Args:
      d_model: model width.
      n_head: query heads; n_kv_head (default n_head) key/value heads, must divide n_head.
      head_dim: width of each head.
      n_global_heads, window: the LS split (ignored when ``window_sizes`` is given).
      window_sizes: optional explicit per-head windows (int >= 1 local, None global).
      qk_norm: LayerNorm of q and k over head_dim before the dot product (a baseline).
      rope_theta: apply rotary embeddings with this base (None: no RoPE).
      dtype / param_dtype: compute and parameter dtypes (e.g. bfloat16 / float32).
      implementation: kernels.ls_attention backend (None: best for the platform).
    """

    def __init__(self, d_model: int, n_head: int, head_dim: int, *, n_kv_head: int | None = None,
                 n_global_heads: int = 1, window: int = 50,
                 window_sizes: Sequence[int | None] | None = None, qk_norm: bool = False,
                 use_bias: bool = False, rope_theta: float | None = None,
                 dtype=jnp.float32, param_dtype=jnp.float32, implementation: str | None = None,
                 init_std: float = 0.02, out_init_std: float | None = None, rngs: nnx.Rngs):
        n_kv_head = n_kv_head or n_head
        if n_head % n_kv_head:
            raise ValueError(f"n_kv_head: expected a divisor of n_head={n_head}, got {n_kv_head}")
        if window_sizes is None:
            window_sizes = layer_window_sizes(n_head, n_global_heads, window)
        self.window_sizes = normalize_window_sizes(window_sizes, n_head)
        self.n_head, self.n_kv_head, self.head_dim = n_head, n_kv_head, head_dim
        self.rope_theta = rope_theta
        self.implementation = implementation
        self.dtype = dtype
        init = nnx.initializers.normal(init_std)
        out_init = nnx.initializers.normal(init_std if out_init_std is None else out_init_std)

        def linear(din, dout, kernel_init):
            return nnx.Linear(din, dout, use_bias=use_bias, kernel_init=kernel_init, dtype=dtype,
                              param_dtype=param_dtype, rngs=rngs)

        self.q_proj = linear(d_model, n_head * head_dim, init)
        self.k_proj = linear(d_model, n_kv_head * head_dim, init)
        self.v_proj = linear(d_model, n_kv_head * head_dim, init)
        self.o_proj = linear(n_head * head_dim, d_model, out_init)
        if qk_norm:
            self.q_norm = nnx.LayerNorm(head_dim, use_bias=False, dtype=jnp.float32,
                                        param_dtype=param_dtype, rngs=rngs)
            self.k_norm = nnx.LayerNorm(head_dim, use_bias=False, dtype=jnp.float32,
                                        param_dtype=param_dtype, rngs=rngs)
        else:
            self.q_norm = self.k_norm = None

    def __call__(self, x_BxTxM: jax.Array, *, positions: jax.Array | None = None,
                 segment_ids: jax.Array | None = None, return_logit_stats: bool = False):
        """Returns y [B, T, d_model], or (y, max_abs_logit [n_head]) with return_logit_stats."""
        B, T, _ = x_BxTxM.shape
        q_BxTxHxD = self.q_proj(x_BxTxM).reshape(B, T, self.n_head, self.head_dim)
        k_BxTxGxD = self.k_proj(x_BxTxM).reshape(B, T, self.n_kv_head, self.head_dim)
        v_BxTxGxD = self.v_proj(x_BxTxM).reshape(B, T, self.n_kv_head, self.head_dim)
        return attend(q_BxTxHxD, k_BxTxGxD, v_BxTxGxD, self.o_proj, self.window_sizes,
                      q_norm=self.q_norm, k_norm=self.k_norm, rope_theta=self.rope_theta,
                      dtype=self.dtype, implementation=self.implementation,
                      positions=positions, segment_ids=segment_ids,
                      return_logit_stats=return_logit_stats)


def attend(q_BxTxHxD, k_BxTxGxD, v_BxTxGxD, o_proj, window_sizes, *, q_norm, k_norm, rope_theta,
           dtype, implementation, positions=None, segment_ids=None, return_logit_stats=False):
    """The layer after the q/k/v projections: QK-norm, RoPE, ``ls_attention``, ``o_proj``.

    Shared by this NNX layer and the Linen one (ls_jax/linen.py); ``q_norm``/``k_norm``/``o_proj``
    are callables of either library (``q_norm`` None: no QK-norm).
    """
    B, T, H, D = q_BxTxHxD.shape
    if q_norm is not None:
        q_BxTxHxD = q_norm(q_BxTxHxD).astype(dtype)
        k_BxTxGxD = k_norm(k_BxTxGxD).astype(dtype)
    if rope_theta is not None:
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(T), (B, T))
        q_BxTxHxD = apply_rope(q_BxTxHxD, positions, rope_theta)
        k_BxTxGxD = apply_rope(k_BxTxGxD, positions, rope_theta)
    result = ls_attention(
        q_BxTxHxD, k_BxTxGxD, v_BxTxGxD, window_sizes, segment_ids=segment_ids,
        return_logit_stats=return_logit_stats, implementation=implementation)
    out_BxTxHxD = result[0] if return_logit_stats else result
    y_BxTxM = o_proj(out_BxTxHxD.reshape(B, T, H * D))
    if return_logit_stats:
        return y_BxTxM, result[1].max_abs_logit
    return y_BxTxM
