"""Failure paths of a real train.py process, faults injected as they happen (issue 51): a disk
that fills while the logs are written (the kernel's ENOSPC on the file's descriptor, or a
small tmpfs filled up), a checkpoint directory that cannot be written, two signals in quick
succession while the main thread is inside a compilation, one signal during a save stalled
in the kernel; and the words of the errors (a checkpoint deleted under its reader, shapes of
another config, a diverged run, an absurd perplexity).

Each run ends within seconds with one ``error:`` line on stderr (no traceback, no "Exception
ignored"), and the same command run again reaches the uninterrupted run's losses bit for bit.
"""

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import jax.numpy as jnp
import pytest

pytest.importorskip("grain", reason="the training loop needs the [train] extra")

import ls_jax.training.train as train_lib
from ls_jax.training.checkpoint import CheckpointError, Checkpointer
from ls_jax.configs.cli import format_eval
from ls_jax.training.evaluate import format_perplexity, perplexity
from ls_jax.training.metrics import MetricsWriter, read_jsonl
from ls_jax.training.rundir import RunDir
from ls_jax.training.state import restore_model
from ls_jax.training.train import TrainingDiverged, train

from tests.test_train import MICRO, micro_config, quiet

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = ["train.num_steps=8", "train.save_every=2", "train.async_checkpoints=true"]
pytestmark = pytest.mark.usefixtures("cli_logging")  # conftest.py: undoes the CLI's log routing

# Runs train.py as __main__ after arranging one fault (argv: fault, then train.py's arguments).
# "full:<file>": once step 2's checkpoint is committed, the file's descriptor is pointed at
# /dev/full (every later write of it gets ENOSPC from the kernel, as on a full disk).
# "fill_disk": then the workdir's filesystem is filled up. "ro_checkpoints": before step 4's
# save (step 2's committed), checkpoints/ is made unwritable (a read-only bind mount for root, whom permissions do not stop; else
# chmod). "two_signals": two SIGINTs 0.05 s apart while the main thread waits in XLA (as in a
# compilation or on a step's results, where the interpreter runs no handler). "stalled_save": step
# 4's save opens a FIFO nobody reads (blocked in the kernel, as on a hung disk), and SIGTERM.
DRIVER = textwrap.dedent("""
    import glob, logging, os, runpy, signal, subprocess, sys, threading, time
    fault = sys.argv[1]
    script = sys.argv[2]
    sys.argv = sys.argv[2:]
    workdir = sys.argv[sys.argv.index("--workdir") + 1]
    import ls_jax.training.train as T

    def fd_of(path):
        for fd in os.listdir("/proc/self/fd"):
            with __import__("contextlib").suppress(OSError):
                if os.readlink(f"/proc/self/fd/{fd}") == os.path.abspath(path):
                    return int(fd)
        raise SystemExit(f"driver: {path} is not open")

    def apply_fault():
        if fault.startswith("full:"):
            which = fault[5:]
            path = {"metrics": os.path.join(workdir, "metrics.jsonl"),
                    "library": os.path.join(workdir, "library.log")}.get(which) or \\
                glob.glob(os.path.join(workdir, "tensorboard", "events.out.tfevents*"))[-1]
            os.dup2(os.open("/dev/full", os.O_WRONLY), fd_of(path))
            if which == "library":  # a library logs something
                logging.getLogger("absl").warning("a library's record")
        elif fault == "fill_disk":
            with open(os.path.join(workdir, "filler"), "wb") as f:
                try:
                    while True:
                        f.write(b"x" * 65536)
                        f.flush()
                except OSError:
                    pass
        elif fault == "ro_checkpoints":
            ckpt = os.path.join(os.path.abspath(workdir), "checkpoints")
            if os.geteuid() == 0:
                subprocess.run(["mount", "--bind", ckpt, ckpt], check=True)
                subprocess.run(["mount", "-o", "remount,ro,bind", ckpt], check=True)
            else:
                os.chmod(ckpt, 0o555)

    real_say = T._StepLog.say

    def say(self, message):
        real_say(self, message)
        if message.startswith("checkpoint: step 2 saved") and fault != "ro_checkpoints":
            apply_fault()

    T._StepLog.say = say
    if fault == "ro_checkpoints":  # before step 4's save, once step 2's is on disk
        from ls_jax.training.checkpoint import Checkpointer
        real_ckpt_save = Checkpointer.save

        def ckpt_save(self, step, *args, **kwargs):
            if step == 4:
                self._manager.wait_until_finished()
                apply_fault()
            return real_ckpt_save(self, step, *args, **kwargs)
        Checkpointer.save = ckpt_save

    def fire_later(sig, delays):
        def run():
            for d in delays:
                time.sleep(d)
                os.kill(os.getpid(), sig)
        threading.Thread(target=run, daemon=True).start()

    if fault == "two_signals":  # at step 3, from another process, 0.05 s apart
        import jax, jax.numpy as jnp
        real_compile = T.compile_train_fns

        @jax.jit
        def long_native_call(x):  # seconds of XLA work the main thread waits on
            return jax.lax.fori_loop(0, 400, lambda i, x: jnp.tanh(x @ x), x)

        def compile_train_fns(cfg, mesh):
            fns = real_compile(cfg, mesh)
            calls = [0]

            def wrap(step_fn):
                def step(*args):
                    calls[0] += 1
                    if calls[0] == 3:
                        x = jnp.full((512, 512), 1e-3)
                        long_native_call(x).block_until_ready()  # compiled first
                        subprocess.Popen(["sh", "-c", f"sleep 0.3; kill -INT {os.getpid()}; "
                                                      f"sleep 0.05; kill -INT {os.getpid()}"])
                        long_native_call(x + 1).block_until_ready()
                    return step_fn(*args)
                return step
            fns.steps = {k: wrap(v) for k, v in fns.steps.items()}
            return fns
        T.compile_train_fns = compile_train_fns
    if fault == "stalled_save":
        from grain._src.python.checkpoint import handler as grain_handler
        real_save = grain_handler.CheckpointHandler.save

        def grain_save(self, directory, item=None, args=None):
            if str(directory).split(os.sep)[-2].startswith("4."):
                os.makedirs(directory, exist_ok=True)
                for name in ("process_0-of-1.json",):
                    os.mkfifo(os.path.join(directory, name))
                fire_later(signal.SIGTERM, [0.5])
            return real_save(self, directory, item, args)
        grain_handler.CheckpointHandler.save = grain_save
    runpy.run_path(script, run_name="__main__")
""")


