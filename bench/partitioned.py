"""``ls_attention`` on inputs split over several GPUs, as a user's program calls it.

No ls_jax training code: a mesh of the local GPUs with axis names of our own ("replica",
"shard"), q, k, v put on it with ``jax.device_put``, and one jitted forward+backward of
``ls_attention`` (forward, and the gradients of a sum against a fixed dO). For each layout it
prints the all-gathers in the compiled program (all of them, and those of q, k, v, the output
or their gradients: ``kernels.sharded.qkv_gathers``) and the median step time against the
same global problem on one GPU. Each row is printed as a JSON line, then a markdown table.

Layouts: "batch" (B over every GPU), "heads" (heads over every GPU), "both" (2-D mesh: B over
"replica", heads over "shard"; needs an even number of GPUs >= 4); axis types Auto (XLA
propagation, custom partitioning) or Explicit (shard_map over the inputs' types).

Example (two GPUs):
  python bench/partitioned.py --gpus 2 --layout batch,heads --axis-types auto,explicit
      --batch 8 --seq-len 8192 --heads 16 --kv-heads 16 --head-dim 64 --mix 1g15l --window 128
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings

warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*")

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from ls_jax.kernels import ls_attention
from ls_jax.kernels.sharded import qkv_gathers


def windows_of(mix: str, heads: int, window: int):
    """"1g15l": 1 global then 15 local heads of ``window``; "global"; "local"."""
    if mix == "global":
        return (None,) * heads
    if mix == "local":
        return (window,) * heads
    g, l = mix.rstrip("l").split("g")
    if int(g) + int(l) != heads:
        raise SystemExit(f"error: --mix {mix}: expected {heads} heads, got {int(g) + int(l)}")
    return (None,) * int(g) + (window,) * int(l)


def step_fn(windows, implementation):
    def loss(q, k, v, do):
        out = ls_attention(q, k, v, windows, implementation=implementation)
        return jnp.sum(out.astype(jnp.float32) * do)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def median_ms(fn, args, reps: int, warmup: int) -> float:
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - t) * 1e3)
    return float(np.median(times))


def mesh_and_spec(layout: str, devices, axis_type):
    n = len(devices)
    if layout == "batch":
        mesh = jax.make_mesh((n,), ("replica",), axis_types=(axis_type,), devices=devices)
        return mesh, P("replica")
    if layout == "heads":
        mesh = jax.make_mesh((n,), ("shard",), axis_types=(axis_type,), devices=devices)
        return mesh, P(None, None, "shard")
    if layout == "both":
        if n < 4 or n % 2:
            raise SystemExit(f"error: --layout both: needs an even number of GPUs >= 4, got {n}")
        mesh = jax.make_mesh((n // 2, 2), ("replica", "shard"), axis_types=(axis_type,) * 2,
                             devices=devices)
        return mesh, P("replica", None, "shard")
    raise SystemExit(f"error: --layout: expected batch, heads or both, got {layout!r}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--layout", default="batch,heads")
    ap.add_argument("--axis-types", default="auto,explicit")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--mix", default="1g15l")
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--implementation", default=None, help="default: None (dispatch)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    args = ap.parse_args(argv)

    devices = jax.devices()[:args.gpus]
    if len(devices) < args.gpus:
        raise SystemExit(f"error: --gpus {args.gpus}: only {len(jax.devices())} devices here")
    B, T, H, D = args.batch, args.seq_len, args.heads, args.head_dim
    G = args.kv_heads or H
    windows = windows_of(args.mix, H, args.window)
    dtype = jnp.dtype(args.dtype)
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (B, T, H, D), dtype)
    k, v = (jax.random.normal(x, (B, T, G, D), dtype) for x in keys[1:3])
    do = jax.random.normal(keys[3], (B, T, H, D), jnp.float32)
    step = step_fn(windows, args.implementation)

    one = [jax.device_put(x, devices[0]) for x in (q, k, v, do)]
    base_ms = median_ms(step, one, args.reps, args.warmup)
    base_out = [np.asarray(x, np.float32) for x in jax.tree.leaves(step(*one))]
    rows = []
    for layout in args.layout.split(","):
        for name in args.axis_types.split(","):
            axis_type = {"auto": AxisType.Auto, "explicit": AxisType.Explicit}[name]
            mesh, spec = mesh_and_spec(layout, devices, axis_type)
            split = [jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, k, v, do)]
            with jax.set_mesh(mesh):
                fn = step_fn(windows, args.implementation)
                hlo = fn.lower(*split).compile().as_text()
                ms = median_ms(fn, split, args.reps, args.warmup)
                out = fn(*split)
            err = max(float(np.max(np.abs(np.asarray(a, np.float32) - b)))
                      for a, b in zip(jax.tree.leaves(out), base_out))
            row = dict(layout=layout, axis_types=name, gpus=len(devices), B=B, T=T, H=H, G=G,
                       D=D, mix=args.mix, window=args.window, dtype=args.dtype,
                       all_gathers=hlo.count(" all-gather(") + hlo.count(" all-gather-start("),
                       qkv_gathers=len(qkv_gathers(hlo, T, H, D)), ms=ms, one_gpu_ms=base_ms,
                       speedup=base_ms / ms, max_abs_diff_vs_one_gpu=err,
                       device=devices[0].device_kind, jax=jax.__version__)
            print(json.dumps(row), flush=True)
            rows.append(row)
    print("\n| layout | axis types | GPUs | all-gathers | q/k/v gathers | f+b ms | 1 GPU ms "
          "| speedup | max abs diff |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['layout']} | {r['axis_types']} | {r['gpus']} | {r['all_gathers']} | "
              f"{r['qkv_gathers']} | {r['ms']:.3f} | {r['one_gpu_ms']:.3f} | "
              f"{r['speedup']:.2f}x | {r['max_abs_diff_vs_one_gpu']:.3g} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
