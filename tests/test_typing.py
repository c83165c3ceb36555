"""The typed API as a user's type checker sees it: mypy on a small user program
(tests/typing/), against the package laid out as the wheel installs it (``ls_jax.kernels``
and ``ls_jax.configs`` inside ``ls_jax``), with no error; and on a program with mistakes,
which it finds."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> pathlib.Path:
    """The package tree as installed (pyproject's package-dir mapping), without building."""
    dest = tmp_path_factory.mktemp("site")
    with open(ROOT / "pyproject.toml", "rb") as f:
        package_dirs = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    for package, folder in sorted(package_dirs.items()):  # ls_jax before ls_jax.kernels
        shutil.copytree(ROOT / folder, dest.joinpath(*package.split(".")),
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
                        dirs_exist_ok=True)
    return dest


def _mypy(installed: pathlib.Path, program: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, MYPYPATH=str(installed))
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--follow-imports=silent",
         "--cache-dir", str(installed.parent / "mypy_cache"),  # shared by the two runs
         "--show-error-codes", str(ROOT / "tests" / "typing" / program)],
        env=env, cwd=installed, capture_output=True, text=True, timeout=600)


def test_a_user_program_type_checks(installed):
    r = _mypy(installed, "user_program.py")
    assert r.returncode == 0, r.stdout + r.stderr


def test_mistakes_in_a_user_program_are_found(installed):
    r = _mypy(installed, "user_mistakes.py")
    lines = [line for line in r.stdout.splitlines() if ": error:" in line]
    assert r.returncode == 1 and len(lines) == 2, r.stdout
    assert all("ls_attention" in line for line in lines), lines
