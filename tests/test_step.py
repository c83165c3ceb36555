"""The train step's module (``ls_jax.training.step``): importable without the input pipeline's packages,
and the experiments' runner (``experiments/runner.py``) running it with a peak learning rate
held in the state."""

import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from experiments import runner
from experiments.byte_corpus import WindowSampler
from ls_jax.training.step import compile_train_fns

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# what the GPU image the experiments run on lacks
NOT_ON_THE_GPU_IMAGE = ("grain", "tensorflow_datasets", "sentencepiece", "tensorboardX")
BLOCK = textwrap.dedent(f"""
    import importlib.abc, sys

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in {NOT_ON_THE_GPU_IMAGE!r}:
                raise ModuleNotFoundError(f"No module named {{name!r}} (blocked)", name=name)
    sys.meta_path.insert(0, Block())
""")
TINY = ["model.n_layer=1", "model.d_model=48", "model.head_dim=8", "model.window=8",
        "model.max_seq_len=32", "data.seq_len=32", "model.compute_dtype=float32",
        "train.batch_size=4", "train.num_steps=6", "train.warmup_steps=2", "train.lr=0.02",
        "train.min_lr=0.002"]


@pytest.fixture(scope="module")
def without_the_gpu_image_packages():
    """One process without grain, tfds, sentencepiece and tensorboardX (one start of JAX for
    the checks below): it imports the step and the experiments, then the training loop, then
    collects the suite's GPU tests; (exit code, stdout, stderr)."""
    script = BLOCK + textwrap.dedent("""
        import ls_jax.training.step, ls_jax.training.compile_only
        import experiments.runner, experiments.lr_sweep, experiments.paper_batch
        import experiments.byte_corpus, experiments.rules, experiments.stability_report
        print("imported", flush=True)
        try:
            import ls_jax.training.train
        except ModuleNotFoundError as e:
            print(f"ls_jax.training.train: {e}", flush=True)
        import pytest
        sys.exit(pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "-m", "gpu",
                              "tests"]))
    """)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    return proc.returncode, proc.stdout, proc.stderr


def test_the_step_and_the_experiments_import_without_grain_tfds_sentencepiece_tensorboardx(
        without_the_gpu_image_packages):
    _, out, err = without_the_gpu_image_packages
    assert out.startswith("imported\n"), err[-3000:]
    # the blocker bites: the training loop needs grain
    assert "ls_jax.training.train: No module named 'grain' (blocked)" in out, out[-3000:]


def test_runner_at_a_peak_lr_is_the_library_step_at_that_lr():
    """One compiled runner program, its peak lr set in the state, against the library's step
    and optimizer built for that lr: the same losses, lrs, logit statistics and parameters."""
    cfg = runner.variant_config("ls", TINY)
    peak = 0.005  # not the config's 0.02: the schedule (warmup, cosine to min_lr) scales
    lib_cfg = runner.variant_config("ls", [*TINY, f"train.lr={peak}", f"train.min_lr={peak / 10}"])
    rng = np.random.default_rng(0)
    sampler = WindowSampler(rng.integers(1, 256, 4 * 33, dtype=np.uint8), seq_len=32,
                            batch_size=4, seed=0)  # one batch, every step: the loss must fall
    steps = 4
    mesh = runner.data_mesh(jax.devices()[:1])

    program = runner.Program(cfg, mesh)
    state, rec = runner.run_steps(program, program.init(), sampler, peak, steps, fetch_every=2)
    assert program.peak_lr(state) == np.float32(peak) and program.steps_done(state) == steps

    with jax.set_mesh(mesh):
        fns = compile_train_fns(lib_cfg, mesh)
        # its initial state is the runner's less the peak lr: the same seed, and the runner's
        # optimizer state is the library's followed by the peak's (this saves a compile)
        leaves = jax.tree.leaves(program.init())
        del leaves[program._peak_index]
        lib_state = jax.tree.unflatten(jax.tree.structure(fns.abstract), leaves)
        lib = {"loss": [], "lr": [], "max_abs_logit": []}
        for s in range(steps):
            batch = program.put_batch(sampler.batch(s))
            lib_state, m = fns.steps[True](lib_state, batch)
            lib["loss"].append(float(m["loss"]))
            lib["lr"].append(float(m["lr"]))
            lib["max_abs_logit"].append(float(np.max(m["attn_max_abs_logit"])))
    np.testing.assert_allclose(rec.loss, lib["loss"], rtol=2e-5)
    np.testing.assert_allclose(rec.lr, lib["lr"], rtol=1e-6)
    np.testing.assert_allclose(rec.max_abs_logit, lib["max_abs_logit"], rtol=2e-5)
    np.testing.assert_allclose(lib["lr"][:3], [0, peak / 2, peak], rtol=1e-6)  # warmup 2
    assert lib["loss"][-1] < lib["loss"][0]  # it trains at all
    # per parameter, relative to its norm: Adam turns float-rounding differences in a ~0
    # gradient into a sign flip of one element's update, so elementwise checks are brittle.
    # A wrong weight decay or lr scale moves the parameters by > 5e-3 of their norm here.
    ours, theirs = jax.tree.leaves(state[0]), jax.tree.leaves(lib_state[0])
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.linalg.norm(a - b) <= 5e-4 * np.linalg.norm(b), (a.shape, np.abs(a - b).max())


def test_the_suite_collects_without_grain_tfds_sentencepiece_tensorboardx(
        without_the_gpu_image_packages):
    """On the GPU image the modules that drive the training loop are skipped, not errors,
    and the GPU tests are collected."""
    code, out, err = without_the_gpu_image_packages
    assert code == 0, out[-3000:] + err[-3000:]
    assert "error" not in out.lower().splitlines()[-1]
    assert "tests/test_pallas_gpu.py::" in out

