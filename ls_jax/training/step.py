"""The train step and the jitted functions of a run on a mesh.

``make_train_step`` is the step every training run takes (``ls_jax.training.train``, the experiments
of ``experiments/``, ``train.py --compile-only``); ``compile_train_fns`` jits it with the
run's shardings. Importing this module needs JAX, Flax, optax and orbax only (no grain, TFDS,
SentencePiece or tensorboardX): the experiments import it on machines without the input
pipeline's packages (tests/test_step.py checks this).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from ls_jax import sharding as sharding_lib
from ls_jax.config import Config
from ls_jax.training.loss import lm_loss
from ls_jax.training.optimizer import learning_rate_schedule
from ls_jax.training.state import abstract_train_state, create_model_and_optimizer

# the metrics a step with statistics adds: [layer][head] and the lm head's max |logit|
STATS_KEYS = ("attn_max_abs_logit", "lm_head_max_abs_logit")


def make_train_step(graphdef, cfg: Config, *, with_stats: bool) -> Callable:
    """(state, batch) -> (state, metrics); pure, for jax.jit with the state donated.

    ``graphdef`` is that of (model, nnx.Optimizer) (``ls_jax.training.state.abstract_train_state``),
    ``state`` its nnx.State, ``batch`` {"inputs", "targets"} int32 [B, T]. The metrics'
    "lr" is ``learning_rate_schedule(cfg.train)`` at the optimizer's step.
    with_stats: also return the logit-norm statistics (``Transformer(return_stats=True)``);
    the loop asks for them on the steps it logs, so the other steps run the plain kernel.
    """
    accum = cfg.train.grad_accum_steps
    schedule = learning_rate_schedule(cfg.train)

    def loss_fn(model, inputs_BxT, targets_BxT):
        if with_stats:
            logits_BxTxV, stats = model(inputs_BxT, return_stats=True)
        else:
            logits_BxTxV, stats = model(inputs_BxT), {}
        loss, parts = lm_loss(logits_BxTxV, targets_BxT, z_loss=cfg.train.z_loss)
        return loss, (parts, stats)

    def train_step(state, batch):
        model, optimizer = nnx.merge(graphdef, state)
        model_def, params, rest = nnx.split(model, nnx.Param, ...)

        def params_loss(params, inputs_BxT, targets_BxT):
            return loss_fn(nnx.merge(model_def, params, rest), inputs_BxT, targets_BxT)

        grad_fn = jax.value_and_grad(params_loss, has_aux=True)
        if accum == 1:
            (loss, (parts, stats)), grads = grad_fn(params, batch["inputs"], batch["targets"])
        else:  # micro-batches in sequence, gradients summed in float32
            micro = jax.tree.map(lambda x: x.reshape(accum, x.shape[0] // accum, *x.shape[1:]),
                                 batch)

            def body(carry, mb):
                (loss, (parts, stats)), grads = grad_fn(params, mb["inputs"], mb["targets"])
                return jax.tree.map(jnp.add, carry, (loss, parts, grads)), stats

            zeros = jax.tree.map(jnp.zeros_like, (jnp.float32(0), {"ce": jnp.float32(0),
                                                                   "z": jnp.float32(0)}, params))
            (loss, parts, grads), stats = jax.lax.scan(body, zeros, micro)
            loss, parts, grads = jax.tree.map(lambda x: x / accum, (loss, parts, grads))
            stats = jax.tree.map(lambda x: jnp.max(x, axis=0), stats)
        grad_norm = optax.tree.norm(grads)
        lr = schedule(optimizer.step[...])
        optimizer.update(model, grads)
        metrics = {"loss": loss, "ce": parts["ce"], "z": parts["z"], "grad_norm": grad_norm,
                   "lr": lr, **stats}
        return nnx.state((model, optimizer)), metrics

    return train_step


def check_batch_split(tcfg, mesh: jax.sharding.Mesh) -> None:
    """The global batch, and each micro-batch, split over the mesh's data x fsdp devices."""
    n_batch = sharding_lib.batch_divisor(mesh)  # the batch splits over data x fsdp
    if tcfg.batch_size % n_batch:
        raise ValueError(f"train.batch_size: expected a multiple of {n_batch} (mesh data x fsdp "
                         f"of {dict(mesh.shape)}), got {tcfg.batch_size}")
    if (tcfg.batch_size // tcfg.grad_accum_steps) % n_batch:
        raise ValueError(f"train.grad_accum_steps: each micro-batch (batch_size / grad_accum_steps"
                         f" = {tcfg.batch_size // tcfg.grad_accum_steps}) must split over "
                         f"{n_batch} devices (mesh data x fsdp)")


@dataclasses.dataclass
class TrainFns:
    """The jitted functions of a run on a mesh, and where its state lives."""
    graphdef: Any
    abstract: Any  # abstract nnx.State of (model, optimizer)
    state_sharding: Any  # the same tree with a NamedSharding per variable
    init: Callable  # (key) -> state; key = ls_jax.training.state.init_key(cfg)
    steps: dict[bool, Callable]  # with_stats -> (state, global batch) -> (state, metrics)
    # (state, batch) as ShapeDtypeStructs with their shardings: what the steps are lowered for
    step_args: tuple[Any, dict]


def init_compiler_options(mesh: jax.sharding.Mesh) -> dict | None:
    """XLA options for compiling the state's initialisation on the mesh's platform. On CPU,
    LLVM's optimisation of that program takes longer than the program runs (it runs once):
    it is compiled unoptimised. (A jit with compiler options runs at top level only: trace
    ``TrainFns.init`` with ``init.trace(key)``, not inside another jit.)"""
    if mesh.devices.flat[0].platform == "cpu":
        return {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
    return None


def compile_train_fns(cfg: Config, mesh: jax.sharding.Mesh, *,
                      tx: optax.GradientTransformation | None = None) -> TrainFns:
    """Parameters and optimizer moments split over fsdp (and tensor) by their logical axes,
    the batch over data x fsdp, the metrics replicated; the state donated to each step. Each
    function compiles on first use.

    tx: the optimizer (default ``ls_jax.training.optimizer.make_optimizer(cfg.train)``, what a training
    run uses; ``experiments/runner.py`` passes its own, see there).
    """
    graphdef, abstract = abstract_train_state(cfg, tx=tx)
    state_sharding = sharding_lib.state_shardings(abstract, mesh)
    # the key is an argument, never a traced constant (create_model_and_optimizer says why)
    init = jax.jit(lambda key: nnx.state(create_model_and_optimizer(cfg, key=key, tx=tx)),
                   out_shardings=state_sharding, compiler_options=init_compiler_options(mesh))
    batch_sharding = sharding_lib.batch_sharding(mesh)
    steps = {with_stats: jax.jit(make_train_step(graphdef, cfg, with_stats=with_stats),
                                 in_shardings=(state_sharding, batch_sharding),
                                 out_shardings=(state_sharding, sharding_lib.replicated(mesh)),
                                 donate_argnums=0)
             for with_stats in (False, True)}
    batch = {k: jax.ShapeDtypeStruct((cfg.train.batch_size, cfg.data.seq_len), jnp.int32,
                                     sharding=batch_sharding) for k in ("inputs", "targets")}
    step_args = (sharding_lib.with_shardings(abstract, state_sharding), batch)
    return TrainFns(graphdef, abstract, state_sharding, init, steps, step_args)
