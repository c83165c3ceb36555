"""``jax_enable_x64`` on: every backend takes float32 and bfloat16 inputs (and int64 segment
ids, the default integer type then) and gives what it gives with x64 off: q's dtype, the same
output, statistics and gradients."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ls_jax.kernels import ls_attention, split
from ls_jax.kernels.directional import directional_backend
from ls_jax.kernels.reference import reference_attention_parts, reference_backend

WINDOWS = (None, 3, 9, None)


def _inputs(dtype):
    kq, kk, kv, kd = jax.random.split(jax.random.key(7), 4)
    q = jax.random.normal(kq, (1, 40, 4, 16), dtype)
    k, v = (jax.random.normal(x, (1, 40, 2, 16), dtype) for x in (kk, kv))
    do = jax.random.normal(kd, (1, 40, 4, 16), jnp.float32)
    return q, k, v, do


def _run(attend, dtype, segments: bool):
    """(out, max |logit|, dq, dk, dv) as numpy float32, and the dtypes of out and dq."""
    q, k, v, do = _inputs(dtype)
    seg = jnp.asarray([[0] * 25 + [1] * 15]) if segments else None  # int64 under x64

    def loss(q, k, v):
        out, stats = attend(q, k, v, seg)
        return jnp.sum(out.astype(jnp.float32) * do), (out, stats)

    (_, (out, stats)), grads = jax.jit(
        jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    values = [np.asarray(x, np.float32) for x in (out, stats, *grads)]
    return values, (out.dtype, grads[0].dtype)


def _ls_attention(impl: str):
    interpret = impl in ("pallas_gpu", "pallas_tpu", "split")

    def attend(q, k, v, seg):
        out, stats = ls_attention(q, k, v, WINDOWS, segment_ids=seg, return_logit_stats=True,
                                  implementation=impl, interpret=interpret)
        return out, stats.max_abs_logit

    return attend


@pytest.fixture
def cudnn_on_cpu(monkeypatch):
    """cuDNN's calls replaced by the reference (the composition's own code still runs)."""
    def causal(q, k, v, scale=None, is_causal=True, local_window_size=None, implementation=None):
        window = None if local_window_size is None else local_window_size[0] + 1
        return reference_attention_parts(q, k, v, (window,) * q.shape[2], None, scale)[0]

    monkeypatch.setattr(jax.nn, "dot_product_attention", causal)
    monkeypatch.setattr(split, "_global_causal_attention",
                        lambda q, k, v, scale: causal(q, k, v, scale))


CASES = [
    *[pytest.param(impl, dtype, id=f"{impl}-{dtype}",
                   marks=[pytest.mark.slow] if dtype == "bfloat16" else [])
      for impl in ("reference", "pallas_gpu", "pallas_tpu") for dtype in ("float32", "bfloat16")],
    pytest.param("cudnn", "bfloat16", id="cudnn-bfloat16"),  # cuDNN takes no float32
    # its local heads are pallas_gpu's
    pytest.param("split", "bfloat16", id="split-bfloat16", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("impl,dtype", CASES)
def test_x64_gives_what_x32_gives(impl, dtype, cudnn_on_cpu):
    segments = impl not in ("cudnn", "split")  # cuDNN takes no segment ids
    with jax.enable_x64(True):
        got, got_dtypes = _run(_ls_attention(impl), jnp.dtype(dtype), segments)
    want, want_dtypes = _run(_ls_attention(impl), jnp.dtype(dtype), segments)
    assert got_dtypes == want_dtypes == (jnp.dtype(dtype), jnp.dtype(dtype))
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)


def test_x64_directional_pairing():
    """The forward-only / differentiated pairing of implementation=None (stand-ins: the
    reference scaled by 2 for the forward only)."""
    def primal(q, k, v, **kw):
        out, stats = reference_backend(q, k, v, **kw)
        return 2 * out, stats

    backend = directional_backend(primal, reference_backend)

    def attend(q, k, v, seg):
        out, _ = backend(q, k, v, window_sizes=WINDOWS, segment_ids=seg, scale=0.25,
                         return_logit_stats=False, interpret=False)
        return out, jnp.zeros(4)

    q, k, v, _ = _inputs(jnp.float32)
    with jax.enable_x64(True):
        got, got_dtypes = _run(attend, jnp.float32, False)
        forward_only = jax.jit(lambda q, k, v: attend(q, k, v, None)[0])(q, k, v)
    want, want_dtypes = _run(attend, jnp.float32, False)
    assert got_dtypes == want_dtypes
    np.testing.assert_allclose(np.asarray(forward_only), 2 * want[0], rtol=1e-6, atol=1e-6)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)
