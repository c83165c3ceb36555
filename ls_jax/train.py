"""The training loop: jit-compiled data-parallel steps over a device mesh, with logging,
evaluation, orbax checkpoints, automatic resume, SIGTERM handling and NaN stops.

``train(cfg, workdir)`` is what ``train.py`` runs; tests call it directly. It reads as its
steps: check the config, claim the run directory, restore or initialise the state, run the
step loop (each step's metrics checked and logged, checkpoints saved, periodic evals), and a
final eval.
"""

from __future__ import annotations

import dataclasses
import math
import signal
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from ls_jax import data as data_lib
from ls_jax import mesh as mesh_lib
from ls_jax.checkpoint import Checkpointer
from ls_jax.config import Config
from ls_jax.evaluate import evaluate_model
from ls_jax.loss import lm_loss
from ls_jax.metrics import MetricsWriter, logit_norm_summary
from ls_jax.model import count_params
from ls_jax.optimizer import learning_rate_schedule
from ls_jax.profiler import StepProfiler
from ls_jax.rundir import RunDir
from ls_jax.state import abstract_train_state, create_model_and_optimizer
from ls_jax.tokenizer import make_tokenizer

STATS_KEYS = ("attn_max_abs_logit", "lm_head_max_abs_logit")


class TrainingDiverged(RuntimeError):
    """Raised when a step produced a non-finite loss or gradient norm."""


@dataclasses.dataclass
class TrainResult:
    workdir: str
    start_step: int  # the step the run resumed from (0 for a fresh run)
    final_step: int
    losses: dict[int, float]  # every step this run executed -> its training loss
    last_metrics: dict[str, Any]
    eval_metrics: dict[str, Any] | None
    interrupted: bool = False


# -- the step ---------------------------------------------------------------------------------

def make_train_step(graphdef, cfg: Config, *, with_stats: bool) -> Callable:
    """(state, batch) -> (state, metrics); pure, for jax.jit with the state donated.

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


# -- the run ----------------------------------------------------------------------------------

def train(cfg: Config, workdir: str, *, stop_after_steps: int | None = None,
          stop_at_time: float | None = None, log: Callable[[str], None] = print) -> TrainResult:
    """Trains ``cfg`` in ``workdir``, resuming from its latest checkpoint if there is one.

    stop_after_steps: stop (after checkpointing) once this many steps ran in this call, as a
      kill would; the same call again resumes. For tests and time-boxed jobs.
    stop_at_time: likewise, stop at the first step boundary after this ``time.time()``.
    """
    check_train_config(cfg)
    run = RunDir(workdir)
    is_main = jax.process_index() == 0
    if is_main:
        run.write_or_check_config(cfg)
    mesh = mesh_lib.make_mesh()
    with jax.set_mesh(mesh):
        data_iter = iter(_train_dataset(cfg))
        ckpt = Checkpointer(run, keep=cfg.train.keep_checkpoints,
                            async_save=cfg.train.async_checkpoints)
        step_log = None
        profiler = StepProfiler(cfg.train.profile_range, run.tensorboard_dir, log)
        try:
            graphdef, state, start_step = _restore_or_init(cfg, mesh, ckpt, data_iter, log)
            step_log = _StepLog(cfg, run, start_step, log, enabled=is_main)
            with _Stopper(stop_after_steps, stop_at_time) as stopper:
                state, final_step, interrupted = _step_loop(
                    cfg, mesh, graphdef, state, start_step, data_iter, ckpt, step_log, stopper,
                    profiler, log)
            eval_metrics = None
            if final_step == cfg.train.num_steps and not interrupted:
                eval_metrics = _final_eval(cfg, graphdef, state, final_step, step_log, log)
        finally:
            profiler.close()
            if step_log is not None:
                step_log.close()
            ckpt.close()
            if hasattr(data_iter, "close"):  # stop grain's prefetch threads
                data_iter.close()
    return TrainResult(workdir=workdir, start_step=start_step, final_step=final_step,
                       losses=step_log.losses, last_metrics=step_log.last_metrics,
                       eval_metrics=eval_metrics, interrupted=interrupted)


def check_train_config(cfg: Config) -> None:
    """What only the running job can check: the batch split over its devices, the vocabulary
    against the tokenizer."""
    tcfg = cfg.train
    n_dev = jax.device_count()
    if tcfg.batch_size % n_dev:
        raise ValueError(f"train.batch_size: expected a multiple of the device count {n_dev}, "
                         f"got {tcfg.batch_size}")
    if (tcfg.batch_size // tcfg.grad_accum_steps) % n_dev:
        raise ValueError(f"train.grad_accum_steps: each micro-batch (batch_size / grad_accum_steps"
                         f" = {tcfg.batch_size // tcfg.grad_accum_steps}) must split over {n_dev} devices")
    tokenizer = make_tokenizer(cfg.data.tokenizer)
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ValueError(f"model.vocab_size: expected >= the tokenizer's vocabulary "
                         f"({tokenizer.vocab_size} for {cfg.data.tokenizer!r}), got {cfg.model.vocab_size}")


def _train_dataset(cfg: Config):
    """This process's shard of the training batches."""
    n_proc = jax.process_count()
    return data_lib.make_dataset(
        cfg.data, cfg.data.train_split, batch_size=cfg.train.batch_size // n_proc,
        seed=cfg.data.shuffle_seed, shard_index=jax.process_index(), shard_count=n_proc)


