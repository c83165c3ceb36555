"""Cases that need 8 fake CPU devices run in a subprocess (its XLA_FLAGS must be set before JAX
starts). A case script (tests/partition_cases.py, tests/library_cases.py) ends with
``main(globals())``: ``python tests/X_cases.py NAME ARGS [+ NAME ARGS ...]`` runs
``case_NAME(*ARGS)`` for each call, in one process, and prints their results as one JSON list,
last. A test starts it with ``start`` and reads the list with ``result``."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def start(script: str, *args: str) -> subprocess.Popen:
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8")
    return subprocess.Popen([sys.executable, str(ROOT / "tests" / script), *args], env=env,
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def result(proc: subprocess.Popen, timeout: float = 900) -> list:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def main(namespace: dict) -> None:
    calls = [[]]
    for arg in sys.argv[1:]:
        if arg == "+":
            calls.append([])
        else:
            calls[-1].append(arg)
    print(json.dumps([namespace[f"case_{name}"](*args) for name, *args in calls]), flush=True)
