"""ls-jax: LS-attention (local + global heads) in JAX/Flax NNX.

    from ls_jax import LSAttention, Transformer, ModelConfig
    from ls_jax.kernels import ls_attention      # the kernel entry point alone

The public names below are imported on first use (PEP 562), so that ``import ls_jax.kernels``
does not pull in Flax and no import order between the subpackages matters.
"""

from __future__ import annotations

import importlib
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


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'ls_jax' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
