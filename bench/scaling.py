"""Data-parallel scaling of a training step on 1, 2 and 4 GPUs: tokens/s, speed-up, MFU per GPU,
whether the compiled step gathers q, k or v around the attention kernel, and how many Mosaic
GPU and Triton kernel calls it makes (JSON only).

    python bench/scaling.py --out scaling.json            # GPU host with >= 4 GPUs
    python bench/scaling.py --smoke --out /tmp/s.json     # CPU, tiny shapes (a test runs this)

Two shapes, same per-device batch on every device count (weak scaling):

* ``125m``: 12 layers, 12 heads x 64, d=768, vocab 50304, T=8192, 1 global + 11 local heads
  with window 128, bf16 compute, per-device batch 2.
* ``paper``: 6 layers, 6 heads x 32, d=192, vocab 256 (bytes), T=2048, 1 global + 5 local with
  window 50, per-device batch 8.

Each (shape, device count) runs in its own subprocess with CUDA_VISIBLE_DEVICES=0..n-1 (on CPU,
that many fake devices), on a mesh of n devices (``--mesh data`` = pure data parallel, the
default; ``--mesh fsdp`` = parameters and optimizer state split too). Random tokens (no input
pipeline). MFU = model FLOPs / (time x devices x peak), model FLOPs = 6 x non-embedding
parameters x tokens + the attention band's FLOPs (kernels/band.py, forward + backward).
The table is printed last; JSON goes to --out.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import subprocess
import sys
import time

SHAPES = {
    "125m": dict(model=dict(vocab_size=50304, n_layer=12, d_model=768, n_head=12, head_dim=64,
                            n_global_heads=1, window=128, max_seq_len=8192,
                            compute_dtype="bfloat16"),
                 seq_len=8192, per_device_batch=2),
    "paper": dict(model=dict(vocab_size=256, n_layer=6, d_model=192, n_head=6, head_dim=32,
                             n_global_heads=1, window=50, max_seq_len=2048,
                             compute_dtype="bfloat16"),
                  seq_len=2048, per_device_batch=8),
}
SMOKE_SHAPES = {
    "smoke": dict(model=dict(vocab_size=256, n_layer=1, d_model=32, n_head=4, head_dim=8,
                             n_global_heads=1, window=8, max_seq_len=48),
                  seq_len=48, per_device_batch=2),
}

def peak_flops(device_kind: str) -> float | None:
    from hardware import peaks  # bench/hardware.py, beside this script
    found = peaks(device_kind)
    return found[0] if found else None


def _phase(name: str, t_start: float) -> None:
    """One line on stderr per phase, so a run killed at its timeout says where it was."""
    print(f"phase {name} at {time.perf_counter() - t_start:.1f} s", file=sys.stderr, flush=True)


def worker(shape_name: str, shape: dict, mesh_kind: str, steps: int, warmup: int,
           deadline_s: float | None = None) -> dict:
    """One measurement on every visible device; returns a JSON-able dict."""
    t_start = time.perf_counter()
    if deadline_s:
        # a run that hangs prints every thread's Python stack before the parent kills it
        faulthandler.dump_traceback_later(deadline_s, exit=True)
    import jax
    import numpy as np
    from flax import nnx

    from ls_jax import sharding as sharding_lib
    from ls_jax.config import MeshConfig, ModelConfig, TrainConfig
    from ls_jax.kernels.band import band_flops
    from ls_jax.kernels.sharded import qkv_gathers
    from ls_jax.training.loss import lm_loss
    from ls_jax.layers.transformer import Transformer
    from ls_jax.training.optimizer import make_optimizer

    mcfg = ModelConfig(**shape["model"])
    n_dev = jax.device_count()
    T, batch = shape["seq_len"], shape["per_device_batch"] * n_dev
    mesh_cfg = MeshConfig(data=-1) if mesh_kind == "data" else MeshConfig(data=1, fsdp=-1)
    mesh = sharding_lib.make_mesh(mesh_cfg)
    tcfg = TrainConfig(warmup_steps=1)

    def create(key):
        model = Transformer(mcfg, rngs=nnx.Rngs(params=key))
        return model, nnx.Optimizer(model, make_optimizer(tcfg), wrt=nnx.Param)

    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
        graphdef, abstract = nnx.split(nnx.eval_shape(create, jax.random.key(0)))
    state_sharding = sharding_lib.state_shardings(abstract, mesh)

    def step(state, batch):
        model, optimizer = nnx.merge(graphdef, state)

        def loss_fn(model):
            logits = model(batch["inputs"])
            return lm_loss(logits, batch["targets"])[0]

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), loss

    data_sharding = sharding_lib.batch_sharding(mesh)
    with jax.set_mesh(mesh):
        # the key is an argument: a constant seed would make XLA constant-fold the random
        # initialisation at compile time (over a minute for the 125M shape)
        t0 = time.perf_counter()
        state = jax.jit(lambda key: nnx.state(create(key)),
                        out_shardings=state_sharding)(jax.random.key(0))
        jax.block_until_ready(state)
        init_s = time.perf_counter() - t0
        step_fn = jax.jit(step, in_shardings=(state_sharding, data_sharding),
                          out_shardings=(state_sharding, sharding_lib.replicated(mesh)),
                          donate_argnums=0)
        _phase("init", t_start)
        rng = np.random.default_rng(0)
        tokens = rng.integers(0, mcfg.vocab_size, size=(batch, T + 1), dtype=np.int32)
        batch_arr = sharding_lib.global_batch({"inputs": tokens[:, :-1],
                                               "targets": tokens[:, 1:]}, data_sharding)
        _phase("compile", t_start)
        t0 = time.perf_counter()
        compiled = step_fn.lower(state, batch_arr).compile()
        compile_s = time.perf_counter() - t0
        hlo = compiled.as_text()
        _phase("warm-up", t_start)
        for i in range(warmup):
            state, loss = step_fn(state, batch_arr)
            jax.block_until_ready(loss)
            _phase(f"warm-up step {i + 1} done", t_start)
        t0 = time.perf_counter()
        for _ in range(steps):
            state, loss = step_fn(state, batch_arr)
        jax.block_until_ready(loss)
        seconds = (time.perf_counter() - t0) / steps
        _phase("timed steps done", t_start)

    params = nnx.state(nnx.merge(graphdef, state)[0], nnx.Param)
    embed_names = {"embed", "pos_embed"}
    n_params = sum(x.size for x in jax.tree.leaves(params))
    n_embed = sum(v.get_value().size for p, v in nnx.to_flat_state(params)
                  if p[0] in embed_names)
    tokens_per_step = batch * T
    flops = (6.0 * (n_params - n_embed) * tokens_per_step
             + mcfg.n_layer * band_flops(batch, T, mcfg.window_sizes, mcfg.head_dim,
                                         backward=True))
    kind = jax.devices()[0].device_kind
    peak = peak_flops(kind)
    gathers = qkv_gathers(hlo, T, mcfg.n_head, mcfg.head_dim)
    return {
        "shape": shape_name, "devices": n_dev, "device_kind": kind, "mesh": dict(mesh.shape),
        "global_batch": batch, "seq_len": T, "params": int(n_params),
        "step_s": seconds, "tokens_per_s": tokens_per_step / seconds,
        "mfu_per_device": (flops / seconds / n_dev / peak) if peak else None,
        "init_s": init_s, "compile_s": compile_s, "loss": float(loss),
        "qkv_all_gathers": len(gathers), "qkv_all_gather_lines": gathers[:3],
        "all_gathers": hlo.count(" all-gather(") + hlo.count(" all-gather-start("),
        "all_reduces": hlo.count(" all-reduce(") + hlo.count(" all-reduce-start("),
        # which attention kernels the step runs (Hopper: Mosaic GPU; else Triton)
        "mosaic_gpu_calls": hlo.count('custom_call_target="mosaic_gpu'),
        "triton_calls": hlo.count('custom_call_target="__gpu$xla.gpu.triton"'),
    }


def _run_one(shape_name: str, n: int, args, timeout: float) -> dict:
    env = dict(os.environ)
    if args.smoke:
        env.update(JAX_PLATFORMS="cpu",
                   XLA_FLAGS=f"--xla_force_host_platform_device_count={n}")
    else:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(n))
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", shape_name,
           "--mesh", args.mesh, "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--deadline-s", str(max(5.0, timeout - 10.0))]
    if args.smoke:
        cmd.append("--smoke")
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        return {"shape": shape_name, "devices": n, "error": f"timed out after {timeout:.0f} s",
                "stderr_tail": _text(e.stderr)[-6000:]}
    if proc.returncode != 0:
        phases = [ln for ln in proc.stderr.splitlines() if ln.startswith("phase ")]
        hung = "Timeout (" in proc.stderr  # faulthandler's header: the worker's own deadline
        error = (f"hung after {phases[-1] if phases else 'start'} (stacks in stderr_tail)"
                 if hung else proc.stderr.strip().splitlines()[-1] if proc.stderr.strip()
                 else f"exit {proc.returncode}")
        return {"shape": shape_name, "devices": n, "error": error,
                "stderr_tail": proc.stderr[-6000:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _text(b) -> str:
    return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")


def table(results: list[dict]) -> str:
    base = {r["shape"]: r["tokens_per_s"] for r in results
            if r.get("devices") == 1 and "tokens_per_s" in r}
    lines = [f"{'shape':<7} {'GPUs':>4} {'tokens/s':>12} {'speed-up':>8} {'MFU/GPU':>8} "
             f"{'qkv gathers':>11} {'all-gathers':>11}  device"]
    for r in results:
        if "error" in r:
            lines.append(f"{r['shape']:<7} {r['devices']:>4}  error: {r['error'][:90]}")
            continue
        speed = r["tokens_per_s"] / base[r["shape"]] if r["shape"] in base else float("nan")
        mfu = f"{100 * r['mfu_per_device']:.1f}%" if r["mfu_per_device"] is not None else "n/a"
        lines.append(f"{r['shape']:<7} {r['devices']:>4} {r['tokens_per_s']:>12,.0f} "
                     f"{speed:>7.2f}x {mfu:>8} {r['qkv_all_gathers']:>11} "
                     f"{r['all_gathers']:>11}  {r['device_kind']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=None, help="comma-separated subset of "
                        f"{list(SHAPES)} (default: all)")
    parser.add_argument("--devices", default="1,2,4", help="device counts to measure")
    parser.add_argument("--mesh", choices=("data", "fsdp"), default="data")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--budget-s", type=float, default=400.0,
                        help="stop starting runs after this many seconds in total")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, 2 steps")
    parser.add_argument("--out", default=None, help="JSON file for the results")
    parser.add_argument("--per-run-s", type=float, default=None,
                        help="time limit of one (shape, device count) run; a run past it "
                        "prints its Python stacks and is reported as hung")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--deadline-s", type=float, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    if args.smoke:
        args.steps, args.warmup = min(args.steps, 2), 1

    if args.worker:
        print(json.dumps(worker(args.worker, shapes[args.worker], args.mesh, args.steps,
                                args.warmup, args.deadline_s)), flush=True)
        return 0

    if args.per_run_s is not None and not args.per_run_s > 0:
        parser.error(f"--per-run-s: expected seconds > 0, got {args.per_run_s}")
    names = args.shapes.split(",") if args.shapes else list(shapes)
    for name in names:
        if name not in shapes:
            parser.error(f"--shapes: expected names from {list(shapes)}, got {name!r}")
    try:
        counts = [int(n) for n in args.devices.split(",")]
    except ValueError:
        parser.error(f"--devices: expected comma-separated ints, got {args.devices!r}")
    t_start, results = time.perf_counter(), []
    for name in names:
        for n in counts:
            left = args.budget_s - (time.perf_counter() - t_start)
            if left < 20:
                results.append({"shape": name, "devices": n, "error": "skipped: --budget-s spent"})
                continue
            r = _run_one(name, n, args, timeout=min(left, args.per_run_s or left))
            results.append(r)
            print(json.dumps({k: v for k, v in r.items() if k != "stderr_tail"}), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"results": results, "mesh": args.mesh, "steps": args.steps}, f, indent=2)
    print(table(results))
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
