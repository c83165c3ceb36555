"""Shared test setup: GPU/TPU markers skipped where absent (the venv has the project installed)."""

import jax
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
