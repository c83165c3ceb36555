"""The op and the layers in a user's own JAX program: MQA and GQA on Auto axes, forward-mode
autodiff (jvp, Hessian-vector products) on one and on 8 devices, ``jax.vmap`` on Auto axes
without gathers, float64 through the reference, Flax's decode cache named as the cause, and
parameters of any NNX module out to and back from a safetensors file.

The 8-device cases run in subprocesses (tests/library_cases.py), started together once."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ls_jax import LSAttention
from ls_jax.interop.attention_fn import make_attention_fn
from ls_jax.kernels import ls_attention
from ls_jax.kernels.reference import reference_backend
from ls_jax.interop.weights import load_params, save_params
from eight_devices import result, start  # tests/, beside this file

WINDOWS = (None, 3, 9, 40)


@pytest.fixture(scope="module")
def cases():
    procs = [start("library_cases.py", "kv_heads", "reference", "+", "layer_mqa", "+", "vmap", "+",
                    "forward_mode", "reference"),
             start("library_cases.py", "forward_mode", "pallas_gpu")]
    (kv_heads, layer_mqa, vmap, forward_reference), (forward_pallas,) = map(result, procs)
    return dict(kv_heads=kv_heads, layer_mqa=layer_mqa, vmap=vmap,
                forward={"reference": forward_reference, "pallas_gpu": forward_pallas})


# -- 8 devices, Auto axes -----------------------------------------------------------------

@pytest.mark.parametrize("case", ["G1:batch", "G2:batch", "G2:batch_heads", "G4:batch",
                                  "G4:batch_heads", "G8:batch", "G8:batch_heads"])
def test_every_kv_head_count_runs_per_shard_on_auto_axes(cases, case):
    r = cases["kv_heads"][case]
    assert r["diff"] < 1e-5 and r["gathers"] == 0, r


def test_mqa_layer_runs_on_auto_axes(cases):
    assert cases["layer_mqa"]["diff"] < 1e-5


@pytest.mark.parametrize("split", ["batch", "mapped"])
def test_vmap_on_auto_axes_gathers_nothing_and_keeps_the_sharding(cases, split):
    r = cases["vmap"][split]
    assert r["diff"] < 1e-4 and r["gathers"] == 0, r
    assert r["out_spec"] == {"batch": "P(None, 'rows')", "mapped": "P('cols', 'rows')"}[split]


@pytest.mark.parametrize("impl", ["reference", "pallas_gpu"])
def test_forward_mode_and_second_order_on_eight_devices(cases, impl):
    r = cases["forward"][impl]
    assert r["jvp"] < 1e-5 and r["hvp"] < 1e-5 and r["grad_of_grad"] < 1e-5, r


# -- one device ---------------------------------------------------------------------------

def _inputs(dtype=jnp.float32):
    kq, kk, kv = jax.random.split(jax.random.key(6), 3)
    return (jax.random.normal(kq, (2, 40, 4, 16), dtype),
            jax.random.normal(kk, (2, 40, 2, 16), dtype),
            jax.random.normal(kv, (2, 40, 2, 16), dtype))


def _reference(q, k, v):
    return reference_backend(q, k, v, window_sizes=WINDOWS, segment_ids=None,
                             scale=16 ** -0.5, return_logit_stats=False, interpret=False)[0]


@pytest.mark.parametrize("impl", ["reference", "pallas_gpu", "pallas_tpu"])
def test_jvp_and_hessian_vector_product_on_one_device(impl):
    """Forward mode through the op, to second order; the backward that reverse mode runs stays
    the backend's (kernels/forward_mode.py)."""
    q, k, v = _inputs()
    tangents = tuple(0.5 * x for x in (q, k, v))

    def f(attend):
        return lambda q, k, v: jnp.sum(jnp.sin(attend(q, k, v)))

    ours = f(lambda q, k, v: ls_attention(q, k, v, WINDOWS, implementation=impl,
                                          interpret=impl != "reference"))
    ref = f(_reference)
    for transform in (lambda g: jax.jvp(g, (q, k, v), tangents),
                      lambda g: jax.jvp(jax.grad(g, argnums=(0, 1, 2)), (q, k, v), tangents),
                      lambda g: jax.jvp(lambda *x: jax.jvp(g, x, tangents)[1], (q, k, v),
                                        tangents),  # forward over forward
                      lambda g: jax.jacfwd(g)(q, k, v)):
        got, want = jax.jit(lambda: transform(ours))(), transform(ref)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(a, b, atol=2e-5, rtol=2e-5)


