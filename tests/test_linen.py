"""ls_jax.interop.linen.LSAttention: the NNX layer's parameter tree and outputs, in Linen."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ls_jax import LSAttention as NNXAttention
from ls_jax.interop.linen import LSAttention as LinenAttention

D_MODEL, N_HEAD, HEAD_DIM, T = 24, 4, 6, 12


def nnx_params_as_linen_tree(layer) -> dict:
    """{'q_proj': {'kernel': ...}, ...}: the NNX layer's parameters as a plain nested dict."""
    return jax.tree.map(jnp.asarray, nnx.to_pure_dict(nnx.state(layer, nnx.Param)))


@pytest.mark.parametrize("options", [
    dict(),
    dict(n_kv_head=2, window=3),
    dict(qk_norm=True, rope_theta=100.0, use_bias=True, n_global_heads=2, window=5),
    dict(window_sizes=(None, 2, 7, 1), n_kv_head=1),
], ids=["default", "gqa", "qknorm_rope_bias", "explicit_windows"])
def test_linen_matches_nnx(options):
    kwargs = dict(d_model=D_MODEL, n_head=N_HEAD, head_dim=HEAD_DIM, **options)
    nnx_layer = NNXAttention(**kwargs, rngs=nnx.Rngs(1))
    # perturb the norm scales away from their init (ones) so that a swapped q/k norm shows
    if options.get("qk_norm"):
        nnx_layer.q_norm.scale[...] = 1.0 + 0.3 * jax.random.normal(jax.random.key(7), (HEAD_DIM,))
        nnx_layer.k_norm.scale[...] = 1.0 - 0.2 * jax.random.normal(jax.random.key(8), (HEAD_DIM,))
    x_BxTxM = jax.random.normal(jax.random.key(2), (2, T, D_MODEL))
    linen_layer = LinenAttention(**kwargs)
    linen_params = jax.jit(linen_layer.init)(jax.random.key(3), x_BxTxM)["params"]
    nnx_tree = nnx_params_as_linen_tree(nnx_layer)

    # the same parameter names and shapes
    shapes = lambda tree: jax.tree.map(lambda a: a.shape, tree)
    assert shapes(linen_params) == shapes(nnx_tree)

    # the calls jitted: one compile each instead of one per operation
    y_nnx, stats_nnx = nnx.jit(lambda layer, x: layer(x, return_logit_stats=True))(
        nnx_layer, x_BxTxM)
    apply = jax.jit(lambda params, x: linen_layer.apply({"params": params}, x,
                                                        return_logit_stats=True))
    y_linen, stats_linen = apply(nnx_tree, x_BxTxM)
    np.testing.assert_allclose(np.asarray(y_linen), np.asarray(y_nnx), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(stats_linen), np.asarray(stats_nnx), rtol=1e-6)
    # and the output is not trivially equal to what the Linen init would give
    y_own, _ = apply(linen_params, x_BxTxM)
    assert not np.allclose(np.asarray(y_own), np.asarray(y_nnx))


def test_linen_bad_kv_heads_is_one_line_error_at_construction():
    with pytest.raises(ValueError, match=r"n_kv_head: expected a divisor of n_head=4, got 3"):
        LinenAttention(d_model=D_MODEL, n_head=N_HEAD, head_dim=HEAD_DIM, n_kv_head=3)
