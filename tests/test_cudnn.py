"""The cuDNN composition (kernels/cudnn.py) on CPU: its head plumbing (one call per window,
GQA kept where the group allows, outputs back in head order) with cuDNN's call replaced by
the reference, and no gather or scatter in its forward or backward (kernels/heads.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ls_jax.kernels import cudnn
from ls_jax.kernels.reference import reference_attention_parts

from jitted_reference import reference_vjp  # tests/, beside this file

SCALE = 0.3
T = 24


@pytest.fixture
def calls(monkeypatch):
    """Replaces ``jax.nn.dot_product_attention`` by the reference; records (Hq, Hkv, window)
    of each call."""
    log = []

    def fake(q, k, v, *, scale, is_causal, local_window_size, implementation):
        assert is_causal and implementation == "cudnn" and q.shape[2] % k.shape[2] == 0
        window = None if local_window_size is None else local_window_size[0] + 1
        log.append((q.shape[2], k.shape[2], window))
        k_full = jnp.repeat(k, q.shape[2] // k.shape[2], axis=2)
        v_full = jnp.repeat(v, q.shape[2] // k.shape[2], axis=2)
        f32 = [x.astype(jnp.float32) for x in (q, k_full, v_full)]
        return reference_attention_parts(*f32, (window,) * q.shape[2], None,
                                         scale)[0].astype(q.dtype)

    monkeypatch.setattr(jax.nn, "dot_product_attention", fake)
    return log


def backend(windows):
    def run(q, k, v):
        return cudnn.cudnn_backend(q, k, v, window_sizes=windows, segment_ids=None, scale=SCALE,
                                   return_logit_stats=False, interpret=False)[0]
    return run


def inputs(H, G, seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    shapes = [(2, T, H, 16), (2, T, G, 16), (2, T, G, 16), (2, T, H, 16)]
    return [jax.random.normal(key, s, jnp.float32).astype(jnp.bfloat16)
            for key, s in zip(keys, shapes)]


# (H, G, windows, expected calls (Hq, Hkv, window): the global heads, then each window)
CASES = [
    (4, 4, (None,) * 4, [(4, 4, None)]),
    (4, 4, (5, None, 5, 30), [(2, 2, None), (2, 2, 5)]),          # interleaved; 30 >= T
    (4, 2, (None, None, 5, 5), [(2, 1, None), (2, 1, 5)]),         # groups kept
    (4, 2, (None, 5, 5, 5), [(1, 1, None), (3, 3, 5)]),            # uneven: expanded
    (4, 1, (None, 3, None, 3), [(2, 1, None), (2, 1, 3)]),         # MQA
]


@pytest.mark.parametrize("H,G,windows,want_calls", CASES)
def test_matches_reference_forward_and_backward(calls, H, G, windows, want_calls):
    q, k, v, do = inputs(H, G)
    run = backend(windows)

    @jax.jit
    def forward_and_backward(q, k, v, do):
        out, vjp = jax.vjp(run, q, k, v)
        return out, vjp(do)

    out, grads = forward_and_backward(q, k, v, do)
    assert calls == want_calls
    want, _, want_grads = reference_vjp(q, k, v, do, windows, None, SCALE)
    for got, ref_value in zip((out, *grads), (want, *want_grads)):
        got = np.asarray(got, np.float32)
        err = np.linalg.norm(got - ref_value) / np.linalg.norm(ref_value)
        assert err < 1e-2, err  # bf16 rounding; a head out of place is O(1)


@pytest.mark.parametrize("H,G,windows,want_calls", CASES)
def test_no_gather_or_scatter(calls, H, G, windows, want_calls):
    """Heads are moved with slices and concatenates only: XLA's gather and its transpose, a
    scatter-add, cost a sixth of the forward+backward."""
    q, k, v, do = inputs(H, G)
    run = backend(windows)

    def fwd_bwd(q, k, v, do):
        out, vjp = jax.vjp(run, q, k, v)
        return out, vjp(do)

    text = str(jax.make_jaxpr(fwd_bwd)(q, k, v, do))
    assert "gather" not in text and "scatter" not in text
