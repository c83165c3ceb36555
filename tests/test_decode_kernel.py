"""kernels/decode.py: cached attention backends against an explicit per-query loop (CPU;
the Pallas GPU decode kernel in interpret mode)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ls_jax.kernels.decode import cached_attention
from ls_jax.kernels.pallas_gpu.decode import pallas_gpu_cached_attention


def loop_attention(q, k, v, q_pos, k_pos, windows):
    """numpy, one (row, query, head) at a time."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    B, T, Hq, D = q.shape
    r = Hq // k.shape[2]
    out = np.zeros_like(q)
    for b in range(B):
        for i in range(T):
            for h in range(Hq):
                w = np.inf if windows[h] is None else windows[h]
                qp = int(q_pos[b, i])
                slots = [s for s in range(k.shape[1])
                         if 0 <= k_pos[b, s] <= qp and qp - k_pos[b, s] < w]
                if not slots:
                    continue
                logits = np.array([q[b, i, h] @ k[b, s, h // r] / np.sqrt(D) for s in slots])
                p = np.exp(logits - logits.max())
                out[b, i, h] = (p / p.sum()) @ np.stack([v[b, s, h // r] for s in slots])
    return out


def case(T, S=37, B=2, Hq=4, Hkv=2, D=16):
    ks = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(ks[0], (B, T, Hq, D))
    k = jax.random.normal(ks[1], (B, S, Hkv, D))
    v = jax.random.normal(ks[2], (B, S, Hkv, D))
    # row 0: a global-style cache (slot = position, 30 written); row 1: scrambled positions
    k_pos = np.stack([np.where(np.arange(S) < 30, np.arange(S), -1),
                      np.arange(S)[::-1] - 3]).astype(np.int32)
    q_pos = np.stack([np.arange(29 - T + 1, 30), np.arange(20 - T + 1, 21)]).astype(np.int32)
    return q, k, v, jnp.asarray(q_pos), jnp.asarray(k_pos)


WINDOWS = (None, 5, 3, None)


@pytest.mark.parametrize("impl", ["reference", "xla"])
@pytest.mark.parametrize("T", [1, 4])
def test_backends_match_the_loop(impl, T):
    q, k, v, q_pos, k_pos = case(T)
    want = loop_attention(q, k, v, np.asarray(q_pos), np.asarray(k_pos), WINDOWS)
    got = cached_attention(q, k, v, q_pos, k_pos, WINDOWS, implementation=impl)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_s", [16, 64])  # 3 splits with a ragged tail / one block
def test_pallas_gpu_decode_interpret_matches_reference(block_s):
    q, k, v, q_pos, k_pos = case(1)
    ref = cached_attention(q, k, v, q_pos, k_pos, WINDOWS, implementation="reference")
    got = pallas_gpu_cached_attention(q, k, v, q_pos, k_pos, window_sizes=WINDOWS,
                                      scale=0.25, interpret=True, block_s=block_s)
    np.testing.assert_allclose(got, ref, atol=1e-5, rtol=1e-5)


def test_bf16_cache_close_to_float32():
    q, k, v, q_pos, k_pos = case(1)
    ref = cached_attention(q, k, v, q_pos, k_pos, WINDOWS, implementation="reference")
    got = cached_attention(q, k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), q_pos, k_pos,
                           WINDOWS, implementation="xla")
    np.testing.assert_allclose(got, ref, atol=3e-2)


def test_bad_input():
    q, k, v, q_pos, k_pos = case(1)
    with pytest.raises(ValueError, match="implementation: expected None or one of"):
        cached_attention(q, k, v, q_pos, k_pos, WINDOWS, implementation="cudnn")
    with pytest.raises(ValueError, match=r"k_pos: expected int \[B=2, S=37\]"):
        cached_attention(q, k, v, q_pos, k_pos[:, :5], WINDOWS)
    with pytest.raises(ValueError, match="window_sizes: expected one entry per query head"):
        cached_attention(q, k, v, q_pos, k_pos, (None, 5))


@pytest.mark.gpu
def test_pallas_gpu_decode_on_gpu():
    q, k, v, q_pos, k_pos = case(1, S=300, D=32)
    ref = cached_attention(q, k, v, q_pos, k_pos, WINDOWS, implementation="reference")
    for dtype in (jnp.float32, jnp.bfloat16):
        got = cached_attention(q.astype(dtype), k.astype(dtype), v.astype(dtype), q_pos, k_pos,
                               WINDOWS, implementation="pallas_gpu")
        np.testing.assert_allclose(got.astype(jnp.float32), ref, atol=3e-2 if dtype ==
                                   jnp.bfloat16 else 1e-4)
