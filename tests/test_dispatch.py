"""Which backend ``implementation=None`` picks (kernels/dispatch.py), checked on CPU by naming
the platform: the per-case table on CUDA and no silent dense fallback elsewhere."""

import jax
import jax.numpy as jnp
import pytest

from ls_jax.kernels import DEFAULT_IMPLEMENTATION, default_implementation, ls_attention
from ls_jax.kernels import api, dispatch
from ls_jax.kernels.dispatch import choose_implementation, current_platform
from ls_jax.kernels.reference import reference_backend

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
    ((None,) * 4, {"head_dim": 256}, "pallas_gpu"),   # beyond cuDNN's range on every card
    ((None,) * 4, {"head_dim": 36}, "pallas_gpu"),    # not a multiple of 8
    # long LS mixes whose global heads dominate go to "split": cuDNN causal for the global
    # heads, ours for the local ones (dispatch.SPLIT_*; estimated from run I, H100)
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
    "split" in every measured case (run J): LS mixes stay on pallas_gpu; all global still
    goes to cuDNN (our fwd+bwd 0.86-0.94x of it)."""
    want = "cudnn" if all(w is None for w in windows) else "pallas_gpu"
    assert choose_implementation("cuda", window_sizes=windows, hopper=True,
                                 **{**CASE, **changes}) == want


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

    q = jnp.ones((1, 16, 2, 8), jnp.bfloat16)
    monkeypatch.setattr(api, "get_backend", fake_get_backend)
    monkeypatch.setattr(dispatch, "current_platform", lambda: "cuda")
    ls_attention(q, q, q, (None, 16))
    ls_attention(q, q, q, (None, 4))
    ls_attention(q, q, q, (None, None), return_logit_stats=True)
    ls_attention(q, q, q, (None, None), segment_ids=jnp.zeros((1, 16), jnp.int32))
    ls_attention(q, q, q, (None, None), implementation="reference")
    # a long LS mix, traced abstractly (nothing of that size is allocated)
    jax.eval_shape(lambda q: ls_attention(q, q, q, (None, 128)),
                   jax.ShapeDtypeStruct((1, 32768, 2, 128), jnp.bfloat16))
    assert picked == ["cudnn", "pallas_gpu", "pallas_gpu", "pallas_gpu", "reference", "split"]

    monkeypatch.setattr(dispatch, "current_platform", lambda: "rocm")
    with pytest.raises(ValueError, match=r"implementation: no default backend on platform "
                                         r"'rocm'"):
        ls_attention(q, q, q, (None, 4))
    ls_attention(q, q, q, (None, 4), implementation="reference")  # an explicit choice works


@pytest.mark.gpu
def test_cuda_default_runs_cudnn_for_all_global_and_matches_reference():
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
