"""The TPU paths compiled for TPU chips on a host without one, and the compile-only command.

libtpu (the ``jax[tpu]`` extra; ``make venv-tpu`` makes a venv with it) compiles for a TPU
topology description (``jax.experimental.topologies``) on any host, so these tests run the
TPU compiler itself, Mosaic's passes included: what tests/test_tpu_export.py's lowering does
not reach (layouts, each kernel's scoped VMEM against the chip's limit, the SPMD partitioning
of the train step). Marked ``tpu_compile`` and skipped where libtpu is absent;
``make test-tpu-compile`` runs them. Nothing here runs on a TPU: compiling says nothing of
speed or of numerics (those are interpret-mode tests, tests/test_pallas_tpu.py).

The unmarked tests run everywhere: ``--compile-only local`` on this host's CPU, and the one
line a missing libtpu gives.
"""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ls_jax.training.compile_only import (EXIT_DOES_NOT_FIT, compile_steps, kernel_calls,
                                 prepare_libtpu, topology_devices)

try:
    import libtpu  # noqa: F401
    HAVE_LIBTPU = True
except ImportError:
    HAVE_LIBTPU = False


def needs_libtpu(test):
    """Marked ``tpu_compile``; skipped where libtpu is absent."""
    test = pytest.mark.tpu_compile(test)
    return pytest.mark.skipif(not HAVE_LIBTPU, reason="needs libtpu: make venv-tpu")(test)


prepare_libtpu()  # before conftest's jax.default_backend() starts the backends

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# one small topology per chip generation that ships an LS kernel target: v5e and v6e (the
# single-core chips), v5p (two TensorCores as one device)
CHIPS = {"v5e": "v5e:2x2", "v6e": "v6e:2x2", "v5p": "v5p:2x2x1"}
KERNEL_NAMES = ("ls_attention_tpu_fwd", "ls_attention_tpu_dq", "ls_attention_tpu_dkdv")


def _one_device(chip: str):
    """A mesh of one device of ``chip``'s topology and its replicated sharding."""
    device = topology_devices(CHIPS[chip])[0]
    mesh = jax.sharding.Mesh(np.array([device]), ("x",))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


# ---------------------------------------------------------------------------------------------
# The kernel alone: forward, forward + backward

KERNEL_CASES = {
    # name: B, T, H, G, D, windows, dtype, segments, logit statistics
    "paper_layer": (4, 2048, 6, 6, 32, (None,) + (51,) * 5, jnp.bfloat16, False, True),
    "125m_layer": (1, 8192, 12, 12, 64, (None,) + (128,) * 11, jnp.bfloat16, False, False),
    "gqa_odd_length_segments": (2, 1000, 8, 2, 64, (None, 128, 5, 300, None, 1, 64, 129),
                                jnp.bfloat16, True, True),
    "mqa_all_local_f32": (1, 777, 4, 1, 128, (17, 200, 64, 1), jnp.float32, True, False),
    "all_global_d256": (1, 4096, 2, 2, 256, (None, None), jnp.bfloat16, False, True),
    "head_dim_96_f32": (1, 640, 2, 1, 96, (None, 100), jnp.float32, False, False),
    "long_blocks_doubled": (1, 65536, 2, 1, 128, (None, 128), jnp.bfloat16, False, False),
}


def _kernel_fn(windows, stats, backward):
    from ls_jax.kernels import ls_attention

    def attention(q, k, v, seg):
        result = ls_attention(q, k, v, windows, segment_ids=seg, implementation="pallas_tpu",
                              return_logit_stats=stats)
        return result if stats else (result, None)

    if not backward:
        return attention

    def loss(q, k, v, seg):
        out, s = attention(q, k, v, seg)
        total = jnp.sum(out.astype(jnp.float32))
        return total + (jnp.sum(s.max_abs_logit) if stats else 0.0)
    return jax.value_and_grad(loss, argnums=(0, 1, 2))


@needs_libtpu
@pytest.mark.parametrize("case", sorted(KERNEL_CASES))
@pytest.mark.parametrize("chip", ["v5e", "v6e"])
def test_forward_and_backward_compile(chip, case):
    _compile_kernel_case(chip, *KERNEL_CASES[case], backward=True)