def _train_py(workdir, fault=None, timeout=240, env=None):
    """(exit code, stdout, stderr, seconds) of ``train.py`` on the micro config."""
    args = [os.path.join(ROOT, "train.py"), "--workdir", str(workdir), *MICRO, *RUN]
    cmd = [sys.executable, "-c", DRIVER, fault, *args] if fault else [sys.executable, *args]
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})
    return proc.returncode, proc.stdout, proc.stderr, time.monotonic() - start


def _losses(workdir):
    records = read_jsonl(os.path.join(workdir, "metrics.jsonl"))
    return ({r["step"]: r["loss"] for r in records if "loss" in r},
            [r["eval/loss"] for r in records if "eval/loss" in r])


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The losses of the run without faults: every step's and the final eval's."""
    workdir = tmp_path_factory.mktemp("uninterrupted") / "run"
    code, out, err, _ = _train_py(workdir)
    assert code == 0, out + err
    return _losses(workdir)


def _one_error_line(err):
    assert err.count("\n") == 1 and err.startswith("error: "), err
    assert "Traceback" not in err and "Exception ignored" not in err, err
    return err.strip()


def _resumes_exactly(workdir, uninterrupted):
    """The same command again finishes (resuming where a checkpoint is left), with the
    uninterrupted run's losses."""
    saved = RunDir(workdir).checkpoint_steps()
    code, out, err, _ = _train_py(workdir)
    assert code == 0, out + err
    assert (f"resumed from {RunDir(workdir).checkpoint_dir} at step {saved[-1]}" in out
            if saved else "resumed" not in out), out
    assert _losses(workdir) == uninterrupted


