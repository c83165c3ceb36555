"""make_attention_fn inside Flax's own attention layers (NNX and Linen), against a masked softmax
written out here. (Our window against jax.nn's local_window_size: tests/test_reference.py.)"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ls_jax.interop.attention_fn import make_attention_fn

T, HEADS, HEAD_DIM = 10, 4, 8
FEATURES = HEADS * HEAD_DIM
WINDOWS = (None, 1, 3, 6)


def window_mask(T, windows):
    """bool [H, T, T] by explicit loops: query i sees key j iff j <= i and i - j < p."""
    m = np.zeros((len(windows), T, T), bool)
    for h, p in enumerate(windows):
        for i in range(T):
            for j in range(T):
                m[h, i, j] = j <= i and (p is None or i - j < p)
    return m


def masked_softmax_attention(q, k, v, windows):
    """numpy float64 reference: [B, T, H, D] inputs (k/v heads repeated for GQA)."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    rep = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, rep, axis=2), np.repeat(v, rep, axis=2)
    logits = np.einsum("bthd,bshd->bhts", q, k) / np.sqrt(q.shape[-1])
    logits = np.where(window_mask(q.shape[1], windows)[None], logits, -np.inf)
    w = np.exp(logits - logits.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    return np.einsum("bhts,bshd->bthd", w, v)


def qkv(kv_heads=HEADS, batch=(2,)):
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (*batch, T, HEADS, HEAD_DIM))
    k = jax.random.normal(keys[1], (*batch, T, kv_heads, HEAD_DIM))
    v = jax.random.normal(keys[2], (*batch, T, kv_heads, HEAD_DIM))
    return q, k, v


@pytest.mark.parametrize("kv_heads", [HEADS, 2])
def test_fn_matches_masked_softmax(kv_heads):
    q, k, v = qkv(kv_heads)
    out = jax.jit(make_attention_fn(WINDOWS))(q, k, v)
    np.testing.assert_allclose(out, masked_softmax_attention(q, k, v, WINDOWS), rtol=1e-5, atol=1e-5)


def test_fn_extra_batch_dims_and_dtype():
    q, k, v = qkv(batch=(2, 3))
    out = jax.jit(make_attention_fn(WINDOWS), static_argnames="dtype")(q, k, v,
                                                                      dtype=jnp.bfloat16)
    assert out.shape == q.shape and out.dtype == jnp.bfloat16
    ref = masked_softmax_attention(q.reshape(6, T, HEADS, HEAD_DIM), k.reshape(6, T, HEADS, HEAD_DIM),
                                   v.reshape(6, T, HEADS, HEAD_DIM), WINDOWS)
    np.testing.assert_allclose(np.asarray(out, np.float32).reshape(ref.shape), ref, atol=3e-2)


def test_in_nnx_multi_head_attention():
    fn = make_attention_fn(WINDOWS)
    layer = nnx.MultiHeadAttention(num_heads=HEADS, in_features=FEATURES, attention_fn=fn,
                                   decode=False, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, T, FEATURES))
    # the layer's calls jitted (one compile each); a mask is a concrete array, closed over
    out = nnx.jit(lambda layer, x: layer(x, is_causal=True))(layer, x)
    # reference: the same layer with Flax's own attention and the window mask written out
    layer.attention_fn = nnx.dot_product_attention
    mask = jnp.asarray(window_mask(T, WINDOWS))[None]
    ref = nnx.jit(lambda layer, x: layer(x, mask=mask))(layer, x)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    # a causal mask written out is accepted, as a concrete array
    layer.attention_fn = fn
    causal = jnp.tril(jnp.ones((T, T), bool))[None, None]
    np.testing.assert_allclose(
        nnx.jit(lambda layer, x: layer(x, mask=causal, is_causal=True))(layer, x), out,
        rtol=1e-6, atol=1e-6)


def test_in_linen_multi_head_dot_product_attention():
    x = jax.random.normal(jax.random.key(1), (2, T, FEATURES))
    ours = nn.MultiHeadDotProductAttention(num_heads=HEADS, attention_fn=make_attention_fn(WINDOWS))
    flax_own = nn.MultiHeadDotProductAttention(num_heads=HEADS)
    params = flax_own.init(jax.random.key(2), x)
    mask = jnp.asarray(window_mask(T, WINDOWS))[None]
    ref = jax.jit(lambda params, x: flax_own.apply(params, x, mask=mask))(params, x)
    causal = nn.make_causal_mask(x[..., 0])  # concrete, closed over
    np.testing.assert_allclose(jax.jit(lambda params, x: ours.apply(params, x, mask=causal))(
        params, x), ref, rtol=1e-5, atol=1e-5)
    # jit works with mask=None
    np.testing.assert_allclose(jax.jit(ours.apply)(params, x), ref, rtol=1e-5, atol=1e-5)


def test_refuses_what_it_cannot_honour():
    fn = make_attention_fn(WINDOWS)
    q, k, v = qkv()
    full = jnp.ones((1, 1, T, T), bool)
    cases = [
        (dict(mask=full), r"mask: expected None or the causal mask"),
        (dict(is_causal=False), r"is_causal: expected True"),
        (dict(bias=jnp.zeros((1, HEADS, T, T))), r"bias: expected None"),
        (dict(dropout_rate=0.1, deterministic=False), r"dropout_rate: expected 0 or deterministic=True"),
        (dict(module=object()), r"sow_weights: expected False"),
        (dict(precision=jax.lax.Precision.HIGHEST), r"precision: expected None or the default"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            fn(q, k, v, **kwargs)
    # dropout in evaluation (deterministic) is fine
    np.testing.assert_allclose(fn(q, k, v, dropout_rate=0.1, deterministic=True), fn(q, k, v))
    # a mask traced under jit cannot be checked: refused
    with pytest.raises(ValueError, match=r"mask: expected None or a concrete causal mask, got a traced"):
        jax.jit(lambda m: fn(q, k, v, mask=m))(jnp.tril(jnp.ones((T, T), bool)))
    # in the layers: dropout while training, a padding mask
    layer = nnx.MultiHeadAttention(num_heads=HEADS, in_features=FEATURES, attention_fn=fn,
                                   decode=False, dropout_rate=0.1, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, T, FEATURES))
    with pytest.raises(ValueError, match=r"dropout_rate"):
        layer(x, is_causal=True, deterministic=False)
    with pytest.raises(ValueError, match=r"is_causal: expected True"):
        layer(x, deterministic=True)
    padding = nn.make_attention_mask(jnp.arange(T) < 7, jnp.arange(T) < 7)[None]
    linen_layer = nn.MultiHeadDotProductAttention(num_heads=HEADS, attention_fn=fn)
    params = linen_layer.init(jax.random.key(2), x)
    with pytest.raises(ValueError, match=r"mask: expected None or the causal mask"):
        linen_layer.apply(params, x, mask=padding)
    with pytest.raises(ValueError, match=r"window_sizes: expected one entry per query head \(4\)"):
        make_attention_fn((None, 3))(q, k, v)
    with pytest.raises(ValueError, match=r"window_sizes: expected a tuple with one entry per query head"):
        make_attention_fn(51)
