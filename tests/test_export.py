"""``jax.export`` for "cuda" and "tpu" from this CPU machine (ls_jax/interop/export.py): the op and a
model lower to our kernels' custom calls (Pallas' Triton/Mosaic lowering runs; the GPU/TPU
compilers do not), also with a symbolic batch; ``implementation=None`` chooses per platform of
the export (one artifact for several), and under ``jax.export`` itself is refused for another
platform than the tracing machine's, with one line. A symbolic length exports on the reference
alone (the op and a model); for a kernel, or off a GPU without ``gpu=``, one line."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ls_jax.config import ModelConfig
from ls_jax.interop.export import KERNEL_CUSTOM_CALLS, export
from ls_jax.kernels import explain, ls_attention
from ls_jax.layers.transformer import Transformer

GPU = "NVIDIA H100 80GB HBM3"  # the target a CPU machine names for the GPU lowering
IMPL = {"cuda": "pallas_gpu", "tpu": "pallas_tpu"}
# an export for "cpu" alone runs here only where JAX's devices are CPUs
CPU_HOST = pytest.mark.skipif(jax.default_backend() != "cpu", reason="runs a CPU export here")


def _targets(exported) -> list[str]:
    return re.findall(r'call_target_name = "([^"]+)"|stablehlo.custom_call @([^(\s]+)',
                      exported.mlir_module())


def _kernel_calls(exported, platform: str) -> int:
    return sum(1 for pair in _targets(exported) for t in pair
               if t in KERNEL_CUSTOM_CALLS[platform])


@pytest.mark.parametrize("platform", ["cuda", "tpu"], ids=["to_cuda", "to_tpu"])  # "tpu" alone is a marker name
def test_the_op_forward_and_backward_lower_to_our_kernels(platform):
    q = jax.ShapeDtypeStruct((1, 256, 4, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.bfloat16)

    def loss(q, k, v):
        out = ls_attention(q, k, v, (None, 9, 9, 130), implementation=IMPL[platform])
        return jnp.sum(out.astype(jnp.float32))

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    exported = export(step, platforms=(platform,), gpu=GPU)(q, kv, kv)
    assert exported.platforms == (platform,)
    assert _kernel_calls(exported, platform) >= 3  # forward, and dQ and dK/dV
    assert [a.shape for a in exported.out_avals] == [(), q.shape, kv.shape, kv.shape]


@pytest.mark.parametrize("gpu,lowerings", [
    pytest.param(GPU, {"mosaic_gpu_v2"}, id="hopper"),
    pytest.param("NVIDIA A100-SXM4-80GB", {"__gpu$xla.gpu.triton"}, id="ampere"),
])
def test_the_launches_are_planned_for_the_named_gpu(gpu, lowerings):
    """An LS mix that the Mosaic GPU kernels take (16-bit, D=64, no segment ids) lowers to
    them for a Hopper target and to Triton only for another GPU, wherever it is exported."""
    q = jax.ShapeDtypeStruct((4, 4096, 16, 64), jnp.bfloat16)
    f = jax.jit(lambda q, k, v: ls_attention(q, k, v, (None,) + (128,) * 15,
                                              implementation="pallas_gpu"))
    targets = {t for pair in _targets(export(f, platforms=("cuda",), gpu=gpu)(q, q, q))
               for t in pair if t}
    assert lowerings <= targets <= set(KERNEL_CUSTOM_CALLS["cuda"])
    if "mosaic_gpu_v2" not in lowerings:
        assert "mosaic_gpu_v2" not in targets


@pytest.mark.parametrize("platform", ["cuda", "tpu"], ids=["to_cuda", "to_tpu"])  # "tpu" alone is a marker name
def test_a_model_lowers_to_our_kernels_once_per_layer(platform):
    cfg = ModelConfig(vocab_size=64, n_layer=2, d_model=64, n_head=4, head_dim=16, window=8,
                      max_seq_len=128, attn_implementation=IMPL[platform])
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))

    @jax.jit
    def logits(state, tokens):
        return nnx.merge(graphdef, state)(tokens)

    tokens = jax.ShapeDtypeStruct((2, 128), jnp.int32)
    exported = export(logits, platforms=(platform,), gpu=GPU)(state, tokens)
    assert _kernel_calls(exported, platform) == cfg.n_layer
    assert exported.out_avals[0].shape == (2, 128, 64)


@pytest.mark.parametrize("platform", ["cuda", "tpu"], ids=["to_cuda", "to_tpu"])  # "tpu" alone is a marker name
def test_implementation_none_under_jax_export_is_refused_for_another_platform(platform):
    q = jax.ShapeDtypeStruct((1, 64, 2, 16), jnp.float32)
    f = jax.jit(lambda q: ls_attention(q, q, q, (None, 9)))
    with pytest.raises(ValueError, match=(
            r"implementation: None chose 'reference' for 'cpu', the platform of the machine "
            rf"that traced the call, but the program is lowered for \('{platform}',\); "
            r"export with ls_jax.interop.export.export \(it chooses per platform\)")):
        jax.export.export(f, platforms=(platform,))(q)
    assert jax.export.export(f, platforms=("cpu",))(q).platforms == ("cpu",)


@pytest.mark.parametrize("platform", ["cuda", "tpu"], ids=["to_cuda", "to_tpu"])
def test_implementation_none_chooses_for_the_export_platform(platform):
    q = jax.ShapeDtypeStruct((1, 256, 4, 64), jnp.bfloat16)
    f = jax.jit(lambda q: ls_attention(q, q, q, (None, 9, 9, 130)))
    assert _kernel_calls(export(f, platforms=(platform,), gpu=GPU)(q), platform) >= 1


@pytest.mark.parametrize("platform,gpu", [("cuda", GPU), ("cuda", "NVIDIA A100-SXM4-80GB"),
                                          ("tpu", None)],
                         ids=["to_cuda_hopper", "to_cuda_ampere", "to_tpu"])
def test_a_symbolic_batch_exports_forward_and_backward(platform, gpu):
    """One export for every batch size (a serving stack's): the kernels' cost estimates and
    launch heuristics take a symbolic batch (kernels/pallas_gpu/backend.py,
    kernels/pallas_tpu/plan.py)."""
    b, = jax.export.symbolic_shape("b")
    q = jax.ShapeDtypeStruct((b, 256, 4, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((b, 256, 2, 64), jnp.bfloat16)

    def loss(q, k, v):
        out = ls_attention(q, k, v, (None, 9, 9, 130), implementation=IMPL[platform])
        return jnp.sum(out.astype(jnp.float32))

    exported = export(jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))),
                      platforms=(platform,), gpu=gpu)(q, kv, kv)
    assert _kernel_calls(exported, platform) >= 3
    assert [a.shape for a in exported.out_avals] == [(), q.shape, kv.shape, kv.shape]


def test_one_export_for_cpu_cuda_and_tpu_runs_here():
    """implementation=None under ls_jax.interop.export.export: one artifact holding the reference for
    CPU and our kernels for CUDA and TPU (a jax.lax.platform_dependent branch each), which
    runs on this CPU as the call does."""
    W = (None, 9, 9, 130)
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(kq, (2, 256, 4, 64), jnp.bfloat16)
    k, v = (jax.random.normal(x, (2, 256, 2, 64), jnp.bfloat16) for x in (kk, kv))

    def loss(q, k, v):
        return jnp.sum(ls_attention(q, k, v, W).astype(jnp.float32))

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    exported = export(step, platforms=("cpu", "cuda", "tpu"), gpu=GPU)(q, k, v)
    assert exported.platforms == ("cpu", "cuda", "tpu")
    assert _kernel_calls(exported, "cuda") >= 3 and _kernel_calls(exported, "tpu") >= 3
    (got_loss, got_grads), (want_loss, want_grads) = exported.call(q, k, v), step(q, k, v)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-4)
    for a, b in zip(got_grads, want_grads):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_bad_arguments_are_one_line():
    with pytest.raises(ValueError, match="platforms: expected a tuple of platform names"):
        export(jax.jit(lambda x: x), platforms=())
    with pytest.raises(ValueError, match="gpu: expected a device kind"):
        export(jax.jit(lambda x: x), platforms=("cuda",), gpu="")


def _random_qkv(seq_len: int, dtype=jnp.float32):
    kq, kk, kv = jax.random.split(jax.random.key(seq_len), 3)
    return (jax.random.normal(kq, (2, seq_len, 4, 32), dtype),
            *(jax.random.normal(x, (2, seq_len, 2, 32), dtype) for x in (kk, kv)))


@CPU_HOST
@pytest.mark.parametrize("names", ["t", "b, t"], ids=["length", "batch_and_length"])
def test_a_symbolic_length_exports_the_reference_forward_and_backward(names):
    """The reference (the CPU default) takes a symbolic T: its band mask compares each pair's
    distance with the head's window, never with T. One export runs every length as the call
    does, windows wider than the sequence included."""
    dims = jax.export.symbolic_shape(names)
    b, t = dims if len(dims) == 2 else (2, dims[0])

    def loss(q, k, v):
        return jnp.sum(ls_attention(q, k, v, (None, 9, 9, 130)))

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    exported = export(step, platforms=("cpu",))(
        jax.ShapeDtypeStruct((b, t, 4, 32), jnp.float32),
        *[jax.ShapeDtypeStruct((b, t, 2, 32), jnp.float32)] * 2)
    for seq_len in (1, 37, 140):
        q, k, v = _random_qkv(seq_len)
        (got_loss, got_grads), (want_loss, want_grads) = exported.call(q, k, v), step(q, k, v)
        np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5, atol=1e-5)
        for a, w in zip(got_grads, want_grads):
            np.testing.assert_allclose(a, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("implementation,platforms,got", [
    pytest.param("pallas_gpu", ("cuda",), "implementation='pallas_gpu'", id="pallas_gpu"),
    pytest.param("pallas_tpu", ("tpu",), "implementation='pallas_tpu'", id="pallas_tpu"),
    pytest.param("cudnn", ("cuda",), "implementation='cudnn'", id="cudnn"),
    pytest.param(None, ("cpu", "cuda"), "implementation=None, which runs a kernel on ('cuda',)",
                 id="none_for_cpu_and_cuda"),
])
def test_a_symbolic_length_for_a_kernel_is_one_line(implementation, platforms, got):
    """A kernel's launch grid is static: a symbolic T is refused before any backend runs."""
    t, = jax.export.symbolic_shape("t")
    q = jax.ShapeDtypeStruct((2, t, 4, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, t, 2, 64), jnp.bfloat16)
    f = jax.jit(lambda q, k, v: ls_attention(q, k, v, (None, 9, 9, 130),
                                             implementation=implementation))
    with pytest.raises(ValueError, match=(
            r"^q: a symbolic sequence length T=t runs on implementation='reference' alone")) as e:
        export(f, platforms=platforms, gpu=GPU)(q, kv, kv)
    assert f"got {got};" in str(e.value) and "\n" not in str(e.value)


def test_a_concrete_numpy_length_is_not_symbolic():
    q = jax.ShapeDtypeStruct((1, np.int64(256), 4, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, np.int64(256), 2, 64), jnp.bfloat16)
    plan = explain(q, kv, kv, (None, 9, 9, 130), platform="cuda", device_kind=GPU)
    assert plan.routes[0].differentiated == "pallas_gpu"


@CPU_HOST
@pytest.mark.parametrize("pos_embedding,constraints", [
    pytest.param("learned", ("t <= 128",), id="learned_table_bounded"),
    pytest.param("rope", (), id="rope"),
])
def test_a_model_exports_with_a_symbolic_length(pos_embedding, constraints):
    cfg = ModelConfig(vocab_size=64, n_layer=2, d_model=64, n_head=4, head_dim=16, window=8,
                      max_seq_len=128, pos_embedding=pos_embedding)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)

    @jax.jit
    def logits(state, tokens):
        return nnx.merge(graphdef, state)(tokens)

    b, t = jax.export.symbolic_shape("b, t", constraints=constraints)
    exported = export(logits, platforms=("cpu",))(state, jax.ShapeDtypeStruct((b, t), jnp.int32))
    tokens = jnp.arange(3 * 21, dtype=jnp.int32).reshape(3, 21) % cfg.vocab_size
    np.testing.assert_allclose(exported.call(state, tokens), model(tokens), rtol=1e-5, atol=1e-5)


