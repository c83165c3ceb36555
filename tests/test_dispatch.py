"""Which backend ``implementation=None`` picks (kernels/dispatch.py), checked on CPU by naming
the platform: the per-case table on CUDA and no silent dense fallback elsewhere."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ls_jax.kernels import DEFAULT_IMPLEMENTATION, default_implementation, ls_attention
from ls_jax.kernels import backends, dispatch
from ls_jax.kernels.dispatch import choose_implementation, current_platform
from ls_jax.kernels.reference import reference_backend
from stand_in_backends import scaled_get_backend  # tests/, beside this file

CASE = dict(seq_len=1024, head_dim=64, dtype=jnp.bfloat16, has_segments=False,
            return_logit_stats=False)


def test_platform_defaults():
    assert current_platform() == "cpu"  # the tests run on CPU
    assert choose_implementation("cpu") == default_implementation("cpu") == "reference"
    assert choose_implementation("tpu") == DEFAULT_IMPLEMENTATION["tpu"] == "pallas_tpu"
    for platform in ("gpu", "cuda"):
        assert choose_implementation(platform) == "pallas_gpu"
    # the per-case rule applies on CUDA only
    assert choose_implementation("tpu", window_sizes=(None,) * 4, **CASE) == "pallas_tpu"
    assert choose_implementation("cpu", window_sizes=(None,) * 4, **CASE) == "reference"


@pytest.mark.parametrize("platform", ["gpu", "cuda"])
@pytest.mark.parametrize("windows,changes,want", [
    ((None,) * 4, {}, "cudnn"),                        # full causal: cuDNN is faster
    ((None, 1024, 5000, None), {}, "cudnn"),           # windows >= T are global heads
    ((None, None, None, 1023), {}, "pallas_gpu"),      # one local head
    ((None,) + (128,) * 15, {}, "pallas_gpu"),         # the LS mix
    ((None,) * 4, {"return_logit_stats": True}, "pallas_gpu"),
    ((None,) * 4, {"has_segments": True}, "pallas_gpu"),
    ((None,) * 4, {"dtype": jnp.float32}, "pallas_gpu"),
    ((None,) * 4, {"dtype": jnp.float16}, "cudnn"),
    ((None,) * 4, {"head_dim": 128}, "cudnn"),
    ((None,) * 4, {"head_dim": 256}, "pallas_gpu"),   # beyond cuDNN's range off Hopper
    ((None,) * 4, {"head_dim": 36}, "pallas_gpu"),    # not a multiple of 8
    # long LS mixes whose global heads dominate go to "split": cuDNN causal for the global
    # heads, ours for the local ones (dispatch.SPLIT_*)
    ((None,) * 2 + (128,) * 14, {"seq_len": 65536, "head_dim": 128}, "split"),
    ((None,) * 2 + (512,) * 14, {"seq_len": 131072, "head_dim": 128}, "split"),
    ((None,) * 2 + (128,) * 14, {"seq_len": 32768, "head_dim": 128}, "split"),  # T edge
    ((None,) * 2 + (128,) * 14, {"seq_len": 32767, "head_dim": 128}, "pallas_gpu"),
    ((None,) + (128,) * 15, {"seq_len": 65536, "head_dim": 128}, "pallas_gpu"),  # 1 in 16
    ((None,) + (128,) * 7, {"seq_len": 65536, "head_dim": 128}, "split"),  # 1 in 8: the edge
    ((None, 128, None, 128), {"seq_len": 32768, "head_dim": 128}, "split"),  # interleaved
    ((None, 40000) + (128,) * 6, {"seq_len": 32768, "head_dim": 128}, "split"),  # p >= T
    ((128,) * 16, {"seq_len": 65536, "head_dim": 128}, "pallas_gpu"),  # no global head
    ((None,) * 2 + (128,) * 14, {"seq_len": 65536, "head_dim": 72}, "split"),  # D edge
    ((None,) * 2 + (128,) * 14, {"seq_len": 65536, "head_dim": 64}, "pallas_gpu"),
    ((None,) * 2 + (128,) * 14, {"seq_len": 65536, "head_dim": 100}, "pallas_gpu"),  # % 8
    ((None,) * 2 + (128,) * 14, {"seq_len": 65536, "head_dim": 136}, "pallas_gpu"),  # > 128
    ((None,) * 2 + (128,) * 14, {"seq_len": 65536, "head_dim": 128,
                                 "dtype": jnp.float16}, "split"),
    ((None,) * 2 + (128,) * 14, {"seq_len": 65536, "head_dim": 128,
                                 "return_logit_stats": True}, "pallas_gpu"),
    ((None,) * 2 + (128,) * 14, {"seq_len": 65536, "head_dim": 128,
                                 "has_segments": True}, "pallas_gpu"),
    ((None,) * 2 + (128,) * 14, {"seq_len": 65536, "head_dim": 128,
                                 "dtype": jnp.float32}, "pallas_gpu"),
])
def test_cuda_table(platform, windows, changes, want):
    # a CUDA GPU without the Hopper kernels (the Triton path; "split" applies there)
    assert choose_implementation(platform, window_sizes=windows, hopper=False,
                                 **{**CASE, **changes}) == want


@pytest.mark.parametrize("windows,changes", [
    ((None,) * 2 + (128,) * 14, {"seq_len": 65536, "head_dim": 128}),
    ((None, 128, None, 128), {"seq_len": 32768, "head_dim": 128}),
    ((None,) * 4, {}),
])
def test_hopper_keeps_ls_mixes_on_ours(windows, changes):
    """On a Hopper GPU our kernels run the global heads on the Mosaic GPU kernels, faster than
    "split": LS mixes stay on pallas_gpu; all global still goes to cuDNN, whose forward and
    backward are faster than ours there."""
    want = "cudnn" if all(w is None for w in windows) else "pallas_gpu"
    assert choose_implementation("cuda", window_sizes=windows, hopper=True,
                                 **{**CASE, **changes}) == want


@pytest.mark.parametrize("windows,changes,want", [
    ((None,) * 4, {"head_dim": 256}, "cudnn"),
    ((None,) + (128,) * 3, {"head_dim": 256}, "cudnn"),  # an LS mix too
    ((128,) * 4, {"head_dim": 136}, "cudnn"),  # every head local
    ((None,) + (128,) * 3, {"head_dim": 192, "seq_len": 65536}, "cudnn"),
    ((None,) + (128,) * 3, {"head_dim": 128}, "pallas_gpu"),  # within our Hopper kernels
    ((None,) + (128,) * 3, {"head_dim": 264}, "pallas_gpu"),  # beyond cuDNN's range
    ((None,) + (128,) * 3, {"head_dim": 196}, "pallas_gpu"),  # not a multiple of 8
    ((None,) + (128,) * 3, {"head_dim": 256, "return_logit_stats": True}, "pallas_gpu"),
    ((None,) + (128,) * 3, {"head_dim": 256, "has_segments": True}, "pallas_gpu"),
    ((None,) + (128,) * 3, {"head_dim": 256, "dtype": jnp.float32}, "pallas_gpu"),
])
def test_hopper_sends_heads_beyond_its_kernels_to_cudnn(windows, changes, want):
    """On Hopper, heads wider than our Mosaic GPU kernels take (where cuDNN takes them) run on
    cuDNN whatever the mix, differentiated or not: ours would run them on Triton."""
    case = dict(window_sizes=windows, hopper=True, **{**CASE, **changes})
    assert choose_implementation("cuda", **case) == want
    assert dispatch.choose_primal_implementation("cuda", **case) == want


@pytest.mark.parametrize("platform", ["rocm", "metal"])
def test_no_silent_dense_fallback(platform):
    pattern = rf"implementation: no default backend on platform '{platform}'.*pass one of"
    with pytest.raises(ValueError, match=pattern):
        choose_implementation(platform)
    with pytest.raises(ValueError, match=pattern):
        choose_implementation(platform, window_sizes=(None, 3), **CASE)


def test_ls_attention_follows_the_rule(monkeypatch):
    """The public entry passes the call's case to the rule and runs what it picks."""
    picked = []

    def fake_get_backend(implementation):
        picked.append(implementation)
        return reference_backend

    def call(*args, **kwargs):  # traced: the pick is made while tracing, nothing compiled
        return jax.eval_shape(lambda q: ls_attention(q, q, q, *args, **kwargs), q)

    q = jnp.ones((1, 16, 2, 8), jnp.bfloat16)
    monkeypatch.setattr(backends, "get_backend", fake_get_backend)
    monkeypatch.setattr(dispatch, "current_platform", lambda: "cuda")
    call((None, 16))
    call((None, 4))
    call((None, None), return_logit_stats=True)
    call((None, None), segment_ids=jnp.zeros((1, 16), jnp.int32))
    call((None, None), implementation="reference")
    # a long LS mix, traced abstractly (nothing of that size is allocated)
    jax.eval_shape(lambda q: ls_attention(q, q, q, (None, 128)),
                   jax.ShapeDtypeStruct((1, 32768, 2, 128), jnp.bfloat16))
    assert picked == ["cudnn", "pallas_gpu", "pallas_gpu", "pallas_gpu", "reference", "split"]

    monkeypatch.setattr(dispatch, "current_platform", lambda: "rocm")
    with pytest.raises(ValueError, match=r"implementation: no default backend on platform "
                                         r"'rocm'"):
        call((None, 4))
    call((None, 4), implementation="reference")  # an explicit choice works


