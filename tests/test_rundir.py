"""The run directory: its file names, the config identity check, the status file."""

import json
import os

import pytest

from ls_jax.configs import get_config
from ls_jax.rundir import RunDir


def test_paths_are_the_documented_layout(tmp_path):
    run = RunDir(tmp_path / "r")
    root = str(tmp_path / "r")
    assert run.config_path == os.path.join(root, "config.json")
    assert run.checkpoint_dir == os.path.join(os.path.abspath(root), "checkpoints")
    assert run.metrics_path == os.path.join(root, "metrics.jsonl")
    assert run.tensorboard_dir == os.path.join(root, "tensorboard")
    assert run.status_path == os.path.join(root, "status.json")
    assert run.eval_path(40, "validation", 256) == os.path.join(root, "eval_step40_validation_T256.json")
    assert not os.path.exists(root)  # naming paths creates nothing


def test_config_identity(tmp_path):
    run = RunDir(tmp_path / "r")
    with pytest.raises(FileNotFoundError, match="expected a run directory with config.json"):
        run.load_config()
    cfg = get_config("tiny")
    run.write_or_check_config(cfg)
    assert json.loads(open(run.config_path).read())["train"]["lr"] == cfg.train.lr
    run.write_or_check_config(cfg)  # the same config again: accepted
    assert run.load_config() == cfg
    other = get_config("tiny", ["train.lr=1e-3", "model.window=16"])
    with pytest.raises(ValueError, match=r"different config \(model.window: 32 -> 16; train.lr: 0.002 -> 0.001\)"):
        run.write_or_check_config(other)
    assert run.load_config() == cfg  # nothing overwritten
    assert sorted(os.listdir(run.path)) == ["config.json"]


def test_status_round_trip(tmp_path):
    run = RunDir(tmp_path / "r")
    assert run.read_status() is None
    run.write_status({"state": "finished", "step": 6})
    assert run.read_status() == {"state": "finished", "step": 6}
    assert sorted(os.listdir(run.path)) == ["status.json"]
