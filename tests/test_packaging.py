"""The wheel: built from the sources, installed into a fresh venv beside other top-level
``kernels`` and ``configs`` packages, and imported from outside the checkout.

The fresh venv reuses the installed, locked dependencies through a ``.pth`` line pointing at this
venv's site-packages (nothing is downloaded); a line in a ``.pth`` file adds a directory to
``sys.path`` without running the ``.pth`` files inside it, so this venv's editable finder for the
checkout stays inactive there.
"""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import tomllib
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = ("ls-jax-train", "ls-jax-eval", "ls-jax-sample")
# [train]-only packages: the core import path must not need them.
TRAIN_ONLY = ("grain", "tensorflow_datasets", "sentencepiece", "tensorboardX", "tqdm", "matplotlib",
              "safetensors")

CHECK = textwrap.dedent("""
    import importlib.abc, json, sys

    class Block(importlib.abc.MetaPathFinder):  # the [train] extra is not installed
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in TRAIN_ONLY:
                raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)
    sys.meta_path.insert(0, Block())

    import configs, kernels
    import jax, jax.numpy as jnp
    import ls_jax
    from flax import nnx
    from ls_jax.configs import get_config
    from ls_jax.kernels import ls_attention

    q = jnp.arange(2 * 8 * 2 * 4, dtype=jnp.float32).reshape(2, 8, 2, 4) / 64
    out = ls_attention(q, q, q, (None, 3))
    layer = ls_jax.LSAttention(d_model=8, n_head=2, head_dim=4, window=3, rngs=nnx.Rngs(0))
    y = layer(jnp.ones((1, 8, 8)))
    model_cls = ls_jax.Transformer
    print(json.dumps(dict(
        kernels=kernels.WHO, configs=configs.WHO, ls_jax=ls_jax.__file__,
        ls_jax_kernels=sys.modules["ls_jax.kernels"].__file__,
        ls_jax_configs=sys.modules["ls_jax.configs"].__file__,
        out_shape=list(out.shape), out_finite=bool(jnp.isfinite(out).all()),
        y_shape=list(y.shape), tiny_name=get_config("tiny").name,
        paper_window=get_config("paper").model.window)))
""")


def build_wheel(tmp_path) -> str:
    src = tmp_path / "src"  # a copy: an in-tree build would leave build/ in the checkout
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(ROOT, name), src / name)
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        package_dirs = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    for folder in sorted(set(package_dirs.values())):
        shutil.copytree(os.path.join(ROOT, folder), src / folder,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path / "dist")]
    if importlib.util.find_spec("setuptools") is not None:
        cmd.append("--no-build-isolation")  # offline: setuptools is in the lock
    subprocess.run(cmd + [str(src)], check=True, timeout=300)
    (wheel,) = (tmp_path / "dist").glob("ls_jax-*.whl")
    return str(wheel)


@pytest.mark.slow
def test_wheel_installs_beside_other_kernels_and_configs(tmp_path):
    wheel = build_wheel(tmp_path)
    names = zipfile.ZipFile(wheel).namelist()
    assert not [n for n in names if n.split("/")[0] in ("kernels", "configs")], names
    assert "ls_jax/kernels/api.py" in names and "ls_jax/configs/paper.py" in names
    assert "ls_jax/py.typed" in names
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    entry_points = zipfile.ZipFile(wheel).read(entry_points).decode()
    for script in SCRIPTS:
        assert f"{script} = " in entry_points, entry_points

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = str(venv / "bin" / "python")
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    # someone else's top-level kernels and configs, installed first
    for pkg in ("kernels", "configs"):
        os.makedirs(os.path.join(site, pkg))
        with open(os.path.join(site, pkg, "__init__.py"), "w") as f:
            f.write(f"WHO = 'dummy {pkg}'\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", py, "install", "-q", "--no-deps",
                    "--no-index", wheel], check=True, timeout=300)
    with open(os.path.join(site, "locked_deps.pth"), "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run([py, "-c", f"TRAIN_ONLY = {TRAIN_ONLY!r}\n" + CHECK], cwd=outside,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (r["kernels"], r["configs"]) == ("dummy kernels", "dummy configs")
    for key in ("ls_jax", "ls_jax_kernels", "ls_jax_configs"):
        assert r[key].startswith(site), (key, r[key])  # the wheel, not the checkout
    assert r["out_shape"] == [2, 8, 2, 4] and r["out_finite"] and r["y_shape"] == [1, 8, 8]
    assert (r["tiny_name"], r["paper_window"]) == ("tiny", 51)
    for script in SCRIPTS:
        assert os.access(venv / "bin" / script, os.X_OK), script
    # the console script runs from the wheel (the locked [train] packages importable)
    proc = subprocess.run([str(venv / "bin" / "ls-jax-eval"), "--help"], cwd=outside, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "section.key=value" in proc.stdout, proc.stderr[-3000:]
    # without the [train] extra: importing the CLI and --help work; a command that runs ends
    # with one line naming the extra, non-zero exit
    blocked = CHECK[:CHECK.index("import configs, kernels")] + textwrap.dedent("""
        import ls_jax.configs.cli as cli
        try:
            cli.train_main(["--help"])
        except SystemExit as e:
            assert e.code == 0, e.code
        cli.train_main(["--config", "tiny"])
    """)
    proc = subprocess.run([py, "-c", f"TRAIN_ONLY = {TRAIN_ONLY!r}\n" + blocked], cwd=outside,
                          env=env, capture_output=True, text=True, timeout=300)
    assert "usage:" in proc.stdout, proc.stdout
    assert proc.returncode == 1 and proc.stderr.strip().startswith(
        "error: training and evaluation need the [train] extra (missing module"), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