@needs_libtpu
@pytest.mark.parametrize("case", ["paper_layer", "gqa_odd_length_segments", "all_global_d256"])
@pytest.mark.parametrize("chip", ["v5e", "v6e"])
def test_forward_alone_compiles(chip, case):
    """The forward without its residuals (inference, evaluation)."""
    _compile_kernel_case(chip, *KERNEL_CASES[case], backward=False)


@needs_libtpu
@pytest.mark.parametrize("case", ["paper_layer", "gqa_odd_length_segments"])
def test_forward_and_backward_compile_for_v5p(case):
    """A chip with two TensorCores per device: the work lists' "parallel" grid axis."""
    _compile_kernel_case("v5p", *KERNEL_CASES[case], backward=True)


def _compile_kernel_case(chip, B, T, H, G, D, windows, dtype, segments, stats, *, backward):
    from ls_jax.kernels.band import band_flops
    sharding = _one_device(chip)
    q = jax.ShapeDtypeStruct((B, T, H, D), dtype, sharding=sharding)
    kv = jax.ShapeDtypeStruct((B, T, G, D), dtype, sharding=sharding)
    seg = jax.ShapeDtypeStruct((B, T), jnp.int32, sharding=sharding) if segments else None
    compiled = jax.jit(_kernel_fn(windows, stats, backward)).lower(q, kv, kv, seg).compile()
    calls = kernel_calls(compiled.as_text())
    assert calls == {name: 1 for name in KERNEL_NAMES[:3 if backward else 1]}
    # the kernels' cost estimates reach XLA: at least the band's own FLOPs (their padded
    # tiles hold more)
    assert compiled.cost_analysis()["flops"] >= band_flops(B, T, windows, D, backward=backward)


@needs_libtpu
@pytest.mark.parametrize("chip", ["v5e", "v6e"])
def test_vmapped_gradient_compiles_with_x64_enabled(chip):
    """A user's program: x64 on, the op under vmap (k, v shared), with segment ids and logit
    statistics, differentiated. The mapped axis joins the kernels' batch: one call per pass,
    and no float64 or int64 reaches Mosaic."""
    from ls_jax.kernels import ls_attention
    sharding = _one_device(chip)
    windows = (None, 51, 51)
    with jax.enable_x64(True):
        q = jax.ShapeDtypeStruct((3, 2, 1024, 3, 64), jnp.bfloat16, sharding=sharding)
        kv = jax.ShapeDtypeStruct((2, 1024, 3, 64), jnp.bfloat16, sharding=sharding)
        seg = jax.ShapeDtypeStruct((3, 2, 1024), jnp.int32, sharding=sharding)

        def loss(q, k, v, seg):
            def one(q, seg):
                out, stats = ls_attention(q, k, v, windows, segment_ids=seg,
                                          implementation="pallas_tpu", return_logit_stats=True)
                return jnp.sum(out.astype(jnp.float32)) + jnp.sum(stats.max_abs_logit)
            return jnp.sum(jax.vmap(one)(q, seg))

        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
        compiled = step.lower(q, kv, kv, seg).compile()
    assert kernel_calls(compiled.as_text()) == {name: 1 for name in KERNEL_NAMES}


# ---------------------------------------------------------------------------------------------
# The model's train and eval steps, and the command

@needs_libtpu
def test_train_step_runs_the_kernels_per_shard_on_a_data_fsdp_tensor_mesh():
    from ls_jax.configs import get_config
    # T = 384 and d_model = 80 are no weight's dimension and no multiple of head_dim = 32, so
    # an all-gather of [.., 384, h * 32] is one of q, k or v
    cfg = get_config("tiny", ["model.n_layer=2", "model.d_model=80", "data.seq_len=384",
                              "model.max_seq_len=384", "mesh.data=2", "mesh.fsdp=2",
                              "mesh.tensor=2", "train.batch_size=8"])
    report = compile_steps(cfg, "v5e:2x4", programs=("train step",))
    assert report.mesh == {"data": 2, "fsdp": 2, "tensor": 2}
    assert report.attention == "pallas_tpu"  # what a TPU run chooses, not this host's backend
    (step,) = report.programs
    assert step.error is None
    for name in KERNEL_NAMES:  # every pass of every layer through the Mosaic kernels
        assert step.kernel_calls.get(name, 0) >= cfg.model.n_layer
    assert step.qkv_gathers == 0
    assert report.fits and step.flops > 0


