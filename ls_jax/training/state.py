"""Model and optimizer state: fresh, abstract (shapes only), or restored from a run directory."""

from __future__ import annotations

import dataclasses

import jax
import optax
from flax import nnx

from ls_jax import sharding as sharding_lib
from ls_jax.training.checkpoint import Checkpointer
from ls_jax.config import Config, MeshConfig
from ls_jax.layers.transformer import Transformer
from ls_jax.training.optimizer import make_optimizer
from ls_jax.training.rundir import RunDir


def create_model_and_optimizer(cfg: Config, *, seed: int | None = None,
                               key: jax.Array | None = None,
                               tx: optax.GradientTransformation | None = None):
    """A freshly initialised (Transformer, nnx.Optimizer) pair; the optimizer's transformation
    is ``tx``, by default ``make_optimizer(cfg.train)``.

    ``key`` (a PRNG key array) replaces ``seed`` (default ``cfg.train.seed``); the same seed
    gives the same parameters either way. Under ``jax.jit`` pass the key as an argument
    (see ``init_key``): a key built from a Python int inside the traced function is a
    constant, and XLA then constant-folds the random initialisation of every parameter at
    compile time. The blocks draw each parameter once for all layers
    (``ls_jax.layers.transformer.init_blocks``): the random-number code to compile does not grow with depth.
    """
    if key is None:
        key = init_key(cfg, seed)
    model = Transformer(cfg.model, rngs=nnx.Rngs(params=key))
    optimizer = nnx.Optimizer(model, make_optimizer(cfg.train) if tx is None else tx,
                              wrt=nnx.Param)
    return model, optimizer


def init_key(cfg: Config, seed: int | None = None) -> jax.Array:
    """The parameter-initialisation key of a run (``seed``, default ``cfg.train.seed``)."""
    return jax.random.key(cfg.train.seed if seed is None else seed)


def abstract_train_state(cfg: Config, *, tx: optax.GradientTransformation | None = None):
    """(graphdef, abstract state) of (model, optimizer) without allocating parameters (``tx``:
    as in ``create_model_and_optimizer``).

    Built outside any mesh: the parameters' logical axis names stay metadata (ls_jax/sharding.py
    maps them to mesh axes) instead of becoming shardings of the abstract values."""
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
        return nnx.split(nnx.eval_shape(lambda: create_model_and_optimizer(cfg, tx=tx)))


# A checkpoint holds nnx.state((model, optimizer)): the model's part is under this key.
MODEL_KEY = 0


def restore_model(run: RunDir, step: int | None = None,
                  cfg: Config | None = None) -> tuple[Config, int, Transformer]:
    """(config, step, model) of checkpoint ``step`` (None: the latest) of a training run.

    Reads only the model's parameters (the optimizer state stays on disk), placed data
    parallel on the devices here, whatever mesh the run trained on. ``cfg``: the config to
    build the model from (default: the run's ``config.json``); its model section must be the
    run's.
    """
    cfg = dataclasses.replace(run.load_config() if cfg is None else cfg, mesh=MeshConfig())
    graphdef, abstract = nnx.split(nnx.eval_shape(
        lambda: Transformer(cfg.model, rngs=nnx.Rngs(params=cfg.train.seed))))
    mesh = sharding_lib.make_mesh(cfg.mesh)
    abstract = sharding_lib.with_shardings(abstract, sharding_lib.state_shardings(abstract, mesh))
    ckpt = Checkpointer(run, create=False)
    try:
        step, state = ckpt.restore(step, nnx.State({MODEL_KEY: abstract}), partial=True)
    finally:
        ckpt.close()
    return cfg, step, nnx.merge(graphdef, state[MODEL_KEY])
