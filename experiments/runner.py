"""Short training runs for the stability experiments: one compiled program per config, the peak
learning rate a runtime input, data from a ``WindowSampler``, data-parallel over a mesh.

Why not ``ls_jax.train.train``: the experiments run on a GPU image without grain or
tensorboardX, and a learning-rate sweep must not compile once per point. The step here is the
library's: the model (``ls_jax.model.Transformer``), the loss (``ls_jax.loss.lm_loss``) and the
optimizer (``ls_jax.optimizer.make_optimizer``), built with a unit peak learning rate
(lr = 1, min_lr = min_lr / lr) and its update multiplied by the peak lr passed at run time.
AdamW's update is linear in the learning rate (the decoupled weight decay is scaled by it too),
so this is the library's update up to float rounding; a CPU test checks it against
``ls_jax.train.make_train_step``. Every step asks the attention kernel for its logit
statistics (``ls_jax.train`` does so only on logged steps): the per-step max |logit| is what
these experiments record. No checkpoints, no TensorBoard: the runs are minutes long.

Variants are the paper's configs (``ls_jax.configs``: paper, paper_mhsa, paper_qknorm,
paper_zloss) with byte tokens (vocab 256) and the experiment's overrides.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from ls_jax.config import Config
from ls_jax.configs import get_config
from ls_jax.loss import lm_loss
from ls_jax.model import Transformer
from ls_jax.optimizer import learning_rate_schedule, make_optimizer
from ls_jax.state import init_key

from experiments.variants import VARIANTS, config_name

BATCH_AXIS = "data"


def variant_config(variant: str, overrides=()) -> Config:
    """The paper config of ``variant`` with byte tokens and ``overrides`` (section.key=value),
    which must leave alone what makes the variants differ (``experiments.variants``)."""
    cfg = get_config(config_name(variant, overrides),
                     ["model.vocab_size=256", "data.tokenizer=bytes", "data.source=stdlib",
                      *overrides])
    return dataclasses.replace(cfg, name=f"{cfg.name}_bytes")


def data_mesh(devices=None) -> jax.sharding.Mesh:
    """All (or the given) devices on one batch axis."""
    devices = jax.devices() if devices is None else devices
    return jax.make_mesh((len(devices),), (BATCH_AXIS,), devices=devices,
                         axis_types=(jax.sharding.AxisType.Auto,))


def sharded_attention_available() -> bool:
    """True once the kernels run per shard under a mesh (kernels/sharded.py, issue 9)."""
    try:
        import ls_jax.kernels.sharded  # noqa: F401
    except ImportError:
        return False
    return True


class Program:
    """The compiled init / step / eval of one config on one mesh.

    ``step(state, batch_u8_BxT1, peak_lr) -> (state, metrics)``; the same compiled step serves
    every peak lr. ``batch`` is uint8 [B, T + 1] (inputs = [:, :-1], targets = [:, 1:]).
    """

    def __init__(self, cfg: Config, mesh: jax.sharding.Mesh):
        if cfg.train.grad_accum_steps != 1:
            raise ValueError(f"train.grad_accum_steps: expected 1 here, got {cfg.train.grad_accum_steps}")
        if cfg.train.batch_size % mesh.size:
            raise ValueError(f"train.batch_size: expected a multiple of the {mesh.size} devices, "
                             f"got {cfg.train.batch_size}")
        self.cfg, self.mesh = cfg, mesh
        t = cfg.train
        unit = dataclasses.replace(t, lr=1.0, min_lr=t.min_lr / t.lr)
        self.tx = make_optimizer(unit)
        self.unit_schedule = learning_rate_schedule(unit)
        self.graphdef = nnx.split(nnx.eval_shape(lambda: Transformer(
            cfg.model, rngs=nnx.Rngs(params=0))), nnx.Param, ...)[0]
        self.replicated = NamedSharding(mesh, P())
        self.batch_sharding = NamedSharding(mesh, P(BATCH_AXIS))
        self.compile_seconds = None
        self._init = self._step = self._eval = None

    def _init_fn(self, key):
        # the key is an argument: a traced constant seed makes XLA constant-fold the whole
        # initialisation at compile time (ls_jax.state.create_model_and_optimizer)
        model = Transformer(self.cfg.model, rngs=nnx.Rngs(params=key))
        _, params, rest = nnx.split(model, nnx.Param, ...)
        return {"params": params, "rest": rest, "opt": self.tx.init(params),
                "step": jnp.zeros((), jnp.int32)}

    def _split_batch(self, batch_BxT1):
        tokens_BxT1 = batch_BxT1.astype(jnp.int32)
        return tokens_BxT1[:, :-1], tokens_BxT1[:, 1:]

    def _step_fn(self, state, batch_BxT1, peak_lr):
        inputs_BxT, targets_BxT = self._split_batch(batch_BxT1)

        def loss_fn(params):
            model = nnx.merge(self.graphdef, params, state["rest"])
            logits_BxTxV, stats = model(inputs_BxT, return_stats=True)
            loss, parts = lm_loss(logits_BxTxV, targets_BxT, z_loss=self.cfg.train.z_loss)
            return loss, (parts, stats)

        (loss, (parts, stats)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
        updates, opt = self.tx.update(grads, state["opt"], state["params"])
        updates = jax.tree.map(lambda u: u * peak_lr.astype(u.dtype), updates)
        params = optax.apply_updates(state["params"], updates)
        metrics = {"loss": loss, "ce": parts["ce"], "grad_norm": optax.tree.norm(grads),
                   "lr": peak_lr * self.unit_schedule(state["step"]), **stats}
        new = {"params": params, "rest": state["rest"], "opt": opt, "step": state["step"] + 1}
        return new, metrics

    def _eval_fn(self, state, batch_BxT1):
        inputs_BxT, targets_BxT = self._split_batch(batch_BxT1)
        model = nnx.merge(self.graphdef, state["params"], state["rest"])
        _, parts = lm_loss(model(inputs_BxT), targets_BxT)
        return parts["ce"]

    def compile(self) -> float:
        """Compiles init, step and eval ahead of time; returns the seconds it took."""
        t0 = time.time()
        B, T = self.cfg.train.batch_size, self.cfg.data.seq_len
        with jax.set_mesh(self.mesh):
            init = jax.jit(self._init_fn, out_shardings=self.replicated)
            key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=self.replicated)
            abstract = jax.eval_shape(self._init_fn, key)
            abstract = jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self.replicated), abstract)
            batch = jax.ShapeDtypeStruct((B, T + 1), jnp.uint8, sharding=self.batch_sharding)
            lr = jax.ShapeDtypeStruct((), jnp.float32, sharding=self.replicated)
            step = jax.jit(self._step_fn, in_shardings=(self.replicated, self.batch_sharding,
                                                        self.replicated),
                           out_shardings=(self.replicated, self.replicated), donate_argnums=0)
            evaluate = jax.jit(self._eval_fn, in_shardings=(self.replicated, self.batch_sharding),
                               out_shardings=self.replicated)
            self._init = init.lower(key).compile()
            self._step = step.lower(abstract, batch, lr).compile()
            self._eval = evaluate.lower(abstract, batch).compile()
        self.compile_seconds = time.time() - t0
        return self.compile_seconds

    def init(self):
        if self._init is None:
            self.compile()
        return self._init(jax.device_put(init_key(self.cfg), self.replicated))

    def put_batch(self, batch_BxT1: np.ndarray) -> jax.Array:
        return jax.device_put(np.ascontiguousarray(batch_BxT1), self.batch_sharding)

    def put_lr(self, peak_lr: float) -> jax.Array:
        return jax.device_put(np.float32(peak_lr), self.replicated)

    def step(self, state, batch_BxT1: np.ndarray, peak_lr):
        """One step; ``peak_lr`` a float or the array of ``put_lr``."""
        if not isinstance(peak_lr, jax.Array):
            peak_lr = self.put_lr(peak_lr)
        return self._step(state, self.put_batch(batch_BxT1), peak_lr)

    def evaluate(self, state, batches: list[np.ndarray]) -> float:
        """Mean cross-entropy (nats/token) over ``batches``."""
        if not batches:
            return float("nan")
        return float(np.mean([float(self._eval(state, self.put_batch(b))) for b in batches]))


@dataclasses.dataclass
class RunRecord:
    """What one run produced; per-step lists are indexed by step - 1."""

    state: str = "not started"  # "finished", "diverged" (non-finite loss) or "stopped" (time)
    steps: int = 0
    loss: list[float] = dataclasses.field(default_factory=list)
    ce: list[float] = dataclasses.field(default_factory=list)  # the loss less its z-loss term
    grad_norm: list[float] = dataclasses.field(default_factory=list)
    lr: list[float] = dataclasses.field(default_factory=list)
    max_abs_logit: list[float] = dataclasses.field(default_factory=list)
    lm_head_max_abs_logit: list[float] = dataclasses.field(default_factory=list)
    # [step, [L][H] table] every ``table_every`` steps and at the last step
    attn_max_abs_logit_tables: list = dataclasses.field(default_factory=list)
    seconds: float = 0.0
    tokens_per_sec: float = 0.0
    diverged_at: int | None = None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def extend(self, later: "RunRecord") -> None:
        """Appends ``later``: a ``run_steps`` call that continued this record's run."""
        for name in ("loss", "ce", "grad_norm", "lr", "max_abs_logit", "lm_head_max_abs_logit",
                     "attn_max_abs_logit_tables"):
            getattr(self, name).extend(getattr(later, name))
        tokens = self.tokens_per_sec * self.seconds + later.tokens_per_sec * later.seconds
        self.seconds += later.seconds
        self.tokens_per_sec = tokens / max(self.seconds, 1e-9)
        self.state, self.steps, self.diverged_at = later.state, later.steps, later.diverged_at