@pytest.mark.parametrize("hopper", [True, False])
@pytest.mark.parametrize("windows,changes,differentiated,primal_on_hopper", [
    ((None,) * 4, {"seq_len": 8192}, "cudnn", "pallas_gpu"),  # our Hopper forward is faster
    ((None,) * 4, {"seq_len": 8192, "head_dim": 128}, "cudnn", "pallas_gpu"),
    ((None,) * 4, {"seq_len": 8192, "dtype": jnp.float16}, "cudnn", "pallas_gpu"),
    ((None, 9000, None, None), {"seq_len": 8192}, "cudnn", "pallas_gpu"),  # p >= T: global
    ((None,) * 4, {"seq_len": 8192, "head_dim": 96}, "cudnn", "cudnn"),  # no Hopper fwd at 96
    ((None,) * 4, {"seq_len": 8192, "head_dim": 32}, "cudnn", "cudnn"),
    ((None,) * 4, {"seq_len": dispatch.HOPPER_FORWARD_MIN_SEQ_LEN}, "cudnn", "pallas_gpu"),
    ((None,) * 4, {"seq_len": dispatch.HOPPER_FORWARD_MIN_SEQ_LEN - 1}, "cudnn", "cudnn"),
    # the cases cuDNN does not take, and LS mixes: one backend for both kinds of call
    ((None,) * 4, {"seq_len": 8192, "return_logit_stats": True}, "pallas_gpu", "pallas_gpu"),
    ((None,) * 4, {"seq_len": 8192, "has_segments": True}, "pallas_gpu", "pallas_gpu"),
    ((None,) + (128,) * 15, {"seq_len": 8192}, "pallas_gpu", "pallas_gpu"),
    ((None,) * 2 + (128,) * 14, {"seq_len": 65536, "head_dim": 128}, "split", "pallas_gpu"),
])
def test_primal_table(hopper, windows, changes, differentiated, primal_on_hopper):
    """Where nothing differentiates the call: our kernel instead of cuDNN for every-head-global
    calls on Hopper at D a multiple of 64 from HOPPER_FORWARD_MIN_SEQ_LEN; otherwise the same
    backend as a differentiated call. Off Hopper both are the differentiated choice ("split"
    applies there only)."""
    case = dict(window_sizes=windows, hopper=hopper, **{**CASE, **changes})
    if hopper and differentiated == "split":
        differentiated = "pallas_gpu"
    assert choose_implementation("cuda", **case) == differentiated
    want = primal_on_hopper if hopper else differentiated
    assert dispatch.choose_primal_implementation("cuda", **case) == want
    for platform, backend in (("cpu", "reference"), ("tpu", "pallas_tpu")):  # no case rule
        assert dispatch.choose_primal_implementation(platform, **case) == backend


