"""bench/shapes.py on CPU: every shape is a call the library plans on a Hopper GPU; --list
names each once; --out keeps each row as it is measured and --resume goes on from them; bad
input, or no GPU, is one error line and exit 2."""

import argparse
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from bench_scripts import load  # tests/, beside this file
from ls_jax.kernels import explain

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "shapes.py")
ENV = dict(os.environ, JAX_PLATFORMS="cpu")
shapes = load("shapes")


def run(*args):
    return subprocess.run([sys.executable, SCRIPT, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env=ENV)


@pytest.mark.parametrize("name", list(shapes.SHAPES))
def test_each_shape_plans_on_hopper(name):
    D, B, T, H, Hkv, n_global, local = shapes.SHAPES[name]
    windows = shapes.windows_of(shapes.SHAPES[name])
    assert len(windows) == H and windows.count(None) == n_global and H % Hkv == 0
    q = jax.ShapeDtypeStruct((B, T, H, D), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((B, T, Hkv, D), jnp.bfloat16)
    plan = explain(q, kv, kv, windows, platform="cuda", device_kind="NVIDIA H200")
    assert tuple(plan.windows) == windows and "call plan" in str(plan)


@pytest.mark.parametrize("name,backends", [
    ("paper-layer", ("pallas_gpu", "pallas_gpu")),
    ("d256-mix", ("cudnn", "cudnn")),
    ("d256-all-global", ("cudnn", "cudnn")),
], ids=["ours-both-ways", "wide-heads-on-cudnn", "wide-global-on-cudnn"])
def test_rows_name_the_default_backends(name, backends):
    assert shapes.default_backends(name, platform="cuda", device_kind="NVIDIA H200") == backends


@pytest.mark.parametrize("fwd_backend,fb_backend,r_fwd,r_fb,slower", [
    ("pallas_gpu", "pallas_gpu", 1.2, 0.9, True),
    ("pallas_gpu", "pallas_gpu", 0.9, 1.2, True),
    ("pallas_gpu", "pallas_gpu", 1.0, 1.0, False),
    ("cudnn", "cudnn", 0.9, 0.9, False),
    ("cudnn", "pallas_gpu", 0.9, 1.1, False),
    ("cudnn", "pallas_gpu", 1.1, 0.9, True),
], ids=["ours-f+b-slower", "ours-forward-slower", "ours-even", "composition-noise",
        "cudnn-forward-noise", "ours-f+b-behind-cudnn-forward"])
def test_only_our_kernels_count_as_slower(fwd_backend, fb_backend, r_fwd, r_fb, slower):
    row = dict(fwd_backend=fwd_backend, fb_backend=fb_backend, r_fwd=r_fwd, r_fb=r_fb)
    assert shapes.slower(row, min_ratio=1.0) is slower


def test_list_names_every_shape_once():
    proc = run("--list")
    assert proc.returncode == 0, proc.stderr
    assert [line.split(":")[0] for line in proc.stdout.splitlines()] == list(shapes.SHAPES)


@pytest.mark.parametrize("args,message", [
    (("--shapes", "paper-layer,tiny"),
     "--shapes: expected names from `python bench/shapes.py --list`, got 'tiny'"),
    (("--shapes", ","), "--shapes: expected names from `python bench/shapes.py --list`, got ','"),
    (("--reps", "0"), "--reps: expected an int >= 1, got 0"),
    (("--warmup", "-1"), "--warmup: expected an int >= 0, got -1"),
    (("--resume",), "--resume: continues an --out file; name one"),
    (("--out", "README.md"),
     "--out: README.md exists; pass --resume to go on from its rows, or name another file"),
    (("--shapes", "paper-layer"),
     "needs a CUDA GPU for the cuDNN composition; JAX backend is 'cpu'"),
], ids=["unknown-shape", "no-shape", "no-samples", "negative-warmup", "resume-without-out",
        "out-exists", "no-gpu"])
def test_bad_input_is_one_line(args, message):
    proc = run(*args)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"shapes.py: {message}"]


SETTINGS = {"reps": 10, "warmup": 2, "batch": 3}


def _fake_measure(measured: list, stop_at: str | None = None):
    def measure(name, args):
        if name == stop_at:
            raise KeyboardInterrupt
        measured.append(name)
        return {"shape": name, "r_fwd": 1.5}
    return measure


def test_a_stopped_run_keeps_its_rows_and_resume_measures_only_the_rest(tmp_path):
    out = str(tmp_path / "rows.json")
    args, measured = argparse.Namespace(out=out, resume=False, **SETTINGS), []
    with pytest.raises(KeyboardInterrupt):
        shapes.measure_all(["paper-layer", "d64-p512", "d64-gqa"], args, "card",
                           measure=_fake_measure(measured, stop_at="d64-gqa"))
    with open(out) as f:
        assert [r["shape"] for r in json.load(f)["rows"]] == ["paper-layer", "d64-p512"]
    args.resume, measured = True, []
    rows = shapes.measure_all(["d64-gqa", "paper-layer"], args, "card",
                              measure=_fake_measure(measured))
    assert measured == ["d64-gqa"]
    assert [r["shape"] for r in rows] == ["d64-gqa", "paper-layer"]
    with open(out) as f:  # every row kept, in the order of SHAPES
        written = json.load(f)
    assert [r["shape"] for r in written["rows"]] == ["paper-layer", "d64-gqa", "d64-p512"]
    assert written["card"] == "card" and not os.path.exists(out + ".tmp")


@pytest.mark.parametrize("card,reps", [("card-a", 5), ("card-b", 10)],
                         ids=["other-settings", "other-card"])
def test_resume_of_another_run_is_one_line(tmp_path, capsys, card, reps):
    out = tmp_path / "rows.json"
    out.write_text(json.dumps({"card": "card-a", "jax": jax.__version__, "settings": SETTINGS,
                               "rows": []}))
    ours = dict(SETTINGS, reps=reps)
    args = argparse.Namespace(out=str(out), resume=True, **ours)
    with pytest.raises(SystemExit) as e:
        shapes.measure_all(["paper-layer"], args, card, measure=_fake_measure([]))
    assert e.value.code == 2
    assert capsys.readouterr().err == (
        f"shapes.py: --resume: {out} holds rows of card-a, jax {jax.__version__}, {SETTINGS}; "
        f"this run is on {card}, jax {jax.__version__}, {ours}: name another --out\n")
