"""The run directory: the one place that knows what a training run writes, and where.

Layout of ``<workdir>`` (``train.py --workdir``, ``eval.py --checkpoint``)::

    config.json                       the resolved Config; fixes the run's identity
    checkpoints/<step>/               orbax: state/ checksums/ data/ data_meta/ (ls_jax.training.checkpoint)
    metrics.jsonl                     one JSON record per logged step (see ls_jax.training.metrics)
    metrics.jsonl.old                 the log of an earlier run that was started over
    tensorboard/                      the same numbers as TensorBoard event files
    tensorboard/plugins/profile/      JAX profiler traces of train.profile_steps (ls_jax.training.profiler)
    eval_step<S>_<split>_T<T>_B<B>_<all|first<K>>[_o<hash>].json   eval.py's results, one file
                                      per evaluation (<hash>: of its overrides)
    status.json                       the state of a run driven by an experiment
    library.log                       the log records of the libraries (orbax, grain, asyncio, jax)
    .lock                             held (flock) by the training run using the directory
    damaged_checkpoints/<step>/       checkpoints that failed verification, moved aside (kept)

Every other module asks a ``RunDir`` for these paths instead of joining names itself.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
from typing import Any, Callable, Iterator

from ls_jax.config import Config

CONFIG_FILE = "config.json"
CHECKPOINT_SUBDIR = "checkpoints"
METRICS_FILE = "metrics.jsonl"
TENSORBOARD_SUBDIR = "tensorboard"
STATUS_FILE = "status.json"
LOCK_FILE = ".lock"
DAMAGED_SUBDIR = "damaged_checkpoints"
LIBRARY_LOG_FILE = "library.log"

# Fields that do not change what a run computes: they may change when a run resumes (each
# change is logged). Every other field fixes the run's identity. (num_steps is here so a run can
# be extended; with train.decay_steps=None the decay follows it, which its log line says.)
NON_IDENTITY_FIELDS = {
    "train": ("num_steps", "log_every", "eval_every", "eval_batches", "save_every",
              "keep_checkpoints", "async_checkpoints", "progress", "profile_steps"),
}


class WorkdirLocked(RuntimeError):
    """Another live process is training in the same run directory."""


class WriteFailed(OSError):
    """A file of the run could not be written (a full disk, permissions); the message names the
    file and what to do."""


_REMEDY = {
    errno.ENOSPC: "free space on its disk",
    errno.EDQUOT: "free space within your disk quota",
    errno.EFBIG: "raise the file-size limit (ulimit -f)",
    errno.EACCES: "make it writable",
    errno.EPERM: "make it writable",
    errno.EROFS: "use a writable filesystem",
    errno.ENOENT: "create its directory",
}


def remedy(err: int | None) -> str:
    """What to do about a failed write with errno ``err``."""
    return _REMEDY.get(err, "fix the cause")


def write_failed(path: str, e: OSError) -> WriteFailed:
    """The one-line error for a failed write of ``path``: the file, the cause, what to do."""
    return WriteFailed(f"could not write {path} ({e.strerror or e}); {remedy(e.errno)}, then "
                       f"rerun the same command")


def write_atomically(path: str, text: str) -> None:
    """``path`` holds ``text`` or what it held before, never a part (a temporary file, renamed);
    a failed write raises ``WriteFailed`` and leaves no temporary file."""
    tmp = path + ".tmp"
    try:
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise write_failed(path, e) from e


class RunDir:
    """Paths and identity of one run directory. Creating the object touches nothing on disk."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)

    def __repr__(self) -> str:
        return f"RunDir({self.path!r})"

    # -- paths ---------------------------------------------------------------------------------
    @property
    def config_path(self) -> str:
        return os.path.join(self.path, CONFIG_FILE)

    @property
    def checkpoint_dir(self) -> str:
        """Absolute (orbax requires it)."""
        return os.path.join(os.path.abspath(self.path), CHECKPOINT_SUBDIR)

    @property
    def metrics_path(self) -> str:
        return os.path.join(self.path, METRICS_FILE)

    @property
    def tensorboard_dir(self) -> str:
        return os.path.join(self.path, TENSORBOARD_SUBDIR)

    @property
    def status_path(self) -> str:
        return os.path.join(self.path, STATUS_FILE)

    @property
    def lock_path(self) -> str:
        return os.path.join(self.path, LOCK_FILE)

    @property
    def damaged_checkpoint_dir(self) -> str:
        return os.path.join(os.path.abspath(self.path), DAMAGED_SUBDIR)

    def checkpoint_steps(self) -> list[int]:
        """The steps whose checkpoints are committed on disk (an unfinished save's directory
        carries orbax's tmp suffix, never a bare step number)."""
        root = self.checkpoint_dir
        if not os.path.isdir(root):
            return []
        return sorted(int(n) for n in os.listdir(root)
                      if n.isdigit() and os.path.isdir(os.path.join(root, n)))

    @property
    def library_log_path(self) -> str:
        return os.path.join(self.path, LIBRARY_LOG_FILE)

    def eval_path(self, step: int, split: str, seq_len: int, batch_size: int,
                  max_batches: int | None, overrides: list[str] | tuple[str, ...] = ()) -> str:
        """One name per evaluation: what decides its numbers (the step, split, length, batch
        size, how many batches, and the overrides, as a short hash) is in the name, so no
        evaluation overwrites another."""
        batches = "all" if max_batches is None else f"first{max_batches}"
        name = f"eval_step{step}_{split}_T{seq_len}_B{batch_size}_{batches}"
        if overrides:
            name += "_o" + hashlib.sha256(json.dumps(list(overrides)).encode()).hexdigest()[:8]
        return os.path.join(self.path, name + ".json")

    # -- config.json: the run's identity ---------------------------------------------------------
    def check_config(self, cfg: Config, log: Callable[[str], None] = print) -> None:
        """Checks ``cfg`` against the config the directory already holds (if any); writes
        nothing. Changes to ``NON_IDENTITY_FIELDS`` are logged, one line each; any other change
        raises ``ValueError`` with the diff (no silent mixing of two runs in one directory)."""
        if not os.path.exists(self.config_path):
            return
        old, new = self._read_config_dict(), cfg.to_dict()
        old.pop("mesh", None)  # the mesh is not part of a run's identity: resume on another
        new.pop("mesh", None)
        if old == new:
            return
        refused, allowed = [], []
        if old.get("name") != new["name"]:
            refused.append(f"name: {old.get('name')!r} -> {new['name']!r}")
        for sec in ("model", "data", "train"):
            for k, v in new[sec].items():
                was = old.get(sec, {}).get(k)
                if was != v:
                    change = f"{sec}.{k}: {was!r} -> {v!r}"
                    (allowed if k in NON_IDENTITY_FIELDS.get(sec, ()) else refused).append(change)
        if refused:
            raise ValueError(
                f"workdir: {self.path} holds a run with a different config ({'; '.join(refused)}); "
                f"use a new workdir or the same config to resume")
        for change in allowed:
            if change.startswith("train.num_steps:") and new["train"].get("decay_steps") is None:
                log(f"resume: {change} (the learning-rate decay ends at num_steps when "
                    f"train.decay_steps is None: the steps from here on follow the new schedule)")
            else:
                log(f"resume: {change} (does not change what is computed)")

    def write_config(self, cfg: Config) -> None:
        """Saves the resolved config (after ``check_config`` and every other check passed, so a
        run that failed to start leaves no identity behind)."""
        os.makedirs(self.path, exist_ok=True)
        text = cfg.to_json()
        if os.path.exists(self.config_path):
            with open(self.config_path) as f:
                if f.read() == text:
                    return
        write_atomically(self.config_path, text)

    def write_or_check_config(self, cfg: Config, log: Callable[[str], None] = print) -> None:
        """``check_config`` then ``write_config``."""
        self.check_config(cfg, log)
        self.write_config(cfg)

    def _read_config_dict(self) -> dict:
        try:
            with open(self.config_path) as f:
                d = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"config: {self.config_path} is not valid JSON ({e}); restore it or "
                             f"use a new workdir") from None
        if not isinstance(d, dict):
            raise ValueError(f"config: expected a JSON object in {self.config_path}, got "
                             f"{type(d).__name__}")
        return d

    def load_config(self) -> Config:
        if not os.path.exists(self.config_path):
            raise FileNotFoundError(
                f"checkpoint: expected a run directory with {CONFIG_FILE} (written by train.py), "
                f"but {self.config_path} does not exist")
        d = self._read_config_dict()
        try:
            return Config.from_dict(d)
        except (ValueError, TypeError) as e:
            raise ValueError(f"config: {self.config_path}: {e}") from None

    # -- the lock ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """Holds an exclusive ``flock`` on ``.lock`` while the block runs; a second holder gets
        ``WorkdirLocked``. The OS releases the lock when the process dies (even ``kill -9``),
        so a killed run never leaves the directory locked."""
        os.makedirs(self.path, exist_ok=True)
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                raise WorkdirLocked(
                    f"workdir: {self.path} is in use by another training run (pid {holder}); "
                    f"wait for it to finish or use another workdir") from None
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(os.getpid()).encode(), 0)
            try:
                yield
            finally:
                os.ftruncate(fd, 0)
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    # -- status.json ------------------------------------------------------------------------------
    def read_status(self) -> dict[str, Any] | None:
        """The last status written, or None if there is none."""
        if not os.path.exists(self.status_path):
            return None
        with open(self.status_path) as f:
            return json.load(f)

    def write_status(self, status: dict[str, Any]) -> None:
        os.makedirs(self.path, exist_ok=True)
        write_atomically(self.status_path, json.dumps(status, indent=2))
