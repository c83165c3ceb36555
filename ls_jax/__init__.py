"""ls-jax: LS-attention (local + global heads) in JAX/Flax NNX.

    from ls_jax import LSAttention, Transformer, ModelConfig
"""

from kernels import LogitStats, ls_attention
from ls_jax.attention import LSAttention, layer_window_sizes
from ls_jax.config import Config, DataConfig, ModelConfig, TrainConfig
from ls_jax.model import Transformer

__all__ = [
    "Config",
    "DataConfig",
    "LSAttention",
    "LogitStats",
    "ModelConfig",
    "TrainConfig",
    "Transformer",
    "layer_window_sizes",
    "ls_attention",
]
__version__ = "0.1.0"
