"""The default config: a small LS-attention model that trains on 2 CPU cores in minutes.

Byte-level, on the offline corpus (the Python standard library's sources), T=256,
1 global + 3 local heads with window 32.
"""

import dataclasses

from ls_jax.config import Config, DataConfig, ModelConfig, TrainConfig


def tiny() -> Config:
    """LS: 4 layers, d=128, 1 global + 3 local heads (window 32), bytes, T=256, stdlib corpus."""
    return Config(
        name="tiny",
        model=ModelConfig(vocab_size=256, n_layer=4, d_model=128, n_head=4, head_dim=32,
                          n_global_heads=1, window=32, max_seq_len=256),
        data=DataConfig(source="stdlib", tokenizer="bytes", seq_len=256),
        train=TrainConfig(batch_size=16, num_steps=600, lr=2e-3, min_lr=2e-4, warmup_steps=50,
                          log_every=10, save_every=200, eval_every=0, eval_batches=8),
    )


def tiny_mhsa() -> Config:
    """tiny with plain multi-head self-attention: all 4 heads global."""
    cfg = tiny()
    return dataclasses.replace(cfg, name="tiny_mhsa",
                               model=dataclasses.replace(cfg.model, n_global_heads=cfg.model.n_head))
