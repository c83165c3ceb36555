"""bench/startup.py --tiny on CPU (run as the script it is: tests import no bench module): one
row per (shape, attention) with every phase timed, in the order a run meets them; bad input
is one error line and exit 2."""

import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "startup.py")
ENV = dict(os.environ, JAX_PLATFORMS="cpu")


def test_startup_bench_tiny(tmp_path):
    out = tmp_path / "startup.json"
    proc = subprocess.run([sys.executable, SCRIPT, "--tiny", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, env=ENV)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    [row] = json.loads(out.read_text())["results"]
    assert (row["shape"], row["attention"], row["backend"]) == ("smoke", "default", "cpu")
    phases = ("init_lower_s", "init_compile_s", "init_run_s", "lower_s", "compile_s", "step_s")
    assert all(math.isfinite(row[k]) and row[k] > 0 for k in phases), row
    assert row["init_s"] == pytest.approx(
        row["init_lower_s"] + row["init_compile_s"] + row["init_run_s"])
    # the first step ends after the init, the step's lowering and its compilation
    assert row["first_step_at_s"] > row["init_s"] + row["lower_s"] + row["compile_s"]
    assert math.isfinite(row["loss"]) and row["tokens_per_s"] > 0
    assert "| shape | attention | init s |" in proc.stdout


def test_startup_bench_bad_input(tmp_path):
    proc = subprocess.run([sys.executable, SCRIPT, "--shapes", "huge", "--out",
                           str(tmp_path / "x.json")], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env=ENV)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("startup.py: error: --shapes:")
    assert not (tmp_path / "x.json").exists()
