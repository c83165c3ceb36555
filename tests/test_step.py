"""The train step's module (``ls_jax.step``): importable without the input pipeline's
packages."""

import os
import subprocess
import sys
import textwrap

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


def test_the_step_and_the_experiments_import_without_grain_tfds_sentencepiece_tensorboardx():
    script = BLOCK + textwrap.dedent("""
        import ls_jax.step, ls_jax.compile_only
        import experiments.runner, experiments.lr_sweep, experiments.paper_batch
        import experiments.byte_corpus, experiments.paper_claims
        print("OK")
    """)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]
    # the blocker bites: the training loop needs grain
    proc = subprocess.run([sys.executable, "-c", BLOCK + "import ls_jax.train"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "No module named 'grain' (blocked)" in proc.stderr