def _train_py(args, cwd):
    return subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=600)


def _no_data_overrides():
    """A data source and tokenizer that do not exist: a compile must not need them."""
    return ["data.source=text:/nonexistent/*.txt",
            "data.tokenizer=sentencepiece:/nonexistent.model"]


@needs_libtpu
def test_compile_only_command_for_a_slice(tmp_path):
    """``train.py --compile-only v6e:2x2``: the report on stdout, progress lines only on stderr
    (none of libtpu's start-up warnings), no data read, nothing written."""
    result = _train_py(["--config", "tiny", "--compile-only", "v6e:2x2", "model.n_layer=1",
                        "train.batch_size=4", *_no_data_overrides()], tmp_path)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "4 x TPU v6 lite, HBM 32.00 GiB each; mesh data=4 fsdp=1 tensor=1" in out
    for program in ("train step ", "train step + statistics ", "eval step "):
        assert f"\n  {program}" in out
    assert out.count("dkdv 1, dq 1, fwd 1") == 2 and out.count("  fwd 1  ") == 1
    assert out.splitlines()[-1].startswith("fits: the largest program holds ")
    assert [line for line in result.stderr.splitlines()
            if not line.startswith("compiling the ")] == []
    assert list(tmp_path.iterdir()) == []


@needs_libtpu
def test_compile_only_command_when_it_does_not_fit(tmp_path):
    """A batch the chip cannot hold: the compiler's message, "does not fit", exit 3."""
    result = _train_py(["--config", "tiny", "--compile-only", "v5e:2x2", "model.n_layer=1",
                        "model.d_model=512", "model.vocab_size=65536", "data.seq_len=2048",
                        "model.max_seq_len=2048", "train.batch_size=256",
                        *_no_data_overrides()], tmp_path)
    assert result.returncode == EXIT_DOES_NOT_FIT, result.stderr
    assert "Ran out of memory" in result.stdout
    assert result.stdout.splitlines()[-1] == "does not fit v5e:2x2"


@needs_libtpu
def test_compile_only_unknown_topology_is_one_line(capsys):
    from ls_jax.configs.cli import train_main
    assert train_main(["--config", "tiny", "--compile-only", "v9z:2x2"]) == 1
    err = capsys.readouterr().err
    assert err.splitlines() == [err.strip()]
    assert err.startswith("error: --compile-only: expected a TPU topology such as v5e:2x4, "
                          "v6e:2x2, v5p:2x2x1 or 'local', got 'v9z:2x2'")


@pytest.mark.skipif(HAVE_LIBTPU, reason="libtpu is installed here")
def test_compile_only_without_libtpu_is_one_line(tmp_path):
    result = _train_py(["--config", "tiny", "--compile-only", "v5e:2x4"], tmp_path)
    assert result.returncode == 1
    assert result.stderr.strip() == (
        "error: --compile-only: compiling for the TPU topology 'v5e:2x4' needs libtpu: pip "
        f"install 'jax[tpu]=={jax.__version__}' (or `make venv-tpu`)")


def test_compile_only_local(tmp_path, capsys, monkeypatch):
    """``--compile-only local`` on this host: the same report for its own devices (the CPU
    here), from the real steps, without the data the config names and without a workdir."""
    from ls_jax.configs.cli import train_main
    monkeypatch.chdir(tmp_path)
    n = jax.device_count()
    code = train_main(["--config", "tiny", "--compile-only", "local", "model.n_layer=1",
                       "data.seq_len=64", f"train.batch_size={2 * n}", *_no_data_overrides()])
    out = capsys.readouterr().out
    assert code == 0
    assert f"tiny for local: {n} x cpu, HBM unknown each; mesh data={n} fsdp=1 tensor=1; " \
           "attention reference" in out
    assert f"batch {2 * n} x 64 tokens: 2 sequences per device" in out
    assert out.count(" none ") == 3  # no attention kernel calls on the CPU's reference path
    assert out.splitlines()[-1].startswith("fits: ")
    assert list(tmp_path.iterdir()) == []
