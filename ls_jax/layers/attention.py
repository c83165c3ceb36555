"""``LSAttention``: multi-head attention whose heads are split into global and local ones.

Heads ``0 .. n_global_heads - 1`` attend causally to every earlier token; the rest attend to the
last ``window`` tokens (query i sees keys i - window < j <= i). With ``n_global_heads ==
n_head`` it is plain causal multi-head self-attention. The attention itself is one call of
``kernels.ls_attention`` for all heads, which picks the Pallas kernel for the platform (on
sharded inputs, one call per shard: kernels/sharded.py). Given a KV cache
(``ls_jax/layers/kv_cache.py``), the same call attends over it and writes the new keys and values into
it (decoding).
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from ls_jax.config import layer_window_sizes
from ls_jax.kernels import normalize_window_sizes
from ls_jax.kernels.api import ls_attention_validated
from ls_jax.kernels.decode import (cached_attention_validated, choose_decode_implementation,
                                   decode_step_attention_validated, global_positions,
                                   ring_positions)
from ls_jax.kernels.plan import check_backend_options
from ls_jax.kernels.heads import kv_group_size, take_heads
from ls_jax.kernels.reference import default_scale
from ls_jax.layers.kv_cache import (CacheLayout, CacheStep, KVCache, decode_groups, layer_of,
                                    with_written, write_layer)
from ls_jax.layers.rope import apply_rope
from ls_jax.sharding import attention_spec


def partitioned(init, axes: tuple[str | None, ...]):
    """``init`` with logical axis names for sharding (mapped to mesh axes by
    ls_jax/sharding.py when a run places the state; creating a module needs no mesh)."""
    return nnx.with_partitioning(init, axes, eager_sharding=False)


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
    return value


def check_backend(implementation, interpret) -> None:
    """The backend arguments of ``kernels.ls_attention``, checked when a layer is built: a
    layer takes ``interpret`` as a bool; the rest is the call's rule."""
    if not isinstance(interpret, bool):
        raise ValueError(f"interpret: expected True or False, got {interpret!r}")
    check_backend_options(implementation, interpret)


def layer_spec(d_model, n_head, head_dim, n_kv_head, n_global_heads, window, window_sizes,
               rope_theta, implementation, interpret) -> tuple[tuple[int | None, ...], int]:
    """(per-head windows, kv heads) of an LS-attention layer's arguments, each checked with
    one line naming it; shared by the NNX layer and the Linen one (ls_jax/interop/linen.py)."""
    _positive_int("d_model", d_model)
    _positive_int("n_head", n_head)
    _positive_int("head_dim", head_dim)
    n_kv_head = n_head if n_kv_head is None else n_kv_head
    kv_group_size(n_head, n_kv_head)
    if window_sizes is None:
        if n_global_heads < n_head:
            _positive_int("window", window)
        window_sizes = layer_window_sizes(n_head, n_global_heads, window)
    windows = normalize_window_sizes(window_sizes, n_head)
    if rope_theta is not None:
        if isinstance(rope_theta, bool) or not isinstance(rope_theta, (int, float)) \
                or not math.isfinite(rope_theta) or rope_theta <= 0:
            raise ValueError(f"rope_theta: expected None or a finite number > 0, "
                             f"got {rope_theta!r}")
        if head_dim % 2:
            raise ValueError(f"head_dim: expected an even number with rope_theta set (RoPE "
                             f"rotates pairs), got {head_dim}")
    check_backend(implementation, interpret)
    return windows, n_kv_head


def check_positions(shape: tuple, positions=None, segment_ids=None) -> None:
    """One line for positions or segment ids that are not int [B, T] (``shape`` = (B, T))."""
    for name, x in (("positions", positions), ("segment_ids", segment_ids)):
        if x is not None and (tuple(getattr(x, "shape", ())) != tuple(shape)
                              or not jnp.issubdtype(x.dtype, jnp.integer)):
            raise ValueError(f"{name}: expected int [B={shape[0]}, T={shape[1]}], got "
                             f"{getattr(x, 'dtype', type(x).__name__)} "
                             f"{tuple(getattr(x, 'shape', ()))}")


