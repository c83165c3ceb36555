"""Failure paths (issues 11 and 36): a failed start leaves no identity behind, the workdir lock,
damaged checkpoints fall back quietly, failed saves stop the run within a step and never follow a
"saved" line, TensorBoard keeps the resumed step, a finished run is not evaluated twice, one-line
CLI errors, non-identity fields may change on resume, torn log records and full disks, and
SIGTERM / SIGINT at every moment of a real train.py process."""

import gc
import logging
import os
import signal
import struct
import subprocess
import sys
import textwrap
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

grain = pytest.importorskip("grain", reason="the training loop needs the [train] extra")

import ls_jax.training.metrics as metrics_lib
import ls_jax.training.train as train_lib
from ls_jax.training.checkpoint import CheckpointError, Checkpointer
from ls_jax.configs import get_config
from ls_jax.configs.cli import eval_main, train_main
from ls_jax.training.metrics import read_jsonl, send_library_logs_to
from ls_jax.training.rundir import NON_IDENTITY_FIELDS, RunDir, WorkdirLocked
from ls_jax.training.train import train

from tests.test_train import MICRO, micro_config, quiet

GRAIN_HANDLER = grain.checkpoint.CheckpointSave  # registered with grain's CheckpointHandler
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = open(os.path.join(ROOT, "docs", "training.md")).read()


# -- helpers ----------------------------------------------------------------------------------

def tiny_state(offset=0.0):
    return {"w": jnp.arange(4096, dtype=jnp.float32) / 7 + offset,
            "mu": jnp.full((64, 64), 1.0 + offset, jnp.float32), "count": jnp.int32(3)}


def abstract_of(state):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)


def largest_data_file(step_dir):
    files = [os.path.join(r, f) for r, _, fs in os.walk(os.path.join(step_dir, "state"))
             for f in fs if "ocdbt.process" in r and os.sep + "d" in r]
    return max(files, key=os.path.getsize)


def tensorboard_scalars(tb_dir):
    """{tag: {step: value}} as TensorBoard shows it: events are read file by file (oldest
    first); a SessionLog START at step s discards the earlier events with step >= s."""
    from tensorboardX.proto import event_pb2
    events = []
    for name in sorted(os.listdir(tb_dir)):
        with open(os.path.join(tb_dir, name), "rb") as f:
            data = f.read()
        pos = 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos:pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + length])
            pos += 12 + length + 4
            if event.HasField("session_log") and event.session_log.status == event.session_log.START:
                events = [e for e in events if e[1] < event.step]
            for value in event.summary.value:
                events.append((value.tag, event.step, value.simple_value))
    out = {}
    for tag, step, value in events:
        out.setdefault(tag, {})[step] = value
    return out


pytestmark = pytest.mark.usefixtures("cli_logging")  # conftest.py: undoes the CLI's log routing


class FakeBar:
    """Stands in for tqdm: records what was written through it and when it was closed."""

    def __init__(self, events):
        self.events = events

    def update(self, n):
        pass

    def set_postfix(self, **kw):
        pass

    def write(self, message):
        self.events.append(("bar", message))

    def close(self):
        self.events.append(("bar-closed", None))


# -- item 1 + 5 + 8 + 3 + issue 12: one run directory through its life ------------------------

