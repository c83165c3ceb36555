"""The decode step's dense layers (kernels/dense.py): the Pallas GPU kernel in interpret mode
against the XLA twin, its Triton lowering for a Hopper GPU without one, the backend rule, and
the model's decode step through them against flax's modules."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ls_jax.kernels import dense
from triton_lowering import TRITON_CALL, lower_for_hopper  # tests/, beside this file


def _normal(i, shape, dtype=jnp.float32, scale=1.0):
    return (jax.random.normal(jax.random.key(i), shape) * scale).astype(dtype)


def _norm_case(R, K, widths, bias, param_dtype=jnp.bfloat16):
    x = _normal(0, (R, K))
    scale, shift = _normal(1, (K,), scale=0.3) + 1.0, _normal(2, (K,), scale=0.1)
    weights = [_normal(3 + i, (K, n), param_dtype, 0.05) for i, n in enumerate(widths)]
    biases = [_normal(10 + i, (n,), param_dtype, 0.1) for i, n in enumerate(widths)] if bias \
        else None
    return x, scale, shift, weights, biases


def _close(got, want):
    """Within a few bfloat16 roundings of the output's magnitude: the kernel adds the bias in
    float32 before it rounds, flax after."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=4 * 2.0 ** -8 * max(1.0, np.abs(want).max()))


@pytest.mark.parametrize("R, K, widths, bias, activation", [
    pytest.param(1, 192, (192, 192, 192), True, None, id="one_row_qkv"),
    pytest.param(5, 48, (40,), False, "gelu_tanh", id="ragged_k_and_n_gelu"),
    pytest.param(64, 192, (768,), True, "gelu_tanh", id="full_block_of_rows"),
    pytest.param(70, 100, (24, 8), True, None, id="two_row_blocks"),
])
def test_norm_dense_kernel_matches_xla(R, K, widths, bias, activation):
    x, scale, shift, weights, biases = _norm_case(R, K, widths, bias)
    kw = dict(eps=1e-6, compute_dtype=jnp.bfloat16, activation=activation)
    want = dense.norm_dense(x, scale, shift, weights, biases, **kw)
    got = dense.norm_dense(x, scale, shift, weights, biases, implementation="pallas_gpu",
                           interpret=True, **kw)
    assert len(got) == len(widths)
    for g, w in zip(got, want):
        assert g.dtype == jnp.bfloat16
        _close(g, w)


@pytest.mark.parametrize("R, K, N, bias", [
    pytest.param(1, 192, 192, True, id="one_row"),
    pytest.param(3, 768, 192, False, id="long_k_no_bias"),
    pytest.param(66, 40, 24, True, id="ragged_two_row_blocks"),
])
def test_dense_residual_kernel_matches_xla(R, K, N, bias):
    h = _normal(0, (R, K), jnp.bfloat16)
    w = _normal(1, (K, N), jnp.float32, 0.05)  # float32 parameters, bfloat16 compute
    b = _normal(2, (N,), jnp.float32, 0.1) if bias else None
    residual = _normal(3, (R, N))
    want = dense.dense_residual(h, w, b, residual, compute_dtype=jnp.bfloat16)
    got = dense.dense_residual(h, w, b, residual, compute_dtype=jnp.bfloat16,
                               implementation="pallas_gpu", interpret=True)
    assert got.dtype == jnp.float32
    _close(got, want)