def _restore_or_init(cfg: Config, mesh, ckpt: Checkpointer, data_iter, log):
    """(graphdef, state, start step): the latest checkpoint (the data iterator restored in
    place) if there is one, else a fresh initialisation."""
    replicated = mesh_lib.replicated(mesh)
    graphdef, abstract = abstract_train_state(cfg)
    start_step = ckpt.latest_step() or 0
    if start_step:
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), abstract)
        _, state = ckpt.restore(start_step, abstract, data_iter)
        log(f"resumed from {ckpt.directory} at step {start_step}")
        return graphdef, state, start_step
    state = jax.jit(lambda: nnx.state(create_model_and_optimizer(cfg)), out_shardings=replicated)()
    n_params = count_params(nnx.merge(graphdef, state)[0])
    log(f"{cfg.name}: {n_params / 1e6:.2f}M parameters, {jax.device_count()} device(s), "
        f"attention implementation {cfg.model.attn_implementation or 'default'}")
    return graphdef, state, 0


def _step_loop(cfg: Config, mesh, graphdef, state, start_step: int, data_iter,
               ckpt: Checkpointer, step_log: "_StepLog", stopper: "_Stopper",
               profiler: StepProfiler, log):
    """Runs steps until num_steps or a stop; returns (state, final step, interrupted)."""
    tcfg = cfg.train
    replicated, data_sharding = mesh_lib.replicated(mesh), mesh_lib.batch_sharding(mesh)
    step_fns = {with_stats: jax.jit(make_train_step(graphdef, cfg, with_stats=with_stats),
                                    in_shardings=(replicated, data_sharding),
                                    out_shardings=(replicated, replicated), donate_argnums=0)
                for with_stats in (False, True)}  # each compiled on first use
    step, why_stop = start_step, None
    while step < tcfg.num_steps and why_stop is None:
        batch = mesh_lib.global_batch(next(data_iter), data_sharding)
        profiler.before_step(step + 1)
        state, dev_metrics = step_fns[step_log.logs(step + 1)](state, batch)
        step += 1
        profiler.after_step(step, dev_metrics)
        step_log.record(step, dev_metrics)
        why_stop = stopper.after_step()
        at_eval = tcfg.eval_every and step % tcfg.eval_every == 0
        save_now = step % tcfg.save_every == 0 or step == tcfg.num_steps or why_stop is not None
        if save_now or at_eval:
            step_log.flush()  # check this step's loss before saving it
        if save_now:
            ckpt.save(step, state, data_iter)
            step_log.last_saved = step
        if at_eval and step != tcfg.num_steps:
            step_log.write_eval(step, _evaluate(cfg, graphdef, state))
        if why_stop is not None:
            log(f"stopping at step {step} ({why_stop}); checkpoint saved")
    step_log.flush()
    return state, step, why_stop is not None


def _evaluate(cfg: Config, graphdef, state) -> dict[str, Any]:
    model = nnx.merge(graphdef, state)[0]
    return evaluate_model(model, cfg, max_batches=cfg.train.eval_batches)


def _final_eval(cfg: Config, graphdef, state, step: int, step_log: "_StepLog", log):
    metrics = _evaluate(cfg, graphdef, state)
    step_log.write_eval(step, metrics)
    log(f"final eval ({cfg.data.eval_split}): loss {metrics['loss']:.4f} "
        f"ppl {metrics['perplexity']:.2f} bpb {metrics['bits_per_byte']:.4f}")
    return metrics


# -- stopping and logging ---------------------------------------------------------------------

