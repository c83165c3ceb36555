"""Every validation error of kernels.ls_attention names the argument, what was expected and given."""

import jax.numpy as jnp
import pytest

from ls_jax.kernels import ls_attention

q = jnp.zeros((2, 8, 4, 16))
kv = jnp.zeros((2, 8, 2, 16))
W = (None, 3, 3, 3)


@pytest.mark.parametrize("args,kwargs,pattern", [
    ((jnp.zeros((8, 4, 16)), kv, kv, W), {}, r"q: expected rank 4 \[B, T, H, D\], got rank 3"),
    ((q, jnp.zeros((2, 8, 2)), jnp.zeros((2, 8, 2)), W), {}, r"k: expected rank 4.*got rank 3"),
    ((q, kv, jnp.zeros((2, 8, 2, 8)), W), {}, r"k and v: expected the same shape"),
    ((q, jnp.zeros((2, 9, 2, 16)), jnp.zeros((2, 9, 2, 16)), W), {}, r"k: expected shape \[B=2, T=8, Hkv, D=16\]"),
    ((q, jnp.zeros((2, 8, 3, 16)), jnp.zeros((2, 8, 3, 16)), W), {}, r"k heads \(Hkv\): expected a divisor of the query heads Hq=4, got 3"),
    ((q, kv, kv, (None, 3, 3)), {}, r"window_sizes: expected one entry per query head \(4\), got 3"),
    ((q, kv, kv, (None, 0, 3, 3)), {}, r"window_sizes\[1\]: expected an int >= 1 or None, got 0"),
    ((q, kv, kv, (None, 2.5, 3, 3)), {}, r"window_sizes\[1\]: expected an int >= 1 or None, got 2.5"),
    ((q, kv, kv, 5), {}, r"window_sizes: expected a tuple of 4 entries"),
    ((q.astype(jnp.int32), kv, kv, W), {}, r"q: expected dtype float32, bfloat16 or float16, got int32"),
    ((q, kv.astype(jnp.bfloat16), kv.astype(jnp.bfloat16), W), {}, r"q, k, v: expected one dtype"),
    ((q, kv, kv, W), {"segment_ids": jnp.zeros((2, 7), jnp.int32)}, r"segment_ids: expected shape \[B=2, T=8\]"),
    ((q, kv, kv, W), {"segment_ids": jnp.zeros((2, 8))}, r"segment_ids: expected an integer dtype"),
    ((q, kv, kv, W), {"scale": -1.0}, r"scale: expected a finite float > 0 or None, got -1.0"),
    ((q, kv, kv, W), {"implementation": "flash"}, r"implementation: expected None or one of .*got 'flash'"),
    ((q, kv, kv, W), {"interpret": True}, r"interpret: True needs an explicit implementation"),
    ((q, kv, kv, W), {"implementation": "reference", "interpret": True}, r"interpret: only the Pallas backends"),
])
def test_bad_inputs_raise_clear_errors(args, kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        ls_attention(*args, **kwargs)
