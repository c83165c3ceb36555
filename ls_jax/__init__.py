"""ls-jax: LS-attention (local + global heads) in JAX/Flax NNX.

    from ls_jax import LSAttention, Transformer, ModelConfig
    from ls_jax.kernels import ls_attention      # the kernel entry point alone

The public names below are imported on first use (PEP 562), so that ``import ls_jax.kernels``
does not pull in Flax and no import order between the subpackages matters.
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what a type checker sees of the names that _EXPORTS imports on first use
    from ls_jax.layers.attention import LSAttention as LSAttention
    from ls_jax.config import Config as Config
    from ls_jax.config import DataConfig as DataConfig
    from ls_jax.config import ModelConfig as ModelConfig
    from ls_jax.config import TrainConfig as TrainConfig
    from ls_jax.config import layer_window_sizes as layer_window_sizes
    from ls_jax.kernels import LogitStats as LogitStats
    from ls_jax.kernels import ls_attention as ls_attention
    from ls_jax.layers.transformer import Transformer as Transformer

_EXPORTS = {
    "Config": "ls_jax.config",
    "DataConfig": "ls_jax.config",
    "ModelConfig": "ls_jax.config",
    "TrainConfig": "ls_jax.config",
    "LSAttention": "ls_jax.layers.attention",
    "layer_window_sizes": "ls_jax.config",
    "Transformer": "ls_jax.layers.transformer",
    "LogitStats": "ls_jax.kernels",
    "ls_attention": "ls_jax.kernels",
}

__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"

# modules that moved into the subpackages: importing an old path says where it went
MOVED = {
    "ls_jax.model": "ls_jax.layers.transformer",
    "ls_jax.attention": "ls_jax.layers.attention",
    "ls_jax.kv_cache": "ls_jax.layers.kv_cache",
    "ls_jax.rope": "ls_jax.layers.rope",
    "ls_jax.sources": "ls_jax.inputs.sources",
    "ls_jax.tokenizer": "ls_jax.inputs.tokenizer",
    "ls_jax.data": "ls_jax.inputs.pipeline",
    "ls_jax.loss": "ls_jax.training.loss",
    "ls_jax.optimizer": "ls_jax.training.optimizer",
    "ls_jax.state": "ls_jax.training.state",
    "ls_jax.step": "ls_jax.training.step",
    "ls_jax.train": "ls_jax.training.train",
    "ls_jax.evaluate": "ls_jax.training.evaluate",
    "ls_jax.rundir": "ls_jax.training.rundir",
    "ls_jax.checkpoint": "ls_jax.training.checkpoint",
    "ls_jax.metrics": "ls_jax.training.metrics",
    "ls_jax.profiler": "ls_jax.training.profiler",
    "ls_jax.gc_pause": "ls_jax.training.gc_pause",
    "ls_jax.compile_only": "ls_jax.training.compile_only",
    "ls_jax.generate": "ls_jax.inference.generate",
    "ls_jax.sample": "ls_jax.inference.sample",
    "ls_jax.linen": "ls_jax.interop.linen",
    "ls_jax.attention_fn": "ls_jax.interop.attention_fn",
    "ls_jax.export": "ls_jax.interop.export",
    "ls_jax.weights": "ls_jax.interop.weights",
}


class _MovedModules:
    """A ``sys.meta_path`` finder for the old module paths alone: one line instead of a bare
    ModuleNotFoundError."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name in MOVED:
            raise ModuleNotFoundError(
                f"{name} moved to {MOVED[name]} (the same names): import that instead")
        return None


if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
    sys.meta_path.append(_MovedModules())


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'ls_jax' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
