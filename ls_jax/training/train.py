"""The training loop: jit-compiled steps over a (data, fsdp, tensor) device mesh, with logging,
evaluation, orbax checkpoints, automatic resume, SIGTERM handling and NaN stops.

``train(cfg, workdir)`` is what ``train.py`` runs; tests call it directly. It reads as its
steps: check the config, claim the run directory, restore or initialise the state, run the
step loop (each step's metrics checked and logged, checkpoints saved, periodic evals), commit
the last checkpoint, and a final eval. The step and its jitted functions are ``ls_jax.training.step``'s.

SIGTERM and SIGINT (Ctrl-C) ask for a stop throughout (``stopping.Stopper``): during start-up the run
stops before its first step, in the loop after the current step (saved first), in the final
eval at once (its checkpoint is committed before the eval starts); each ends with one line and
returns normally. A second signal stops at once (``Interrupted``; with ``exit_at_once`` it ends
the process), except while a checkpoint is being written, which it waits for (with
``exit_at_once``, at most ``stopping.SECOND_SIGNAL_WAIT_S``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import sys
import threading
import time
from typing import Any, Callable

import jax
from flax import nnx

from ls_jax.inputs import pipeline as data_lib
from ls_jax import sharding as sharding_lib
from ls_jax.training.checkpoint import CheckpointError, Checkpointer, DataLayout
from ls_jax.config import Config
from ls_jax.training.evaluate import evaluate_model, format_perplexity
from ls_jax.training.gc_pause import collection_paused
from ls_jax.training.metrics import MetricsWriter, logit_norm_summary
from ls_jax.layers.transformer import count_params
from ls_jax.training.profiler import StepProfiler
from ls_jax.training.rundir import RunDir
from ls_jax.inputs.sources import load_split
from ls_jax.training.state import init_key
from ls_jax.training.stopping import STALLED_SAVE_S, Interrupted, Stopper
from ls_jax.training.step import STATS_KEYS, TrainFns, check_batch_split, compile_train_fns
from ls_jax.inputs.tokenizer import make_tokenizer

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
    stop: str | None = None  # when interrupted: the line that said why and what is saved


# -- the run ----------------------------------------------------------------------------------

def use_compilation_cache() -> str | None:
    """Turns on JAX's persistent compilation cache for this process, in
    ``$XDG_CACHE_HOME/ls-jax/jax`` (default ``~/.cache/ls-jax/jax``), unless the environment
    decided already: ``JAX_COMPILATION_CACHE_DIR`` names another directory (empty: none),
    ``JAX_ENABLE_COMPILATION_CACHE=false`` turns it off. A later run of the same program (a
    rerun, a resume, another workdir; the same JAX and machine) then loads the executables of
    its init and steps instead of compiling them: the same executables, so the same numbers.
    Call it before the first compilation. Returns the directory in use, or None."""
    if jax.config.jax_compilation_cache_dir is None:
        cache_home = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
        jax.config.update("jax_compilation_cache_dir", os.path.join(cache_home, "ls-jax", "jax"))
    if not jax.config.jax_enable_compilation_cache:
        return None
    return jax.config.jax_compilation_cache_dir or None


def train(cfg: Config, workdir: str, *, stop_after_steps: int | None = None,
          stop_at_time: float | None = None, log: Callable[[str], None] = print,
          exit_at_once: bool = False) -> TrainResult:
    """Trains ``cfg`` in ``workdir``, resuming from its latest intact checkpoint if there is one.

    stop_after_steps: stop (after checkpointing) once this many steps ran in this call, as a
      kill would; the same call again resumes. For tests and time-boxed jobs.
    stop_at_time: likewise, stop at the first step boundary after this ``time.time()``.

    The run holds the workdir's lock (``RunDir.lock``) throughout; ``config.json`` is written
    only once the config, both data splits and the checkpoint passed their checks. A stop
    (signal, step count, time) returns ``interrupted=True`` with its line in ``stop`` (also
    logged); a second signal raises ``Interrupted``.

    exit_at_once: what a command line wants. Signals are counted by a thread of their own
    (every one, also while the main thread is inside a long native call such as a
    compilation), and a second signal, or a first one while a checkpoint save is stalled
    (``STALLED_SAVE_S``), prints its ``error:`` line on stderr and ends the process
    (``os._exit``, status 128 + the signal) without waiting on the main thread or tearing down
    the interpreter under native threads that still run. What is committed on disk is kept.
    """
    run = RunDir(workdir)

    def last_checkpoint() -> str:
        steps = run.checkpoint_steps()
        return (f"the last checkpoint is step {steps[-1]} in {run.checkpoint_dir}" if steps
                else "there is no checkpoint yet")

    def second_signal_line(name: str) -> str:
        return (f"stopped at once by a second {name} (nothing more was saved); "
                f"{last_checkpoint()}; rerun the same command to resume")

    def stalled_line(name: str) -> str:
        return (f"stopped by {name} while a checkpoint save wrote nothing for "
                f"{STALLED_SAVE_S:.0f} s (a hung disk; its unfinished save is removed on the next "
                f"start); {last_checkpoint()}; rerun the same command to resume")

    with Stopper(stop_after_steps, stop_at_time,
                  exit_with=(second_signal_line, stalled_line) if exit_at_once else None,
                  checkpoint_dir=run.checkpoint_dir) as stopper:
        try:
            mesh = sharding_lib.make_mesh(cfg.mesh)
            check_train_config(cfg, mesh)
            is_main = jax.process_index() == 0
            with run.lock() if is_main else contextlib.nullcontext():
                return _train(cfg, mesh, workdir, stopper, log)
        except KeyboardInterrupt as e:
            if isinstance(e, Interrupted) or stopper.signum is None:
                raise
            raise Interrupted(second_signal_line(stopper.signal_name), stopper.signum) from None
        except TrainingDiverged as e:  # the run's saves are committed: name the newest
            steps = run.checkpoint_steps()
            where = (f"the newest good checkpoint is step {steps[-1]} in {run.checkpoint_dir}"
                     if steps else "no checkpoint was saved before it")
            raise TrainingDiverged(f"{e}; {where}") from None


def _train(cfg: Config, mesh, workdir: str, stopper: Stopper, log) -> TrainResult:
    run = RunDir(workdir)
    is_main = jax.process_index() == 0
    say = log if is_main else (lambda _m: None)
    if is_main:
        run.check_config(cfg, log)
    _check_eval_split(cfg)
    if why := stopper.at_startup():
        return _stopped_before_start(workdir, run.checkpoint_steps(), why, say)
    with jax.set_mesh(mesh):
        ckpt = Checkpointer(run, keep=cfg.train.keep_checkpoints,
                            async_save=cfg.train.async_checkpoints)
        step_log = data = ahead = None
        profiler = StepProfiler(cfg.train.profile_range, run.tensorboard_dir, log)
        finished = False
        try:
            with collection_paused():  # while the run traces, lowers and compiles
                fns = compile_train_fns(cfg, mesh)
                ahead = _CompileAhead(cfg, mesh, fns, (ckpt.latest_step() or 0) + 1)
                graphdef, state, start_step, data = _restore_or_init(cfg, mesh, fns, ckpt, log)
                if why := stopper.at_startup():
                    finished = True
                    return _stopped_before_start(workdir, run.checkpoint_steps(), why, say)
                if is_main:
                    run.write_config(cfg)
                step_log = _StepLog(cfg, run, start_step, log, enabled=is_main)
                ahead.join()  # a signal from here on stops after the first step (saved)
            state, final_step, why_stop = _step_loop(
                cfg, mesh, fns, state, start_step, data, ckpt, step_log, stopper, profiler, log)
            eval_metrics, stop = None, None
            if why_stop is not None:
                stop = (f"stopped at step {final_step} ({why_stop}); checkpoint step {final_step} "
                        f"is saved in {ckpt.directory}; rerun the same command to resume")
            elif step_log.finished_before():
                step_log.close_progress()
                say(f"the run already finished at step {final_step} (its final eval is in "
                    f"{run.metrics_path}); nothing to do")
            else:
                eval_metrics = _final_eval(cfg, graphdef, state, final_step, step_log, stopper)
                if eval_metrics is None:
                    stop = (f"stopped during the final eval ({stopper.signal_name}); checkpoint "
                            f"step {final_step} is saved in {ckpt.directory}; rerun the same "
                            f"command to run the final eval")
            if stop is not None:
                step_log.close_progress()
                say(stop)
            step_log.sync()  # a failed write of the logs is reported, not lost in close()
            finished = True
        finally:
            if ahead is not None:
                ahead.join()  # no compilation outlives the run
            profiler.close()
            if step_log is not None:
                step_log.close()
            if data is not None:
                data.close()
            try:
                with stopper.commit():  # a pending save is finished, not cut short
                    ckpt.close()
            except CheckpointError:
                if finished:
                    raise  # else the error that ended the run is the one to report
    return TrainResult(workdir=workdir, start_step=start_step, final_step=final_step,
                       losses=step_log.losses, last_metrics=step_log.last_metrics,
                       eval_metrics=eval_metrics, interrupted=stop is not None, stop=stop)


def _stopped_before_start(workdir: str, saved: list[int], why: str, say) -> TrainResult:
    """A stop during start-up: no step ran, so nothing new needs saving."""
    start = saved[-1] if saved else 0
    latest = f" (the latest checkpoint is step {start})" if saved else ""
    stop = (f"stopped before step {start + 1} ({why}, during start-up): nothing new to "
            f"save{latest}; rerun the same command to resume")
    say(stop)
    return TrainResult(workdir=workdir, start_step=start, final_step=start, losses={},
                       last_metrics={}, eval_metrics=None, interrupted=True, stop=stop)


def check_train_config(cfg: Config, mesh: jax.sharding.Mesh) -> None:
    """What only the running job can check: the batch split over its mesh, the vocabulary
    against the tokenizer."""
    check_batch_split(cfg.train, mesh)
    tokenizer = make_tokenizer(cfg.data.tokenizer)
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ValueError(f"model.vocab_size: expected >= the tokenizer's vocabulary "
                         f"({tokenizer.vocab_size} for {cfg.data.tokenizer!r}), got {cfg.model.vocab_size}")


def _check_eval_split(cfg: Config) -> None:
    """The eval split gives at least one batch (the train split is checked when its pipeline is
    built), so a run does not fail at its final eval after all its steps."""
    load_split(cfg.data, cfg.data.eval_split)  # the clear errors: missing, empty
    batch_size = cfg.train.batch_size // jax.process_count()
    it = iter(data_lib.make_dataset(cfg.data, cfg.data.eval_split, batch_size=batch_size,
                                    seed=cfg.data.shuffle_seed, shard_index=jax.process_index(),
                                    shard_count=jax.process_count(), num_epochs=1, shuffle=False))
    try:
        next(it)
    except StopIteration:
        raise ValueError(
            f"data.eval_split: {cfg.data.eval_split!r} of {cfg.data.source!r} holds less than "
            f"one batch of {batch_size} x {cfg.data.seq_len} tokens; add text, raise "
            f"data.validation_percent or lower train.batch_size / data.seq_len") from None
    finally:
        if hasattr(it, "close"):
            it.close()


class _CompileAhead:
    """Compiles the train step that ``first_step`` takes (with or without the logit
    statistics) in a thread of its own, while the run restores or initialises its state: XLA
    compiles without holding the GIL, so the set-up's own work (the input pipeline, the init's
    tracing and lowering, a checkpoint restore) goes on meanwhile. The executable lands in the
    jitted step's own cache, where the first step's call finds it (loaded from the persistent
    compilation cache when that holds it). Whatever fails here (another first step than the
    one foreseen, an error) only loses the head start: the first step's own call compiles what
    it needs and reports any error itself. A run with no step left to take compiles nothing."""

    def __init__(self, cfg: Config, mesh, fns: TrainFns, first_step: int):
        self._thread = None
        if first_step > cfg.train.num_steps:
            return
        step_fn = fns.steps[_logs(cfg.train, first_step)]

        def compile_step():
            try:
                with jax.set_mesh(mesh):  # the mesh context is per thread; the call's key has it
                    step_fn.lower(*fns.step_args).compile()
            except Exception:  # noqa: BLE001  the first step's call compiles again and reports it
                pass

        self._thread = threading.Thread(target=compile_step, name="compile-first-step",
                                        daemon=True)
        self._thread.start()

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()


class _TrainData:
    """This process's shard of the training batches, from the pipeline ``seed`` (the config's
    ``data.shuffle_seed`` unless the pipeline was restarted, ``data_lib.restart_seed``; saved
    with each checkpoint, so a resume rebuilds the same pipeline before restoring its
    position)."""

    def __init__(self, cfg: Config, seed: int):
        n_proc = jax.process_count()
        self.seed = seed
        self.iterator = iter(data_lib.make_dataset(
            cfg.data, cfg.data.train_split, batch_size=cfg.train.batch_size // n_proc,
            seed=seed, shard_index=jax.process_index(), shard_count=n_proc))

    def close(self) -> None:
        if hasattr(self.iterator, "close"):  # stop grain's prefetch threads
            self.iterator.close()


def _restore_or_init(cfg: Config, mesh, fns: TrainFns, ckpt: Checkpointer, log):
    """(graphdef, state, start step, data): the latest intact checkpoint if there is one, else
    a fresh initialisation. A checkpoint written on any mesh is restored straight into this
    run's shardings. Its data position carries over when it was saved by as many processes as
    this run has (each keeps its input shard); otherwise ``_restarted_data``."""
    if not ckpt.latest_step():
        data = _TrainData(cfg, cfg.data.shuffle_seed)  # checks the train split before the init
        try:
            state = fns.init(init_key(cfg))
        except BaseException:
            data.close()
            raise
        n_params = count_params(nnx.merge(fns.graphdef, state)[0])
        log(f"{cfg.name}: {n_params / 1e6:.2f}M parameters, {jax.device_count()} device(s) "
            f"(mesh {dict(mesh.shape)}), {jax.process_count()} process(es), "
            f"attention implementation {cfg.model.attn_implementation or 'default'}")
        return fns.graphdef, state, 0, data
    tried = {"data": None, "layout": None}  # of the step restore_latest_intact tried last

    def position_into(step, layout):
        if tried["data"] is not None:
            tried["data"].close()
        tried.update(data=None, layout=layout)
        if layout is not None and layout.process_count != jax.process_count():
            return None  # restore the state only
        # the same processes (or no readable position: its restore reports the step damaged)
        tried["data"] = _TrainData(cfg, _saved_pipeline_seed(cfg, layout))
        return tried["data"].iterator

    try:
        start_step, state = ckpt.restore_latest_intact(fns.step_args[0], position_into, log)
        if start_step > cfg.train.num_steps:
            raise ValueError(f"train.num_steps: expected >= the checkpointed step {start_step} "
                             f"to resume {ckpt.directory}, got {cfg.train.num_steps}")
        data = tried["data"]
        if data is None:
            data = _restarted_data(cfg, start_step, tried["layout"], log)
    except BaseException:
        if tried["data"] is not None:
            tried["data"].close()
        raise
    log(f"resumed from {ckpt.directory} at step {start_step}")
    return fns.graphdef, state, start_step, data


def _saved_pipeline_seed(cfg: Config, layout: DataLayout | None) -> int:
    """The seed a step's pipeline was built from: the one its ``DataLayout`` records, else the
    config's ``data.shuffle_seed`` (a checkpoint from before ``data_meta/``, or no layout)."""
    if layout is None or layout.pipeline_seed is None:
        return cfg.data.shuffle_seed
    return layout.pipeline_seed


