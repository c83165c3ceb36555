"""The command lines answer in one line: run by a Python without the project's packages they
say how to run them; ``train.py --help`` lists every named config and override key; a
misspelt config name gets the closest one."""

import os
import subprocess
import sys

import pytest

from ls_jax import run_hint
from ls_jax.config import valid_keys
from ls_jax.configs import CONFIGS, get_config
from ls_jax.configs.cli import train_main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the Python this venv was made from, without site-packages: no JAX, no installed ls_jax
BARE_PYTHON = [getattr(sys, "_base_executable", sys.executable), "-S"]


@pytest.mark.parametrize("command,make_target", [
    pytest.param(["train.py", "--help"], "train", id="train-help"),
    pytest.param(["train.py", "--config", "tiny"], "train", id="train"),
    pytest.param(["eval.py", "--checkpoint", "runs/tiny"], "eval", id="eval"),
    pytest.param(["-m", "ls_jax.inference.sample", "--checkpoint", "runs/tiny", "--prompt", "def main("],
                 "sample", id="sample"),
])
def test_outside_the_venv_one_line_says_how_to_run(command, make_target):
    proc = subprocess.run(BARE_PYTHON + command, cwd=ROOT, capture_output=True, text=True,
                          timeout=60, env={k: v for k, v in os.environ.items()
                                           if k not in ("PYTHONPATH", "PYTHONHOME")})
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    name = command[1] if command[0] == "-m" else command[0]
    assert lines[0].startswith(f"error: {name} runs in the project's venv ("), lines[0]
    assert f"make {make_target}" in lines[0]
    # the same command, ready to paste, with the venv's Python
    rerun = " ".join(command).replace("def main(", "'def main('")
    assert f".venv/bin/python {rerun}" in lines[0], lines[0]


def test_without_a_venv_the_line_says_make_makes_it(monkeypatch, tmp_path):
    monkeypatch.setattr(run_hint, "VENV", str(tmp_path / "no_venv"))
    line = run_hint.how_to_run(ModuleNotFoundError("No module named 'jax'", name="jax"),
                               ["eval.py", "--checkpoint", "runs/tiny"], "eval", "evaluation")
    assert "has no module 'jax'" in line and "make eval (it makes .venv first)" in line, line


def test_installed_without_the_train_extra_names_the_extra(monkeypatch):
    monkeypatch.setattr(run_hint, "in_checkout", lambda: False)
    line = run_hint.how_to_run(ModuleNotFoundError("No module named 'orbax'", name="orbax"),
                               ["-m", "ls_jax.inference.sample"], "sample", "sampling")
    assert line == ("error: sampling needs the [train] extra (missing module 'orbax'): "
                    "pip install 'ls-jax[train]'")


def test_train_help_lists_every_config_and_key(capsys):
    with pytest.raises(SystemExit) as e:
        train_main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for name in CONFIGS:
        assert f"\n  {name} " in out, name
    for key in valid_keys(get_config("tiny")):
        assert key.partition(".")[2] in out, key


@pytest.mark.parametrize("name,hint", [
    pytest.param("tin", "; did you mean tiny?", id="close"),
    pytest.param("paper_qk", "; did you mean paper_qknorm", id="prefix"),
    pytest.param("gpt2", "", id="nothing-close"),
])
def test_unknown_config_names_the_closest(name, hint, capsys):
    with pytest.raises(SystemExit) as e:
        train_main(["--config", name])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: config: expected one of ") and f"got {name!r}{hint}" in err
    assert len(err.strip().splitlines()) == 1
