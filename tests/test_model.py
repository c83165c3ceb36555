"""The Flax NNX model: LSAttention alone, the Transformer, its options and its logit stats."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import ls_jax.attention as attention_lib
from ls_jax import LSAttention, ModelConfig, Transformer
from ls_jax.loss import lm_loss

SMALL = dict(vocab_size=64, n_layer=2, d_model=32, n_head=4, head_dim=8, window=4, max_seq_len=64)


def test_lsattention_all_global_is_plain_causal_mhsa():
    attn = LSAttention(32, 4, 8, n_global_heads=4, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, 19, 32))
    y, stats = attn(x, return_logit_stats=True)
    q = attn.q_proj(x).reshape(2, 19, 4, 8)
    k = attn.k_proj(x).reshape(2, 19, 4, 8)
    v = attn.v_proj(x).reshape(2, 19, 4, 8)
    want = attn.o_proj(jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(2, 19, 32))
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)
    logits = np.einsum("bihd,bjhd->bhij", q, k) / np.sqrt(8)
    causal = np.tril(np.ones((19, 19), bool))
    np.testing.assert_allclose(stats, np.abs(np.where(causal, logits, 0)).max(axis=(0, 2, 3)),
                               rtol=1e-5)
    assert attn.window_sizes == (None,) * 4


def test_lsattention_head_split_and_errors():
    attn = LSAttention(16, 3, 4, n_global_heads=1, window=7, rngs=nnx.Rngs(0))
    assert attn.window_sizes == (None, 7, 7)
    with pytest.raises(ValueError, match=r"n_global_heads: expected an int in \[0, n_head=3\], got 4"):
        LSAttention(16, 3, 4, n_global_heads=4, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"n_kv_head: expected a divisor of n_head=4, got 3"):
        LSAttention(16, 4, 4, n_kv_head=3, rngs=nnx.Rngs(0))


def test_causality_and_local_receptive_field():
    """Logits at i never see tokens after i; with only local heads (window 3, 2 layers) they see
    nothing before i - 4."""
    cfg = ModelConfig(**{**SMALL, "window": 3}, n_global_heads=0, pos_embedding="rope")
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(2), (1, 20), 0, 64)
    base = model(tokens)
    changed_future = model(tokens.at[0, 12].set((tokens[0, 12] + 1) % 64))
    np.testing.assert_array_equal(base[0, :12], changed_future[0, :12])
    assert not np.allclose(base[0, 12], changed_future[0, 12])
    changed_past = model(tokens.at[0, 5].set((tokens[0, 5] + 1) % 64))
    np.testing.assert_allclose(base[0, 10:], changed_past[0, 10:], rtol=1e-6, atol=1e-6)
    assert not np.allclose(base[0, 9], changed_past[0, 9])  # 9 - 5 = 4 = 2 * (3 - 1): reached


def test_global_head_sees_far_past():
    cfg = ModelConfig(**{**SMALL, "window": 2}, n_global_heads=1, pos_embedding="rope")
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(3), (1, 30), 0, 64)
    changed = model(tokens.at[0, 0].set((tokens[0, 0] + 1) % 64))
    assert not np.allclose(model(tokens)[0, -1], changed[0, -1])


def test_stats_shapes_and_lm_head_max():
    cfg = ModelConfig(**SMALL, n_global_heads=1)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(4), (3, 17), 0, 64)
    logits, stats = model(tokens, return_stats=True)
    assert logits.shape == (3, 17, 64) and logits.dtype == jnp.float32
    assert stats["attn_max_abs_logit"].shape == (2, 4)
    assert np.all(np.asarray(stats["attn_max_abs_logit"]) > 0)
    assert float(stats["lm_head_max_abs_logit"]) == pytest.approx(float(jnp.abs(logits).max()))


def test_logit_stats_are_requested_from_the_kernel_only_when_asked(monkeypatch):
    real = attention_lib.ls_attention  # the layer's kernel call
    asked = []

    def recording(*args, return_logit_stats=False, **kwargs):
        asked.append(return_logit_stats)
        return real(*args, return_logit_stats=return_logit_stats, **kwargs)

    monkeypatch.setattr(attention_lib, "ls_attention", recording)
    model = Transformer(ModelConfig(**SMALL, n_global_heads=1), rngs=nnx.Rngs(0))
    tokens = jnp.zeros((1, 9), jnp.int32)
    plain = model(tokens)
    assert asked == [False, False]  # one call per layer, none asking for statistics
    with_stats, _ = model(tokens, return_stats=True)
    assert asked == [False, False, True, True]
    np.testing.assert_array_equal(plain, with_stats)


@pytest.mark.parametrize("options", [
    dict(pos_embedding="rope"),
    dict(qk_norm=True),
    dict(tie_embeddings=True),
    dict(n_kv_head=2),
    dict(use_bias=True),
    dict(compute_dtype="bfloat16"),
])
def test_model_options_train(options):
    """Each option builds, gives a finite loss and a gradient step lowers the loss."""
    cfg = ModelConfig(**SMALL, **options)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(5), (2, 16), 0, 64)

    def loss_fn(m):
        return lm_loss(m(tokens[:, :-1]), tokens[:, 1:])[0]

    loss0, grads = nnx.value_and_grad(loss_fn)(model)
    assert np.isfinite(loss0)
    params = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda p, g: p - 0.5 * g, params, nnx.state(grads, nnx.Param)))
    assert loss_fn(model) < loss0


def test_bf16_compute_close_to_fp32():
    cfg32 = ModelConfig(**SMALL)
    cfg16 = ModelConfig(**SMALL, compute_dtype="bfloat16")
    tokens = jax.random.randint(jax.random.key(6), (2, 16), 0, 64)
    a = Transformer(cfg32, rngs=nnx.Rngs(0))(tokens)
    b = Transformer(cfg16, rngs=nnx.Rngs(0))(tokens)
    assert float(jnp.linalg.norm(a - b) / jnp.linalg.norm(a)) < 2e-2


def test_learned_positions_reject_too_long_input():
    model = Transformer(ModelConfig(**{**SMALL, "max_seq_len": 8}), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="sequence length 9 exceeds model.max_seq_len=8"):
        model(jnp.zeros((1, 9), jnp.int32))


def test_z_loss_term():
    logits = jax.random.normal(jax.random.key(7), (2, 5, 11)) * 3
    targets = jnp.zeros((2, 5), jnp.int32)
    plain, parts = lm_loss(logits, targets)
    with_z, _ = lm_loss(logits, targets, z_loss=1e-2)
    lse = np.log(np.exp(np.asarray(logits, np.float64)).sum(-1))
    ce = (lse - np.asarray(logits)[..., 0]).mean()
    assert float(plain) == pytest.approx(ce, rel=1e-5)
    assert float(with_z) == pytest.approx(ce + 1e-2 * (lse ** 2).mean(), rel=1e-5)
