"""Model and optimizer state: fresh, abstract (shapes only), or restored from a run directory."""

from __future__ import annotations

from flax import nnx

from ls_jax.checkpoint import Checkpointer
from ls_jax.config import Config
from ls_jax.model import Transformer
from ls_jax.optimizer import make_optimizer
from ls_jax.rundir import RunDir


def create_model_and_optimizer(cfg: Config, *, seed: int | None = None):
    """A freshly initialised (Transformer, nnx.Optimizer) pair."""
    seed = cfg.train.seed if seed is None else seed
    model = Transformer(cfg.model, rngs=nnx.Rngs(params=seed))
    optimizer = nnx.Optimizer(model, make_optimizer(cfg.train), wrt=nnx.Param)
    return model, optimizer


def abstract_train_state(cfg: Config):
    """(graphdef, abstract state) of (model, optimizer) without allocating parameters."""
    return nnx.split(nnx.eval_shape(lambda: create_model_and_optimizer(cfg)))


def restore_model(run: RunDir, step: int | None = None) -> tuple[Config, int, Transformer]:
    """(config, step, model) of checkpoint ``step`` (None: the latest) of a training run."""
    cfg = run.load_config()
    ckpt = Checkpointer(run, create=False)
    graphdef, abstract = abstract_train_state(cfg)
    try:
        step, state = ckpt.restore(step, abstract)
    finally:
        ckpt.close()
    return cfg, step, nnx.merge(graphdef, state)[0]
