"""Shared test setup: GPU/TPU markers skipped where absent (the venv has the project installed),
one XLA compilation cache for the test session, and ``cli_logging`` for the CLI's tests."""

import atexit
import logging
import os
import shutil
import tempfile

# Many tests compile the same small programs (every train() call jits its init, steps and
# eval afresh). JAX's persistent compilation cache, in a directory made for this test session
# and removed at its end, lets later compiles of the same program load the executable instead
# (about a third of the suite's time on 2 cores). Set before jax is imported; pytest-xdist
# workers and the subprocesses tests start inherit it. A directory set by the caller is kept.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache_dir = tempfile.mkdtemp(prefix="ls_jax_tests_xla_cache_")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache_dir
    atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# The suite compiles hundreds of small programs, and XLA's CPU compile is most of its time; LLVM
# at optimisation level 0 compiles them in about half the time (what runs is the same
# computation, and the tests compare with tolerances or with runs under the same flags).
# Subprocesses that set XLA_FLAGS of their own append to this value.
os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_backend_optimization_level=0"]).strip()
# Pallas' GPU interpreter runs each warpgroup of a Mosaic kernel as its own XLA CPU execution,
# blocked inside host callbacks while it waits on a barrier; the CPU client runs one more at
# once than it counts processors (PJRT_NPROC, default the machine's). On a 2-core machine a
# four-warpgroup kernel (the three-consumer forward) then hung; more slots fix it.
os.environ.setdefault("PJRT_NPROC", "8")

import jax  # noqa: E402
import pytest


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
def cli_logging():
    """Undoes the log routing of ``train_main`` / ``eval_main`` (the libraries' records go to
    the run directory, ``ls_jax.training.metrics.send_library_logs_to``) after a test."""
    root = logging.getLogger()
    handlers, raise_exceptions = list(root.handlers), logging.raiseExceptions
    yield
    for h in root.handlers[:]:
        if h not in handlers:
            root.removeHandler(h)
            h.close()
    root.handlers[:] = handlers
    logging.raiseExceptions = raise_exceptions
    logging.captureWarnings(False)
