"""Many devices: the model and optimizer state sharded over a (data, fsdp, tensor) mesh (the
kernel per shard: tests/test_partitioning.py), resharding restore, and two processes stopping
together.

The multi-device cases run in subprocesses with fake CPU devices (tests/mesh_cases.py), since
XLA_FLAGS must be set before JAX starts."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys

import numpy as np
import pytest
from jax.sharding import AbstractMesh

from ls_jax.config import MeshConfig
from ls_jax.kernels.sharded import head_shard_windows, qkv_gathers
from ls_jax.sharding import logical_to_spec, mesh_shape

ROOT = pathlib.Path(__file__).resolve().parents[1]
CASES = str(ROOT / "tests" / "mesh_cases.py")


def _env(devices: int) -> dict:
    return dict(os.environ, JAX_PLATFORMS="cpu",
                XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}")


def _start(devices: int, *args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, CASES, *map(str, args)], env=_env(devices),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)


def _result(proc: subprocess.Popen, timeout: float = 400) -> dict:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


# -- in-process: the arithmetic of the mesh --------------------------------------------------

def test_mesh_shape_resolves_the_rest_and_rejects_bad_products():
    assert mesh_shape(MeshConfig(), 8) == (8, 1, 1)
    assert mesh_shape(MeshConfig(data=2, fsdp=-1, tensor=2), 8) == (2, 2, 2)
    assert mesh_shape(MeshConfig(data=1, fsdp=4, tensor=1), 4) == (1, 4, 1)
    with pytest.raises(ValueError, match="mesh: expected data x fsdp x tensor = 8"):
        mesh_shape(MeshConfig(data=2, fsdp=2, tensor=1), 8)
    with pytest.raises(ValueError, match="mesh.data: -1 needs"):
        mesh_shape(MeshConfig(data=-1, tensor=3), 8)
    with pytest.raises(ValueError, match="mesh.fsdp: expected an int >= 1 or -1"):
        MeshConfig(fsdp=0)


def test_logical_names_map_to_mesh_axes_where_they_divide():
    mesh = AbstractMesh((2, 2, 2), ("data", "fsdp", "tensor"))
    assert tuple(logical_to_spec(("embed", "heads"), (40, 32), mesh)) == ("fsdp", "tensor")
    assert tuple(logical_to_spec(("vocab", "embed"), (255, 40), mesh)) == (None, "fsdp")
    assert tuple(logical_to_spec((None,), (40,), mesh)) == (None,)


def test_head_shards_get_their_own_window_slices():
    windows = (None, 3, 8, 16, 16, 16)
    assert head_shard_windows(windows, 3) == [(None, 3), (8, 16), (16, 16)]
    assert head_shard_windows(windows, 1) == [windows]


def test_qkv_gather_check_reads_hlo_lines():
    hlo = ("  %all-gather.1 = f32[8,48,4,8]{3,2,1,0} all-gather(%p), dimensions={0}\n"
           "  %all-gather.2 = f32[256,40]{1,0} all-gather(%w), dimensions={0}\n"
           "  %ags = (f32[2,48,16]{2,1,0}, f32[4,48,16]{2,1,0}) all-gather-start(%x)\n"
           "  %all-reduce = f32[8,48,4,8]{3,2,1,0} all-reduce(%y)\n"
           # a kernel's custom call, its module inline (long, with many "="): not a gather
           "  %cc = f32[8,48,4,8]{3,2,1,0} custom-call(%q), backend_config=\""
           + "key = value, " * 300 + "\"\n")
    found = qkv_gathers(hlo, 48, 4, 8)
    assert [line.split()[0] for line in found] == ["%all-gather.1", "%ags"]


# -- 8 fake devices -------------------------------------------------------------------------

@pytest.mark.slow
def test_dispatch_by_direction_per_shard():
    """implementation=None's pairing (kernels/directional.py) on sharded inputs: per shard, the
    forward-only program runs the primal backend and the gradient program the differentiated
    one, output and gradients as on one device (stand-in backends, tests/mesh_cases.py)."""
    r = _result(_start(8, "directional"))
    assert r["forward_traced"] == ["pallas_gpu"] and r["grad_traced"] == ["cudnn"], r
    assert r["out_vs_2ref"] < 1e-2 and r["grads_vs_3ref"] < 2e-2, r
    assert r["out_spec"] == "P('data', None, 'tensor')", r


def _assert_split_as_planned(r: dict):
    """Params and optimizer moments split over fsdp x tensor, the batch over data x fsdp, no
    all-gather of q, k or v (case_train's report of its last mesh)."""
    specs = r["specs"]
    assert specs["q_proj"] == ["fsdp", "tensor"]  # [d_model, heads]
    assert specs["o_proj"] == ["tensor", "fsdp"]
    assert specs["fc"] == ["fsdp", "tensor"]  # [d_model, mlp]
    assert specs["embed"] == ["tensor", "fsdp"]  # [vocab, d_model]
    assert specs["ln"] == [None]
    assert specs["mu_q_proj"] == ["fsdp", "tensor"]  # Adam moment as its parameter
    assert specs["batch"] == [["data", "fsdp"], None]
    assert r["gathers"] == []


def test_losses_and_shardings_on_every_mesh():
    """1 device vs 2x4 data x fsdp vs 2x2x2 with tensor (reference): the same losses; params
    and optimizer moments split over fsdp x tensor, the batch over data x fsdp; no all-gather
    of q, k or v. (8-way data parallel against 1 device:
    test_checkpoint_from_8_devices_restores_on_4_and_1.)"""
    r = _result(_start(8, "train", "reference", "1x1x1,2x4x1,2x2x2"))  # 1x1x1: one of the 8
    ref = r["losses"].pop("1x1x1")
    for mesh, losses in r["losses"].items():
        np.testing.assert_allclose(losses, ref, rtol=2e-6, err_msg=mesh)
    _assert_split_as_planned(r)


@pytest.mark.slow
def test_the_pallas_gpu_kernel_on_a_mesh_gives_the_reference_losses():
    """The model's Pallas GPU kernel calls (interpret mode) on 2x2x2: the one-device
    reference's losses, the same split, no all-gather of q, k or v. (The kernel per shard:
    test_partitioning.py's pallas_gpu cases; the model's split: the test above.)"""
    procs = [_start(1, "train", "reference", "1x1x1"), _start(8, "train", "pallas_gpu", "2x2x2")]
    ref, pallas = [_result(p) for p in procs]
    np.testing.assert_allclose(pallas["losses"]["2x2x2"], ref["losses"]["1x1x1"], rtol=2e-6)
    _assert_split_as_planned(pallas)


@pytest.mark.slow
def test_checkpoint_from_8_devices_restores_on_4_and_1(tmp_path):
    """Saved on 8 devices at step 2; resumed on 8, 4 and 1: the restored state is bit-identical
    and the next steps' losses agree (bitwise on 8 and 4, to float32 rounding on 1)."""
    wd = {n: tmp_path / f"d{n}" for n in (8, 4, 1)}
    first = _result(_start(8, "restore", wd[8], 2))
    assert first["final"] == 2
    shutil.copytree(wd[8], wd[4])
    shutil.copytree(wd[8], wd[1])
    procs = {n: _start(n, "restore", wd[n], 0) for n in (8, 4, 1)}
    res = {n: _result(p) for n, p in procs.items()}
    for n in (8, 4, 1):
        assert res[n]["devices"] == n and res[n]["start"] == 2 and res[n]["final"] == 4
    assert res[8]["digest"] == res[4]["digest"] == res[1]["digest"] is not None
    assert res[4]["losses"] == res[8]["losses"]
    np.testing.assert_allclose([res[1]["losses"][s] for s in ("3", "4")],
                               [res[8]["losses"][s] for s in ("3", "4")], rtol=1e-6)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_stop_together_on_one_sigterm(tmp_path):
    """Two processes (jax.distributed on localhost); SIGTERM to process 1 only: both save the
    same step and exit 0; the rerun resumes from it. One process then resumes their last
    checkpoint: the state carries over, the data position cannot (one warning)."""
    wd = tmp_path / "run"
    port = _free_port()
    procs = [_start(1, "multiprocess", wd, i, port, 0) for i in range(2)]
    for line in procs[0].stdout:  # process 0 logs every step
        if line.startswith("step 2:"):
            procs[1].send_signal(signal.SIGTERM)
            break
    results = [_result(p) for p in procs]
    assert [r["process"] for r in results] == [0, 1]
    assert all(r["interrupted"] for r in results)
    stopped = results[0]["final"]
    assert results[1]["final"] == stopped and stopped >= 2
    steps = sorted(int(p.name) for p in (wd / "checkpoints").iterdir() if p.name.isdigit())
    assert steps == [stopped]
    port = _free_port()
    again = [_result(p) for p in [_start(1, "multiprocess", wd, i, port, 1) for i in range(2)]]
    assert [r["start"] for r in again] == [stopped, stopped]
    assert [r["final"] for r in again] == [stopped + 1, stopped + 1]
    alone = _result(_start(1, "alone", wd))
    assert alone["process_count"] == 1
    assert alone["start"] == stopped + 1 and alone["final"] == stopped + 2
    assert len(alone["warnings"]) == 1 and "saved by 2 process(es), now 1" in alone["warnings"][0]
    assert not (wd / "damaged_checkpoints").exists()


@pytest.mark.slow
def test_remat_policies_give_the_same_gradients():
    import dataclasses

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from ls_jax.config import ModelConfig
    from ls_jax.layers.transformer import Transformer
    base = ModelConfig(vocab_size=64, n_layer=2, d_model=16, n_head=2, head_dim=8, window=4,
                       max_seq_len=16)
    tokens = jax.random.randint(jax.random.key(0), (2, 16), 0, 64)

    def grads(remat):
        model = Transformer(dataclasses.replace(base, remat=remat), rngs=nnx.Rngs(params=0))
        return nnx.grad(lambda m: jnp.mean(m(tokens) ** 2))(model)

    want = jax.tree.leaves(grads("none"))
    for remat in ("full", "dots"):
        for a, b in zip(want, jax.tree.leaves(grads(remat))):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="model.remat: expected one of"):
        ModelConfig(remat="some")


@pytest.mark.slow
def test_scaling_bench_smoke(tmp_path):
    """bench/scaling.py --smoke: one tiny run on 2 CPU devices, JSON and table written."""
    out = tmp_path / "scaling.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "scaling.py"), "--smoke",
                           "--devices", "2", "--out", str(out)], env=_env(1), cwd=ROOT,
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (run,) = json.loads(out.read_text())["results"]
    assert run["devices"] == 2 and run["mesh"]["data"] == 2
    assert run["tokens_per_s"] > 0 and run["qkv_all_gathers"] == 0
    assert proc.stdout.strip().splitlines()[-2].startswith("shape")


def test_scaling_bench_refuses_a_bad_per_run_limit():
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "scaling.py"), "--smoke",
                           "--per-run-s", "0"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].endswith(
        "--per-run-s: expected seconds > 0, got 0.0"), proc.stderr
