"""A user's program, checked by mypy (tests/test_typing.py): the public API's types as a type
checker sees them through the installed package."""

from typing import assert_type

import jax
import jax.numpy as jnp
from flax import nnx

from ls_jax import LSAttention, LogitStats, ls_attention
from ls_jax.interop.attention_fn import make_attention_fn
from ls_jax.interop.linen import LSAttention as LinenLSAttention

q = jnp.zeros((2, 16, 4, 8))
kv = jnp.zeros((2, 16, 2, 8))
windows = (None, 4, 4, 4)

out = ls_attention(q, kv, kv, windows)
assert_type(out, jax.Array)
out, stats = ls_attention(q, kv, kv, windows, return_logit_stats=True,
                          implementation="reference")
assert_type(stats, LogitStats)
assert_type(stats.max_abs_logit, jax.Array)

layer = LSAttention(32, 4, 8, n_kv_head=2, window=4, rngs=nnx.Rngs(0))
assert_type(layer, LSAttention)
y = layer(jnp.zeros((2, 16, 32)))

fn = make_attention_fn(windows)
mha = nnx.MultiHeadAttention(num_heads=4, in_features=32, attention_fn=fn, decode=False,
                             rngs=nnx.Rngs(0))
linen_layer = LinenLSAttention(d_model=32, n_head=4, head_dim=8, window=4)
assert_type(linen_layer, LinenLSAttention)
