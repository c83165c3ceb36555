"""The Flax NNX model: LSAttention alone, the Transformer, its options and its logit stats, the
scan over its blocks, and checkpoints of the model as it was before the scan."""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import ls_jax.layers.attention as attention_lib
from ls_jax import LSAttention, ModelConfig, Transformer
from ls_jax.training.checkpoint import Checkpointer
from ls_jax.config import Config, DataConfig, TrainConfig
from ls_jax.training.loss import lm_loss
from ls_jax.training.rundir import RunDir
from ls_jax.training.state import abstract_train_state, restore_model

SMALL = dict(vocab_size=64, n_layer=2, d_model=32, n_head=4, head_dim=8, window=4, max_seq_len=64)

# The model's calls below run jitted: one compiled program for a call instead of one for each
# operation, as an eager call compiles them (the model's parameters are initialised eagerly:
# their draws repeat shapes from one test to the next, which an eager call reuses).
forward = nnx.jit(lambda model, tokens: model(tokens))
forward_with_stats = nnx.jit(lambda model, tokens: model(tokens, return_stats=True))


def changed(tokens, at):
    """The tokens with the one of the first row at position ``at`` replaced."""
    tokens = np.array(tokens)
    tokens[0, at] = (tokens[0, at] + 1) % 64
    return tokens


def test_lsattention_all_global_is_plain_causal_mhsa():
    attn = LSAttention(32, 4, 8, n_global_heads=4, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, 19, 32))

    @nnx.jit
    def run(attn, x):
        y, stats = attn(x, return_logit_stats=True)
        q = attn.q_proj(x).reshape(2, 19, 4, 8)
        k = attn.k_proj(x).reshape(2, 19, 4, 8)
        v = attn.v_proj(x).reshape(2, 19, 4, 8)
        want = attn.o_proj(
            jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(2, 19, 32))
        return y, stats, want, q, k

    y, stats, want, q, k = run(attn, x)
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
    base = forward(model, tokens)
    changed_future = forward(model, changed(tokens, 12))
    np.testing.assert_array_equal(base[0, :12], changed_future[0, :12])
    assert not np.allclose(base[0, 12], changed_future[0, 12])
    changed_past = forward(model, changed(tokens, 5))
    np.testing.assert_allclose(base[0, 10:], changed_past[0, 10:], rtol=1e-6, atol=1e-6)
    assert not np.allclose(base[0, 9], changed_past[0, 9])  # 9 - 5 = 4 = 2 * (3 - 1): reached


def test_global_head_sees_far_past():
    cfg = ModelConfig(**{**SMALL, "window": 2}, n_global_heads=1, pos_embedding="rope")
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(3), (1, 30), 0, 64)
    assert not np.allclose(forward(model, tokens)[0, -1], forward(model, changed(tokens, 0))[0, -1])


def test_stats_shapes_and_lm_head_max():
    cfg = ModelConfig(**SMALL, n_global_heads=1)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(4), (3, 17), 0, 64)
    logits, stats = forward_with_stats(model, tokens)
    assert logits.shape == (3, 17, 64) and logits.dtype == jnp.float32
    assert stats["attn_max_abs_logit"].shape == (2, 4)
    assert np.all(np.asarray(stats["attn_max_abs_logit"]) > 0)
    assert float(stats["lm_head_max_abs_logit"]) == pytest.approx(float(np.abs(logits).max()))


def test_logit_stats_are_requested_from_the_kernel_only_when_asked(monkeypatch):
    real = attention_lib.ls_attention_validated  # the layer's kernel call
    asked = []

    def recording(*args, return_logit_stats=False, **kwargs):
        asked.append(return_logit_stats)
        return real(*args, return_logit_stats=return_logit_stats, **kwargs)

    monkeypatch.setattr(attention_lib, "ls_attention_validated", recording)
    model = Transformer(ModelConfig(**SMALL, n_global_heads=1), rngs=nnx.Rngs(0))
    tokens = jnp.zeros((1, 9), jnp.int32)
    # jitted afresh here: a call of the module's jitted functions may reuse an earlier trace
    plain = nnx.jit(lambda model, tokens: model(tokens))(model, tokens)
    assert asked == [False]  # the scan traces the block once; no statistics asked
    with_stats, _ = nnx.jit(lambda model, tokens: model(tokens, return_stats=True))(model, tokens)
    assert asked == [False, True]
    np.testing.assert_array_equal(plain, with_stats)


