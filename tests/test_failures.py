"""Failure paths (issue 11): a failed start leaves no identity behind, the workdir lock, damaged
checkpoints fall back, failed saves stop the run, TensorBoard keeps the resumed step, a finished
run is not evaluated twice, one-line CLI errors, non-identity fields may change on resume."""

import os
import signal
import struct
import subprocess
import sys
import textwrap
import warnings

import grain
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ls_jax.train as train_lib
from ls_jax.checkpoint import CheckpointError, Checkpointer
from ls_jax.configs import get_config
from ls_jax.configs.cli import eval_main, train_main
from ls_jax.metrics import read_jsonl
from ls_jax.rundir import NON_IDENTITY_FIELDS, RunDir, WorkdirLocked
from ls_jax.train import train

from tests.test_train import MICRO, micro_config

GRAIN_HANDLER = grain.checkpoint.CheckpointSave  # registered with grain's CheckpointHandler


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
    assert len(messages) == 1 and messages[0].startswith("warning: checkpoint: step 4")
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


# -- item 4: a failed save stops the run, nothing partial left ----------------------------------

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
    with pytest.raises(CheckpointError, match=r"saving .* failed \(OSError: \[Errno 28\] No space") as e:
        ckpt.save(4, tiny_state(1.0), iterator)
        ckpt.close()  # async: the error may surface only when waiting
    assert "\n" not in str(e.value)
    ckpt.close()  # reported once; closing again does not raise
    assert sorted(os.listdir(os.path.join(tmp_path, "checkpoints"))) == ["2"]


def test_a_failed_async_save_stops_the_training_run(tmp_path, monkeypatch):
    _fail_grain_saves_from(monkeypatch, 2)
    cfg = micro_config("train.num_steps=12", "train.save_every=2", "train.async_checkpoints=true")
    with pytest.raises(CheckpointError, match="No space left on device"):
        train(cfg, str(tmp_path), log=print)
    steps = [r["step"] for r in read_jsonl(os.path.join(tmp_path, "metrics.jsonl")) if "loss" in r]
    assert 4 <= max(steps) <= 5  # the step of the failed save, or the one after
    assert sorted(os.listdir(os.path.join(tmp_path, "checkpoints"))) == ["2"]


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
        from ls_jax.rundir import RunDir
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


# -- item 8: Ctrl-C is treated like SIGTERM -----------------------------------------------------

@pytest.mark.slow
def test_ctrl_c_saves_and_exits_zero(tmp_path, signal_training_run):
    workdir = tmp_path / "run"
    returncode, out = signal_training_run(workdir, MICRO, signal.SIGINT, after_lines=2)
    assert returncode == 0, out
    assert "Traceback" not in out and "KeyboardInterrupt" not in out
    assert "stopping at step" in out and f"signal {int(signal.SIGINT)}" in out
    assert "checkpoint: step" in out and "interrupted" in out
    ckpt = Checkpointer(str(workdir), create=False)
    steps = ckpt.all_steps()
    ckpt.close()
    assert len(steps) == 1 and steps[0] >= 2


def test_library_log_records_lose_their_tracebacks_without_debug(capsys):
    import logging
    from ls_jax.configs.cli import quiet_library_tracebacks
    logger = logging.getLogger("absl")
    handler = logging.StreamHandler(sys.stderr)
    logger.addHandler(handler)
    before = list(logger.filters)
    try:
        with warnings.catch_warnings():
            quiet_library_tracebacks()
            try:
                raise OSError(28, "No space left on device")
            except OSError:
                logger.exception("save raised an exception: [Errno 28] No space left on device")
    finally:
        logger.removeHandler(handler)
        logger.filters[:] = before
    err = capsys.readouterr().err
    assert err == "save raised an exception: [Errno 28] No space left on device\n"
