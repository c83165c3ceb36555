"""The "split" backend (kernels/split.py) against the pure-JAX reference twin.

On CPU the global heads' cuDNN call is replaced (monkeypatch of the module's one cuDNN seam)
by the reference, and the local heads run our kernel in Pallas interpret mode; inputs are
bfloat16 (the backend's dtypes), so tolerances are bfloat16-sized. A wrong head order, kv
group or window gives errors of order 1. The ``gpu`` test runs cuDNN and the compiled kernel.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ls_jax.kernels import ls_attention, split
from ls_jax.kernels.heads import kv_for_heads, split_heads
from ls_jax.kernels.pallas_gpu import Launch, Launches, TritonConfig

from jitted_reference import reference_attention_parts, reference_vjp  # tests/, beside this file

warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*")

# small tiles keep interpret mode fast; T = 40 is not a multiple of them
TILES = TritonConfig(block_q=16, block_k=16, dq_block_q=16, dq_block_k=16, dkdv_block_q=16,
                     dkdv_block_k=16)
SCALE = 0.3
TOL = 1e-2  # bfloat16 rounding of out / grads (measured <= 4e-3 here)


def rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.all(np.isfinite(got)), "non-finite values in the result"
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def inputs(seed, B, T, H, G, D):
    rng = np.random.default_rng(seed)
    shapes = [(B, T, H, D), (B, T, G, D), (B, T, G, D), (B, T, H, D)]
    return [jnp.asarray(rng.standard_normal(s, np.float32), jnp.bfloat16) for s in shapes]


@pytest.fixture
def calls(monkeypatch):
    """Replaces cuDNN by the reference and records both parts' calls: ("global", Hq, Hkv) and
    ("local", windows, Hkv)."""
    log = []

    def fake_cudnn(q, k, v, scale):
        assert q.shape[2] % k.shape[2] == 0, "cuDNN needs query heads a multiple of kv heads"
        log.append(("global", q.shape[2], k.shape[2]))
        return reference_attention_parts(q, k, v, (None,) * q.shape[2], None, scale)[0]

    real_pallas = split.pallas_gpu_attention

    def spy_pallas(q, k, v, window_sizes, **kw):
        log.append(("local", tuple(window_sizes), k.shape[2]))
        return real_pallas(q, k, v, window_sizes, **kw)

    monkeypatch.setattr(split, "_global_causal_attention", fake_cudnn)
    monkeypatch.setattr(split, "pallas_gpu_attention", spy_pallas)
    return log


def local_launches(windows, k, num_heads):
    """One Triton launch on ``TILES`` over the local heads, for as many kv heads as the backend
    gives them (shapes only: nothing enters the caller's trace)."""
    local = split_heads(windows, k.shape[1]).local_heads
    if not local:
        return None
    num_kv = jax.eval_shape(lambda k: kv_for_heads(k, k, local, num_heads)[0], k).shape[2]
    launch = Launch("triton", tuple(range(len(local))), TILES)
    return Launches(forward=(launch,), backward=(launch,), num_heads=len(local),
                    num_kv_heads=num_kv)


def split_fn(windows, return_logit_stats):
    """The backend on (q, k, v), in interpret mode on small tiles (jitted: several times faster
    than eager interpret mode; traced afresh per call, so ``calls`` sees every trace)."""
    return lambda q, k, v: split.split_backend(
        q, k, v, window_sizes=windows, segment_ids=None, scale=SCALE, interpret=True,
        launches=local_launches(windows, k, q.shape[2]),
        return_logit_stats=return_logit_stats)


def run_split(q, k, v, windows, return_logit_stats):
    return jax.jit(split_fn(windows, return_logit_stats))(q, k, v)


# (H, G, windows, expected calls); T = 40, so 40 and 100 are global windows
CASES = [
    (4, 4, (4, None, 8, None), [("global", 2, 2), ("local", (4, 8), 2)]),  # interleaved
    (4, 2, (None, None, 5, 9), [("global", 2, 1), ("local", (5, 9), 1)]),   # groups kept
    (4, 2, (None, 5, None, 9), [("global", 2, 2), ("local", (5, 9), 2)]),   # 1 per group each
    (4, 2, (None, 5, 7, 40), [("global", 2, 2), ("local", (5, 7), 2)]),     # 40 >= T: global
    (4, 2, (None, 5, 7, 9), [("global", 1, 1), ("local", (5, 7, 9), 3)]),   # uneven: expanded
    (4, 1, (3, None, 6, None), [("global", 2, 1), ("local", (3, 6), 1)]),   # MQA
    (2, 2, (None, 100), [("global", 2, 2)]),                                # all global
    (3, 1, (5, 1, 9), [("local", (5, 1, 9), 1)]),                           # all local
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"H{c[0]}G{c[1]}-{c[2]}")
def test_forward_and_stats_match_reference(calls, case):
    H, G, windows, want_calls = case
    q, k, v, _ = inputs(sum(map(ord, str(case))), 2, 40, H, G, 16)
    out, stats = run_split(q, k, v, windows, return_logit_stats=True)
    assert calls == want_calls
    want_out, _, want_stats = reference_attention_parts(q, k, v, windows, scale=SCALE)
    assert out.shape == q.shape and out.dtype == jnp.bfloat16
    assert rel_err(out, want_out) < TOL
    out, want_out = np.asarray(out, np.float32), np.asarray(want_out, np.float32)
    for h in range(H):  # each head on its own: a swapped head fails here
        assert rel_err(out[:, :, h], want_out[:, :, h]) < TOL, h
    assert stats.shape == (H,) and stats.dtype == jnp.float32
    np.testing.assert_allclose(stats, want_stats, rtol=1e-2)


@pytest.mark.parametrize("H,G,windows", [(4, 4, (4, None, 8, None)), (4, 2, (None, 5, 7, 9))],
                         ids=["interleaved", "gqa-uneven"])
def test_no_stats_output_and_gradients_match_reference(calls, H, G, windows):
    q, k, v, do = inputs(11 + G, 1, 40, H, G, 16)

    @jax.jit
    def ours(q, k, v, do):
        (out, stats), vjp = jax.vjp(split_fn(windows, False), q, k, v)
        assert stats is None
        return out, vjp((do, None))

    out, got = ours(q, k, v, do)
    want_out, _, want_grads = reference_vjp(q, k, v, do, windows, None, SCALE)
    assert rel_err(out, want_out) < TOL
    for name, g, w in zip(("dq", "dk", "dv"), got, want_grads):
        assert g.shape == w.shape and g.dtype == jnp.bfloat16, name
        assert rel_err(g, w) < TOL, name


def test_heads_in_order_take_no_gather(calls):
    """Global heads first (the model's layout): slices and one concatenate, no gather."""
    q, k, v, _ = inputs(5, 1, 40, 4, 2, 16)
    jaxpr = str(jax.make_jaxpr(split_fn((None, None, 5, 9), False))(q, k, v))
    assert "gather" not in jaxpr and "concatenate" in jaxpr


def test_public_entry_point(calls):
    q, k, v, _ = inputs(3, 1, 40, 2, 1, 16)
    out = jax.jit(lambda q, k, v: ls_attention(q, k, v, (None, 9), implementation="split",
                                               interpret=True, scale=SCALE))(q, k, v)
    assert [c[0] for c in calls] == ["global", "local"]
    want_out = reference_attention_parts(q, k, v, (None, 9), scale=SCALE)[0]
    assert rel_err(out, want_out) < TOL


def test_bad_inputs_are_clear_errors():
    q = jnp.zeros((1, 16, 2, 8), jnp.bfloat16)
    seg = jnp.zeros((1, 16), jnp.int32)
    with pytest.raises(NotImplementedError, match="segment_ids: implementation='split' does "
                                                  "not support segment_ids"):
        ls_attention(q, q, q, (None, 4), segment_ids=seg, implementation="split",
                     interpret=True)
    q32 = q.astype(jnp.float32)
    with pytest.raises(ValueError, match="q: implementation='split' needs bfloat16 or "
                                         "float16, got float32"):
        ls_attention(q32, q32, q32, (None, 4), implementation="split", interpret=True)


def test_global_heads_off_gpu_are_a_clear_error():
    if jax.default_backend() == "gpu":
        pytest.skip("a GPU is present")
    q = jnp.zeros((1, 16, 2, 8), jnp.bfloat16)
    with pytest.raises(ValueError, match="implementation='split' runs its global heads "
                                         "through cuDNN and needs a CUDA GPU"):
        ls_attention(q, q, q, (None, 4), implementation="split", interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("H,G,windows", [
    (8, 8, (None, None) + (128,) * 6),
    (8, 4, (64, None, 128, 256, None, 32, 128, 128)),
    (8, 2, (None, 128, 128, 128, 128, 128, 128, 128)),
], ids=["globals-first", "interleaved-gqa", "gqa-uneven"])
def test_gpu_matches_reference(H, G, windows):
    B, T, D = 2, 1024, 128
    q, k, v, do = inputs(H + G, B, T, H, G, D)

    def ours(q, k, v):
        return ls_attention(q, k, v, windows, implementation="split")

    def ref(q, k, v):
        return reference_attention_parts(*(x.astype(jnp.float32) for x in (q, k, v)),
                                         windows)[0]

    out, vjp = jax.vjp(jax.jit(ours), q, k, v)
    want, ref_vjp = jax.vjp(ref, q, k, v)
    assert rel_err(out, want) < TOL
    for name, g, w in zip(("dq", "dk", "dv"), vjp(do), ref_vjp(do.astype(jnp.float32))):
        assert rel_err(g, w) < TOL, name
    _, stats = ls_attention(q, k, v, windows, implementation="split", return_logit_stats=True)
    want_stats = reference_attention_parts(q, k, v, windows)[2]
    np.testing.assert_allclose(stats.max_abs_logit, want_stats, rtol=1e-2)