# -- a full disk while the logs are written -----------------------------------------------------

@pytest.mark.parametrize("which", ["events", "metrics", "library"])
def test_a_full_disk_under_the_logs_stops_in_seconds_with_one_line(tmp_path, which,
                                                                   uninterrupted):
    """TensorBoard's events are written by a thread of ours: its ENOSPC stops the run at the
    next step (the thread never blocks the loop), as a failed write of metrics.jsonl or of
    the library log does."""
    workdir = tmp_path / "run"
    code, out, err, seconds = _train_py(workdir, f"full:{which}")
    assert code == 1, out + err
    line = _one_error_line(err)
    path = {"metrics": os.path.join(workdir, "metrics.jsonl"),
            "library": os.path.abspath(os.path.join(workdir, "library.log"))}.get(
        which, os.path.join(workdir, "tensorboard", "events.out.tfevents."))
    assert line.startswith(f"error: could not write {path}"), line
    assert line.endswith("(No space left on device); free space on its disk, then rerun the "
                         "same command"), line
    _resumes_exactly(workdir, uninterrupted)


@contextlib.contextmanager
def _small_filesystem(path, size):
    """A tmpfs of ``size`` mounted at ``path`` (needs root; skips where it cannot mount)."""
    path.mkdir()
    if os.geteuid() != 0 or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
            capture_output=True).returncode != 0:
        pytest.skip("mounting a small tmpfs needs root")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


@pytest.mark.slow
def test_a_disk_that_fills_up_stops_the_run_and_the_rerun_goes_on(tmp_path, uninterrupted):
    """A real full disk: a 24 MB tmpfs filled after the first checkpoint. Whichever write
    fails first (a log, a checkpoint) ends the run with its one line."""
    with _small_filesystem(tmp_path / "disk", "24m") as disk:
        workdir = disk / "run"
        code, out, err, _ = _train_py(workdir, "fill_disk")
        assert code == 1, out + err
        line = _one_error_line(err)
        assert str(workdir) in line and "No space left on device" in line, line
        os.remove(workdir / "filler")
        _resumes_exactly(workdir, uninterrupted)


# -- a checkpoint directory that cannot be written -------------------------------------------

def test_an_unwritable_checkpoint_directory_fails_the_save_at_once(tmp_path, uninterrupted):
    """The step's directory cannot be made (a read-only checkpoints/): the save fails at once
    with the OS error and the path, not after orbax's timeout."""
    workdir = tmp_path / "run"
    ckpt = RunDir(workdir).checkpoint_dir
    try:
        code, out, err, seconds = _train_py(workdir, "ro_checkpoints", timeout=120)
    finally:
        if os.geteuid() == 0:
            subprocess.run(["umount", ckpt], capture_output=True)
        elif os.path.isdir(ckpt):
            os.chmod(ckpt, 0o755)
    assert code == 1, out + err
    line = _one_error_line(err)
    cause = ("OSError: [Errno 30] Read-only file system" if os.geteuid() == 0 else
             "PermissionError: [Errno 13] Permission denied")
    assert line.startswith(f"error: checkpoint: saving step 4 to {ckpt} failed ({cause}: "
                           f"'{ckpt}/4.orbax-checkpoint-tmp'); the checkpoints left there: [2]; "), line
    assert seconds < 100, seconds  # orbax's own wait is 300 s
    _resumes_exactly(workdir, uninterrupted)


def test_an_unwritable_workdir_is_one_line(tmp_path):
    """Nothing in the run directory can be written (root: a read-only bind mount): the
    library log's file is the first write, and its error is the only line."""
    workdir = tmp_path / "run"
    workdir.mkdir()
    if os.geteuid() == 0:
        if subprocess.run(["mount", "--bind", str(workdir), str(workdir)]).returncode:
            pytest.skip("cannot bind-mount")
        subprocess.run(["mount", "-o", "remount,ro,bind", str(workdir)], check=True)
    else:
        os.chmod(workdir, 0o555)
    try:
        code, out, err, _ = _train_py(workdir, timeout=120)
    finally:
        if os.geteuid() == 0:
            subprocess.run(["umount", str(workdir)], check=True)
        else:
            os.chmod(workdir, 0o755)
    assert code == 1, out + err
    line = _one_error_line(err)
    assert line.startswith(f"error: could not write {workdir.resolve()}/library.log ("), line


