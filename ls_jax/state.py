"""Model and optimizer state: fresh, abstract (shapes only), or restored from a run directory."""

from __future__ import annotations

import dataclasses

import jax
from flax import nnx

from ls_jax import sharding as sharding_lib
from ls_jax.checkpoint import Checkpointer
from ls_jax.config import Config, MeshConfig
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
    """(graphdef, abstract state) of (model, optimizer) without allocating parameters.

    Built outside any mesh: the parameters' logical axis names stay metadata (ls_jax/sharding.py
    maps them to mesh axes) instead of becoming shardings of the abstract values."""
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
        return nnx.split(nnx.eval_shape(lambda: create_model_and_optimizer(cfg)))


def restore_model(run: RunDir, step: int | None = None) -> tuple[Config, int, Transformer]:
    """(config, step, model) of checkpoint ``step`` (None: the latest) of a training run."""
    # placed data parallel on the devices here, whatever mesh the run trained on
    cfg = dataclasses.replace(run.load_config(), mesh=MeshConfig())
    ckpt = Checkpointer(run, create=False)
    graphdef, abstract = abstract_train_state(cfg)
    mesh = sharding_lib.make_mesh(cfg.mesh)
    abstract = sharding_lib.with_shardings(abstract, sharding_lib.state_shardings(abstract, mesh))
    try:
        step, state = ckpt.restore(step, abstract)
    finally:
        ckpt.close()
    return cfg, step, nnx.merge(graphdef, state)[0]