def run_steps(program: Program, state, sampler, peak_lr: float, num_steps: int, *,
              fetch_every: int = 50, table_every: int = 0, stop_at: float | None = None,
              log: Callable[[str], None] | None = None, log_every: int = 0):
    """Trains ``num_steps`` steps from the state's step; stops early at a non-finite loss or
    gradient norm ("diverged") or at the first fetch after ``stop_at`` (time.time(), "stopped").

    Metrics stay on the device and are read every ``fetch_every`` steps. Returns
    (state, RunRecord).
    """
    rec = RunRecord()
    tokens_per_step = program.cfg.train.batch_size * program.cfg.data.seq_len
    pending: list = []
    start = int(jax.device_get(state["step"]))
    t0 = time.perf_counter()

    def drain() -> bool:
        host = jax.device_get(pending)
        pending.clear()
        for step, m in host:
            rec.steps = step
            rec.loss.append(float(m["loss"]))
            rec.ce.append(float(m["ce"]))
            rec.grad_norm.append(float(m["grad_norm"]))
            rec.lr.append(float(m["lr"]))
            table = np.asarray(m["attn_max_abs_logit"], np.float64)
            rec.max_abs_logit.append(float(table.max()))
            rec.lm_head_max_abs_logit.append(float(m["lm_head_max_abs_logit"]))
            if (table_every and step % table_every == 0) or step == start + num_steps:
                rec.attn_max_abs_logit_tables.append([step, table.tolist()])
            if log and log_every and step % log_every == 0:
                log(f"step {step}: loss {rec.loss[-1]:.4f} max|logit| {rec.max_abs_logit[-1]:.1f} "
                    f"lr {rec.lr[-1]:.2e}")
            if not (math.isfinite(rec.loss[-1]) and math.isfinite(rec.grad_norm[-1])):
                rec.diverged_at = step
                if not rec.attn_max_abs_logit_tables or rec.attn_max_abs_logit_tables[-1][0] != step:
                    rec.attn_max_abs_logit_tables.append([step, table.tolist()])
                return False
        return True

    with jax.set_mesh(program.mesh):
        rec.state = "finished"
        lr = program.put_lr(peak_lr)
        for step in range(start + 1, start + num_steps + 1):
            state, metrics = program.step(state, sampler.batch(step - 1), lr)
            pending.append((step, metrics))
            if step % fetch_every == 0 or step == start + num_steps:
                if not drain():
                    rec.state = "diverged"
                    break
                if stop_at is not None and time.time() >= stop_at and step < start + num_steps:
                    rec.state = "stopped"
                    break
    rec.seconds = time.perf_counter() - t0
    rec.tokens_per_sec = (rec.steps - start) * tokens_per_step / max(rec.seconds, 1e-9)
    return state, rec