# -- signals --------------------------------------------------------------------------------------

@contextlib.contextmanager
def _cpu_load(n=2):
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for p in burners:
            p.kill()
            p.wait()


def test_two_signals_while_the_main_thread_waits_in_native_code_stop_at_once(tmp_path,
                                                                            uninterrupted):
    """Two SIGINTs 0.05 s apart while the main thread waits in XLA (where the interpreter's own
    handler would run once, for both), under CPU load: the second stops the process at once
    with its line; no abort, no traceback."""
    workdir = tmp_path / "run"
    with _cpu_load():
        code, out, err, _ = _train_py(workdir, "two_signals")
    assert code == 130, out + err
    line = _one_error_line(err)
    assert line == (f"error: stopped at once by a second SIGINT (nothing more was saved); the "
                    f"last checkpoint is step 2 in {RunDir(workdir).checkpoint_dir}; rerun the "
                    f"same command to resume"), line
    assert "stopped at step" not in out
    _resumes_exactly(workdir, uninterrupted)


@pytest.mark.slow
def test_a_signal_during_a_stalled_save_stops_the_run(tmp_path, uninterrupted):
    """Step 4's save blocks in the kernel (a FIFO nobody reads: a hung disk) and one SIGTERM
    comes: the run ends once the save wrote nothing for ``STALLED_SAVE_S``, keeping step 2."""
    workdir = tmp_path / "run"
    code, out, err, seconds = _train_py(workdir, "stalled_save", timeout=180)
    assert code == 128 + signal.SIGTERM, out + err
    line = _one_error_line(err)
    assert line.startswith("error: stopped by SIGTERM while a checkpoint save wrote nothing "
                           "for 10 s") and line.endswith(
        f"the last checkpoint is step 2 in {RunDir(workdir).checkpoint_dir}; rerun the same "
        f"command to resume"), line
    _resumes_exactly(workdir, uninterrupted)


# -- the words for the cause ------------------------------------------------------------------

def test_the_tensorboard_thread_reports_a_full_disk_and_never_blocks(tmp_path):
    writer = MetricsWriter(str(tmp_path / "metrics.jsonl"), tensorboard_dir=str(tmp_path / "tb"))
    writer.write(1, {"loss": 1.0})
    writer.flush()
    (events,) = os.listdir(tmp_path / "tb")
    path = str(tmp_path / "tb" / events)
    fd = next(int(f) for f in os.listdir("/proc/self/fd")
              if os.path.realpath(f"/proc/self/fd/{f}") == os.path.realpath(path))
    os.dup2(os.open("/dev/full", os.O_WRONLY), fd)
    with pytest.raises(OSError, match=rf"^could not write {path} \(No space left on device\); "
                                      rf"free space on its disk"):
        for step in range(2, 200):  # never blocks: the thread's error is raised
            writer.write(step, {"loss": 1.0})
            writer.flush()
    writer.close()  # reported once; closing does not raise or wait


def _two_checkpoints(tmp_path):
    ckpt = Checkpointer(str(tmp_path), async_save=False)
    state = {"w": jnp.arange(64, dtype=jnp.float32)}
    for step in (2, 4):
        ckpt.save(step, state)
    ckpt.close()
    return state