def check_input(x_BxTxM, d_model: int, positions=None, segment_ids=None) -> None:
    """One line for an input that is not [B, T, d_model], or positions or segment ids that are
    not int [B, T]: the layer's input, checked once per call (its attention trusts it)."""
    shape = tuple(getattr(x_BxTxM, "shape", ()))
    if len(shape) != 3 or shape[-1] != d_model:
        raise ValueError(f"x: expected shape [B, T, d_model={d_model}], got {shape}")
    check_positions(shape[:2], positions, segment_ids)


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
      interpret: run a Pallas backend in interpret mode (CPU); needs ``implementation``
        "pallas_gpu", "pallas_tpu" or "split".
    Every argument is checked here, the input at each call (one line naming it); ``forward``
    is the call without the input checks, for a caller that checked them (``Block``).
    """

    def __init__(self, d_model: int, n_head: int, head_dim: int, *, n_kv_head: int | None = None,
                 n_global_heads: int = 1, window: int = 50,
                 window_sizes: Sequence[int | None] | None = None, qk_norm: bool = False,
                 use_bias: bool = False, rope_theta: float | None = None,
                 dtype=jnp.float32, param_dtype=jnp.float32, implementation: str | None = None,
                 interpret: bool = False, init_std: float = 0.02,
                 out_init_std: float | None = None, rngs: nnx.Rngs):
        self.window_sizes, n_kv_head = layer_spec(
            d_model, n_head, head_dim, n_kv_head, n_global_heads, window, window_sizes,
            rope_theta, implementation, interpret)
        self.d_model, self.n_head, self.n_kv_head, self.head_dim = (
            d_model, n_head, n_kv_head, head_dim)
        self.rope_theta = rope_theta
        self.implementation, self.interpret = implementation, interpret
        self.dtype = dtype
        init = nnx.initializers.normal(init_std)
        out_init = nnx.initializers.normal(init_std if out_init_std is None else out_init_std)

        def linear(din, dout, kernel_init, axes):  # axes: logical names (ls_jax/sharding.py)
            return nnx.Linear(din, dout, use_bias=use_bias, dtype=dtype, param_dtype=param_dtype,
                              kernel_init=partitioned(kernel_init, axes),
                              bias_init=partitioned(nnx.initializers.zeros_init(), axes[1:]),
                              rngs=rngs)

        self.q_proj = linear(d_model, n_head * head_dim, init, ("embed", "heads"))
        self.k_proj = linear(d_model, n_kv_head * head_dim, init, ("embed", "heads"))
        self.v_proj = linear(d_model, n_kv_head * head_dim, init, ("embed", "heads"))
        self.o_proj = linear(n_head * head_dim, d_model, out_init, ("heads", "embed"))
        if qk_norm:
            self.q_norm = nnx.LayerNorm(head_dim, use_bias=False, dtype=jnp.float32,
                                        param_dtype=param_dtype, rngs=rngs)
            self.k_norm = nnx.LayerNorm(head_dim, use_bias=False, dtype=jnp.float32,
                                        param_dtype=param_dtype, rngs=rngs)
        else:
            self.q_norm = self.k_norm = None
        # the split into the global cache and the ring buffer, for decoding with a KV cache
        self.cache_layout = CacheLayout.build(self.window_sizes, n_head, n_kv_head)

    def __call__(self, x_BxTxM: jax.Array, *, positions: jax.Array | None = None,
                 segment_ids: jax.Array | None = None, return_logit_stats: bool = False,
                 cache: KVCache | None = None, step: CacheStep | None = None, layer=0):
        """Returns y [B, T, d_model], or (y, max_abs_logit [n_head]) with return_logit_stats.

        With ``cache`` (a ``KVCache`` of this layer's ``cache_layout``) and ``step``
        (``CacheStep``), the T new tokens at ``positions`` attend over the cache's layer
        ``layer`` and are written into it; returns (y, the updated KVCache). See
        ``attend_cached``.
        """
        check_input(x_BxTxM, self.d_model, positions, segment_ids)
        if (cache is None) != (step is None):
            raise ValueError("cache, step: expected both (a cached call) or neither, got "
                             f"cache={type(cache).__name__}, step={type(step).__name__}")
        if cache is not None and (positions is None or segment_ids is not None
                                  or return_logit_stats):
            raise ValueError("cache: a cached call takes positions, and neither segment_ids "
                             "nor return_logit_stats")
        if cache is not None and isinstance(layer, int) and not 0 <= layer < cache.num_layers:
            raise ValueError(f"layer: expected 0 <= layer < {cache.num_layers} (the cache's "
                             f"layers), got {layer}")
        return self.forward(x_BxTxM, positions=positions, segment_ids=segment_ids,
                            return_logit_stats=return_logit_stats, cache=cache, step=step,
                            layer=layer)

    def forward(self, x_BxTxM: jax.Array, *, positions=None, segment_ids=None,
                return_logit_stats: bool = False, cache: KVCache | None = None,
                step: CacheStep | None = None, layer=0):
        """``__call__`` on inputs its checks passed."""
        q_BxTxHxD, k_BxTxGxD, v_BxTxGxD = self.project(x_BxTxM)
        if cache is not None:
            return self.attend_cached(q_BxTxHxD, k_BxTxGxD, v_BxTxGxD, cache, layer, positions,
                                      step)
        return attend(q_BxTxHxD, k_BxTxGxD, v_BxTxGxD, self.o_proj, self.window_sizes,
                      q_norm=self.q_norm, k_norm=self.k_norm, rope_theta=self.rope_theta,
                      dtype=self.dtype, implementation=self.implementation,
                      interpret=self.interpret, positions=positions, segment_ids=segment_ids,
                      return_logit_stats=return_logit_stats)

    @property
    def projections(self) -> tuple[nnx.Linear, nnx.Linear, nnx.Linear]:
        """The q, k and v projections."""
        return self.q_proj, self.k_proj, self.v_proj

    def project(self, x_BxTxM: jax.Array):
        """(q [B, T, H, D], k [B, T, G, D], v [B, T, G, D]): the input projections."""
        B, T, _ = x_BxTxM.shape
        return (self.q_proj(x_BxTxM).reshape(B, T, self.n_head, self.head_dim),
                self.k_proj(x_BxTxM).reshape(B, T, self.n_kv_head, self.head_dim),
                self.v_proj(x_BxTxM).reshape(B, T, self.n_kv_head, self.head_dim))

    # -- decoding with a KV cache (ls_jax/layers/kv_cache.py, ls_jax/inference/generate.py) ----------------------

    def attend_cached(self, q_BxCxHxD, k_BxCxGxD, v_BxCxGxD, cache: KVCache, layer,
                      positions_BxC, step: CacheStep):
        """Attention of C new tokens per row (projected) that also writes them into layer
        ``layer`` of ``cache``.

        A fresh step (an empty cache, positions 0 .. C-1: the first prefill chunk) attends with
        one ``ls_attention`` call, the full-sequence kernel. Otherwise queries read the cache
        through ``kernels.decode.cached_attention``; with C == 1 (a decode step) one
        ``kernels.decode.decode_step_attention`` call writes the token and attends (local heads
        read only their ring buffer). Returns (y [B, C, d_model], the updated KVCache).
        """
        B, C = q_BxCxHxD.shape[:2]
        layout = self.cache_layout
        if C == 1 and not step.fresh:
            out_BxHxD, new_cache = self.decode_heads(q_BxCxHxD, k_BxCxGxD, v_BxCxGxD, cache,
                                                     layer, positions_BxC, step)
            return self.o_proj(out_BxHxD.reshape(B, 1, self.n_head * self.head_dim)), new_cache
        q_BxCxHxD, k_BxCxGxD = norm_and_rope(
            q_BxCxHxD, k_BxCxGxD, positions_BxC, q_norm=self.q_norm, k_norm=self.k_norm,
            rope_theta=self.rope_theta, dtype=self.dtype)
        new_cache = write_layer(cache, layout, layer, k_BxCxGxD, v_BxCxGxD, positions_BxC, step)
        if step.fresh:
            out_BxCxHxD = kernel_attention(q_BxCxHxD, k_BxCxGxD, v_BxCxGxD, self.window_sizes,
                                           implementation=self.implementation,
                                           interpret=self.interpret)
        else:
            out_BxCxHxD = self._read_cache(q_BxCxHxD, k_BxCxGxD, v_BxCxGxD, layout,
                                           layer_of(cache.k_local, layer),
                                           layer_of(cache.v_local, layer),
                                           layer_of(new_cache.k_global, layer),
                                           layer_of(new_cache.v_global, layer),
                                           positions_BxC, step)
        y_BxCxM = self.o_proj(out_BxCxHxD.reshape(B, C, self.n_head * self.head_dim))
        return y_BxCxM, new_cache

    def decode_backend(self, batch: int, step: CacheStep) -> str:
        """The backend of this layer's decode step attention (one new token per row):
        ``kernels.decode.choose_decode_implementation``'s choice, as ``decode_step`` makes it."""
        return choose_decode_implementation(
            step.decode_implementation, one_query=True, head_dim=self.head_dim, batch=batch,
            all_global=all(w is None for w in self.window_sizes))

    def decode_heads(self, q_Bx1xHxD, k_Bx1xGxD, v_Bx1xGxD, cache: KVCache, layer,
                     positions_Bx1, step: CacheStep):
        """A decode step's attention before ``o_proj``: QK-norm and RoPE of one new token per
        row (projected), then one ``decode_step``. Returns (out [B, H, D], the KVCache)."""
        q_Bx1xHxD, k_Bx1xGxD = norm_and_rope(
            q_Bx1xHxD, k_Bx1xGxD, positions_Bx1, q_norm=self.q_norm, k_norm=self.k_norm,
            rope_theta=self.rope_theta, dtype=self.dtype)
        return decode_step(self.cache_layout, cache, layer, q_Bx1xHxD[:, 0], k_Bx1xGxD[:, 0],
                           v_Bx1xGxD[:, 0], positions_Bx1[:, 0], step, self.window_sizes,
                           interpret=self.interpret)

    def _read_cache(self, q_BxCxHxD, k_BxCxGxD, v_BxCxGxD, layout, k_ring, v_ring, k_global,
                    v_global, positions_BxC, step):
        """A prefill chunk's attention over the layer's cache: the global kv heads' part over
        the written global cache (``k_global``, ``v_global``), the local ones' over the old
        ring (``k_ring``, ``v_ring``), then the chunk's own keys, put back in head order."""
        new_lengths_B = step.new_lengths_B
        q_sorted = take_heads(q_BxCxHxD, layout.q_order)
        n_qg = len(layout.global_windows)
        scale = default_scale(q_BxCxHxD.shape[-1])
        q_pos_BxC = jnp.where(positions_BxC < new_lengths_B[:, None], positions_BxC, -1)
        parts = []
        if layout.global_kv:
            parts.append(cached_attention_validated(
                q_sorted[:, :, :n_qg], k_global, v_global, q_pos_BxC,
                global_positions(new_lengths_B, k_global.shape[1]), layout.global_windows,
                scale=scale, implementation=step.decode_implementation))
        if layout.local_kv:
            k_loc, v_loc = (take_heads(x, layout.local_kv) for x in (k_BxCxGxD, v_BxCxGxD))
            k_read = jnp.concatenate([k_ring, k_loc.astype(k_ring.dtype)], 1)
            v_read = jnp.concatenate([v_ring, v_loc.astype(v_ring.dtype)], 1)
            k_pos = jnp.concatenate(
                [ring_positions(step.old_lengths_B, k_ring.shape[1]), q_pos_BxC], 1)
            parts.append(cached_attention_validated(
                q_sorted[:, :, n_qg:], k_read, v_read, q_pos_BxC, k_pos, layout.local_windows,
                scale=scale, implementation=step.decode_implementation))
        out_sorted = jnp.concatenate(parts, axis=2) if len(parts) > 1 else parts[0]
        return take_heads(out_sorted, layout.q_inverse).astype(q_BxCxHxD.dtype)


def decode_step(layout: CacheLayout, cache: KVCache, layer, q_BxHxD, k_BxGxD, v_BxGxD,
                positions_B, step: CacheStep, window_sizes, *, interpret: bool = False):
    """One new token per row at ``positions_B`` (a row whose position is not below
    ``step.new_lengths_B`` is padding: it writes nothing): one
    ``kernels.decode.decode_step_attention`` call writes its key and value into layer
    ``layer`` of the cache (``kv_cache.decode_groups``) and every head attends. Returns
    (out [B, H, D], the KVCache)."""
    q_pos_B = jnp.where(positions_B < step.new_lengths_B, positions_B, -1)
    out_BxHxD, written = decode_step_attention_validated(
        q_BxHxD, k_BxGxD, v_BxGxD, q_pos_B,
        tuple(decode_groups(layout, cache, positions_B, step.old_lengths_B)), window_sizes,
        scale=default_scale(q_BxHxD.shape[-1]), layer=layer,
        implementation=step.decode_implementation, interpret=interpret)
    return out_BxHxD, with_written(layout, cache, written)


def norm_and_rope(q_BxTxHxD, k_BxTxGxD, positions_BxT, *, q_norm, k_norm, rope_theta, dtype):
    """QK-norm (when ``q_norm`` is not None) then RoPE (when ``rope_theta`` is not None) of
    queries and keys: the one place both the full-sequence and the cached path do it."""
    if q_norm is not None:
        q_BxTxHxD = q_norm(q_BxTxHxD).astype(dtype)
        k_BxTxGxD = k_norm(k_BxTxGxD).astype(dtype)
    if rope_theta is not None:
        q_BxTxHxD = apply_rope(q_BxTxHxD, positions_BxT, rope_theta)
        k_BxTxGxD = apply_rope(k_BxTxGxD, positions_BxT, rope_theta)
    return q_BxTxHxD, k_BxTxGxD


def kernel_attention(q_BxTxHxD, k_BxTxGxD, v_BxTxGxD, window_sizes, *, implementation,
                     interpret=False, segment_ids=None, return_logit_stats=False):
    """The full-sequence ``ls_attention`` call of training, evaluation and a fresh prefill
    chunk, on the layer's projections and its validated windows: one kernel call per shard,
    laid out as the model's mesh lays out heads and batch."""
    B, _, H, D = q_BxTxHxD.shape
    return ls_attention_validated(
        q_BxTxHxD, k_BxTxGxD, v_BxTxGxD, window_sizes, default_scale(D),
        segment_ids=segment_ids, return_logit_stats=return_logit_stats,
        implementation=implementation, interpret=interpret,
        partition_spec=attention_spec(B, H, k_BxTxGxD.shape[2]))


def attend(q_BxTxHxD, k_BxTxGxD, v_BxTxGxD, o_proj, window_sizes, *, q_norm, k_norm, rope_theta,
           dtype, implementation, interpret=False, positions=None, segment_ids=None,
           return_logit_stats=False):
    """The layer after the q/k/v projections: QK-norm, RoPE, ``ls_attention``, ``o_proj``.

    Shared by this NNX layer and the Linen one (ls_jax/interop/linen.py); ``q_norm``/``k_norm``/``o_proj``
    are callables of either library (``q_norm`` None: no QK-norm).
    """
    B, T, H, D = q_BxTxHxD.shape
    if rope_theta is not None and positions is None:
        positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    q_BxTxHxD, k_BxTxGxD = norm_and_rope(q_BxTxHxD, k_BxTxGxD, positions, q_norm=q_norm,
                                         k_norm=k_norm, rope_theta=rope_theta, dtype=dtype)
    result = kernel_attention(q_BxTxHxD, k_BxTxGxD, v_BxTxGxD, window_sizes,
                              segment_ids=segment_ids, return_logit_stats=return_logit_stats,
                              implementation=implementation, interpret=interpret)
    out_BxTxHxD = result[0] if return_logit_stats else result
    y_BxTxM = o_proj(out_BxTxHxD.reshape(B, T, H * D))
    if return_logit_stats:
        return y_BxTxM, result[1].max_abs_logit
    return y_BxTxM
