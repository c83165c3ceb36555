"""The run directory: the one place that knows what a training run writes, and where.

Layout of ``<workdir>`` (``train.py --workdir``, ``eval.py --checkpoint``)::

    config.json                       the resolved Config; fixes the run's identity
    checkpoints/<step>/               orbax: {state/, data/} (see ls_jax.checkpoint)
    metrics.jsonl                     one JSON record per logged step (see ls_jax.metrics)
    metrics.jsonl.old                 the log of an earlier run that was started over
    tensorboard/                      the same numbers as TensorBoard event files
    tensorboard/plugins/profile/      JAX profiler traces of train.profile_steps (ls_jax.profiler)
    eval_step<S>_<split>_T<T>.json    eval.py's results
    status.json                       the state of a run driven by an experiment

Every other module asks a ``RunDir`` for these paths instead of joining names itself.
"""

from __future__ import annotations

import json
import os
from typing import Any

from ls_jax.config import Config

CONFIG_FILE = "config.json"
CHECKPOINT_SUBDIR = "checkpoints"
METRICS_FILE = "metrics.jsonl"
TENSORBOARD_SUBDIR = "tensorboard"
STATUS_FILE = "status.json"


def _write_atomically(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


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

    def eval_path(self, step: int, split: str, seq_len: int) -> str:
        return os.path.join(self.path, f"eval_step{step}_{split}_T{seq_len}.json")

    # -- config.json: the run's identity ---------------------------------------------------------
    def write_or_check_config(self, cfg: Config) -> None:
        """Saves the resolved config; a directory that already holds one must hold the same
        config (no silent mixing of two runs in one directory)."""
        os.makedirs(self.path, exist_ok=True)
        if not os.path.exists(self.config_path):
            _write_atomically(self.config_path, cfg.to_json())
            return
        with open(self.config_path) as f:
            old = json.load(f)
        new = cfg.to_dict()
        if old == new:
            return
        diffs = [f"{sec}.{k}: {old.get(sec, {}).get(k)!r} -> {v!r}"
                 for sec in ("model", "data", "train") for k, v in new[sec].items()
                 if old.get(sec, {}).get(k) != v]
        if old.get("name") != new["name"]:
            diffs.insert(0, f"name: {old.get('name')!r} -> {new['name']!r}")
        raise ValueError(
            f"workdir: {self.path} holds a run with a different config ({'; '.join(diffs)}); "
            f"use a new workdir or the same config to resume")

    def load_config(self) -> Config:
        if not os.path.exists(self.config_path):
            raise FileNotFoundError(
                f"checkpoint: expected a run directory with {CONFIG_FILE} (written by train.py), "
                f"but {self.config_path} does not exist")
        with open(self.config_path) as f:
            return Config.from_dict(json.load(f))

    # -- status.json ------------------------------------------------------------------------------
    def read_status(self) -> dict[str, Any] | None:
        """The last status written, or None if there is none."""
        if not os.path.exists(self.status_path):
            return None
        with open(self.status_path) as f:
            return json.load(f)

    def write_status(self, status: dict[str, Any]) -> None:
        os.makedirs(self.path, exist_ok=True)
        _write_atomically(self.status_path, json.dumps(status, indent=2))
