"""Shared test setup: GPU/TPU markers skipped where absent (the venv has the project installed)."""

import os
import subprocess
import sys
import time

import jax
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pytest_collection_modifyitems(config, items):
    backend = jax.default_backend()
    skip_gpu = pytest.mark.skip(reason=f"needs a GPU; JAX backend is {backend}")
    skip_tpu = pytest.mark.skip(reason=f"needs a TPU; JAX backend is {backend}")
    for item in items:
        if "gpu" in item.keywords and backend != "gpu":
            item.add_marker(skip_gpu)
        if "tpu" in item.keywords and backend != "tpu":
            item.add_marker(skip_tpu)


@pytest.fixture
def signal_training_run():
    """``run(workdir, overrides, sig, after_lines)``: starts ``train.py --config tiny`` as a
    subprocess for a practically endless run, sends ``sig`` once metrics.jsonl has
    ``after_lines`` lines, and returns (exit code, combined stdout/stderr)."""
    def run(workdir, overrides, sig, after_lines):
        cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--config", "tiny", "--workdir",
               str(workdir), *overrides, "train.num_steps=100000", "train.save_every=100000"]
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
        metrics = os.path.join(str(workdir), "metrics.jsonl")
        deadline = time.time() + 120
        while time.time() < deadline and not (
                os.path.exists(metrics) and open(metrics).read().count("\n") >= after_lines):
            time.sleep(0.2)
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=120)
        return proc.returncode, out
    return run