def _restarted_data(cfg: Config, step: int, layout: DataLayout, log) -> _TrainData:
    """A fresh pipeline for this run's processes when ``step``'s data position was saved by
    another number of processes (each process's shard differs): reseeded from (its seed,
    step), so it does not replay the run's first batches; one warning line."""
    data = _TrainData(cfg, data_lib.restart_seed(_saved_pipeline_seed(cfg, layout), step))
    if jax.process_index() == 0:
        log(f"warning: the data position of step {step} cannot carry over (saved by "
            f"{layout.process_count} process(es), now {jax.process_count()}): the input pipeline "
            f"restarts with pipeline seed {data.seed}, so the data order differs from an "
            f"uninterrupted run from here on")
    return data


def _step_loop(cfg: Config, mesh, fns: TrainFns, state, start_step: int, data: _TrainData,
               ckpt: Checkpointer, step_log: "_StepLog", stopper: Stopper,
               profiler: StepProfiler, log):
    """Runs steps until num_steps or a stop; returns (state, final step, why it stopped early
    or None). Every checkpoint it saved is committed when it returns (each one's "saved" line
    follows its commit); a save that failed raises ``CheckpointError`` at the step after orbax
    gave up on it."""
    tcfg = cfg.train
    graphdef, data_sharding = fns.graphdef, sharding_lib.batch_sharding(mesh)
    step, why_stop = start_step, None

    def say_committed(steps):
        for s in steps:
            step_log.say(f"checkpoint: step {s} saved to {ckpt.directory}")

    while step < tcfg.num_steps and why_stop is None:
        batch = sharding_lib.global_batch(next(data.iterator), data_sharding)
        profiler.before_step(step + 1)
        state, dev_metrics = fns.steps[step_log.logs(step + 1)](state, batch)
        step += 1
        profiler.after_step(step, dev_metrics)
        step_log.record(step, dev_metrics)
        step_log.check_writes()  # a failed write of the logs (a full disk) stops the run here
        with stopper.commit():
            say_committed(ckpt.poll())  # a background save that failed stops the run here
        why_stop = stopper.after_step()
        at_eval = tcfg.eval_every and step % tcfg.eval_every == 0
        save_now = step % tcfg.save_every == 0 or step == tcfg.num_steps or why_stop is not None
        if save_now or at_eval:
            step_log.flush()  # check this step's loss before saving it
        if save_now:
            step_log.sync()  # a resume from this step finds every step up to it logged
            with stopper.commit():
                ckpt.save(step, state, data.iterator, data.seed)
                say_committed(ckpt.poll())
        if at_eval and step != tcfg.num_steps:
            step_log.write_eval(step, _evaluate(cfg, graphdef, state))
    step_log.flush()
    with stopper.commit():
        say_committed(ckpt.wait())  # the last save, committed before the final eval
    return state, step, why_stop