def test_layer_norm_is_flax_layer_norm():
    x = _normal(0, (4, 48)) * 3 + 1
    ln = nnx.LayerNorm(48, rngs=nnx.Rngs(0))
    ln.scale[...], ln.bias[...] = _normal(1, (48,)), _normal(2, (48,))
    np.testing.assert_allclose(dense.layer_norm(x, ln.scale[...], ln.bias[...], ln.epsilon),
                               ln(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("R, K, widths, bias, activation", [
    pytest.param(1, 192, (192, 192, 192), True, None, id="paper_qkv_one_row"),
    pytest.param(64, 192, (768,), True, "gelu_tanh", id="paper_mlp_in"),
    pytest.param(64, 768, (3072,), False, "gelu_tanh", id="wide_mlp_in_no_bias"),
    pytest.param(3, 100, (24,), True, None, id="ragged"),
])
def test_norm_dense_lowers_to_one_triton_launch(R, K, widths, bias, activation):
    """The Triton lowering (jaxpr -> Triton IR, in Python) for a Hopper GPU, without one: what
    interpret mode does not exercise."""
    x, scale, shift, weights, biases = _norm_case(R, K, widths, bias)
    text = lower_for_hopper(
        lambda *a: dense.norm_dense(*a[:3], a[3], a[4], eps=1e-5, compute_dtype=jnp.bfloat16,
                                    activation=activation, implementation="pallas_gpu"),
        x, scale, shift, weights, biases)
    assert text.count(TRITON_CALL) == 1 and "ls_dense" in text


@pytest.mark.parametrize("R, K, N", [pytest.param(1, 768, 192, id="paper_mlp_out"),
                                     pytest.param(64, 3072, 768, id="wide_mlp_out"),
                                     pytest.param(3, 40, 24, id="ragged")])
def test_dense_residual_lowers_to_one_triton_launch(R, K, N):
    args = (_normal(0, (R, K), jnp.bfloat16), _normal(1, (K, N), jnp.bfloat16),
            _normal(2, (N,), jnp.bfloat16), _normal(3, (R, N)))
    text = lower_for_hopper(
        lambda h, w, b, r: dense.dense_residual(h, w, b, r, compute_dtype=jnp.bfloat16,
                                                implementation="pallas_gpu"), *args)
    assert text.count(TRITON_CALL) == 1


SMALL = ((1536, 576),)  # a LayerNorm of 192 features and a 576-column product


@pytest.mark.parametrize("rows, dtype, attention, products, want", [
    pytest.param(1, jnp.bfloat16, "pallas_gpu", SMALL, "pallas_gpu", id="decode_row"),
    pytest.param(dense.PALLAS_MAX_ROWS, jnp.float16, "pallas_gpu", SMALL, "pallas_gpu",
                 id="most_rows_float16"),
    pytest.param(dense.PALLAS_MAX_ROWS + 1, jnp.bfloat16, "pallas_gpu", SMALL, "xla",
                 id="more_rows_are_a_gemm"),
    pytest.param(16, jnp.bfloat16, "pallas_gpu", SMALL + ((6144, 3072),), "xla",
                 id="a_wide_product"),
    pytest.param(1, jnp.float32, "pallas_gpu", SMALL, "xla", id="float32_compute"),
    pytest.param(8, jnp.bfloat16, "xla", SMALL, "xla", id="xla_attention"),
    pytest.param(1, jnp.bfloat16, "reference", SMALL, "xla", id="reference_attention"),
])
def test_choose_dense_implementation(rows, dtype, attention, products, want):
    assert dense.choose_dense_implementation(rows, dtype=dtype, attention=attention,
                                             products=products) == want


@pytest.mark.parametrize("rows, row_bytes, N", [(1, 768, 192), (64, 6144, 3072), (3, 100, 17)])
def test_x_reads_count_each_column_block(rows, row_bytes, N):
    from ls_jax.kernels.pallas_gpu.dense import BLOCK_N

    programs = -(-N // BLOCK_N)
    assert dense.x_reads(rows, row_bytes, N) == rows * row_bytes * programs


@pytest.mark.parametrize("shape, rows, want", [
    pytest.param((6, 32, 192), 1, "pallas_gpu", id="paper_one_row"),
    pytest.param((6, 32, 192), 64, "pallas_gpu", id="paper_64_rows"),
    pytest.param((12, 64, 768), 1, "pallas_gpu", id="wide_one_row"),
    pytest.param((12, 64, 768), 16, "xla", id="wide_16_rows"),
])
def test_model_blocks_choose_by_their_products(shape, rows, want):
    """The benchmark's shapes (bench/inference.py): (heads, head_dim, d_model), MLP 4x, the
    float32 residual stream of ``Transformer``."""
    from ls_jax.config import ModelConfig
    from ls_jax.layers.transformer import Block

    H, D, d = shape
    cfg = ModelConfig(vocab_size=97, n_layer=1, d_model=d, n_head=H, head_dim=D,
                      n_global_heads=1, window=50, max_seq_len=64, compute_dtype="bfloat16")
    block = Block(cfg, rngs=nnx.Rngs(0))
    assert dense.choose_dense_implementation(rows, dtype=jnp.bfloat16, attention="pallas_gpu",
                                             products=block.dense_products(jnp.float32)) == want


def _recorded(fn, calls: list):
    def wrapped(*args, **kwargs):
        calls.append(1)
        return fn(*args, **kwargs)
    return wrapped


@pytest.mark.parametrize("use_bias", [True, False], ids=["bias", "no_bias"])
def test_model_decode_step_through_the_kernels_matches_flax(use_bias, monkeypatch):
    """A decode step on the Pallas kernels (attention and dense layers, interpret mode) gives
    the reference attention's and flax's logits and cache, within bfloat16 rounding."""
    from ls_jax.config import ModelConfig
    from ls_jax.inference.generate import decode_step
    from ls_jax.layers.transformer import Block, Transformer

    cfg = ModelConfig(vocab_size=97, n_layer=2, d_model=64, n_head=4, head_dim=16,
                      n_global_heads=1, window=5, max_seq_len=64, param_dtype="float32",
                      compute_dtype="bfloat16", use_bias=use_bias)
    model = Transformer(cfg, rngs=nnx.Rngs(params=0))
    B, T = 3, 9
    tokens = jax.random.randint(jax.random.key(1), (B, T), 0, cfg.vocab_size)
    _, cache = model.decode(tokens, model.init_cache(B, 32),
                            positions_BxC=jnp.broadcast_to(jnp.arange(T), (B, T)),
                            new_lengths_B=jnp.full((B,), T), fresh=True)
    want_logits, want_cache = decode_step(model, tokens[:, 0], cache,
                                          decode_implementation="reference")
    for block in model.blocks:  # the layers' interpret mode runs the Pallas kernels on CPU
        block.attn.interpret = True
    fused = []
    monkeypatch.setattr(Block, "decode_fused", _recorded(Block.decode_fused, fused))
    logits, got_cache = decode_step(model, tokens[:, 0], cache,
                                    decode_implementation="pallas_gpu")
    assert fused  # the blocks (one scanned body) took the kernels
    _close(logits, want_logits)
    for got, want in zip(got_cache.arrays(), want_cache.arrays()):
        _close(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("R, K, widths", [pytest.param(1, 192, (192, 192, 192), id="one_row"),
                                          pytest.param(64, 768, (3072,), id="block_of_rows")])
def test_kernels_on_the_gpu_match_xla(R, K, widths):
    """The compiled kernels (Triton's dot, which interpret mode replaces) against the twin."""
    x, scale, shift, weights, biases = _norm_case(R, K, widths, True)
    kw = dict(eps=1e-5, compute_dtype=jnp.bfloat16, activation="gelu_tanh")
    for got, want in zip(dense.norm_dense(x, scale, shift, weights, biases,
                                          implementation="pallas_gpu", **kw),
                         dense.norm_dense(x, scale, shift, weights, biases, **kw)):
        _close(got, want)
    h, residual = _normal(5, (R, widths[0]), jnp.bfloat16), _normal(6, (R, K))
    w = _normal(7, (widths[0], K), jnp.bfloat16, 0.05)
    _close(dense.dense_residual(h, w, biases[0][:K], residual, compute_dtype=jnp.bfloat16,
                                implementation="pallas_gpu"),
           dense.dense_residual(h, w, biases[0][:K], residual, compute_dtype=jnp.bfloat16))
