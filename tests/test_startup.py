"""What a run does before its first step, and how cheaply: the offline corpus listed once, the
first step's compilation overlapped with the state's set-up, no garbage collection while it
builds its programs, the TensorBoard flushes spaced, the compilation cache of train.py
(issue 37)."""

import gc
import os
import pathlib
import signal
import struct
import subprocess
import sys
import threading

import jax
import pytest

pytest.importorskip("grain", reason="the training loop needs the [train] extra")

from ls_jax.training import metrics as metrics_lib
from ls_jax.inputs import sources
from ls_jax.training import train as train_lib
from ls_jax.configs import get_config
from ls_jax.training.train import train, use_compilation_cache
from test_train import MICRO  # the micro config of the training tests

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# -- the offline corpus ---------------------------------------------------------------------

@pytest.fixture
def library(tmp_path, monkeypatch):
    """A standard-library-like tree: nested packages, excluded directories, links of each kind,
    a directory named like a module, hidden files."""
    root = tmp_path / "lib"
    for rel in ("os.py", "json/__init__.py", "json/decoder.py", "email/mime/text.py",
                ".hidden.py", "notes.txt", "site-packages/pkg/mod.py", "a/__pycache__/x.py",
                "a/dist-packages/y.py", "a/b/c/deep.py", "pkg.py/inner.py"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(f"# {rel}\n")
    (root / "linked_file.py").symlink_to(root / "os.py")
    (root / "linked_dir").symlink_to(root / "json", target_is_directory=True)
    (root / "broken.py").symlink_to(root / "missing.py")
    monkeypatch.setattr(sources, "stdlib_root", lambda: root)
    sources._stdlib_files.cache_clear()
    yield root
    sources._stdlib_files.cache_clear()


def test_stdlib_listing_is_pathlibs_and_is_made_once_per_process(library, monkeypatch):
    expected = sorted(p.relative_to(library).as_posix() for p in library.rglob("*.py")
                      if p.is_file() and not {"site-packages", "dist-packages", "__pycache__"}
                      & set(p.relative_to(library).parts))
    scans = []
    real_scandir = os.scandir
    monkeypatch.setattr(sources.os, "scandir", lambda path: scans.append(path) or real_scandir(path))
    splits = {split: sources.load_documents("stdlib", split, validation_percent=50)
              for split in sources.LOCAL_SPLITS for _ in range(2)}
    assert sorted(splits["train"].relative_paths + splits["validation"].relative_paths) == expected
    assert "linked_file.py" in expected and "pkg.py/inner.py" in expected  # what is compared
    directories = len(scans)
    assert directories == len({str(p) for p in scans})  # each directory listed once in all
    sources.load_documents("stdlib", "train", validation_percent=50)
    assert len(scans) == directories


# -- the first step's compilation -----------------------------------------------------------

def test_the_first_step_is_compiled_ahead_once_and_a_start_up_stop_waits_for_it(
        tmp_path, monkeypatch):
    """The executable of the step a run starts with is made in the compile-ahead thread, and
    the step's own call in the main thread finds it there. A SIGTERM during the state's set-up
    stops the run before step 1 (one line, nothing written) once that compilation is done."""
    cfg = get_config("tiny", MICRO + ["train.num_steps=4", "train.save_every=2"])
    run = str(tmp_path / "run")
    compiles = []

    def listener(event, duration, fun_name=None, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration" and fun_name == "jit(train_step)":
            compiles.append(threading.current_thread().name)

    def set_up_signalled(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return set_up(*args, **kwargs)

    set_up = train_lib._restore_or_init
    monkeypatch.setattr(train_lib, "_restore_or_init", set_up_signalled)
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        stopped = train(cfg, run, log=lambda _m: None)
        assert stopped.stop.startswith("stopped before step 1 (SIGTERM, during start-up)")
        assert not os.path.exists(os.path.join(run, "config.json"))
        assert compiles == ["compile-first-step"]
        assert "compile-first-step" not in [t.name for t in threading.enumerate()]
        monkeypatch.setattr(train_lib, "_restore_or_init", set_up)
        compiles.clear()
        result = train(cfg, run, stop_after_steps=1, log=lambda _m: None)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert result.final_step == 1 and compiles == ["compile-first-step"]


def test_set_up_runs_with_the_collector_paused_and_leaves_it_as_found(tmp_path, monkeypatch):
    """No garbage collection while a run builds its programs (from compile_train_fns to the
    first step's compilation); the collector is on again for the steps, stays off for a
    caller that turned it off, and is restored when the set-up fails."""
    cfg = get_config("tiny", MICRO + ["train.num_steps=2"])
    seen = []
    compile_fns, step_loop = train_lib.compile_train_fns, train_lib._step_loop

    def compile_recorded(*args, **kwargs):
        seen.append(("set-up", gc.isenabled()))
        return compile_fns(*args, **kwargs)

    def loop_recorded(*args, **kwargs):
        seen.append(("steps", gc.isenabled()))
        return step_loop(*args, **kwargs)

    monkeypatch.setattr(train_lib, "compile_train_fns", compile_recorded)
    monkeypatch.setattr(train_lib, "_step_loop", loop_recorded)
    assert gc.isenabled()
    train(cfg, str(tmp_path / "on"), stop_after_steps=1, log=lambda _m: None)
    assert seen == [("set-up", False), ("steps", True)] and gc.isenabled()

    seen.clear()
    gc.disable()
    try:
        train(cfg, str(tmp_path / "off"), stop_after_steps=1, log=lambda _m: None)
        assert seen == [("set-up", False), ("steps", False)] and not gc.isenabled()
    finally:
        gc.enable()

    def compile_fails(*args, **kwargs):
        raise ValueError("model.d_model: a set-up error")

    monkeypatch.setattr(train_lib, "compile_train_fns", compile_fails)
    with pytest.raises(ValueError, match="a set-up error"):
        train(cfg, str(tmp_path / "fails"), log=lambda _m: None)
    assert gc.isenabled()


# -- the imports of train.py and eval.py -----------------------------------------------------

_IMPORTS_PROBE = """
import gc, json
from ls_jax.configs import cli
collections = []
gc.callbacks.append(lambda phase, info: phase == "start" and collections.append(info))
frozen = gc.get_freeze_count()
cli._train_extra()
out = {"collections": len(collections), "newly_frozen": gc.get_freeze_count() - frozen,
       "enabled_after": gc.isenabled()}
gc.disable()
cli._train_extra()
out["disabled_stays"] = not gc.isenabled()
print(json.dumps(out))
"""


def test_the_train_extras_imports_run_uncollected_and_frozen_and_leave_gc_as_found():
    import json
    proc = subprocess.run([sys.executable, "-c", _IMPORTS_PROBE], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["collections"] == 0  # no collection walked the imports' objects
    assert out["newly_frozen"] > 100_000  # JAX, Flax, orbax, grain: out of later collections
    assert out["enabled_after"] and out["disabled_stays"]


# -- TensorBoard ----------------------------------------------------------------------------

def _event_steps(tb_dir: str, tag: str) -> list[int]:
    from tensorboardX.proto import event_pb2
    steps = []
    for name in sorted(os.listdir(tb_dir)):
        data = pathlib.Path(tb_dir, name).read_bytes()
        pos = 0
        while pos + 12 <= len(data):
            (length,) = struct.unpack("<Q", data[pos:pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + length])
            pos += 12 + length + 4
            steps += [event.step for v in event.summary.value if v.tag == tag]
    return steps


def test_tensorboard_events_are_synced_off_the_main_thread_and_close_keeps_every_event(
        tmp_path, monkeypatch):
    synced_by = []
    real_fsync = metrics_lib.os.fsync
    monkeypatch.setattr(metrics_lib.os, "fsync", lambda fd: synced_by.append(
        threading.current_thread().name) or real_fsync(fd))
    writer = metrics_lib.MetricsWriter(str(tmp_path / "metrics.jsonl"),
                                       tensorboard_dir=str(tmp_path / "tb"))
    for step in (1, 2, 3, 4, 5):
        writer.write(step, {"loss": 1.0 / step})
    assert [r["step"] for r in metrics_lib.read_jsonl(str(tmp_path / "metrics.jsonl"))] == \
        [1, 2, 3, 4, 5]  # the JSONL log is flushed at every record
    writer.close()
    assert sorted(_event_steps(str(tmp_path / "tb"), "loss")) == [1, 2, 3, 4, 5]
    # the events file is synced by the writer's own thread: a step never waits on the disk
    assert "tensorboard-events" in synced_by
    assert threading.main_thread().name not in synced_by


# -- the compilation cache of train.py -------------------------------------------------------

@pytest.fixture
def jax_cache_config():
    saved = {k: getattr(jax.config, k) for k in ("jax_compilation_cache_dir",
                                                  "jax_enable_compilation_cache")}
    yield
    for k, v in saved.items():
        jax.config.update(k, v)


@pytest.mark.parametrize("env_dir,enabled,xdg,expected", [
    (None, True, "xdg", "{tmp}/xdg/ls-jax/jax"),           # the default: the user's cache
    (None, True, None, "{home}/.cache/ls-jax/jax"),        # no XDG_CACHE_HOME
    ("{tmp}/mine", True, "xdg", "{tmp}/mine"),             # JAX_COMPILATION_CACHE_DIR wins
    ("", True, "xdg", None),                               # ... and empty means none
    (None, False, "xdg", None),                            # JAX_ENABLE_COMPILATION_CACHE=false
])
def test_train_py_caches_compilations_in_the_users_cache_unless_told(
        tmp_path, monkeypatch, jax_cache_config, env_dir, enabled, xdg, expected):
    """JAX reads JAX_COMPILATION_CACHE_DIR / JAX_ENABLE_COMPILATION_CACHE into its config at
    import; this sets the config as the environment would have."""
    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    if xdg is None:
        monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    else:
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / xdg))
    jax.config.update("jax_compilation_cache_dir",
                      None if env_dir is None else env_dir.format(tmp=tmp_path))
    jax.config.update("jax_enable_compilation_cache", enabled)
    used = use_compilation_cache()
    assert used == (None if expected is None else expected.format(tmp=tmp_path, home=home))


# -- bench/startup.py --train ----------------------------------------------------------------

def test_startup_bench_train_refuses_an_unknown_cache_state(tmp_path):
    out = tmp_path / "t.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "startup.py"), "--train",
                           "--cache", "cold,hot", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and not out.exists()
    assert proc.stderr.strip().splitlines()[-1] == (
        "startup.py: error: --cache: expected names from ['off', 'cold', 'warm'], got 'hot'")
