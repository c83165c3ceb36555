"""The training loop: jit-compiled data-parallel steps over a device mesh, with logging,
evaluation, orbax checkpoints, automatic resume, SIGTERM handling and NaN stops.

``train(cfg, workdir)`` is what ``train.py`` runs; tests call it directly.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from ls_jax import data as data_lib
from ls_jax import sharding as sharding_lib
from ls_jax.checkpoint import Checkpointer
from ls_jax.config import Config
from ls_jax.evaluate import evaluate_model
from ls_jax.loss import lm_loss
from ls_jax.metrics import MetricsWriter, logit_norm_summary
from ls_jax.model import Transformer, count_params
from ls_jax.optimizer import learning_rate_schedule, make_optimizer
from ls_jax.tokenizer import make_tokenizer

CONFIG_FILE = "config.json"


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


# -- setup ------------------------------------------------------------------------------------

def create_model_and_optimizer(cfg: Config, *, seed: int | None = None):
    """A freshly initialised (Transformer, nnx.Optimizer) pair."""
    seed = cfg.train.seed if seed is None else seed
    model = Transformer(cfg.model, rngs=nnx.Rngs(params=seed))
    optimizer = nnx.Optimizer(model, make_optimizer(cfg.train), wrt=nnx.Param)
    return model, optimizer


def abstract_train_state(cfg: Config):
    """(graphdef, abstract state) of (model, optimizer) without allocating parameters.

    Built outside any mesh: the logical axis names stay metadata (ls_jax/sharding.py maps
    them to mesh axes) instead of becoming shardings of the abstract values."""
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
        return nnx.split(nnx.eval_shape(lambda: create_model_and_optimizer(cfg)))


def write_or_check_config(cfg: Config, workdir: str) -> None:
    """Saves the resolved config; an existing workdir must hold the same config (no silent
    mixing of two runs in one directory)."""
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, CONFIG_FILE)
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
        new = cfg.to_dict()
        old.pop("mesh", None)  # the mesh is not part of a run's identity: resume on another
        new.pop("mesh", None)
        if old != new:
            diffs = [f"{sec}.{k}: {old.get(sec, {}).get(k)!r} -> {v!r}"
                     for sec in ("model", "data", "train") for k, v in new[sec].items()
                     if old.get(sec, {}).get(k) != v]
            if old.get("name") != new["name"]:
                diffs.insert(0, f"name: {old.get('name')!r} -> {new['name']!r}")
            raise ValueError(
                f"workdir: {workdir} holds a run with a different config ({'; '.join(diffs)}); "
                f"use a new workdir or the same config to resume")
        return
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(cfg.to_json())
    os.replace(tmp, path)


def load_config(workdir: str) -> Config:
    path = os.path.join(workdir, CONFIG_FILE)
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"checkpoint: expected a run directory with {CONFIG_FILE} (written by train.py), "
            f"but {path} does not exist")
    with open(path) as f:
        return Config.from_dict(json.load(f))


# -- the step ---------------------------------------------------------------------------------

def make_train_step(graphdef, cfg: Config) -> Callable:
    """(state, batch) -> (state, metrics); pure, for jax.jit with the state donated."""
    accum = cfg.train.grad_accum_steps
    schedule = learning_rate_schedule(cfg.train)

    def loss_fn(model, inputs_BxT, targets_BxT):
        logits_BxTxV, stats = model(inputs_BxT, return_stats=True)
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


@dataclasses.dataclass
class TrainFns:
    """The jitted functions of a run on a mesh, and where the state lives."""
    graphdef: Any
    abstract: Any  # abstract nnx.State of (model, optimizer)
    state_sharding: Any  # the same tree of NamedShardings
    init: Callable  # () -> state
    step: Callable  # (state, global batch) -> (state, metrics); state donated


def compile_train_fns(cfg: Config, mesh: jax.sharding.Mesh) -> TrainFns:
    """Parameters and optimizer moments split over fsdp (and tensor) by their logical axes,
    the batch over data x fsdp, the metrics replicated."""
    graphdef, abstract = abstract_train_state(cfg)
    state_sharding = sharding_lib.state_shardings(abstract, mesh)
    init = jax.jit(lambda: nnx.state(create_model_and_optimizer(cfg)),
                   out_shardings=state_sharding)
    step = jax.jit(make_train_step(graphdef, cfg),
                   in_shardings=(state_sharding, sharding_lib.batch_sharding(mesh)),
                   out_shardings=(state_sharding, sharding_lib.replicated(mesh)),
                   donate_argnums=0)
    return TrainFns(graphdef, abstract, state_sharding, init, step)


# -- the loop ---------------------------------------------------------------------------------

class _StopFlag:
    """Set by SIGTERM; the loop checkpoints and returns at the next step boundary."""

    def __init__(self):
        self.signum = None
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


def _to_host(metrics: dict) -> dict[str, Any]:
    host = jax.device_get(metrics)
    out = {k: float(v) for k, v in host.items()
           if k not in ("attn_max_abs_logit", "lm_head_max_abs_logit")}
    out.update(logit_norm_summary(host["attn_max_abs_logit"], host["lm_head_max_abs_logit"]))
    return out


def _check_finite(step: int, metrics: dict[str, Any], last_saved: int | None) -> None:
    bad = [k for k in ("loss", "grad_norm") if not math.isfinite(metrics[k])]
    if bad:
        where = (f"the last good checkpoint is step {last_saved}" if last_saved is not None
                 else "no checkpoint was saved before it")
        raise TrainingDiverged(
            f"training diverged at step {step}: non-finite {', '.join(bad)} "
            f"(loss={metrics['loss']}, grad_norm={metrics['grad_norm']}, "
            f"max_abs_logit={metrics.get('max_abs_logit')}); {where}")


def train(cfg: Config, workdir: str, *, stop_after_steps: int | None = None,
          stop_at_time: float | None = None, log: Callable[[str], None] = print) -> TrainResult:
    """Trains ``cfg`` in ``workdir``, resuming from its latest checkpoint if there is one.

    stop_after_steps: stop (after checkpointing) once this many steps ran in this call, as a
      kill would; the same call again resumes. For tests and time-boxed jobs.
    stop_at_time: likewise, stop at the first step boundary after this ``time.time()``.
    """
    tcfg, dcfg = cfg.train, cfg.data
    n_dev, n_proc = jax.device_count(), jax.process_count()
    mesh = sharding_lib.make_mesh(cfg.mesh)
    n_batch = sharding_lib.batch_divisor(mesh)  # the batch splits over data x fsdp
    if tcfg.batch_size % n_batch:
        raise ValueError(f"train.batch_size: expected a multiple of {n_batch} (mesh data x fsdp "
                         f"= {dict(mesh.shape)}), got {tcfg.batch_size}")
    if (tcfg.batch_size // tcfg.grad_accum_steps) % n_batch:
        raise ValueError(f"train.grad_accum_steps: each micro-batch (batch_size / grad_accum_steps"
                         f" = {tcfg.batch_size // tcfg.grad_accum_steps}) must split over "
                         f"{n_batch} devices (mesh data x fsdp)")
    tokenizer = make_tokenizer(dcfg.tokenizer)
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ValueError(f"model.vocab_size: expected >= the tokenizer's vocabulary "
                         f"({tokenizer.vocab_size} for {dcfg.tokenizer!r}), got {cfg.model.vocab_size}")
    is_main = jax.process_index() == 0
    if is_main:
        write_or_check_config(cfg, workdir)

    data_sharding = sharding_lib.batch_sharding(mesh)
    with jax.set_mesh(mesh):
        fns = compile_train_fns(cfg, mesh)
        graphdef, abstract, state_sharding = fns.graphdef, fns.abstract, fns.state_sharding
        dataset = data_lib.make_dataset(
            dcfg, dcfg.train_split, batch_size=tcfg.batch_size // n_proc, seed=dcfg.shuffle_seed,
            shard_index=jax.process_index(), shard_count=n_proc)
        data_iter = iter(dataset)
        ckpt = Checkpointer(workdir, keep=tcfg.keep_checkpoints, async_save=tcfg.async_checkpoints)
        start_step = ckpt.latest_step() or 0
        if start_step:
            # restored straight into this run's shardings, whatever mesh wrote the checkpoint
            abstract_sharded = sharding_lib.with_shardings(abstract, state_sharding)
            _, state = ckpt.restore(start_step, abstract_sharded, data_iter)
            log(f"resumed from {ckpt.directory} at step {start_step}")
        else:
            state = fns.init()
        n_params = count_params(nnx.merge(graphdef, state)[0])
        if start_step == 0:
            log(f"{cfg.name}: {n_params / 1e6:.2f}M parameters, {n_dev} device(s) "
                f"(mesh {dict(mesh.shape)}), {n_proc} process(es), "
                f"attention implementation {cfg.model.attn_implementation or 'default'}")
        step_fn = fns.step
        writer = MetricsWriter(workdir, resume_step=start_step if start_step else None,
                               enabled=is_main)
        result = TrainResult(workdir=workdir, start_step=start_step, final_step=start_step,
                             losses={}, last_metrics={}, eval_metrics=None)
        last_saved = start_step or None
        tokens_per_step = tcfg.batch_size * dcfg.seq_len
        progress = _progress_bar(tcfg, start_step, enabled=is_main and tcfg.progress)
        pending = None  # (step, device metrics) of the previous step: read one step late
        t_last, steps_since_log = time.perf_counter(), 0

        def finish_step(step, dev_metrics):
            nonlocal t_last, steps_since_log
            host = _to_host(dev_metrics)
            result.losses[step] = host["loss"]
            _check_finite(step, host, last_saved)
            steps_since_log += 1
            if step % tcfg.log_every == 0 or step == tcfg.num_steps:
                now = time.perf_counter()
                host["tokens_per_sec"] = steps_since_log * tokens_per_step / (now - t_last)
                host["time"] = time.time()
                t_last, steps_since_log = now, 0
                writer.write(step, host)
                result.last_metrics = host
                if progress is not None:
                    progress.set_postfix(loss=f"{host['loss']:.4f}",
                                         max_logit=f"{host['max_abs_logit']:.1f}",
                                         tok_s=f"{host['tokens_per_sec']:.0f}", refresh=False)
                elif is_main:
                    log(f"step {step}: loss {host['loss']:.4f} max|logit| "
                        f"{host['max_abs_logit']:.2f} lm_head {host['lm_head_max_abs_logit']:.2f} "
                        f"{host['tokens_per_sec']:.0f} tok/s")

        try:
            with _StopFlag() as stop:
                step = start_step
                ran = 0
                while step < tcfg.num_steps:
                    batch = next(data_iter)
                    batch = sharding_lib.global_batch(batch, data_sharding)
                    state, dev_metrics = step_fn(state, batch)
                    step += 1
                    ran += 1
                    if pending is not None:
                        finish_step(*pending)
                    pending = (step, dev_metrics)
                    if progress is not None:
                        progress.update(1)
                    stop_now = (stop.signum is not None
                                or (stop_after_steps is not None and ran >= stop_after_steps)
                                or (stop_at_time is not None and time.time() >= stop_at_time))
                    # a SIGTERM reaches hosts at different steps: all stop (and save) at the
                    # first step any of them saw it
                    stop_now = sharding_lib.any_process(stop_now)
                    at_eval = tcfg.eval_every and step % tcfg.eval_every == 0
                    save_now = step % tcfg.save_every == 0 or step == tcfg.num_steps or stop_now
                    if save_now or at_eval:
                        finish_step(*pending)  # check this step's loss before saving it
                        pending = None
                    if save_now:
                        ckpt.save(step, state, data_iter)
                        last_saved = step
                    if at_eval and step != tcfg.num_steps:
                        model = nnx.merge(graphdef, state)[0]
                        ev = evaluate_model(model, cfg, max_batches=tcfg.eval_batches)
                        writer.write(step, ev, prefix="eval/")
                    if stop_now:
                        result.interrupted = True
                        why = (f"signal {stop.signum}" if stop.signum is not None
                               else "another process was stopped" if n_proc > 1
                               else f"stop_after_steps={stop_after_steps}"
                               if stop_after_steps is not None and ran >= stop_after_steps
                               else "time budget")
                        log(f"stopping at step {step} ({why}); checkpoint saved")
                        break
                if pending is not None:
                    finish_step(*pending)
                result.final_step = step
                if step == tcfg.num_steps and not result.interrupted:
                    model = nnx.merge(graphdef, state)[0]
                    result.eval_metrics = evaluate_model(model, cfg, max_batches=tcfg.eval_batches)
                    writer.write(step, result.eval_metrics, prefix="eval/")
                    log(f"final eval ({dcfg.eval_split}): loss {result.eval_metrics['loss']:.4f} "
                        f"ppl {result.eval_metrics['perplexity']:.2f} "
                        f"bpb {result.eval_metrics['bits_per_byte']:.4f}")
        finally:
            if progress is not None:
                progress.close()
            ckpt.close()
            writer.close()
            if hasattr(data_iter, "close"):  # stop grain's prefetch threads
                data_iter.close()
    return result


def _progress_bar(tcfg, start_step: int, enabled: bool):
    """A tqdm bar on a terminal; elsewhere (logs, CI) None, and the loop prints plain lines."""
    import sys
    if not enabled or not sys.stderr.isatty():
        return None
    from tqdm.auto import tqdm
    return tqdm(total=tcfg.num_steps, initial=start_step, unit="step", dynamic_ncols=True,
                mininterval=1.0)
