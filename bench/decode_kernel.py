"""Device time of the Pallas decode step's two launches, attend and merge, alone.

For each (shape, variant, batch) it builds the caches a model holds at --context tokens (bf16,
every layer's: the global cache of S = context + 128 slots, the local heads' ring of
--window + 1 slots), runs the step on each layer in turn, and reads each launch's device time
from a profiler trace (the median over --steps steps). It does so for each --programs value
(the step's ``target_programs``: programs it asks for at least; the library's default first),
so a change of the split rule can be judged on the launch itself rather than through a model.

  python bench/decode_kernel.py                         # paper shape, LS and MHSA, batch 1, 64
  python bench/decode_kernel.py --programs 528,1056,2112 --shapes paper,wide --batches 64
  python bench/decode_kernel.py --smoke                 # tiny sizes in interpret mode (CPU)

On a GPU each row also gives ``xla_read``: the device time of an XLA pass that reads what the
attend launch reads of a layer (every group's keys and values) and only sums them, a bound
for a launch that streams the cache.

Prints a markdown table (microseconds per launch; without a GPU, the step's wall time) and,
with --out, the rows as JSON.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import math
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
from jax.profiler import ProfileData

from ls_jax.kernels.pallas_gpu.decode import TARGET_PROGRAMS, pallas_gpu_decode_step

SHAPES = {"paper": (6, 6, 32), "wide": (12, 12, 64), "smoke": (2, 4, 16)}  # (layers, heads, D)
LAUNCHES = ("ls_decode_step", "ls_decode_merge")


def make_case(shape: str, variant: str, B: int, context: int, window: int):
    """(layers, q, groups, kv_heads, windows, position_rules): every slot below ``context``
    written, the slots' positions given by their rules and the rows' lengths, as the model's
    cache gives them (``kernels.decode.SlotRule``)."""
    L, H, D = SHAPES[shape]
    S, P = context + 128, window + 1
    lengths = jnp.full((B,), context, jnp.int32)

    def cache(G, slots):
        return jnp.full((L, B, slots, G, D), 0.01, jnp.bfloat16)

    glob_group = (cache(H if variant == "MHSA" else 1, S), cache(H if variant == "MHSA" else 1, S),
                  lengths, jnp.full((B,), context, jnp.int32))
    if variant == "MHSA":
        groups, kv_heads, windows = (glob_group,), (tuple(range(H)),), (None,) * H
        rules = ("global",)
    else:
        ring = (cache(H - 1, P), cache(H - 1, P), lengths, jnp.full((B,), context % P, jnp.int32))
        groups, kv_heads = (glob_group, ring), ((0,), tuple(range(1, H)))
        windows = (None,) + (P,) * (H - 1)
        rules = ("global", "ring")
    q = jax.random.normal(jax.random.key(0), (B, H, D), jnp.bfloat16)
    return L, q, groups, kv_heads, windows, rules


def kernel_times(run) -> dict[str, list[float]]:
    """Device microseconds of each kernel launch that ``run()`` makes, by kernel name."""
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            run()
        data = ProfileData.from_file(glob.glob(d + "/**/*.xplane.pb", recursive=True)[0])
    times = collections.defaultdict(list)
    for plane in data.planes:
        if plane.name.startswith("/device:GPU"):
            for line in plane.lines:
                for e in line.events:
                    if line.name.startswith("Stream") and not e.name.startswith("Memcpy"):
                        times[e.name].append(e.duration_ns / 1e3)
    return times


def launch_times(run) -> dict[str, float]:
    """Median device microseconds of each decode launch that ``run()`` makes."""
    return {name: statistics.median(t) for name, t in kernel_times(run).items()
            if name in LAUNCHES}


def read_time(groups, L: int, steps: int) -> float:
    """Device microseconds per layer of an XLA pass that reads one layer of every group's k
    and v (rows of up to 1024 elements, each summed) and does nothing else."""
    @jax.jit
    def read(groups, layer):
        sums = []
        for k, v, _, _ in groups:
            for x in (k, v):
                x = jax.lax.dynamic_index_in_dim(x, layer, keepdims=False)
                sums.append(x.reshape(-1, math.gcd(x.size, 1024)).astype(jnp.float32).sum(1))
        return sums

    def run(n):
        for i in range(n):
            out = read(groups, jnp.int32(i % L))
        jax.block_until_ready(out)

    run(2)
    times = kernel_times(lambda: run(steps))
    return sum(sum(t) for t in times.values()) / steps


def measure(shape, variant, B, target, args) -> dict:
    L, q, groups, kv_heads, windows, rules = make_case(shape, variant, B, args.context,
                                                       args.window)
    D = q.shape[-1]
    step = jax.jit(lambda q, g, layer: pallas_gpu_decode_step(
        q, q, q, jnp.full((B,), args.context, jnp.int32), g, kv_heads=kv_heads,
        position_rules=rules, window_sizes=windows, scale=D ** -0.5, layer=layer,
        interpret=args.smoke, target_programs=target), donate_argnums=(1,))
    box = {"g": jax.tree.map(jnp.copy, groups), "out": q}

    def run(steps: int):
        """``steps`` decode steps, layer after layer, until the last has finished."""
        for i in range(steps):
            box["out"], kv = step(q, box["g"], jnp.int32(i % L))
            box["g"] = tuple((k, v, g[2], g[3]) for (k, v), g in zip(kv, box["g"]))
        jax.block_until_ready(box["out"])

    run(args.warmup)
    row = {"shape": shape, "variant": variant, "batch": B, "programs": target,
           "default": target == TARGET_PROGRAMS}
    if jax.devices()[0].platform == "gpu":
        row.update({k: round(v, 2) for k, v in launch_times(lambda: run(args.steps)).items()})
        row["xla_read"] = round(read_time(box["g"], L, args.steps), 2)
    else:  # no device trace: the step's wall time
        t0 = time.perf_counter()
        run(args.steps)
        row["step_wall"] = round((time.perf_counter() - t0) / args.steps * 1e6, 1)
    return row


def table(rows) -> str:
    cols = [c for c in ("ls_decode_step", "ls_decode_merge", "xla_read", "step_wall")
            if any(c in r for r in rows)]
    lines = ["| shape | variant | batch | programs | " + " | ".join(f"{c} us" for c in cols) + " |",
             "|---|---|---|---|" + "---|" * len(cols)]
    for r in rows:
        programs = f"{r['programs']}" + (" (default)" if r["default"] else "")
        lines.append(f"| {r['shape']} | {r['variant']} | {r['batch']} | {programs} | "
                     + " | ".join(f"{r.get(c, '-')}" for c in cols) + " |")
    return "\n".join(lines)


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="paper")
    parser.add_argument("--variants", default="LS,MHSA")
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--programs", default=str(TARGET_PROGRAMS),
                        help="target_programs values, comma-separated")
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--window", type=int, default=50, help="the local heads' p")
    parser.add_argument("--warmup", type=int, default=6)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, interpret mode")
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args(argv)
    if args.smoke:
        args.shapes, args.batches, args.context, args.window = "smoke", "2", 200, 8
        args.warmup, args.steps = 2, 2
    shapes, variants = args.shapes.split(","), args.variants.split(",")
    bad = [s for s in shapes if s not in SHAPES] + [v for v in variants if v not in ("LS", "MHSA")]
    if bad:
        print(f"decode_kernel.py: unknown shape or variant {bad[0]!r} (shapes: "
              f"{', '.join(SHAPES)}; variants: LS, MHSA)", file=sys.stderr)
        return 2
    rows = []
    for shape in shapes:
        for variant in variants:
            for B in ints(args.batches):
                for target in ints(args.programs):
                    rows.append(measure(shape, variant, B, target, args))
                    print(json.dumps(rows[-1]), flush=True)
    print(table(rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