@pytest.mark.slow
def test_run_directory_lifecycle(tmp_path, monkeypatch, capsys):
    run = str(tmp_path / "run")
    # a failed start (no such files) leaves no config.json: the corrected command is not refused
    with pytest.raises(FileNotFoundError, match="no files match the glob"):
        train(micro_config("data.source=text:/nomatch/*.txt"), run, log=print)
    assert not os.path.exists(os.path.join(run, "config.json"))

    cfg = micro_config("train.num_steps=4", "train.save_every=2")
    train(cfg, run, stop_after_steps=2, log=print)

    # resume with a changed logging cadence (a non-identity field): allowed, logged, written
    events = []
    monkeypatch.setattr(train_lib, "_progress_bar", lambda *a, **k: FakeBar(events))
    cfg2 = micro_config("train.num_steps=4", "train.save_every=2", "train.log_every=2")
    second = train(cfg2, run, log=lambda m: events.append(("log", m)))
    assert second.start_step == 2 and second.final_step == 4
    assert ("log", "resume: train.log_every: 1 -> 2 (does not change what is computed)") in events
    assert RunDir(run).load_config() == cfg2
    # checkpoint lines go through the bar; the final eval line comes after the bar is closed
    assert ("bar", f"checkpoint: step 4 saved to {RunDir(run).checkpoint_dir}") in events
    closed = events.index(("bar-closed", None))
    final = next(i for i, e in enumerate(events) if e[1] and e[1].startswith("final eval"))
    assert closed < final

    # TensorBoard keeps the step the run resumed from (2) and everything else logged
    assert sorted(tensorboard_scalars(os.path.join(run, "tensorboard"))["loss"]) == [1, 2, 4]

    # rerunning the finished run does nothing: no second eval record, logs unchanged
    metrics_before = open(os.path.join(run, "metrics.jsonl")).read()
    messages = []
    third = train(cfg2, run, log=messages.append)
    assert third.eval_metrics is None and third.losses == {}
    assert any("already finished at step 4" in m for m in messages)
    assert open(os.path.join(run, "metrics.jsonl")).read() == metrics_before
    records = read_jsonl(os.path.join(run, "metrics.jsonl"))
    assert [r["step"] for r in records if "eval/loss" in r] == [4]
    assert sorted(tensorboard_scalars(os.path.join(run, "tensorboard"))["loss"]) == [1, 2, 4]

    # an identity field still refuses, with the diff, and nothing is overwritten
    with pytest.raises(ValueError, match=r"different config \(train.lr: 0.002 -> 0.001\)"):
        train(micro_config("train.num_steps=4", "train.save_every=2", "train.log_every=2",
                           "train.lr=1e-3"), run, log=print)
    assert RunDir(run).load_config() == cfg2

    # random bytes inside the newest checkpoint's data: a warning, a fallback to step 2 (kept
    # damaged step moved aside), and the replayed steps equal the first replay bit for bit
    step4 = os.path.join(RunDir(run).checkpoint_dir, "4")
    path = largest_data_file(step4)
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.seek(size // 4)
        f.write(np.random.default_rng(0).bytes(size // 2))
    messages = []
    fourth = train(cfg2, run, log=messages.append)
    warning = [m for m in messages if m.startswith("warning:")]
    assert len(warning) == 1 and "step 4" in warning[0] and "resuming from step 2" in warning[0]
    assert fourth.start_step == 2 and fourth.losses == second.losses
    assert os.path.isdir(os.path.join(run, "damaged_checkpoints", "4", "state"))

    # eval.py whose JSON cannot be written (as in a read-only run directory): numbers printed,
    # then one error line, non-zero exit
    capsys.readouterr()
    out_path = str(tmp_path / "no_such_dir" / "e.json")
    assert eval_main(["--checkpoint", run, "--max-batches", "1", "--output", out_path]) == 2
    captured = capsys.readouterr()
    assert "perplexity" in captured.out
    assert captured.err.count("\n") == 1 and f"could not write {out_path}" in captured.err


# -- item 2: both splits before step 1 ----------------------------------------------------------

def test_a_too_small_eval_split_stops_before_step_one(tmp_path, monkeypatch):
    text = tmp_path / "one.txt"
    text.write_text("hello world\n" * 300)  # 3600 bytes: 5 % validation < one 8 x 65 batch
    monkeypatch.setattr(train_lib, "_step_loop", lambda *a, **k: pytest.fail("stepped"))
    with pytest.raises(ValueError, match=r"data.eval_split: 'validation' of .* less than one batch"):
        train(micro_config(f"data.source=text:{text}"), str(tmp_path / "run"), log=print)
    assert not os.path.exists(tmp_path / "run" / "config.json")


# -- item 3: verified restore and fallback (the real orbax save/restore) -------------------------

@pytest.mark.parametrize("damage", ["random_bytes", "truncated", "non_finite"])
def test_a_damaged_latest_checkpoint_falls_back(tmp_path, damage):
    ckpt = Checkpointer(str(tmp_path), async_save=False)
    ckpt.save(2, tiny_state())
    newest = tiny_state(1.0)
    if damage == "non_finite":  # saved as such (e.g. a bug): the finite check catches it
        newest["mu"] = newest["mu"].at[3, 5].set(jnp.nan)
    ckpt.save(4, newest)
    ckpt.close()
    path = largest_data_file(os.path.join(tmp_path, "checkpoints", "4"))
    size = os.path.getsize(path)
    if damage == "random_bytes":
        with open(path, "r+b") as f:
            f.seek(size // 4)
            f.write(np.random.default_rng(1).bytes(size // 2))
    elif damage == "truncated":
        os.truncate(path, size // 3)

    ckpt = Checkpointer(str(tmp_path))
    with pytest.raises(CheckpointError, match="step 4 .*(damaged|could not be restored)"):
        ckpt.restore(4, abstract_of(newest))
    messages = []
    step, state = ckpt.restore_latest_intact(abstract_of(newest), log=messages.append)
    assert step == 2
    np.testing.assert_array_equal(state["w"], np.asarray(tiny_state()["w"]))  # what was saved
    assert len(messages) == 1 and messages[0].startswith("warning: checkpoint: step 4 is damaged")
    assert ckpt.all_steps() == [2]
    ckpt.close()
    assert os.path.exists(os.path.join(tmp_path, "damaged_checkpoints", "4"))  # kept


def test_no_intact_checkpoint_is_an_error_and_moves_nothing(tmp_path):
    ckpt = Checkpointer(str(tmp_path), async_save=False)
    ckpt.save(2, tiny_state())
    ckpt.close()
    os.truncate(largest_data_file(os.path.join(tmp_path, "checkpoints", "2")), 10)
    ckpt = Checkpointer(str(tmp_path))
    with pytest.raises(CheckpointError, match=r"no intact checkpoint .*steps \[2\]"):
        ckpt.restore_latest_intact(abstract_of(tiny_state()), log=print)
    assert ckpt.all_steps() == [2]
    ckpt.close()


# -- item 4 (and issue 36.2): a failed save stops the run, nothing partial left ------------------

def _fail_grain_saves_from(monkeypatch, nth):
    """grain's iterator writer raises ENOSPC from its ``nth`` call on (a full disk)."""
    from grain._src.python.checkpoint import handler as grain_handler
    real, calls = grain_handler.CheckpointHandler.save, []

    def save(self, directory, item=None, args=None):
        calls.append(directory)
        if len(calls) >= nth:
            raise OSError(28, "No space left on device")
        return real(self, directory, item, args)

    monkeypatch.setattr(grain_handler.CheckpointHandler, "save", save)


@pytest.mark.parametrize("async_save", [True, False])
def test_a_failed_save_raises_one_line_and_leaves_no_tmp(tmp_path, monkeypatch, async_save):
    _fail_grain_saves_from(monkeypatch, 2)
    iterator = iter(grain.MapDataset.source([1, 2, 3]).to_iter_dataset())
    ckpt = Checkpointer(str(tmp_path), async_save=async_save)
    ckpt.save(2, tiny_state(), iterator)
    assert ckpt.wait() == [2]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(CheckpointError, match=r"saving step 4 .* failed \(OSError: \[Errno 28\] "
                                                  r"No space left on device\); the checkpoints left "
                                                  r"there: \[2\]; free space on its disk, then "
                                                  r"rerun the same command to resume from step 2"):
            ckpt.save(4, tiny_state(1.0), iterator)
        gc.collect()  # the writes orbax had prepared were closed, not left to warn here
    assert not [w for w in caught if "never awaited" in str(w.message)]
    ckpt.close()  # reported once; closing again does not raise
    assert sorted(os.listdir(os.path.join(tmp_path, "checkpoints"))) == ["2"]


def test_old_checkpoints_go_only_after_a_newer_one_committed(tmp_path, monkeypatch):
    """keep=1: each commit deletes the step before it; a failed save deletes nothing."""
    ckpt = Checkpointer(str(tmp_path), keep=1, async_save=True)
    for step in (2, 4):
        ckpt.save(step, tiny_state(step))
        assert ckpt.wait() == [step]
        assert ckpt.committed_steps() == [step]
    _fail_grain_saves_from(monkeypatch, 1)
    iterator = iter(grain.MapDataset.source([1, 2, 3]).to_iter_dataset())
    with pytest.raises(CheckpointError, match=r"left there: \[4\]"):
        ckpt.save(6, tiny_state(6), iterator)
    ckpt.close()
    assert sorted(os.listdir(os.path.join(tmp_path, "checkpoints"))) == ["4"]


def test_a_failed_async_save_stops_the_training_run(tmp_path, monkeypatch):
    _fail_grain_saves_from(monkeypatch, 2)
    cfg = micro_config("train.num_steps=12", "train.save_every=2", "train.async_checkpoints=true")
    messages = []
    with pytest.raises(CheckpointError, match="saving step 4 .*No space left on device"):
        train(cfg, str(tmp_path), log=messages.append)
    steps = [r["step"] for r in read_jsonl(os.path.join(tmp_path, "metrics.jsonl")) if "loss" in r]
    assert max(steps) == 4  # the save of step 4 failed as it started
    assert not [m for m in messages if m.startswith("checkpoint: step 4 saved")]
    assert sorted(os.listdir(os.path.join(tmp_path, "checkpoints"))) == ["2"]


def test_a_background_save_that_fails_stops_the_run_at_the_next_step(tmp_path):
    """A file-size limit (as a full disk would) fails orbax's background write of step 2: the
    run stops at the first step after orbax gave up on it (the hook makes that step 3), names
    step 2, prints no "saved" line for it and lists what is left (nothing)."""
    workdir = tmp_path / "run"
    code, out, err = _run_at_moment("save_fails", None, workdir, ["train.num_steps=8"])
    assert code == 1, out + err
    assert err.count("\n") == 1, err  # the orbax and TensorStore errors went to library.log
    assert err.startswith(f"error: checkpoint: saving step 2 to {RunDir(workdir).checkpoint_dir} "
                          f"failed (OSError: [Errno 27] File too large); the checkpoints left "
                          f"there: none; raise the file-size limit"), err
    assert "saved" not in out
    steps = [r["step"] for r in read_jsonl(str(workdir / "metrics.jsonl")) if "loss" in r]
    assert max(steps) <= 3
    assert os.listdir(workdir / "checkpoints") == []  # no partial (tmp) directory either
    assert "OUT_OF_RANGE" in (workdir / "library.log").read_text()


# -- item 6: the workdir lock ---------------------------------------------------------------

def test_a_second_run_in_a_locked_workdir_refuses(tmp_path):
    run = RunDir(tmp_path / "run")
    with run.lock():
        with pytest.raises(WorkdirLocked, match=f"in use by another training run \\(pid {os.getpid()}\\)"):
            with RunDir(tmp_path / "run").lock():
                pass
        with pytest.raises(WorkdirLocked):
            train(micro_config(), run.path, log=print)
        assert train_main(["--workdir", run.path, *MICRO]) == 1
    with run.lock():  # released on exit
        pass


def test_a_killed_run_does_not_leave_the_lock_stuck(tmp_path):
    script = textwrap.dedent(f"""
        import time
        from ls_jax.training.rundir import RunDir
        with RunDir({str(tmp_path)!r}).lock():
            print("locked", flush=True)
            time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    with pytest.raises(WorkdirLocked, match=f"pid {proc.pid}"):
        with RunDir(tmp_path).lock():
            pass
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    with RunDir(tmp_path).lock():
        pass


# -- item 7: one line and a non-zero exit ----------------------------------------------------

def test_train_cli_errors_are_one_line(tmp_path, capsys):
    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / "config.json").write_text("{not json")
    assert train_main(["--workdir", str(garbage), *MICRO]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "config.json is not valid JSON" in err
    assert str(garbage / "config.json") in err and "Traceback" not in err
    with pytest.raises(ValueError, match="not valid JSON"):  # --debug: the exception itself
        train_main(["--debug", "--workdir", str(garbage), *MICRO])
    missing = ["--workdir", str(tmp_path / "m"), *MICRO, "data.source=text:/nomatch/*.txt"]
    assert train_main(missing) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no files match the glob" in err
    assert not os.path.exists(tmp_path / "m" / "config.json")


def test_a_workdir_that_is_a_file_is_one_line_and_left_alone(tmp_path, capsys):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    with pytest.raises(SystemExit) as e:
        train_main(["--workdir", str(a_file), *MICRO])
    assert e.value.code == 2
    assert capsys.readouterr().err == (f"error: --workdir: {a_file} is a file; expected a run "
                                       "directory (a new one, or an earlier run's to resume)\n")
    assert a_file.read_text() == "mine"


# -- issue 12: the non-identity fields --------------------------------------------------------

def test_non_identity_fields_may_change_on_resume(tmp_path):
    run = RunDir(tmp_path)
    cfg = get_config("tiny")
    run.write_config(cfg)
    changed = get_config("tiny", ["train.num_steps=5000", "train.progress=false",
                                  "train.save_every=50", "train.eval_every=100"])
    lines = []
    run.check_config(changed, lines.append)
    assert lines[0] == ("resume: train.num_steps: 600 -> 5000 (the learning-rate decay ends at "
                        "num_steps when train.decay_steps is None: the steps from here on follow "
                        "the new schedule)")
    assert lines[1:] == [
        "resume: train.eval_every: 0 -> 100 (does not change what is computed)",
        "resume: train.save_every: 200 -> 50 (does not change what is computed)",
        "resume: train.progress: True -> False (does not change what is computed)",
    ]
    assert run.load_config() == cfg  # checking writes nothing
    both = get_config("tiny", ["train.log_every=1", "model.window=16", "data.seq_len=128"])
    with pytest.raises(ValueError, match=r"\(model.window: 32 -> 16; data.seq_len: 256 -> 128\)"):
        run.check_config(both, lines.append)
    assert set(NON_IDENTITY_FIELDS) == {"train"}  # model and data fields always fix identity


# -- issue 36.3: SIGTERM and SIGINT at every moment of a real train.py process -----------------

# Runs train.py as __main__ in this process after arranging for the process to signal itself at
# one moment of the run (argv: moment, signal name or -, then train.py's arguments), so each
# case is exact without waiting on output.
MOMENT_DRIVER = textwrap.dedent("""
    import os, runpy, signal, sys, time
    moment, signame = sys.argv[1:3]
    script = sys.argv[3]
    sys.argv = sys.argv[3:]
    sig = getattr(signal, signame, None)

    def fire(times=1):
        for _ in range(times):
            os.kill(os.getpid(), sig)

    if moment == "save_fails":  # a file-size limit: a write past it fails (EFBIG), as on a full disk
        import resource
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (300_000, resource.RLIM_INFINITY))
    if moment == "imports":
        class FireOnJax:  # while train.py imports jax
            def find_spec(self, name, path=None, target=None):
                if name == "jax":
                    sys.meta_path.remove(self)
                    fire()
        sys.meta_path.insert(0, FireOnJax())
    else:
        import ls_jax.training.train as T
        from ls_jax.training.checkpoint import Checkpointer
        real_compile, real_save, real_eval = T.compile_train_fns, Checkpointer.save, T.evaluate_model
        saving = []

        def compile_train_fns(cfg, mesh):
            if moment == "startup":
                fire()
            fns = real_compile(cfg, mesh)
            calls = [0]

            def wrap(step_fn):
                def step(*args):
                    calls[0] += 1
                    if (moment, calls[0]) in (("compile", 1), ("step", 3)):
                        fire()
                    if moment == "save_fails":  # orbax is done with the pending save first
                        while saving and saving[0]._manager.is_saving_in_progress():
                            time.sleep(0.01)
                    return step_fn(*args)
                return step
            fns.steps = {k: wrap(v) for k, v in fns.steps.items()}
            return fns

        def save(self, *args, **kwargs):
            first = not saving
            saving[:] = [self]
            real_save(self, *args, **kwargs)
            if first and moment in ("save", "second_signal"):  # while step 2's save runs
                fire(2 if moment == "second_signal" else 1)

        def evaluate_model(*args, **kwargs):
            if moment == "final_eval":
                fire()
            return real_eval(*args, **kwargs)

        T.compile_train_fns, T.evaluate_model = compile_train_fns, evaluate_model
        Checkpointer.save = save
    runpy.run_path(script, run_name="__main__")
""")
MOMENT_RUN = ["train.num_steps=4", "train.save_every=2", "train.async_checkpoints=true"]


def _run_at_moment(moment, sig, workdir, extra=()):
    """(exit code, stdout, stderr) of ``train.py --config tiny`` on the micro config."""
    cmd = [sys.executable, "-c", MOMENT_DRIVER, moment, sig.name if sig else "-",
           os.path.join(ROOT, "train.py"), "--workdir", str(workdir), *MICRO, *MOMENT_RUN, *extra]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    return proc.returncode, proc.stdout, proc.stderr


# the moments "step" and "final_eval" run in `make test`, the others in `make test-all`
@pytest.mark.parametrize("moment,sig,code,last,saved", [pytest.param(
    *case, id=case[0], marks=[] if case[0] in ("step", "final_eval") else [pytest.mark.slow])
    for case in [
    ("imports", signal.SIGTERM, 0, "stopped (SIGTERM) outside the training loop: nothing to "
                                   "save; rerun the same command to resume", None),
    ("startup", signal.SIGTERM, 0, "stopped before step 1 (SIGTERM, during start-up): nothing "
                                   "new to save; rerun the same command to resume", []),
    ("compile", signal.SIGINT, 0, "stopped at step 1 (SIGINT); checkpoint step 1 is saved in "
                                  "{ckpt}; rerun the same command to resume", [1]),
    ("step", signal.SIGTERM, 0, "stopped at step 3 (SIGTERM); checkpoint step 3 is saved in "
                                "{ckpt}; rerun the same command to resume", [2, 3]),
    ("save", signal.SIGINT, 0, "stopped at step 3 (SIGINT); checkpoint step 3 is saved in "
                               "{ckpt}; rerun the same command to resume", [2, 3]),
    ("final_eval", signal.SIGTERM, 0, "stopped during the final eval (SIGTERM); checkpoint step 4 "
                                      "is saved in {ckpt}; rerun the same command to run the "
                                      "final eval", [2, 4]),
    ("second_signal", signal.SIGINT, 130, "error: stopped at once by a second SIGINT (nothing "
                                          "more was saved); the last checkpoint is step 2 in "
                                          "{ckpt}; rerun the same command to resume", [2]),
]])
def test_a_signal_at_any_moment_ends_with_one_line(tmp_path, moment, sig, code, last, saved):
    """The first signal asks for a stop: exit 0, one line saying what is saved, every written
    checkpoint kept (the final one committed before the final eval). A second one, here while
    step 2's save is in flight, stops at once but waits for that commit."""
    workdir = tmp_path / "run"
    rc, out, err = _run_at_moment(moment, sig, workdir)
    ckpt_dir = RunDir(workdir).checkpoint_dir
    lines = (out + err).strip().splitlines()
    assert rc == code, out + err
    assert lines[-1] == last.format(ckpt=ckpt_dir), out + err
    assert sum("stopped" in line for line in lines) == 1 and "Traceback" not in out + err
    if saved is None:
        assert not workdir.exists()
        return
    assert sorted(os.listdir(ckpt_dir), key=int) == [str(s) for s in saved]  # no unfinished save
    for step in saved[:-1] if moment == "second_signal" else saved:  # each after its commit
        assert f"checkpoint: step {step} saved to {ckpt_dir}" in out
    assert os.path.exists(workdir / "config.json") == bool(saved)  # a start-up stop leaves none
    if moment == "final_eval":  # the rerun runs the final eval of the saved step
        resumed = train(micro_config(*MOMENT_RUN), str(workdir), log=quiet)
        assert resumed.start_step == 4 and resumed.losses == {}
        assert resumed.eval_metrics is not None


# -- issue 36.4: a damaged checkpoint's fallback is quiet; library logs go to a file ------------

def test_a_damaged_checkpoint_fallback_prints_one_short_line(tmp_path, monkeypatch, capfd):
    """state/_METADATA removed: one warning of at most 300 characters, whatever orbax, asyncio
    or TensorStore log (a flood of 500 records here); they and the whole error are in
    library.log."""
    run = str(tmp_path / "run")
    train(micro_config("train.num_steps=4", "train.save_every=2"), run, log=quiet)
    os.remove(os.path.join(run, "checkpoints", "4", "state", "_METADATA"))
    real_restore = Checkpointer._restore

    def flooding_restore(self, step, *args, **kwargs):
        for i in range(500):
            try:
                raise RuntimeError(f"TensorStore read {i} failed")
            except RuntimeError:
                logging.getLogger("asyncio").exception("Task exception was never retrieved")
        return real_restore(self, step, *args, **kwargs)

    monkeypatch.setattr(Checkpointer, "_restore", flooding_restore)
    capfd.readouterr()
    assert train_main(["--workdir", run, *MICRO, "train.num_steps=5", "train.save_every=2"]) == 0
    out, err = capfd.readouterr()
    assert len(err.splitlines()) <= 3, err[:2000]
    assert all(len(line) <= 300 for line in (out + err).splitlines()), out + err
    (warning,) = [line for line in out.splitlines() if line.startswith("warning:")]
    assert warning.startswith("warning: checkpoint: step 4 is damaged (unreadable: ") and \
        warning.endswith(f"moved to {tmp_path}/run/damaged_checkpoints/4, resuming from step 2")
    log = open(os.path.join(run, "library.log")).read()
    assert log.count("Task exception was never retrieved") >= 1000  # two restores, 500 each
    assert "step 4" in log and "Traceback" in log


@pytest.mark.parametrize("debug", [False, True])
def test_library_log_records_go_to_the_log_file_and_with_debug_to_stderr(tmp_path, capsys, debug):
    path = str(tmp_path / "run" / "library.log")
    assert send_library_logs_to(path, echo=debug) == path
    try:
        raise OSError(28, "No space left on device")
    except OSError:
        logging.getLogger("absl").exception("save raised an exception")
    warnings.warn("a library's warning")
    err = capsys.readouterr().err
    log = open(path).read()
    assert "save raised an exception" in log and "Traceback" in log and "a library's warning" in log
    if debug:
        assert "save raised an exception" in err and "Traceback" in err
    else:
        assert err == ""


def test_without_a_log_file_records_stay_on_stderr_one_line_each(tmp_path, capsys):
    assert send_library_logs_to(None) is None
    try:
        raise OSError(28, "No space left on device")
    except OSError:
        logging.getLogger("absl").exception("save raised an exception")
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "save raised an exception" in err


# -- issue 36.1: torn records and full disks ----------------------------------------------------

def test_a_torn_last_record_is_repaired_on_resume(tmp_path):
    """A write cut short (a full disk, a kill) leaves a partial last record in metrics.jsonl and
    the TensorBoard events: the resume removes both with one warning and goes on."""
    cfg = micro_config("train.num_steps=4", "train.save_every=2")
    run = str(tmp_path / "run")
    train(cfg, run, stop_after_steps=2, log=quiet)
    metrics = os.path.join(run, "metrics.jsonl")
    with open(metrics, "a") as f:
        f.write('{"step": 3, "loss": 4.2, "grad_n')
    (events,) = [os.path.join(run, "tensorboard", n) for n in os.listdir(os.path.join(run, "tensorboard"))]
    with open(events, "ab") as f:
        f.write(struct.pack("<Q", 100) + b"\0\0\0\0" + b"partial")
    assert [r["step"] for r in read_jsonl(metrics)] == [1, 2]  # the partial record left out
    messages = []
    resumed = train(cfg, run, log=messages.append)
    warnings_ = [m for m in messages if m.startswith("warning:")]
    assert len(warnings_) == 1 and metrics in warnings_[0] and events in warnings_[0], messages
    assert resumed.start_step == 2 and resumed.final_step == 4
    assert [r["step"] for r in read_jsonl(metrics) if "loss" in r] == [1, 2, 3, 4]
    assert sorted(tensorboard_scalars(os.path.join(run, "tensorboard"))["loss"]) == [1, 2, 3, 4]
    # a damaged record before the last is not guessed at: one line naming the file and line
    lines = open(metrics).read().splitlines()
    lines[1] = lines[1][:20]
    with open(metrics, "w") as f:
        f.write("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=f"metrics: line 2 of {metrics} is not a JSON record"):
        read_jsonl(metrics)


class _FillsUp:
    """A file on a disk that fills up after ``room`` writes: the next write lands half."""

    def __init__(self, f, room):
        self._f, self._room = f, room

    def write(self, text):
        if self._room == 0:
            self._f.write(text[:len(text) // 2])
            self._f.flush()
            raise OSError(28, "No space left on device")
        self._room -= 1
        return self._f.write(text)

    def __getattr__(self, name):
        return getattr(self._f, name)


def test_a_full_disk_names_the_file_and_the_rerun_goes_on(tmp_path, monkeypatch):
    cfg = micro_config("train.num_steps=6", "train.save_every=2")
    run = str(tmp_path / "run")
    metrics = os.path.join(run, "metrics.jsonl")

    def open_on_a_small_disk(path, mode="r", *args, **kwargs):
        f = open(path, mode, *args, **kwargs)
        return _FillsUp(f, room=3) if path == metrics and "a" in mode else f

    monkeypatch.setattr(metrics_lib, "open", open_on_a_small_disk, raising=False)
    with pytest.raises(OSError, match=rf"^could not write {metrics} \(No space left on device\); "
                                      rf"free space on its disk, then rerun the same command$"):
        train(cfg, run, log=quiet)
    assert not open(metrics).read().endswith("\n")  # step 4's record, cut short
    monkeypatch.undo()
    messages = []
    resumed = train(cfg, run, log=messages.append)
    warnings_ = [m for m in messages if m.startswith("warning:")]
    assert len(warnings_) == 1 and f"partial last record of {metrics} (" in warnings_[0]
    assert resumed.start_step == 2 and resumed.final_step == 6
    assert [r["step"] for r in read_jsonl(metrics) if "loss" in r] == list(range(1, 7))


# -- issue 36.8: the documented error format is what the program prints -------------------------

def test_a_bad_override_is_one_line_as_documented(capsys):
    with pytest.raises(SystemExit) as exit_:
        train_main(["train.lr=nan"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert err == "error: train.lr: expected a finite number, got nan\n"
    assert f"`{err.strip()}`" in DOCS
