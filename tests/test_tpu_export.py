"""The Pallas TPU kernels lower to Mosaic for the TPU platform on a machine without a TPU.

``jax.export(jax.jit(f), platforms=("tpu",))`` of the public entry, forward and backward
(value_and_grad), runs Pallas' TPU lowering of all three kernels (forward, dQ, dK/dV), so a
Pallas -> Mosaic lowering error fails here, which interpret mode would not catch. Mosaic's own
passes and the TPU compile run in libtpu and are not exercised.
"""

import jax
import jax.numpy as jnp
import pytest

from ls_jax.kernels import ls_attention

CASES = [
    # B, T, H, G, D, dtype, windows, segments, stats
    (2, 512, 4, 2, 64, jnp.bfloat16, (None, 5, 130, 1), True, True),   # GQA, segments
    (1, 300, 2, 2, 128, jnp.float32, (None, 64), False, False),         # MHA, T padded
    (1, 384, 4, 1, 32, jnp.bfloat16, (None,) * 4, False, True),         # MQA, all global
    (1, 256, 2, 1, 64, jnp.float32, (17, 200), True, False),            # all local
]


@pytest.mark.parametrize("B,T,H,G,D,dtype,windows,segments,stats", CASES)
def test_forward_and_backward_export_for_tpu(B, T, H, G, D, dtype, windows, segments, stats):
    q = jax.ShapeDtypeStruct((B, T, H, D), dtype)
    kv = jax.ShapeDtypeStruct((B, T, G, D), dtype)
    seg = jax.ShapeDtypeStruct((B, T), jnp.int32) if segments else None

    def loss(q, k, v, seg):
        result = ls_attention(q, k, v, windows, segment_ids=seg, implementation="pallas_tpu",
                              return_logit_stats=stats)
        out = result[0] if stats else result
        total = jnp.sum(out.astype(jnp.float32))
        return total + jnp.sum(result[1].max_abs_logit) if stats else total

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    exported = jax.export.export(step, platforms=("tpu",))(q, kv, kv, seg)
    assert exported.platforms == ("tpu",)
    text = exported.mlir_module()
    assert text.count("tpu_custom_call") == 3  # forward, dQ, dK/dV
    for name in ("ls_attention_tpu_fwd", "ls_attention_tpu_dq", "ls_attention_tpu_dkdv"):
        assert name in text
    assert [a.shape for a in exported.out_avals] == [(), (B, T, H, D), (B, T, G, D), (B, T, G, D)]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_vmapped_gradient_exports_for_tpu_with_x64_enabled(dtype):
    """A user's program: ``jax_enable_x64`` on, the op under ``jax.vmap`` (k, v shared) and
    differentiated. The mapped axis joins the kernels' batch: still three Mosaic calls, and
    the index arithmetic lowers as int32."""
    V, B, T, H, D, windows = 3, 2, 384, 2, 64, (None, 100)
    with jax.enable_x64(True):
        q = jax.ShapeDtypeStruct((V, B, T, H, D), dtype)
        kv = jax.ShapeDtypeStruct((B, T, H, D), dtype)

        def loss(q, k, v):
            out = jax.vmap(lambda q: ls_attention(q, k, v, windows,
                                                  implementation="pallas_tpu"))(q)
            return jnp.sum(out.astype(jnp.float32))

        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
        exported = jax.export.export(step, platforms=("tpu",))(q, kv, kv)
    text = exported.mlir_module()
    assert text.count("tpu_custom_call") == 3
    assert [a.shape for a in exported.out_avals] == [(), q.shape, kv.shape, kv.shape]
    assert [a.dtype for a in exported.out_avals[1:]] == [dtype] * 3


def test_exporting_for_cpu_is_refused_by_the_lowering():
    """The kernels are Mosaic kernels: lowering them for another platform fails."""
    q = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.float32)
    f = jax.jit(lambda q: ls_attention(q, q, q, (None, 9), implementation="pallas_tpu"))
    with pytest.raises(ValueError, match="interpret mode"):
        jax.export.export(f, platforms=("cpu",))(q)
