"""The run directory: its file names, the config identity check, the status file."""

import json
import os

import pytest

from ls_jax.configs import get_config
from ls_jax.training.rundir import RunDir


def test_paths_are_the_documented_layout(tmp_path):
    run = RunDir(tmp_path / "r")
    root = str(tmp_path / "r")
    assert run.config_path == os.path.join(root, "config.json")
    assert run.checkpoint_dir == os.path.join(os.path.abspath(root), "checkpoints")
    assert run.metrics_path == os.path.join(root, "metrics.jsonl")
    assert run.tensorboard_dir == os.path.join(root, "tensorboard")
    assert run.status_path == os.path.join(root, "status.json")
    assert run.library_log_path == os.path.join(root, "library.log")
    # every setting that changes an evaluation's numbers is in its file name
    names = {run.eval_path(40, "validation", 256, 16, None),
             run.eval_path(40, "validation", 256, 16, 8), run.eval_path(40, "validation", 256, 8, 8),
             run.eval_path(40, "validation", 128, 16, 8), run.eval_path(40, "train", 256, 16, 8),
             run.eval_path(20, "validation", 256, 16, 8),
             run.eval_path(40, "validation", 256, 16, 8, ["data.data_dir=/a"]),
             run.eval_path(40, "validation", 256, 16, 8, ["data.data_dir=/b"])}
    assert len(names) == 8 and all(os.path.dirname(n) == root for n in names)
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


def test_a_failed_atomic_write_names_the_file_and_keeps_the_old_content(tmp_path, monkeypatch):
    run = RunDir(tmp_path / "r")
    run.write_status({"state": "running", "step": 2})
    real_replace = os.replace

    def full_disk(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full_disk)
    with pytest.raises(OSError, match=rf"could not write {run.status_path} \(No space left on "
                                      rf"device\); free space on its disk, then rerun"):
        run.write_status({"state": "finished", "step": 6})
    monkeypatch.setattr(os, "replace", real_replace)
    assert run.read_status() == {"state": "running", "step": 2}
    assert sorted(os.listdir(run.path)) == ["status.json"]  # no temporary file left


def test_checkpoint_steps_are_the_committed_directories(tmp_path):
    run = RunDir(tmp_path / "r")
    assert run.checkpoint_steps() == []
    for name in ("2", "10", "12.orbax-checkpoint-tmp", "notes"):
        os.makedirs(os.path.join(run.checkpoint_dir, name))
    assert run.checkpoint_steps() == [2, 10]


def test_status_round_trip(tmp_path):
    run = RunDir(tmp_path / "r")
    assert run.read_status() is None
    run.write_status({"state": "finished", "step": 6})
    assert run.read_status() == {"state": "finished", "step": 6}
    assert sorted(os.listdir(run.path)) == ["status.json"]