@pytest.mark.parametrize("step", [2, None])
def test_a_checkpoint_deleted_under_its_reader_is_named_so(tmp_path, monkeypatch, step):
    """A training run in the directory (its own Checkpointer) deletes the step being read, as
    its keep-last-N does: the reader says so (an explicit step) or reads the newest (None)."""
    state = _two_checkpoints(tmp_path)
    abstract = {"w": jnp.zeros(64, jnp.float32)}
    trainer = Checkpointer(str(tmp_path))
    reader = Checkpointer(str(tmp_path), create=False)
    real = reader._manager.restore
    deleted = []

    def restore_while_pruned(s, *args, **kwargs):
        if not deleted:
            deleted.append(s)
            trainer.save(6, state)
            trainer.wait()
            trainer._manager.delete(s)
        return real(s, *args, **kwargs)

    monkeypatch.setattr(reader._manager, "restore", restore_while_pruned)
    if step is None:  # the latest: read again, the newest now
        assert reader.restore(None, abstract)[0] == 6 and deleted == [4]
    else:
        with pytest.raises(CheckpointError, match=rf"step 2 in {tmp_path}/checkpoints was "
                                                  rf"deleted while it was read .*those there "
                                                  rf"now: \[4, 6\]\); read one of those"):
            reader.restore(step, abstract)
    trainer.close()
    reader.close()


def test_a_checkpoint_of_another_config_is_not_called_damaged(tmp_path):
    """config.json deleted, then another model's command in the directory (or another run's
    config given to eval/sample): the shapes differ; nothing is moved aside."""
    run = str(tmp_path / "run")
    train(micro_config("train.num_steps=2", "train.save_every=2"), run, log=quiet)
    os.remove(os.path.join(run, "config.json"))
    other = micro_config("train.num_steps=4", "train.save_every=2", "model.d_model=32",
                         "model.head_dim=16")
    with pytest.raises(CheckpointError, match=r"step 2 in \S+ does not match the config's model "
                                              r"\(\d+ array\(s\) of other shapes, first .*: saved "
                                              r"\(.*\), the config's \(.*\)\): it was written "
                                              r"with another config"):
        train(other, run, log=quiet)
    assert not os.path.exists(os.path.join(run, "damaged_checkpoints"))
    with pytest.raises(CheckpointError, match="does not match the config's model"):
        restore_model(RunDir(run), None, other)


def test_the_divergence_error_names_the_newest_checkpoint_on_disk(tmp_path, monkeypatch):
    real = train_lib._to_host
    calls = []

    def diverges_at_step_5(metrics):
        host = real(metrics)
        calls.append(None)
        if len(calls) == 5:
            host["loss"] = float("nan")
        return host

    monkeypatch.setattr(train_lib, "_to_host", diverges_at_step_5)
    run = str(tmp_path / "run")
    cfg = micro_config("train.num_steps=8", "train.save_every=4", "train.async_checkpoints=true")
    with pytest.raises(TrainingDiverged) as e:
        train(cfg, run, log=quiet)
    assert RunDir(run).checkpoint_steps() == [4]
    assert str(e.value).startswith("training diverged at step 5: non-finite loss (loss=nan")
    assert str(e.value).endswith(f"; the newest good checkpoint is step 4 in "
                                 f"{RunDir(run).checkpoint_dir}")


@pytest.mark.parametrize("loss,shown", [(2.0, "7.389"), (11.0, "59874.142"),
                                        (100.0, "2.688e+43"), (800.0, "inf"),
                                        (float("inf"), "inf")])
def test_a_perplexity_is_printed_sanely(loss, shown):
    """Fixed-point while it is readable, then 4 significant digits; none (null in the JSON,
    "inf" printed) where exp(loss) overflows: never hundreds of digits."""
    ppl = perplexity(loss)
    assert format_perplexity(ppl) == shown
    assert (ppl is None) == (shown == "inf")
    json.dumps({"perplexity": ppl}, allow_nan=False)  # standard JSON either way
    r = {"workdir": "w", "step": 1, "config": "c", "split": "s", "seq_len": 8, "tokens": 8,
         "batches": 1, "loss": loss, "perplexity": ppl, "bits_per_byte": 1.0,
         "max_abs_logit": 1.0, "lm_head_max_abs_logit": 1.0, "attn_max_abs_logit": [[1.0]]}
    assert f"perplexity {shown}  bits/byte" in format_eval(r)
