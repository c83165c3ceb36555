"""AdamW with warmup + cosine decay, global-norm clipping and a weight-decay mask."""

from __future__ import annotations

import jax
import optax

from ls_jax.config import TrainConfig


def learning_rate_schedule(cfg: TrainConfig) -> optax.Schedule:
    """Linear warmup 0 -> lr over warmup_steps, then cosine lr -> min_lr over decay_steps."""
    decay = cfg.decay_steps or max(cfg.num_steps - cfg.warmup_steps, 1)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.lr, warmup_steps=cfg.warmup_steps,
        decay_steps=cfg.warmup_steps + decay, end_value=cfg.min_lr)


def _path_names(path) -> list[str]:
    names = []
    for key in path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                names.append(str(getattr(key, attr)))
                break
    # nnx.Variable leaves add a trailing ".value" attribute; it names no parameter.
    return [n for n in names if n != "value"]


def weight_decay_mask(params, cfg: TrainConfig):
    """True for the parameters that get weight decay.

    Matrices of linear layers always do; embeddings / position tables only with
    ``decay_embeddings``; LayerNorm scales and biases only with ``decay_norms_and_biases``.
    """
    def decide(path, _):
        names = _path_names(path)
        if any(n in ("embed", "pos_embed") for n in names):
            return cfg.decay_embeddings
        if names and names[-1] in ("bias", "scale"):
            return cfg.decay_norms_and_biases
        return True
    return jax.tree.map_with_path(decide, params)


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    chain = []
    if cfg.grad_clip > 0:
        chain.append(optax.clip_by_global_norm(cfg.grad_clip))
    chain.append(optax.adamw(
        learning_rate=learning_rate_schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
        weight_decay=cfg.weight_decay, mask=lambda p: weight_decay_mask(p, cfg)))
    return optax.chain(*chain)