# make test: the options of the model's attention in one model (one compile); make test-all:
# each option alone, and those of the rest of the model
@pytest.mark.parametrize("options", [
    dict(pos_embedding="rope", qk_norm=True, n_kv_head=2),
    pytest.param(dict(pos_embedding="rope"), marks=pytest.mark.slow),
    pytest.param(dict(qk_norm=True), marks=pytest.mark.slow),
    pytest.param(dict(tie_embeddings=True), marks=pytest.mark.slow),
    pytest.param(dict(n_kv_head=2), marks=pytest.mark.slow),
    pytest.param(dict(use_bias=True), marks=pytest.mark.slow),
    pytest.param(dict(compute_dtype="bfloat16"), marks=pytest.mark.slow),
], ids=["rope-qk_norm-gqa", "rope", "qk_norm", "tie_embeddings", "gqa", "bias", "bf16"])
def test_model_options_train(options):
    """Each option builds, gives a finite loss and a gradient step lowers the loss."""
    cfg = ModelConfig(**SMALL, **options)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(5), (2, 16), 0, 64)

    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss_fn(params):
        return lm_loss(nnx.merge(graphdef, params, rest)(tokens[:, :-1]), tokens[:, 1:])[0]

    @jax.jit
    def before_and_after_a_step(params):
        loss0, grads = jax.value_and_grad(loss_fn)(params)
        return loss0, loss_fn(jax.tree.map(lambda p, g: p - 0.5 * g, params, grads))

    loss0, loss1 = before_and_after_a_step(params)
    assert np.isfinite(loss0)
    assert loss1 < loss0


def test_bf16_compute_close_to_fp32():
    cfg32 = ModelConfig(**SMALL)
    cfg16 = ModelConfig(**SMALL, compute_dtype="bfloat16")
    tokens = jax.random.randint(jax.random.key(6), (2, 16), 0, 64)
    a = np.asarray(forward(Transformer(cfg32, rngs=nnx.Rngs(0)), tokens))
    b = np.asarray(forward(Transformer(cfg16, rngs=nnx.Rngs(0)), tokens))
    assert float(np.linalg.norm(a - b) / np.linalg.norm(a)) < 2e-2


def test_learned_positions_reject_too_long_input():
    model = Transformer(ModelConfig(**{**SMALL, "max_seq_len": 8}), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="sequence length 9 exceeds model.max_seq_len=8"):
        model(jnp.zeros((1, 9), jnp.int32))


def test_z_loss_term():
    logits = jax.random.normal(jax.random.key(7), (2, 5, 11)) * 3
    targets = jnp.zeros((2, 5), jnp.int32)
    loss = jax.jit(lm_loss, static_argnames="z_loss")
    plain, parts = loss(logits, targets)
    with_z, _ = loss(logits, targets, z_loss=1e-2)
    lse = np.log(np.exp(np.asarray(logits, np.float64)).sum(-1))
    ce = (lse - np.asarray(logits)[..., 0]).mean()
    assert float(plain) == pytest.approx(ce, rel=1e-5)
    assert float(with_z) == pytest.approx(ce + 1e-2 * (lse ** 2).mean(), rel=1e-5)


# -- the blocks as one scan -------------------------------------------------------------------

def count_primitives(fn, *args, names) -> int:
    """How many equations of the given primitives the jaxpr of ``fn(*args)`` holds, nested
    jaxprs (scan, jit, custom_vjp bodies) included."""
    def walk(jaxpr):
        n = 0
        for eqn in jaxpr.eqns:
            n += eqn.primitive.name in names
            for value in eqn.params.values():
                for sub in value if isinstance(value, (tuple, list)) else (value,):
                    if isinstance(sub, jax.extend.core.ClosedJaxpr):
                        n += walk(sub.jaxpr)
                    elif isinstance(sub, jax.extend.core.Jaxpr):
                        n += walk(sub)
        return n
    return walk(jax.make_jaxpr(fn)(*args).jaxpr)


