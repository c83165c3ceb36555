"""``LSAttention`` as a Flax Linen module, for projects built on ``flax.linen``.

Same arguments, parameter tree (names and shapes) and numerics as the NNX layer
``ls_jax.LSAttention`` (ls_jax/layers/attention.py): ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``
(each ``kernel`` [in, out] and, with ``use_bias``, ``bias``) and, with ``qk_norm``, ``q_norm`` /
``k_norm`` (``scale`` [head_dim]). A parameter tree converts between the two by renaming nothing.

    from ls_jax.interop.linen import LSAttention
    layer = LSAttention(d_model=192, n_head=6, head_dim=32, n_global_heads=1, window=51)
    params = layer.init(jax.random.key(0), x_BxTxM)
    y_BxTxM = layer.apply(params, x_BxTxM)
"""

from __future__ import annotations

from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from ls_jax.layers.attention import attend, check_input, layer_spec


class LSAttention(nn.Module):
    """LS-attention layer: [B, T, d_model] -> [B, T, d_model] (see ``ls_jax.LSAttention``).

    Heads ``0 .. n_global_heads - 1`` are global, the rest local with ``window`` keys (query i
    sees keys i - window < j <= i), unless ``window_sizes`` gives every head's window.
    ``interpret`` runs a Pallas ``implementation`` in interpret mode (CPU). The arguments are
    checked when the module is constructed, the input at each call (one line naming it).
    """

    d_model: int
    n_head: int
    head_dim: int
    n_kv_head: int | None = None
    n_global_heads: int = 1
    window: int = 50
    window_sizes: Sequence[int | None] | None = None
    qk_norm: bool = False
    use_bias: bool = False
    rope_theta: float | None = None
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    implementation: str | None = None
    interpret: bool = False
    init_std: float = 0.02
    out_init_std: float | None = None

    def __post_init__(self):
        # checked and normalised once, when the module is made (a bad argument fails here, not
        # at the first call); setup, which runs at every init/apply, reads the result
        object.__setattr__(self, "_layer", layer_spec(
            self.d_model, self.n_head, self.head_dim, self.n_kv_head, self.n_global_heads,
            self.window, self.window_sizes, self.rope_theta, self.implementation,
            self.interpret))
        super().__post_init__()

    def setup(self):
        self._windows, n_kv_head = self._layer
        self._kv_heads = n_kv_head
        init = nn.initializers.normal(self.init_std)
        out_init = nn.initializers.normal(
            self.init_std if self.out_init_std is None else self.out_init_std)

        def dense(features, kernel_init, name):
            return nn.Dense(features, use_bias=self.use_bias, kernel_init=kernel_init,
                            dtype=self.dtype, param_dtype=self.param_dtype, name=name)

        self.q_proj = dense(self.n_head * self.head_dim, init, "q_proj")
        self.k_proj = dense(n_kv_head * self.head_dim, init, "k_proj")
        self.v_proj = dense(n_kv_head * self.head_dim, init, "v_proj")
        self.o_proj = dense(self.d_model, out_init, "o_proj")
        if self.qk_norm:
            self.q_norm = nn.LayerNorm(use_bias=False, dtype=jnp.float32,
                                       param_dtype=self.param_dtype, name="q_norm")
            self.k_norm = nn.LayerNorm(use_bias=False, dtype=jnp.float32,
                                       param_dtype=self.param_dtype, name="k_norm")

    def __call__(self, x_BxTxM: jax.Array, *, positions: jax.Array | None = None,
                 segment_ids: jax.Array | None = None, return_logit_stats: bool = False):
        """Returns y [B, T, d_model], or (y, max_abs_logit [n_head]) with return_logit_stats."""
        check_input(x_BxTxM, self.d_model, positions, segment_ids)
        B, T, _ = x_BxTxM.shape
        q_BxTxHxD = self.q_proj(x_BxTxM).reshape(B, T, self.n_head, self.head_dim)
        k_BxTxGxD = self.k_proj(x_BxTxM).reshape(B, T, self._kv_heads, self.head_dim)
        v_BxTxGxD = self.v_proj(x_BxTxM).reshape(B, T, self._kv_heads, self.head_dim)
        return attend(q_BxTxHxD, k_BxTxGxD, v_BxTxGxD, self.o_proj, self._windows,
                      q_norm=self.q_norm if self.qk_norm else None,
                      k_norm=self.k_norm if self.qk_norm else None,
                      rope_theta=self.rope_theta, dtype=self.dtype,
                      implementation=self.implementation, interpret=self.interpret,
                      positions=positions,
                      segment_ids=segment_ids, return_logit_stats=return_logit_stats)
