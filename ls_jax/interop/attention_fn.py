"""LS-attention as the ``attention_fn`` of Flax's own attention layers.

    from ls_jax.interop.attention_fn import make_attention_fn
    fn = make_attention_fn((None, 51, 51, 51))              # one window per head
    nnx.MultiHeadAttention(num_heads=4, in_features=128, attention_fn=fn, decode=False, rngs=...)
        (x, is_causal=True)
    nn.MultiHeadDotProductAttention(num_heads=4, attention_fn=fn).apply(params, x)

The returned function computes causal attention with a window per query head through
``ls_jax.kernels.ls_attention``; the layer keeps its own projections and parameters. It honours
what Flax passes in or refuses it with a ``ValueError`` naming the argument; it never drops an
argument silently:

- causality: the result is always causal. ``nnx.MultiHeadAttention`` must be called with
  ``is_causal=True``; a ``mask`` must be None or the plain causal mask (e.g.
  ``nn.make_causal_mask``) given as a concrete array (a mask traced inside ``jit`` cannot be
  checked and is refused: pass ``mask=None``). Any other mask (padding, decode cache,
  bidirectional) is refused.
- ``bias``, ``module`` (``sow_weights=True``: the kernel never forms the weights),
  ``input_positions``, custom einsums and a ``precision`` other than the default are refused.
- dropout: ``dropout_rate > 0`` is refused unless ``deterministic=True`` (evaluation).
- ``dtype``: q, k and v are cast to it (default: their common dtype), as Flax does.
- the softmax scale is 1 / sqrt(head_dim), as in Flax's ``dot_product_attention``.
- query, key and value: ``[batch..., T, heads, head_dim]`` with the same T (self-attention);
  fewer key/value heads than query heads is grouped-query attention.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ls_jax.layers.attention import check_backend
from ls_jax.kernels import ls_attention, normalize_window_sizes


def _is_default_precision(precision) -> bool:
    return precision is None or precision == jax.lax.Precision.DEFAULT or precision == "default"


def _check_causal_mask(mask, T: int) -> None:
    if isinstance(mask, jax.core.Tracer):
        raise ValueError(
            f"mask: expected None or a concrete causal mask, got a traced mask of shape "
            f"{tuple(mask.shape)} that cannot be checked; this attention_fn is causal by "
            "construction, pass mask=None")
    mask = np.asarray(mask)
    if mask.ndim < 2 or mask.shape[-2:] != (T, T):
        raise ValueError(
            f"mask: expected None or a causal mask of shape [..., T={T}, T={T}], got shape "
            f"{mask.shape}")
    causal_TxT = np.tril(np.ones((T, T), bool))
    if not np.array_equal(np.broadcast_to(mask.astype(bool), mask.shape),
                          np.broadcast_to(causal_TxT, mask.shape)):
        raise ValueError(
            "mask: expected None or the causal mask (key j visible to query i iff j <= i); "
            "got another mask (padding/bidirectional/decode masks are not supported by this "
            "attention_fn; use ls_jax.kernels.ls_attention with segment_ids for packing)")


def make_attention_fn(window_sizes: Sequence[int | None], implementation: str | None = None,
                      *, interpret: bool = False) -> Callable[..., jax.Array]:
    """An ``attention_fn`` for ``nnx.MultiHeadAttention`` / ``nn.MultiHeadDotProductAttention``.

    Args:
      window_sizes: one entry per query head: an int p >= 1 for a local head (query i sees keys
        i - p < j <= i), None for a global head (every j <= i).
      implementation: ``ls_attention`` backend (None: best for the platform).
      interpret: run a Pallas backend in interpret mode (CPU testing).
    The arguments are checked here (one line naming a bad one), the call's inputs at the call.
    """
    if isinstance(window_sizes, (str, bytes)) or not isinstance(window_sizes, Sequence) \
            or not len(window_sizes):
        raise ValueError(
            f"window_sizes: expected a tuple with one entry per query head (int >= 1 for a local "
            f"head, None for a global one), got {window_sizes!r}")
    windows = normalize_window_sizes(window_sizes, len(window_sizes))
    check_backend(implementation, interpret)

    def attention_fn(query, key, value, bias=None, mask=None, broadcast_dropout: bool = True,
                     dropout_rng=None, dropout_rate: float = 0.0, deterministic: bool = True,
                     dtype: Any = None, precision=None, module=None, is_causal: bool = True,
                     force_fp32_for_softmax: bool = False, qk_attn_weights_einsum=None,
                     attn_weights_value_einsum=None, input_positions=None):
        # force_fp32_for_softmax and broadcast_dropout need nothing: the softmax is always
        # float32 inside the kernels, and no dropout is applied.
        del force_fp32_for_softmax, broadcast_dropout, dropout_rng
        # the shapes first: a decode cache (nnx.MultiHeadAttention(decode=True)) also comes
        # with is_causal=False and a mask, which would otherwise be named as the cause
        if query.ndim < 3:
            raise ValueError(
                f"query: expected shape [batch..., T, heads, head_dim], got {tuple(query.shape)}")
        if key.shape[-3] != query.shape[-3] or value.shape[-3] != query.shape[-3]:
            raise ValueError(
                f"key/value: expected the query's length T={query.shape[-3]} (causal "
                f"self-attention over the whole sequence), got key {tuple(key.shape)}, value "
                f"{tuple(value.shape)}: a decode cache (decode=True) is not supported by this "
                "attention_fn; call the layer with decode=False, or decode with "
                "ls_jax.LSAttention and its KV cache (ls_jax.inference.generate)")
        if not is_causal:
            raise ValueError(
                "is_causal: expected True (this attention_fn is causal LS-attention; call "
                "nnx.MultiHeadAttention with is_causal=True), got False")
        if bias is not None:
            raise ValueError(
                f"bias: expected None (LS-attention adds no logit bias), got an array of shape "
                f"{tuple(np.shape(bias))}")
        if dropout_rate and not deterministic:
            raise ValueError(
                f"dropout_rate: expected 0 or deterministic=True (the kernels apply no "
                f"attention dropout), got dropout_rate={dropout_rate} with deterministic=False")
        if module is not None:
            raise ValueError(
                "sow_weights: expected False (the kernels never form the attention weights), "
                "got a module to sow them into")
        if input_positions is not None:
            raise ValueError(
                "input_positions: expected None (apply RoPE before attention_fn), got an array")
        if qk_attn_weights_einsum is not None or attn_weights_value_einsum is not None:
            raise ValueError(
                "qk_attn_weights_einsum / attn_weights_value_einsum: expected None (the kernels "
                "use their own matmuls), got a custom einsum")
        if not _is_default_precision(precision):
            raise ValueError(
                f"precision: expected None or the default (the kernels choose their own matmul "
                f"precision), got {precision!r}")
        T = query.shape[-3]
        if mask is not None:
            _check_causal_mask(mask, T)
        if dtype is None:
            dtype = jnp.result_type(query.dtype, key.dtype, value.dtype)
        batch = query.shape[:-3]

        def flat(x):  # [batch..., T, heads, D] -> [B, T, heads, D]
            return x.astype(dtype).reshape((math.prod(batch),) + x.shape[-3:])

        out_BxTxHxD = ls_attention(flat(query), flat(key), flat(value), windows,
                                   implementation=implementation, interpret=interpret)
        return out_BxTxHxD.reshape(batch + out_BxTxHxD.shape[1:])

    return attention_fn


__all__ = ["make_attention_fn"]