def _evaluate(cfg: Config, graphdef, state, should_stop=None) -> dict[str, Any] | None:
    model = nnx.merge(graphdef, state)[0]
    return evaluate_model(model, cfg, max_batches=cfg.train.eval_batches, should_stop=should_stop)


def _final_eval(cfg: Config, graphdef, state, step: int, step_log: "_StepLog",
                stopper: Stopper) -> dict[str, Any] | None:
    """The final eval's metrics, logged; None if a signal stopped it (a single process stops
    at once; several finish it, since each batch is a collective)."""
    should_stop = stopper.requested if jax.process_count() == 1 else None
    metrics = _evaluate(cfg, graphdef, state, should_stop)
    if metrics is None:
        return None
    step_log.write_eval(step, metrics)
    step_log.close_progress()  # the eval line below starts on a line of its own
    step_log.say(f"final eval ({cfg.data.eval_split}): loss {metrics['loss']:.4f} "
                 f"ppl {format_perplexity(metrics['perplexity'])} "
                 f"bpb {metrics['bits_per_byte']:.4f}")
    return metrics


# -- logging -------------------------------------------------------------------------------

class _StepLog:
    """Each step's metrics: read one step late (the host never waits for the step it just
    launched), checked for divergence, and every ``log_every`` steps written to the run's
    metrics log, the progress bar or the ``log`` function."""

    def __init__(self, cfg: Config, run: RunDir, start_step: int, log, *, enabled: bool):
        self.tcfg = cfg.train
        self.tokens_per_step = cfg.train.batch_size * cfg.data.seq_len
        self.log, self.enabled = log, enabled
        self.writer = MetricsWriter(run.metrics_path, tensorboard_dir=run.tensorboard_dir,
                                    resume_step=start_step or None, enabled=enabled, warn=log)
        self.progress = _progress_bar(cfg.train, start_step, enabled=enabled and cfg.train.progress)
        self.losses: dict[int, float] = {}
        self.last_metrics: dict[str, Any] = {}
        self._pending = None  # (step, device metrics) not read yet
        self._t_last, self._steps_since_log = time.perf_counter(), 0

    def logs(self, step: int) -> bool:
        """Whether ``step`` is logged (its step then computes the logit statistics)."""
        return _logs(self.tcfg, step)

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
        _check_finite(step, host)
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

    def check_writes(self) -> None:
        """Raises ``WriteFailed`` if a write of the logs in the background failed."""
        self.writer.check()

    def write_eval(self, step: int, metrics: dict[str, Any]) -> None:
        self.writer.write(step, metrics, prefix="eval/")

    def sync(self) -> None:
        """Puts every record written so far on disk (``MetricsWriter.flush``)."""
        self.writer.flush()

    def finished_before(self) -> bool:
        """Whether the kept log already holds this run's final eval (a rerun of a finished run)."""
        return self.writer.has_record(self.tcfg.num_steps, "eval/loss")

    def say(self, message: str) -> None:
        """A log line that does not break the progress bar."""
        if not self.enabled:
            return
        if self.progress is not None:
            self.progress.write(message)
        else:
            self.log(message)

    def close_progress(self) -> None:
        if self.progress is not None:
            self.progress.close()
            self.progress = None

    def close(self) -> None:
        self.close_progress()
        self.writer.close()


