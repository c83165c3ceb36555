"""The pure-JAX reference twin against explicit Python loops and jax.nn.dot_product_attention."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ls_jax.kernels import ls_attention
from ls_jax.kernels.reference import allowed_mask, blockwise_max_abs_logit

from jitted_reference import reference_attention_parts  # tests/, beside this file

# Each call below runs jitted: one compiled program instead of one per operation.
attention = jax.jit(ls_attention, static_argnames=("window_sizes", "scale", "return_logit_stats"))
causal_xla = jax.jit(lambda q, k, v, scale=None, local_window_size=None: (
    jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True,
                                 local_window_size=local_window_size, implementation="xla")),
    static_argnames=("scale", "local_window_size"))


def loop_allowed(i, j, p, seg=None, b=0):
    ok = j <= i and (p is None or j > i - p)
    if seg is not None:
        ok = ok and seg[b, i] == seg[b, j]
    return ok


def loop_attention(q, k, v, windows, seg=None, scale=None):
    """float64 attention with explicit loops over heads and queries; also max |logit| per head."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    B, T, Hq, D = q.shape
    G = Hq // k.shape[2]
    scale = 1.0 / np.sqrt(D) if scale is None else scale
    out = np.zeros_like(q)
    lse = np.zeros((B, Hq, T))
    max_abs = np.zeros(Hq)
    for b, h, i in itertools.product(range(B), range(Hq), range(T)):
        js = [j for j in range(T) if loop_allowed(i, j, windows[h], seg, b)]
        s = np.array([scale * q[b, i, h] @ k[b, j, h // G] for j in js])
        m = s.max()
        w = np.exp(s - m)
        lse[b, h, i] = m + np.log(w.sum())
        out[b, i, h] = (w[:, None] * v[b, js, h // G]).sum(0) / w.sum()
        max_abs[h] = max(max_abs[h], np.abs(s).max())
    return out, lse, max_abs


def rand_qkv(seed, B, T, Hq, Hkv, D, dtype=jnp.float32):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(kq, (B, T, Hq, D), dtype), jax.random.normal(kk, (B, T, Hkv, D), dtype),
            jax.random.normal(kv, (B, T, Hkv, D), dtype))


CASES = [
    # (T, Hq, Hkv, windows)
    (13, 4, 4, (None, 5, 1, 2)),          # mixed heads, p = 1, T not a multiple of anything
    (17, 6, 2, (None, 3, 3, None, 50, 1)),  # GQA, p >= T
    (9, 3, 1, (1, 1, 9)),                 # MQA, all local, p == T
    (11, 2, 2, (None, None)),             # all global
]


@pytest.mark.parametrize("T,Hq,Hkv,windows", CASES)
def test_mask_matches_loops(T, Hq, Hkv, windows):
    seg = np.array([[0] * (T // 2) + [1] * (T - T // 2)])
    mask = np.asarray(allowed_mask(T, windows, jnp.asarray(seg)))
    for h, i, j in itertools.product(range(Hq), range(T), range(T)):
        assert mask[0, h, i, j] == loop_allowed(i, j, windows[h], seg), (h, i, j)


@pytest.mark.parametrize("T,Hq,Hkv,windows", CASES)
@pytest.mark.parametrize("with_segments", [False, True])
def test_reference_matches_loops(T, Hq, Hkv, windows, with_segments):
    seed = hash((T, Hq, Hkv, windows, with_segments)) % 2**31
    q, k, v = rand_qkv(seed, 2, T, Hq, Hkv, 8)
    seg = None
    if with_segments:
        seg = jnp.asarray(np.sort(np.random.default_rng(seed).integers(0, 3, (2, T)), axis=1))
    out, lse, max_abs = reference_attention_parts(q, k, v, windows, seg)
    want_out, want_lse, want_max = loop_attention(q, k, v, windows, None if seg is None else np.asarray(seg))
    np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(max_abs, want_max, rtol=1e-5)
    _, stats = attention(q, k, v, windows, segment_ids=seg, return_logit_stats=True)
    np.testing.assert_allclose(stats.max_abs_logit, want_max, rtol=1e-5)
    blockwise = jax.jit(blockwise_max_abs_logit, static_argnums=(2,), static_argnames="block_q")
    np.testing.assert_allclose(blockwise(q, k, windows, seg, block_q=4), want_max, rtol=1e-5)


def test_all_global_equals_plain_causal():
    q, k, v = rand_qkv(1, 2, 33, 4, 4, 16)
    ours = attention(q, k, v, (None,) * 4)
    theirs = causal_xla(q, k, v)
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)
    # a window >= T is global too
    np.testing.assert_allclose(attention(q, k, v, (33, 40, 1000, None)), theirs, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("windows", [(7, 7), (1, 2), (39, 40), (None, 3, 100, 16)])
def test_window_p_is_jax_local_window_size_p_minus_1(windows):
    """Our window p (p keys, the current one included) is jax.nn.dot_product_attention's
    local_window_size=(p - 1, 0) with is_causal=True, head by head (an independent reference,
    also for GQA); None is plain is_causal=True."""
    H, G, T = len(windows), 1 if len(windows) > 2 else 2, 40
    q, k, v = rand_qkv(2 + len(windows), 2, T, H, G, 8)
    ours = np.asarray(attention(q, k, v, windows, scale=0.4))
    q, k, v = (np.asarray(x) for x in (q, k, v))
    for h, p in enumerate(windows):
        kv_head = h // (H // G)
        theirs = causal_xla(
            q[:, :, h:h + 1], k[:, :, kv_head:kv_head + 1], v[:, :, kv_head:kv_head + 1],
            scale=0.4, local_window_size=None if p is None else (p - 1, 0))
        np.testing.assert_allclose(ours[:, :, h:h + 1], theirs, rtol=1e-5, atol=1e-6,
                                   err_msg=f"head {h}, window {p}")


def test_max_abs_logit_bruteforce_numpy():
    rng = np.random.default_rng(3)
    q = rng.normal(size=(2, 10, 3, 4)).astype(np.float32) * 3
    k = rng.normal(size=(2, 10, 3, 4)).astype(np.float32)
    windows = (None, 2, 4)
    _, stats = attention(q, k, k, windows, scale=0.7, return_logit_stats=True)
    logits = 0.7 * np.einsum("bihd,bjhd->bhij", q, k)
    for h, p in enumerate(windows):
        allowed = [(i, j) for i in range(10) for j in range(10) if loop_allowed(i, j, p)]
        want = max(abs(logits[b, h, i, j]) for b in range(2) for i, j in allowed)
        assert stats.max_abs_logit[h] == pytest.approx(want, rel=1e-5)


def test_gradients_match_finite_differences():
    q, k, v = rand_qkv(4, 1, 6, 2, 1, 3, jnp.float32)
    q, k, v = (x.astype(jnp.float64) if jax.config.jax_enable_x64 else x for x in (q, k, v))
    windows = (None, 2)
    w = jax.random.normal(jax.random.key(5), q.shape)

    @jax.jit
    def loss(q, k, v):
        return jnp.sum(ls_attention(q, k, v, windows) * w)

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    eps = 1e-2
    rng = np.random.default_rng(0)
    x = [np.asarray(a) for a in (q, k, v)]
    for arg, g in enumerate(grads):
        for _ in range(4):
            idx = tuple(rng.integers(0, s) for s in x[arg].shape)
            step = np.zeros_like(x[arg])
            step[idx] = eps
            plus = [a + step if n == arg else a for n, a in enumerate(x)]
            minus = [a - step if n == arg else a for n, a in enumerate(x)]
            fd = (loss(*plus) - loss(*minus)) / (2 * eps)
            assert float(g[idx]) == pytest.approx(float(fd), rel=2e-2, abs=2e-3), (arg, idx)


def test_stats_carry_no_gradient():
    q, k, v = rand_qkv(6, 1, 5, 2, 2, 4)
    g = jax.jit(jax.grad(lambda q: ls_attention(q, k, v, (None, 2), return_logit_stats=True)[1]
                         .max_abs_logit.sum()))(q)
    assert not np.any(np.asarray(g))