def test_scan_equals_the_blocks_applied_in_turn():
    """Logits and each layer's statistics of the scanned model equal the blocks called one
    after the other (layer order kept: 3 layers of different parameters)."""
    cfg = ModelConfig(**{**SMALL, "n_layer": 3}, n_global_heads=1)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(8), (2, 11), 0, 64)
    logits, stats = forward_with_stats(model, tokens)

    @nnx.jit
    def in_turn(model, tokens):
        x = model.embed(tokens) + model.pos_embed(jnp.arange(11)[None])
        per_layer = []
        for block in model.blocks:
            x, stats_H, _ = block(x, positions=jnp.broadcast_to(jnp.arange(11), (2, 11)),
                                  return_logit_stats=True)
            per_layer.append(stats_H)
        return model.lm_head(model.ln_f(x)), per_layer

    want_logits, per_layer = in_turn(model, tokens)
    np.testing.assert_allclose(logits, want_logits, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(stats["attn_max_abs_logit"], np.stack(per_layer), rtol=1e-6)
    assert len({float(s[0]) for s in per_layer}) == 3  # the layers differ


@pytest.mark.parametrize("remat", ["none", "full", "dots"])
def test_compile_work_is_flat_in_depth(remat):
    """The training forward+backward and the init hold as many matmuls and random draws for
    6 layers as for 2: the block is traced once (a scan), each parameter drawn once for all
    layers."""
    def counts(n_layer):
        cfg = ModelConfig(**{**SMALL, "n_layer": n_layer}, remat=remat)
        # shapes only: the jaxprs are traced, nothing runs
        model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
        tokens = jnp.zeros((1, 8), jnp.int32)
        loss = lambda m: lm_loss(m(tokens[:, :-1]), tokens[:, 1:])[0]
        graphdef, params = nnx.split(model)
        grad = lambda p: jax.grad(lambda p: loss(nnx.merge(graphdef, p)))(p)
        init = lambda key: nnx.state(Transformer(cfg, rngs=nnx.Rngs(params=key)))
        return (count_primitives(grad, params, names={"dot_general"}),
                count_primitives(init, jax.random.key(0), names={"random_bits"}))
    assert counts(2) == counts(6)


@functools.cache  # the "none" baseline: computed once for both policies
def remat_loss_and_grads(remat):
    tokens = jax.random.randint(jax.random.key(9), (2, 12), 0, 64)
    graphdef, params = nnx.split(Transformer(ModelConfig(**SMALL, remat=remat),
                                             rngs=nnx.Rngs(0)), nnx.Param)

    def loss(params):
        model = nnx.merge(graphdef, params)
        return lm_loss(model(tokens[:, :-1]), tokens[:, 1:])[0]
    return jax.jit(jax.value_and_grad(loss))(params)


@pytest.mark.parametrize("remat", ["full", "dots"])
def test_remat_keeps_loss_and_gradients(remat):
    want_loss, want_grads = remat_loss_and_grads("none")
    loss, grads = remat_loss_and_grads(remat)
    assert float(loss) == pytest.approx(float(want_loss), rel=1e-6)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


# -- checkpoints of the per-layer model -------------------------------------------------------

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "per_layer_train_state.npz")


def fixture_config() -> Config:
    """The config tests/fixtures/per_layer_train_state.npz was made with."""
    return Config(
        name="fixture",
        model=ModelConfig(vocab_size=16, n_layer=2, d_model=8, n_head=2, head_dim=4,
                          n_global_heads=1, window=3, max_seq_len=16, mlp_ratio=2),
        data=DataConfig(seq_len=12),
        train=TrainConfig(batch_size=2, num_steps=4, warmup_steps=1, lr=1e-2))


def test_a_checkpoint_of_the_per_layer_model_restores_with_identical_logits(tmp_path):
    """The fixture is the train state after one step of the model as it was before the scan
    (commit d6f1bb0: blocks called in a Python loop), keyed by path, with that model's logits
    on a batch. Written as a checkpoint with today's code, it restores (same paths, shapes
    and dtypes: the layout did not change) and gives the same logits, to float rounding (the
    suite compiles with other XLA flags than the fixture was made with, tests/conftest.py)."""
    saved = np.load(FIXTURE)
    cfg = fixture_config()
    graphdef, abstract = abstract_train_state(cfg)
    flat = nnx.to_flat_state(abstract)
    key = lambda path: "state/" + "/".join(map(str, path))
    assert {key(p) for p, _ in flat} == {k for k in saved.files if k.startswith("state/")}
    for path, var in flat:
        a = saved[key(path)]
        assert (a.shape, a.dtype) == (var.get_value().shape, var.get_value().dtype), path
    state = nnx.from_flat_state([(p, v.replace(jnp.asarray(saved[key(p)]))) for p, v in flat])
    run = RunDir(str(tmp_path))
    run.write_config(cfg)
    ckpt = Checkpointer(run, async_save=False)
    ckpt.save(1, state)
    ckpt.close()
    _, step, model = restore_model(run)
    assert step == 1
    logits = nnx.jit(lambda m, tokens: m(tokens))(model, jnp.asarray(saved["tokens"]))
    np.testing.assert_allclose(np.asarray(logits), saved["logits"], rtol=1e-5, atol=1e-6)
