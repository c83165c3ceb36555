"""The model's train step, LS against MHSA: milliseconds per step on one device and the ratio.

The paper shape (6 layers, d_model 192, 6 heads of 32, byte vocabulary) at T = 8192, batch 8,
bfloat16 compute: LS (1 global head, windows 50 and 128) and MHSA (every head global), each on
its default attention backend, the step `train.py` runs (forward, backward, AdamW update).
Steps run back to back as in `train.py`, each step's loss read one step late, so the host's
dispatch overlaps the device's work. A round times ``--reps`` steps of each variant, rounds
alternate the variants' order, and a row is the median over rounds of the time per step.

  python bench/model_step.py --out docs/performance/17_model_step.json
  JAX_PLATFORMS=cpu python bench/model_step.py --smoke --out /tmp/model_step.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from perf_page import current_card, current_commit, recorded_args, write_table  # bench/

# the target: LS's step at least this many times faster than MHSA's
TARGET = 2.2
PAPER = dict(vocab_size=256, n_layer=6, d_model=192, n_head=6, head_dim=32,
             compute_dtype="bfloat16")
SMOKE = dict(vocab_size=64, n_layer=1, d_model=32, n_head=4, head_dim=8)
VARIANTS = (("LS p=50", 1, 50), ("LS p=128", 1, 128), ("MHSA", None, 128))


def compiled_step(model: dict, n_global, window: int, T: int, B: int):
    """(step, state, batch) of the train step of ``model`` with ``n_global`` global heads
    (None: all), compiled on one device."""
    import jax
    import numpy as np

    from ls_jax import sharding as sharding_lib
    from ls_jax.config import Config, DataConfig, MeshConfig, ModelConfig, TrainConfig
    from ls_jax.training.state import init_key
    from ls_jax.training.step import compile_train_fns

    heads = model["n_head"]
    cfg = Config(name="model_step",
                 model=ModelConfig(**model, n_global_heads=heads if n_global is None else n_global,
                                   window=window, max_seq_len=T),
                 data=DataConfig(seq_len=T),
                 train=TrainConfig(batch_size=B, warmup_steps=1, num_steps=10**6),
                 mesh=MeshConfig())
    mesh = sharding_lib.make_mesh(cfg.mesh)
    tokens = np.random.default_rng(0).integers(0, model["vocab_size"], size=(B, T + 1),
                                               dtype=np.int32)
    with jax.set_mesh(mesh):
        fns = compile_train_fns(cfg, mesh)
        state = fns.init(init_key(cfg))
        batch = sharding_lib.global_batch({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]},
                                          sharding_lib.batch_sharding(mesh))
        step = fns.steps[False].lower(state, batch).compile()
    return step, state, batch


def measure(args) -> dict[str, float]:
    """Milliseconds per step of each variant: per round, ``args.warmup`` steps, then the wall
    time of ``args.reps`` steps back to back over ``args.reps``; the median over
    ``args.rounds`` rounds of alternated order."""
    import jax

    model = SMOKE if args.smoke else PAPER
    cases = {name: list(compiled_step(model, g, w, args.seq_len, args.batch_size))
             for name, g, w in VARIANTS}
    times = {name: [] for name in cases}
    for rnd in range(args.rounds):
        for name in (list(cases) if rnd % 2 == 0 else list(cases)[::-1]):
            step, state, batch = cases[name]
            for _ in range(args.warmup):
                state, metrics = step(state, batch)  # the state is donated
                jax.block_until_ready(metrics["loss"])
            t0 = time.perf_counter()
            late = None
            for _ in range(args.reps):
                state, metrics = step(state, batch)
                if late is not None:
                    jax.device_get(late)  # the previous step's loss, as train.py reads it
                late = metrics["loss"]
            jax.device_get(late)
            times[name].append((time.perf_counter() - t0) * 1e3 / args.reps)
            cases[name][1] = state
    return {name: statistics.median(t) for name, t in times.items()}


def table(ms: dict[str, float], args) -> dict:
    commit = args.commit or current_commit()
    rows = [{"variant": name, "ms": t, "x": ms["MHSA"] / t} for name, t in ms.items()]
    return {
        "section": "kernel",
        "title": (f"The model's train step (`train.py`'s), LS against MHSA, default backends: "
                  f"paper shape, T={args.seq_len}, batch {args.batch_size}"),
        "card": current_card(),
        "commit": commit,
        "commands": [" ".join(["python bench/model_step.py"] + args.argv)],
        "columns": [{"header": "variant", "cell": "{variant}"},
                    {"header": "ms per step", "cell": "{ms:.2f}"},
                    {"header": f"MHSA / variant (target for LS: {TARGET}x)",
                     "cell": "{x:.2f}x"}],
        "rows": rows,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="the JSON table to write")
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--reps", type=int, default=20, help="timed steps per variant and round")
    ap.add_argument("--warmup", type=int, default=2, help="steps before the timed ones")
    ap.add_argument("--smoke", action="store_true", help="a tiny model and sequence (CPU)")
    ap.add_argument("--commit", help="the commit measured (default: git's HEAD here)")
    argv = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(argv)
    for name in ("seq_len", "batch_size", "rounds", "reps"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}: expected an int >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        ap.error(f"--warmup: expected an int >= 0, got {args.warmup}")
    args.argv = recorded_args(argv)
    if args.smoke:
        args.seq_len, args.batch_size, args.rounds, args.reps, args.warmup = 256, 2, 1, 1, 0
    out = table(measure(args), args)
    write_table(args.out, out)
    for row in out["rows"]:
        print(f"{row['variant']:>9}  {row['ms']:.2f} ms  {row['x']:.2f}x")
    worst = min(r["x"] for r in out["rows"] if r["variant"] != "MHSA")
    print(f"LS train step >= {TARGET}x MHSA: {'PASS' if worst >= TARGET else 'MISS'} "
          f"(lowest {worst:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
