"""The tree has no unused import or name and no undefined name (ruff's Pyflakes rules, as
``pyproject.toml``'s ``[tool.ruff]`` selects them)."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_pyflakes_finds_nothing():
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache",
                           "--output-format", "concise", "."],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
