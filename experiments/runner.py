"""Short training runs for the stability experiments through the library's train step: one
compiled program per config, the peak learning rate a runtime value, data from a
``WindowSampler``, data-parallel over all devices.

Why not ``ls_jax.training.train.train``: the experiments run on a GPU image without grain or
tensorboardX, and a learning-rate sweep must not compile once per point. The step is
``ls_jax.training.step``'s (``compile_train_fns``: the model, the loss, the shardings and the donated
state of a training run; it needs no grain), with the statistics on every step: the per-step
max |logit| is what these experiments record (``ls_jax.training.train`` asks for them only on logged
steps). The optimizer is the library's (``ls_jax.training.optimizer.make_optimizer``) built with a unit
peak learning rate (lr = 1, min_lr = min_lr / lr) and followed by a multiplication of its
update by the peak lr, a value of the optimizer state (``with_peak_lr``) and not of the
compiled program. AdamW's update is linear in the learning rate (the decoupled weight decay is
scaled by it too), so this is the library's update up to float rounding; tests/test_step.py
checks it against ``compile_train_fns`` with the library's own optimizer. No checkpoints, no
TensorBoard: the runs are minutes long.

Variants are the paper's configs (``ls_jax.configs``: paper, paper_mhsa, paper_qknorm,
paper_zloss) with byte tokens (vocab 256) and the experiment's overrides.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from ls_jax import sharding as sharding_lib
from ls_jax.config import Config, MeshConfig
from ls_jax.configs import get_config
from ls_jax.training.loss import lm_loss
from ls_jax.training.optimizer import make_optimizer
from ls_jax.training.state import MODEL_KEY, init_key
from ls_jax.training.step import check_batch_split, compile_train_fns

from experiments.variants import config_name


def variant_config(variant: str, overrides=()) -> Config:
    """The paper config of ``variant`` with byte tokens and ``overrides`` (section.key=value),
    which must leave alone what makes the variants differ (``experiments.variants``)."""
    cfg = get_config(config_name(variant, overrides),
                     ["model.vocab_size=256", "data.tokenizer=bytes", "data.source=stdlib",
                      *overrides])
    return dataclasses.replace(cfg, name=f"{cfg.name}_bytes")


def data_mesh(devices=None) -> jax.sharding.Mesh:
    """The library's mesh over all (or the given) devices with the default axes: every device
    on the data axis (the batch split over them, the parameters replicated)."""
    return sharding_lib.make_mesh(MeshConfig(), devices)


def sharded_attention_available() -> bool:
    """True once the kernels run per shard under a mesh (kernels/sharded.py, issue 9)."""
    try:
        import ls_jax.kernels.sharded  # noqa: F401
    except ImportError:
        return False
    return True


class PeakLrState(NamedTuple):
    peak_lr: jax.Array  # float32 scalar


def times_peak_lr() -> optax.GradientTransformation:
    """Multiplies the updates by the ``peak_lr`` its state holds (1 after init)."""

    def init(params):
        return PeakLrState(jnp.ones((), jnp.float32))

    def update(updates, state, params=None):
        return jax.tree.map(lambda u: u * state.peak_lr.astype(u.dtype), updates), state

    return optax.GradientTransformation(init, update)


def unit_lr_config(cfg: Config) -> Config:
    """``cfg`` with the peak lr 1 (its schedule's shape unchanged: min_lr / lr kept)."""
    t = cfg.train
    return dataclasses.replace(cfg, train=dataclasses.replace(t, lr=1.0, min_lr=t.min_lr / t.lr))


class Program:
    """The compiled init / step / eval of one config on one mesh.

    ``step(state, batch_u8_BxT1) -> (state, metrics)`` is ``ls_jax.training.step``'s step with the
    statistics; the same compiled step serves every peak lr, which ``with_peak_lr`` puts in
    the state. ``batch`` is uint8 [B, T + 1] (inputs = [:, :-1], targets = [:, 1:]).
    """

    def __init__(self, cfg: Config, mesh: jax.sharding.Mesh):
        check_batch_split(cfg.train, mesh)
        self.cfg, self.mesh = cfg, mesh
        self.unit_cfg = unit_lr_config(cfg)
        self.fns = compile_train_fns(self.unit_cfg, mesh, tx=optax.chain(
            make_optimizer(self.unit_cfg.train), times_peak_lr()))
        self.replicated = sharding_lib.replicated(mesh)
        self.batch_sharding = sharding_lib.batch_sharding(mesh)
        paths = [jax.tree_util.keystr(p) for p, _ in
                 jax.tree_util.tree_leaves_with_path(self.fns.abstract)]
        (self._peak_index,) = [i for i, p in enumerate(paths) if "'peak_lr'" in p]
        (self._step_index,) = [i for i, p in enumerate(paths) if p.startswith("[1]['step']")]
        self.compile_seconds = None
        self._init = self._step = self._eval = None

    def _eval_fn(self, state, batch):
        model = nnx.merge(self.fns.graphdef, state)[MODEL_KEY]
        _, parts = lm_loss(model(batch["inputs"]), batch["targets"])
        return parts["ce"]

    def compile(self) -> float:
        """Compiles init, step and eval ahead of time; returns the seconds it took."""
        t0 = time.time()
        with jax.set_mesh(self.mesh):
            key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=self.replicated)
            state, batch = self.fns.step_args
            evaluate = jax.jit(self._eval_fn, out_shardings=self.replicated)
            self._init = self.fns.init.lower(key).compile()
            self._step = self.fns.steps[True].lower(state, batch).compile()
            self._eval = evaluate.lower(state, batch).compile()
        self.compile_seconds = time.time() - t0
        return self.compile_seconds

    def init(self, peak_lr: float | None = None):
        """A fresh state (``cfg.train.seed``), with ``peak_lr`` (default ``cfg.train.lr``)."""
        if self._init is None:
            self.compile()
        state = self._init(jax.device_put(init_key(self.cfg), self.replicated))
        return self.with_peak_lr(state, self.cfg.train.lr if peak_lr is None else peak_lr)

    def with_peak_lr(self, state, peak_lr: float):
        """``state`` with the peak lr its updates are multiplied by."""
        leaves, treedef = jax.tree.flatten(state)
        leaves[self._peak_index] = jax.device_put(np.float32(peak_lr), self.replicated)
        return jax.tree.unflatten(treedef, leaves)

    def peak_lr(self, state) -> float:
        return float(jax.tree.leaves(state)[self._peak_index])

    def steps_done(self, state) -> int:
        """The optimizer's step count (the steps ``state`` has taken)."""
        return int(jax.tree.leaves(state)[self._step_index])

    def put_batch(self, batch_BxT1: np.ndarray) -> dict:
        tokens_BxT1 = np.asarray(batch_BxT1, np.int32)
        return sharding_lib.global_batch({"inputs": tokens_BxT1[:, :-1],
                                          "targets": tokens_BxT1[:, 1:]}, self.batch_sharding)

    def step(self, state, batch_BxT1: np.ndarray):
        """One step; the metrics' "lr" is the unit schedule's (times the peak lr: the lr)."""
        return self._step(state, self.put_batch(batch_BxT1))

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
    state = program.with_peak_lr(state, peak_lr)
    start = program.steps_done(state)
    t0 = time.perf_counter()

    def drain() -> bool:
        host = jax.device_get(pending)
        pending.clear()
        for step, m in host:
            rec.steps = step
            rec.loss.append(float(m["loss"]))
            rec.ce.append(float(m["ce"]))
            rec.grad_norm.append(float(m["grad_norm"]))
            rec.lr.append(float(m["lr"]) * peak_lr)  # the unit schedule's, times the peak
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
        for step in range(start + 1, start + num_steps + 1):
            state, metrics = program.step(state, sampler.batch(step - 1))
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
