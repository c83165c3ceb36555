"""kernels/directional.py: the primal backend runs where nothing differentiates the call, the
differentiated backend (its own forward and backward) everywhere else. Checked on CPU with two
backends that give different outputs, so the numbers say which one ran."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ls_jax.kernels.directional import directional_backend
from ls_jax.kernels.reference import reference_backend
from stand_in_backends import scaled_reference  # tests/, beside this file

WINDOWS = (None, 3)
OPTIONS = dict(window_sizes=WINDOWS, scale=0.5, interpret=False)


def inputs():
    kq, kk, kv = jax.random.split(jax.random.key(3), 3)
    return tuple(jax.random.normal(key, (2, 12, 2, 8), jnp.float32) for key in (kq, kk, kv))


def make(log):
    return directional_backend(scaled_reference("primal", 2.0, log), scaled_reference("diff", 1.0, log))


def attend(backend, q, k, v, **kw):
    options = {**OPTIONS, "segment_ids": None, "return_logit_stats": False, **kw}
    return backend(q, k, v, **options)


def test_undifferentiated_call_runs_the_primal_backend():
    log = []
    backend = make(log)
    q, k, v = inputs()
    want = reference_backend(q, k, v, segment_ids=None, return_logit_stats=False, **OPTIONS)[0]
    out, stats = jax.jit(lambda q, k, v: attend(backend, q, k, v))(q, k, v)
    assert stats is None and log == ["primal"]
    np.testing.assert_allclose(out, 2.0 * want, rtol=1e-6, atol=1e-6)
    out_eager, _ = attend(backend, q, k, v)  # and outside jit
    np.testing.assert_allclose(out_eager, 2.0 * want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("jit", [False, True])
def test_differentiated_call_runs_the_other_backend_both_ways(jit):
    log = []
    backend = make(log)
    q, k, v = inputs()
    w = jax.random.normal(jax.random.key(4), q.shape, jnp.float32)

    def loss(fn_backend, q, k, v):
        return jnp.sum(attend(fn_backend, q, k, v)[0] * w)

    grad = jax.value_and_grad(lambda *qkv: loss(backend, *qkv), argnums=(0, 1, 2))
    value, grads = (jax.jit(grad) if jit else grad)(q, k, v)
    assert "primal" not in log and "diff" in log, log
    want_value, want_grads = jax.value_and_grad(
        lambda *qkv: loss(reference_backend, *qkv), argnums=(0, 1, 2))(q, k, v)
    np.testing.assert_allclose(value, want_value, rtol=1e-5)  # not twice it: no primal
    for got, want in zip(grads, want_grads):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_statistics_and_segments_run_the_differentiated_backend():
    log = []
    backend = make(log)
    q, k, v = inputs()
    out, stats = attend(backend, q, k, v, return_logit_stats=True)
    assert log == ["diff"] and stats.shape == (2,)
    segments = jnp.zeros((2, 12), jnp.int32).at[:, 6:].set(1)
    out_seg, _ = attend(backend, q, k, v, segment_ids=segments)
    want = reference_backend(q, k, v, segment_ids=segments, return_logit_stats=False,
                             **OPTIONS)[0]
    assert log == ["diff", "diff"]
    np.testing.assert_allclose(out_seg, want, rtol=1e-6, atol=1e-6)