def test_ls_attention_pairs_backends_by_direction(monkeypatch):
    """On a (pretended) Hopper GPU, an all-global call runs "pallas_gpu" when nothing
    differentiates it and "cudnn" forward and backward under jax.grad; an LS mix runs
    "pallas_gpu" both ways. Stand-in backends scale the reference's output so that the numbers
    show which one ran."""
    from ls_jax.kernels.pallas_gpu import heuristics

    traced = []
    monkeypatch.setattr(backends, "get_backend",
                        scaled_get_backend({"pallas_gpu": 2.0, "cudnn": 3.0}, traced))
    monkeypatch.setattr(dispatch, "current_platform", lambda: "cuda")
    monkeypatch.setattr(heuristics, "current_gpu",
                        lambda interpret=False: heuristics.Gpu(hopper=True, sms=132))
    q = jax.random.normal(jax.random.key(1), (1, 2048, 2, 64), jnp.bfloat16)
    want = jax.jit(lambda q: reference_backend(  # jitted: one compile, not one per operation
        q, q, q, window_sizes=(None, None), segment_ids=None, scale=0.125,
        return_logit_stats=False, interpret=False)[0].astype(jnp.float32))(q)

    def f(q):
        return ls_attention(q, q, q, (None, None))

    out = jax.jit(f)(q)
    assert traced == ["pallas_gpu"]
    np.testing.assert_allclose(np.asarray(out, np.float32), 2 * np.asarray(want), rtol=0.02,
                               atol=0.02)
    traced.clear()
    grad = jax.jit(jax.grad(lambda q: jnp.sum(f(q).astype(jnp.float32))))(q)
    assert traced == ["cudnn"] and bool(jnp.all(jnp.isfinite(grad)))
    traced.clear()
    jax.jit(lambda q: ls_attention(q, q, q, (None, 128)))(q)  # a mix: one backend
    assert traced == ["pallas_gpu"]


