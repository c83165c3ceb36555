"""Every validation error names the argument, what was expected and what was given: of
kernels.ls_attention, of the decode path, and of the layers (NNX, Linen, make_attention_fn),
whose arguments are checked when they are built and whose input at each call."""

import jax
import jax.numpy as jnp
import numpy as np
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
    ((q.astype(jnp.int32), kv, kv, W), {}, r"q: expected dtype float32, bfloat16, float16 \(or float64 with "
     r"implementation=.reference.\), got int32"),
    ((q, kv.astype(jnp.bfloat16), kv.astype(jnp.bfloat16), W), {}, r"q, k, v: expected one dtype"),
    ((q, kv, kv, W), {"segment_ids": jnp.zeros((2, 7), jnp.int32)}, r"segment_ids: expected shape \[B=2, T=8\]"),
    ((q, kv, kv, W), {"segment_ids": jnp.zeros((2, 8))}, r"segment_ids: expected an integer dtype"),
    ((q, kv, kv, W), {"scale": -1.0}, r"scale: expected a finite float > 0 or None, got -1.0"),
    ((q, kv, kv, W), {"implementation": "flash"}, r"implementation: expected None or one of .*got 'flash'"),
    ((q, kv, kv, W), {"interpret": True}, r"interpret: True .* needs implementation one of .*got implementation=None"),
    ((q, kv, kv, W), {"implementation": "reference", "interpret": True}, r"interpret: True .* needs implementation one of .*got implementation=.reference."),
    ((q, kv, kv, W), {"partition_spec": ("data",)}, r"partition_spec: expected None or a jax.sharding.PartitionSpec, got tuple"),
])
def test_bad_inputs_raise_clear_errors(args, kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        ls_attention(*args, **kwargs)


# -- one head-count check for the kernel, the decode path, the layers and the cache -----------

def test_kv_head_count_is_one_check_everywhere():
    from flax import nnx

    from ls_jax.layers.attention import LSAttention
    from ls_jax.kernels.decode import cached_attention
    from ls_jax.layers.kv_cache import CacheLayout
    from ls_jax.interop.linen import LSAttention as LinenAttention

    bad_kv = jnp.zeros((2, 8, 3, 16))
    pos = jnp.zeros((2, 8), jnp.int32)
    arrays = r"k heads \(Hkv\): expected a divisor of the query heads Hq=4, got 3"
    with pytest.raises(ValueError, match=arrays):
        ls_attention(q, bad_kv, bad_kv, W)
    with pytest.raises(ValueError, match=arrays):
        cached_attention(q, bad_kv, bad_kv, pos, pos, W)
    layer = r"n_kv_head: expected a divisor of n_head=4, got 3"
    with pytest.raises(ValueError, match=layer):
        LSAttention(16, 4, 4, n_kv_head=3, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=layer):
        LinenAttention(d_model=16, n_head=4, head_dim=4, n_kv_head=3)
    with pytest.raises(ValueError, match=layer):
        CacheLayout.build(W, n_head=4, n_kv_head=3)


# -- the layers and make_attention_fn: arguments at construction, input at the call -----------

LAYER = dict(d_model=16, n_head=4, head_dim=4)


@pytest.mark.parametrize("kwargs,pattern", [
    (dict(head_dim=0), r"head_dim: expected an int >= 1, got 0"),
    (dict(d_model=-1), r"d_model: expected an int >= 1, got -1"),
    (dict(n_head=2.0), r"n_head: expected an int >= 1, got 2.0"),
    (dict(window=0), r"window: expected an int >= 1, got 0"),
    (dict(n_global_heads=5), r"n_global_heads: expected an int in \[0, n_head=4\], got 5"),
    (dict(window_sizes=(None, 3)), r"window_sizes: expected one entry per query head \(4\)"),
    (dict(implementation="xla"), r"implementation: expected None or one of .*got 'xla'"),
    (dict(interpret=True), r"interpret: True .* needs implementation one of .*got "
                           r"implementation=None"),
    (dict(interpret=1, implementation="pallas_gpu"), r"interpret: expected True or False"),
    (dict(rope_theta=-1.0), r"rope_theta: expected None or a finite number > 0, got -1.0"),
    (dict(head_dim=3, rope_theta=100.0), r"head_dim: expected an even number with rope_theta"),
], ids=["head_dim", "d_model", "n_head", "window", "n_global_heads", "window_sizes",
        "implementation", "interpret_without_pallas", "interpret_not_bool", "rope_theta",
        "rope_odd_head_dim"])
@pytest.mark.parametrize("library", ["nnx", "linen"])
def test_layers_refuse_bad_arguments_at_construction(library, kwargs, pattern):
    from flax import nnx

    from ls_jax.layers.attention import LSAttention
    from ls_jax.interop.linen import LSAttention as LinenAttention

    args = {**LAYER, **kwargs}
    with pytest.raises(ValueError, match=pattern):
        if library == "nnx":
            LSAttention(**args, rngs=nnx.Rngs(0))
        else:
            LinenAttention(**args)


@pytest.mark.parametrize("library", ["nnx", "linen"])
def test_layers_refuse_a_wrong_input_at_the_call(library):
    from flax import nnx

    from ls_jax.layers.attention import LSAttention
    from ls_jax.interop.linen import LSAttention as LinenAttention

    good, wide = jnp.zeros((2, 5, 16)), jnp.zeros((2, 5, 12))
    if library == "nnx":
        call = LSAttention(**LAYER, rngs=nnx.Rngs(0))
    else:
        layer = LinenAttention(**LAYER)
        params = layer.init(jax.random.key(0), good)
        call = lambda x, **kw: layer.apply(params, x, **kw)
    with pytest.raises(ValueError, match=r"x: expected shape \[B, T, d_model=16\], got \(2, 5, 12\)"):
        call(wide)
    with pytest.raises(ValueError, match=r"x: expected shape \[B, T, d_model=16\], got \(5, 16\)"):
        call(good[0])
    with pytest.raises(ValueError, match=r"positions: expected int \[B=2, T=5\], got int32 \(2, 4\)"):
        call(good, positions=jnp.zeros((2, 4), jnp.int32))


@pytest.mark.parametrize("tokens,positions,pattern", [
    (jnp.zeros((2, 5), jnp.float32), None, r"tokens: expected int \[B, T\], got float32 \(2, 5\)"),
    (jnp.zeros((5,), jnp.int32), None, r"tokens: expected int \[B, T\], got int32 \(5,\)"),
    (jnp.zeros((2, 5), jnp.int32), jnp.zeros((2, 4), jnp.int32),
     r"positions: expected int \[B=2, T=5\], got int32 \(2, 4\)"),
], ids=["float_tokens", "one_row", "positions_shape"])
def test_the_model_refuses_a_wrong_input_once_at_the_call(tokens, positions, pattern):
    from flax import nnx

    from ls_jax.config import ModelConfig
    from ls_jax.layers.transformer import Transformer

    model = Transformer(ModelConfig(vocab_size=16, n_layer=1, d_model=16, n_head=2, head_dim=8,
                                    window=3, max_seq_len=8), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=pattern):
        model(tokens, positions=positions)


@pytest.mark.parametrize("args,kwargs,pattern", [
    (((),), {}, r"window_sizes: expected a tuple with one entry per query head"),
    ((W,), dict(implementation="xla"), r"implementation: expected None or one of .*got 'xla'"),
    ((W,), dict(interpret=True), r"interpret: True .* needs implementation one of"),
], ids=["no_heads", "implementation", "interpret_without_pallas"])
def test_make_attention_fn_refuses_bad_arguments_at_construction(args, kwargs, pattern):
    from ls_jax.interop.attention_fn import make_attention_fn

    with pytest.raises(ValueError, match=pattern):
        make_attention_fn(*args, **kwargs)


@pytest.mark.parametrize("library", ["nnx", "linen"])
def test_layers_run_the_pallas_gpu_kernel_in_interpret_mode(library):
    """``interpret=True`` reaches the kernel: on CPU the layer runs our Pallas GPU kernel in
    interpret mode and matches the reference backend."""
    import warnings

    from flax import nnx

    from ls_jax.layers.attention import LSAttention
    from ls_jax.interop.linen import LSAttention as LinenAttention

    warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*")
    x = jax.random.normal(jax.random.key(1), (1, 12, 16))
    kw = dict(LAYER, n_kv_head=2, window=3)
    if library == "nnx":
        ours = LSAttention(**kw, implementation="pallas_gpu", interpret=True, rngs=nnx.Rngs(0))
        ref = LSAttention(**kw, implementation="reference", rngs=nnx.Rngs(0))
        call = nnx.jit(lambda layer, x: layer(x))  # one compile, not one per operation
        got, want = call(ours, x), call(ref, x)
    else:
        ours = LinenAttention(**kw, implementation="pallas_gpu", interpret=True)
        params = jax.jit(ours.init)(jax.random.key(0), x)
        got = jax.jit(ours.apply)(params, x)
        want = jax.jit(LinenAttention(**kw, implementation="reference").apply)(params, x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5)
