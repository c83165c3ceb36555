"""bench/decode_kernel.py --smoke on CPU (run as the script it is: tests import no bench
module): a row per (variant, programs value), the library's default marked; bad input is one
error line and exit 2."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "decode_kernel.py")
ENV = dict(os.environ, JAX_PLATFORMS="cpu")


def test_decode_kernel_bench_smoke(tmp_path):
    from ls_jax.kernels.pallas_gpu.decode import TARGET_PROGRAMS

    out = tmp_path / "decode.json"
    proc = subprocess.run([sys.executable, SCRIPT, "--smoke", "--programs",
                           f"{TARGET_PROGRAMS},4", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, env=ENV)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["variant"], r["programs"], r["default"]) for r in rows] == [
        ("LS", TARGET_PROGRAMS, True), ("LS", 4, False),
        ("MHSA", TARGET_PROGRAMS, True), ("MHSA", 4, False)]
    assert all(r["step_wall"] > 0 for r in rows)


def test_decode_kernel_bench_bad_shape():
    proc = subprocess.run([sys.executable, SCRIPT, "--shapes", "paper,tiny"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env=ENV)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "decode_kernel.py: unknown shape or variant 'tiny' (shapes: paper, wide, smoke; "
        "variants: LS, MHSA)"]