def test_a_symbolic_length_beyond_a_learned_table_is_one_line():
    cfg = ModelConfig(vocab_size=64, n_layer=1, d_model=64, n_head=4, head_dim=16, window=8,
                      max_seq_len=128, pos_embedding="learned")
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    t, = jax.export.symbolic_shape("t")
    f = jax.jit(lambda state, tokens: nnx.merge(graphdef, state)(tokens))
    with pytest.raises(ValueError, match=(
            r"^tokens: the symbolic sequence length t may exceed model.max_seq_len=128 .*; add "
            r"the constraint 't <= 128' to its jax.export.symbolic_shape")) as e:
        export(f, platforms=("cpu",))(state, jax.ShapeDtypeStruct((2, t), jnp.int32))
    assert "\n" not in str(e.value)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="this machine has a GPU to lower for")
def test_exporting_the_gpu_kernels_off_a_gpu_without_gpu_is_one_line():
    q = jax.ShapeDtypeStruct((1, 256, 4, 64), jnp.bfloat16)
    f = jax.jit(lambda q: ls_attention(q, q[:, :, :2], q[:, :, :2], (None, 9, 9, 130),
                                       implementation="pallas_gpu"))
    with pytest.raises(ValueError, match=r"^gpu: exporting the GPU kernels from a machine "
                                         r"without a GPU needs the target named") as e:
        export(f, platforms=("cuda",))(q)
    assert "\n" not in str(e.value)
    assert jax.eval_shape(f, q).shape == q.shape  # tracing alone needs no GPU