def _logs(tcfg, step: int) -> bool:
    """Whether training step ``step`` (1-based) is logged: every ``log_every``-th and the last."""
    return step % tcfg.log_every == 0 or step == tcfg.num_steps


def _to_host(metrics: dict) -> dict[str, Any]:
    host = jax.device_get(metrics)
    out = {k: float(v) for k, v in host.items() if k not in STATS_KEYS}
    if STATS_KEYS[0] in host:
        out.update(logit_norm_summary(host["attn_max_abs_logit"], host["lm_head_max_abs_logit"]))
    return out


def _check_finite(step: int, metrics: dict[str, Any]) -> None:
    """Raises ``TrainingDiverged`` (``train`` adds the newest checkpoint on disk to it)."""
    bad = [k for k in ("loss", "grad_norm") if not math.isfinite(metrics[k])]
    if bad:
        logit = (f", max_abs_logit={metrics['max_abs_logit']}" if "max_abs_logit" in metrics
                 else "")
        raise TrainingDiverged(
            f"training diverged at step {step}: non-finite {', '.join(bad)} "
            f"(loss={metrics['loss']}, grad_norm={metrics['grad_norm']}{logit})")


def _progress_bar(tcfg, start_step: int, enabled: bool):
    """A tqdm bar on a terminal; elsewhere (logs, CI) None, and the loop prints plain lines."""
    if not enabled or not sys.stderr.isatty():
        return None
    from tqdm.auto import tqdm
    return tqdm(total=tcfg.num_steps, initial=start_step, unit="step", dynamic_ncols=True,
                mininterval=1.0)