class _Stopper:
    """Why to stop early, checked after every step: SIGTERM, a step count, a wall-clock time.

    The loop then checkpoints and returns; the same call again resumes.
    """

    def __init__(self, after_steps: int | None, at_time: float | None):
        self.after_steps, self.at_time = after_steps, at_time
        self.signum = None
        self._ran = 0
        self._old = {}

    def __enter__(self):
        try:
            self._old[signal.SIGTERM] = signal.signal(signal.SIGTERM, self._handle)
        except ValueError:  # not the main thread: no signal handling
            pass
        return self

    def _handle(self, signum, frame):
        self.signum = signum

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)

    def after_step(self) -> str | None:
        """The reason to stop now, or None."""
        self._ran += 1
        if self.signum is not None:
            return f"signal {self.signum}"
        if self.after_steps is not None and self._ran >= self.after_steps:
            return f"stop_after_steps={self.after_steps}"
        if self.at_time is not None and time.time() >= self.at_time:
            return "time budget"
        return None


class _StepLog:
    """Each step's metrics: read one step late (the host never waits for the step it just
    launched), checked for divergence, and every ``log_every`` steps written to the run's
    metrics log, the progress bar or the ``log`` function."""

    def __init__(self, cfg: Config, run: RunDir, start_step: int, log, *, enabled: bool):
        self.tcfg = cfg.train
        self.tokens_per_step = cfg.train.batch_size * cfg.data.seq_len
        self.log, self.enabled = log, enabled
        self.writer = MetricsWriter(run.metrics_path, tensorboard_dir=run.tensorboard_dir,
                                    resume_step=start_step or None, enabled=enabled)
        self.progress = _progress_bar(cfg.train, start_step, enabled=enabled and cfg.train.progress)
        self.losses: dict[int, float] = {}
        self.last_metrics: dict[str, Any] = {}
        self.last_saved = start_step or None  # named in the divergence error
        self._pending = None  # (step, device metrics) not read yet
        self._t_last, self._steps_since_log = time.perf_counter(), 0

    def logs(self, step: int) -> bool:
        """Whether ``step`` is logged (its step then computes the logit statistics)."""
        return step % self.tcfg.log_every == 0 or step == self.tcfg.num_steps

    def record(self, step: int, dev_metrics) -> None:
        self.flush()
        self._pending = (step, dev_metrics)
        if self.progress is not None:
            self.progress.update(1)

    def flush(self) -> None:
        if self._pending is None:
            return
        step, dev_metrics = self._pending
        self._pending = None
        host = _to_host(dev_metrics)
        self.losses[step] = host["loss"]
        _check_finite(step, host, self.last_saved)
        self._steps_since_log += 1
        if not self.logs(step):
            return
        now = time.perf_counter()
        host["tokens_per_sec"] = self._steps_since_log * self.tokens_per_step / (now - self._t_last)
        host["time"] = time.time()
        self._t_last, self._steps_since_log = now, 0
        self.writer.write(step, host)
        self.last_metrics = host
        if self.progress is not None:
            self.progress.set_postfix(loss=f"{host['loss']:.4f}",
                                      max_logit=f"{host['max_abs_logit']:.1f}",
                                      tok_s=f"{host['tokens_per_sec']:.0f}", refresh=False)
        elif self.enabled:
            self.log(f"step {step}: loss {host['loss']:.4f} max|logit| "
                     f"{host['max_abs_logit']:.2f} lm_head {host['lm_head_max_abs_logit']:.2f} "
                     f"{host['tokens_per_sec']:.0f} tok/s")

    def write_eval(self, step: int, metrics: dict[str, Any]) -> None:
        self.writer.write(step, metrics, prefix="eval/")

    def close(self) -> None:
        if self.progress is not None:
            self.progress.close()
        self.writer.close()


def _to_host(metrics: dict) -> dict[str, Any]:
    host = jax.device_get(metrics)
    out = {k: float(v) for k, v in host.items() if k not in STATS_KEYS}
    if STATS_KEYS[0] in host:
        out.update(logit_norm_summary(host["attn_max_abs_logit"], host["lm_head_max_abs_logit"]))
    return out


def _check_finite(step: int, metrics: dict[str, Any], last_saved: int | None) -> None:
    bad = [k for k in ("loss", "grad_norm") if not math.isfinite(metrics[k])]
    if bad:
        where = (f"the last good checkpoint is step {last_saved}" if last_saved is not None
                 else "no checkpoint was saved before it")
        logit = (f", max_abs_logit={metrics['max_abs_logit']}" if "max_abs_logit" in metrics
                 else "")
        raise TrainingDiverged(
            f"training diverged at step {step}: non-finite {', '.join(bad)} "
            f"(loss={metrics['loss']}, grad_norm={metrics['grad_norm']}{logit}); {where}")


def _progress_bar(tcfg, start_step: int, enabled: bool):
    """A tqdm bar on a terminal; elsewhere (logs, CI) None, and the loop prints plain lines."""
    if not enabled or not sys.stderr.isatty():
        return None
    from tqdm.auto import tqdm
    return tqdm(total=tcfg.num_steps, initial=start_step, unit="step", dynamic_ncols=True,
                mininterval=1.0)