@pytest.mark.gpu
def test_cuda_default_matches_reference():
    import numpy as np

    from ls_jax.kernels.reference import reference_attention_parts

    assert current_platform() == "cuda"
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(key, (2, 1024, 4, 64), jnp.bfloat16) for key in (kq, kk, kv))
    for windows in ((None,) * 4, (None, 128, 128, 128)):
        out = jax.jit(lambda q, k, v: ls_attention(q, k, v, windows))(q, k, v)
        want = reference_attention_parts(*(x.astype(jnp.float32) for x in (q, k, v)), windows)[0]
        err = np.linalg.norm(np.asarray(out, np.float32) - want) / np.linalg.norm(want)
        assert err < 1e-2, (windows, err)


@pytest.mark.gpu
@pytest.mark.parametrize("windows", [(None,) * 4, (None, 50, 128, 128)],
                         ids=["all-global", "mix"])
def test_cuda_wide_heads_run_cudnn_on_hopper(windows):
    """Heads wider than our Hopper kernels take run on cuDNN there, forward and under
    jax.grad, with no kernel of ours in either program, and match the reference."""
    import numpy as np

    from ls_jax.kernels.pallas_gpu.heuristics import current_gpu
    from ls_jax.kernels.reference import reference_attention_parts

    if not current_gpu().hopper:
        pytest.skip("cuDNN takes heads wider than 128 on Hopper only")
    keys = jax.random.split(jax.random.key(3), 4)
    q, k, v, w = (jax.random.normal(key, (1, 1024, 4, 256), jnp.bfloat16) for key in keys)

    def loss(q, k, v):
        return jnp.sum(ls_attention(q, k, v, windows).astype(jnp.float32) * w)

    forward = jax.jit(lambda q, k, v: ls_attention(q, k, v, windows))
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    for program in (forward.lower(q, k, v).as_text(), grad.lower(q, k, v).as_text()):
        assert "cudnn" in program
        assert "mosaic_gpu" not in program and "triton" not in program
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    want = reference_attention_parts(*f32, windows)[0]
    out = np.asarray(forward(q, k, v), np.float32)
    assert np.linalg.norm(out - want) / np.linalg.norm(want) < 1e-2
    want_grads = jax.grad(lambda *x: jnp.sum(reference_attention_parts(*x, windows)[0] * w),
                          argnums=(0, 1, 2))(*f32)
    for got, want in zip(grad(q, k, v), want_grads):
        got = np.asarray(got, np.float32)
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-2


@pytest.mark.gpu
def test_cuda_all_global_runs_ours_forward_and_cudnn_under_grad():
    """The primal row on the GPU: an all-global call's forward-only program holds our Mosaic
    GPU kernel and no cuDNN call; its gradient program holds cuDNN's and none of ours; both
    match the reference."""
    from ls_jax.kernels.pallas_gpu.heuristics import current_gpu
    from ls_jax.kernels.reference import reference_attention_parts

    if not current_gpu().hopper:
        pytest.skip("the primal rule applies on Hopper GPUs only")
    T = max(2048, dispatch.HOPPER_FORWARD_MIN_SEQ_LEN)
    keys = jax.random.split(jax.random.key(2), 4)
    q, k, v, w = (jax.random.normal(key, (2, T, 4, 64), jnp.bfloat16) for key in keys)
    windows = (None,) * 4

    def f(q, k, v):
        return ls_attention(q, k, v, windows)

    def loss(attend, q, k, v):
        return jnp.sum(attend(q, k, v).astype(jnp.float32) * w.astype(jnp.float32))

    forward = jax.jit(f)
    grad = jax.jit(jax.grad(lambda *qkv: loss(f, *qkv), argnums=(0, 1, 2)))
    forward_hlo = forward.lower(q, k, v).as_text()
    grad_hlo = grad.lower(q, k, v).as_text()
    assert "mosaic_gpu" in forward_hlo and "cudnn" not in forward_hlo
    assert "cudnn" in grad_hlo and "mosaic_gpu" not in grad_hlo

    q32, k32, v32 = (x.astype(jnp.float32) for x in (q, k, v))
    want = reference_attention_parts(q32, k32, v32, windows)[0]
    out = np.asarray(forward(q, k, v), np.float32)
    assert np.linalg.norm(out - want) / np.linalg.norm(want) < 1e-2

    def reference(q, k, v):
        return reference_attention_parts(q, k, v, windows)[0]

    want_grads = jax.grad(lambda *qkv: loss(reference, *qkv), argnums=(0, 1, 2))(q32, k32, v32)
    for name, got, ref in zip("qkv", grad(q, k, v), want_grads):
        got, ref = np.asarray(got, np.float32), np.asarray(ref)
        assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 2e-2, name