def test_float64_runs_on_the_reference_and_kernels_refuse_it():
    with jax.enable_x64(True):
        q, k, v = _inputs(jnp.float64)
        out = ls_attention(q, k, v, WINDOWS)  # the CPU default: the reference
        assert out.dtype == jnp.float64
        np.testing.assert_allclose(out, _reference(q, k, v), rtol=1e-12, atol=1e-12)
        grads = jax.grad(lambda q: jnp.sum(ls_attention(q, k, v, WINDOWS)))(q)
        assert grads.dtype == jnp.float64
        with pytest.raises(ValueError, match=(
                r"^q: float64 is computed by implementation='reference' alone, got "
                r"implementation='pallas_gpu'; cast q, k, v to float32 or pass "
                r"implementation='reference'$")):
            ls_attention(q, k, v, WINDOWS, implementation="pallas_gpu", interpret=True)


def test_decode_cache_of_flax_attention_is_named_as_the_cause():
    layer = nnx.MultiHeadAttention(num_heads=4, in_features=32, qkv_features=32,
                                   attention_fn=make_attention_fn(WINDOWS), decode=True,
                                   rngs=nnx.Rngs(0))
    layer.init_cache((2, 8, 32))
    with pytest.raises(ValueError, match=(
            r"^key/value: expected the query's length T=1 \(causal self-attention over the "
            r"whole sequence\), got key \(2, 8, 4, 8\), value \(2, 8, 4, 8\): a decode cache "
            r"\(decode=True\) is not supported by this attention_fn; call the layer with "
            r"decode=False, or decode with ls_jax.LSAttention and its KV cache "
            r"\(ls_jax.inference.generate\)$")):
        layer(jnp.ones((2, 1, 32)))


class _UserModel(nnx.Module):
    """A user's model holding our layer beside Flax's own."""

    def __init__(self, rngs):
        self.embed = nnx.Linear(8, 32, rngs=rngs)
        self.blocks = nnx.List([LSAttention(32, 4, 8, n_kv_head=1, window=4,
                                            param_dtype=jnp.bfloat16, rngs=rngs)
                                for _ in range(2)])


def test_parameters_of_any_nnx_module_round_trip_through_safetensors(tmp_path):
    from safetensors import safe_open

    path = str(tmp_path / "model.safetensors")
    model, other = _UserModel(nnx.Rngs(0)), _UserModel(nnx.Rngs(1))
    names = save_params(model, path, metadata={"source": "a test"})
    assert "blocks.0.q_proj.kernel" in names and "embed.bias" in names
    with safe_open(path, framework="numpy") as f:
        assert f.metadata()["source"] == "a test"
        assert f.get_tensor("blocks.1.o_proj.kernel").shape == (32, 32)
    assert load_params(other, path) is other
    for (p, a), (_, b) in zip(nnx.to_flat_state(nnx.state(model, nnx.Param)),
                              nnx.to_flat_state(nnx.state(other, nnx.Param))):
        assert a.get_value().dtype == b.get_value().dtype
        np.testing.assert_array_equal(a.get_value(), b.get_value())


def test_linen_parameters_round_trip_and_a_mismatch_is_one_line(tmp_path):
    from ls_jax.interop.linen import LSAttention as LinenLSAttention
    path = str(tmp_path / "linen.safetensors")
    params = LinenLSAttention(d_model=32, n_head=4, head_dim=8, window=4).init(
        jax.random.key(0), jnp.ones((1, 8, 32)))
    save_params(params, path)
    back = load_params(jax.tree.map(jnp.zeros_like, params), path)
    assert jax.tree.all(jax.tree.map(jnp.array_equal, params, back))
    with pytest.raises(ValueError, match=(
            rf"^weights: {path} does not fit the model: missing \['bias', 'kernel'\], "
            r"unexpected \['params.k_proj.kernel', 'params.o_proj.kernel', "
            r"'params.q_proj.kernel'\] ...$")):
        load_params(nnx.Linear(3, 4, rngs=nnx.Rngs(0)), path)
