"""Time to the first training step: jitted init, lowering and compiling the train step, then
the step time, per model shape and attention backend.

    python bench/startup.py --out startup.json                  # 125m and paper, one GPU
    python bench/startup.py --shapes 125m --attention default --out s.json
    python bench/startup.py --baseline before.json --out after.json   # adds "step vs baseline"
    JAX_PLATFORMS=cpu python bench/startup.py --tiny --out /tmp/s.json   # seconds (a test runs it)

Shapes are ``bench/scaling.py``'s (``125m``: 12 layers, d=768, T=8192, batch 2; ``paper``:
6 layers, d=192, T=2048, batch 8; ``--tiny``: its smoke shape), on one device. Attention:
``default`` (the model's ``attn_implementation=None``: our kernels on a GPU) and ``cudnn``,
or any ``kernels.ls_attention`` backend. The step is ls_jax's own: ``compile_train_fns`` of
ls_jax/training/step.py (the state donated, the plain step without logit statistics).

Each (shape, attention) runs in a fresh subprocess with JAX's persistent compilation cache off,
so that no compile is served from a cache. Measured (wall clock, seconds):

  init      lower + compile + run of the jitted state initialisation (``TrainFns.init``)
  lower     tracing and lowering the train step to StableHLO (``jit(...).lower``)
  compile   compiling it (``Lowered.compile``)
  step      the median step time over ``--steps`` steps after ``--warmup`` (each blocked on)
  first     from the worker's start (before ``import jax``) to the end of its first step

Prints the table last and writes JSON to ``--out``; a run that fails or passes ``--per-run-s``
is a row with its error and the exit status is 1.

``--train`` times ``train.py`` itself instead (the issue-37 CPU target: the first step of
``make train`` within 10 s of its start):

    python bench/startup.py --train --out train_startup.json       # tiny, 3 runs per cache
    python bench/startup.py --train --cache off,cold,warm --repeats 3 --out t.json

Each run is ``train.py --config <--config> --workdir <fresh dir>`` in a fresh process, timed
from just before its process starts to the end of its first step (its results ready on the
host), after which the run ends at once. Cache states: ``off`` (JAX's persistent compilation
cache disabled), ``cold`` (an empty cache directory, filled by the run) and ``warm`` (the
directory the last cold run filled). The table gives the median of ``--repeats`` runs per state
and the 1-minute load average before each run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

T_START = time.perf_counter()  # the worker's start: "first" counts from here

from scaling import SHAPES, SMOKE_SHAPES  # noqa: E402  bench/scaling.py, beside this script

ATTENTIONS = ("default", "reference", "cudnn", "pallas_gpu", "pallas_tpu", "split")
# The issue-37 targets (docs/performance.md): a first step in seconds
INIT_TARGET_S = 5.0
LOWER_COMPILE_TARGET_S = 20.0
LOWER_COMPILE_VS_CUDNN = 1.5


def worker(shape_name: str, shape: dict, attention: str, steps: int, warmup: int) -> dict:
    """One (shape, attention) measurement in this process; returns a JSON-able dict."""
    import jax

    jax.config.update("jax_enable_compilation_cache", False)  # every compile is a real one
    import numpy as np
    from flax import nnx

    from ls_jax import sharding as sharding_lib
    from ls_jax.config import Config, DataConfig, MeshConfig, ModelConfig, TrainConfig
    from ls_jax.layers.transformer import count_params
    from ls_jax.training.state import init_key
    try:
        from ls_jax.training.step import compile_train_fns
    except ImportError:  # a checkout from before ls_jax/training/step.py, timed as a baseline
        from ls_jax.training.train import compile_train_fns

    model = dict(shape["model"], attn_implementation=None if attention == "default"
                 else attention)
    T, batch = shape["seq_len"], shape["per_device_batch"] * jax.device_count()
    cfg = Config(name=f"startup_{shape_name}", model=ModelConfig(**model),
                 data=DataConfig(seq_len=T),
                 train=TrainConfig(batch_size=batch, warmup_steps=1, num_steps=warmup + steps),
                 mesh=MeshConfig())
    mesh = sharding_lib.make_mesh(cfg.mesh)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.model.vocab_size, size=(batch, T + 1), dtype=np.int32)
    out = {"shape": shape_name, "attention": attention, "devices": jax.device_count(),
           "device_kind": jax.devices()[0].device_kind, "backend": jax.default_backend(),
           "seq_len": T, "batch": batch}
    with jax.set_mesh(mesh):
        fns = compile_train_fns(cfg, mesh)
        key = init_key(cfg)
        t0 = time.perf_counter()
        init_lowered = fns.init.lower(key)
        t1 = time.perf_counter()
        init_compiled = init_lowered.compile()
        t2 = time.perf_counter()
        state = jax.block_until_ready(init_compiled(key))
        t3 = time.perf_counter()
        out.update(init_s=t3 - t0, init_lower_s=t1 - t0, init_compile_s=t2 - t1,
                   init_run_s=t3 - t2,
                   params=count_params(nnx.merge(fns.graphdef, state)[0]))
        batch_arr = sharding_lib.global_batch({"inputs": tokens[:, :-1],
                                               "targets": tokens[:, 1:]},
                                              sharding_lib.batch_sharding(mesh))
        t0 = time.perf_counter()
        lowered = fns.steps[False].lower(state, batch_arr)
        t1 = time.perf_counter()
        compiled = lowered.compile()
        t2 = time.perf_counter()
        out.update(lower_s=t1 - t0, compile_s=t2 - t1)
        times = []
        for i in range(warmup + steps):
            t0 = time.perf_counter()
            state, metrics = compiled(state, batch_arr)
            loss = float(jax.block_until_ready(metrics["loss"]))
            times.append(time.perf_counter() - t0)
            if i == 0:
                out["first_step_at_s"] = time.perf_counter() - T_START
        step_s = statistics.median(times[warmup:])
    out.update(step_s=step_s, tokens_per_s=batch * T / step_s, loss=loss)
    return out


def run_one(shape_name: str, attention: str, args) -> dict:
    """The worker in a fresh subprocess (one device, no compilation cache)."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env["JAX_ENABLE_COMPILATION_CACHE"] = "false"
    if not args.tiny and "CUDA_VISIBLE_DEVICES" not in env:
        env["CUDA_VISIBLE_DEVICES"] = "0"  # one GPU: the table is per device
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", shape_name,
           "--attention", attention, "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--out", os.devnull]
    if args.tiny:
        cmd.append("--tiny")
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                              timeout=args.per_run_s)
    except subprocess.TimeoutExpired:
        return {"shape": shape_name, "attention": attention,
                "error": f"timed out after {args.per_run_s:.0f} s (--per-run-s)"}
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines()
        return {"shape": shape_name, "attention": attention,
                "error": lines[-1] if lines else f"exit {proc.returncode}",
                "stderr_tail": proc.stderr[-4000:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def targets(results: list[dict]) -> list[str]:
    """The issue's startup targets per shape, against the cuDNN row of the same run."""
    ok = [r for r in results if "error" not in r]
    lines = []
    for r in ok:
        if r["attention"] != "default" or r["shape"] not in SHAPES:  # the smoke shape has none
            continue
        lines.append(f"{r['shape']} init {r['init_s']:.1f} s (target <= {INIT_TARGET_S:g} s): "
                     f"{'PASS' if r['init_s'] <= INIT_TARGET_S else 'MISS'}")
        lc = r["lower_s"] + r["compile_s"]
        lines.append(f"{r['shape']} lower + compile {lc:.1f} s (target <= "
                     f"{LOWER_COMPILE_TARGET_S:g} s): "
                     f"{'PASS' if lc <= LOWER_COMPILE_TARGET_S else 'MISS'}")
        cudnn = [c for c in ok if c["shape"] == r["shape"] and c["attention"] == "cudnn"]
        if cudnn:
            ratio = lc / (cudnn[0]["lower_s"] + cudnn[0]["compile_s"])
            lines.append(f"{r['shape']} lower + compile {ratio:.2f}x cuDNN's (target <= "
                         f"{LOWER_COMPILE_VS_CUDNN:g}x): "
                         f"{'PASS' if ratio <= LOWER_COMPILE_VS_CUDNN else 'MISS'}")
    return lines


def table(results: list[dict], baseline: dict) -> str:
    lines = ["| shape | attention | init s | lower s | compile s | lower + compile s | step ms | "
             "tokens/s | step vs baseline | first step at s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['shape']} | {r['attention']} | error: {r['error'][:120]} "
                         f"| | | | | | | |")
            continue
        base = baseline.get((r["shape"], r["attention"]))
        vs = f"{r['step_s'] / base['step_s']:.3f}x" if base else ""
        lines.append(
            f"| {r['shape']} | {r['attention']} | {r['init_s']:.1f} | {r['lower_s']:.1f} | "
            f"{r['compile_s']:.1f} | {r['lower_s'] + r['compile_s']:.1f} | "
            f"{1e3 * r['step_s']:.2f} | {r['tokens_per_s']:,.0f} | {vs} | "
            f"{r['first_step_at_s']:.1f} |")
    return "\n".join(lines)


def load_baseline(path: str | None) -> dict:
    if path is None:
        return {}
    with open(path) as f:
        rows = json.load(f)["results"]
    return {(r["shape"], r["attention"]): r for r in rows if "error" not in r}


# -- train.py's first step -------------------------------------------------------------------

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIRST_STEP_TARGET_S = 10.0  # issue 37: the first step of `make train` within 10 s of its start
CACHE_STATES = ("off", "cold", "warm")


def train_worker(train_args: list[str]) -> None:
    """Runs train.py with ``train_args`` in this process; at the end of its first step prints
    ``{"first_step_end": time.time()}`` and exits. ``ls_jax.training.train`` is patched as it is
    imported (train.py imports it itself, in its own order)."""
    import importlib.abc
    import importlib.util
    import runpy

    def patch(module):
        def first_step_done(self, step, dev_metrics):  # _StepLog.record: called after each step
            import jax
            jax.block_until_ready(dev_metrics)
            print(json.dumps({"first_step_end": time.time(), "step": step}), flush=True)
            os._exit(0)

        module._StepLog.record = first_step_done

    class PatchOnImport(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != "ls_jax.training.train":
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            exec_module = spec.loader.exec_module

            def exec_and_patch(module):
                exec_module(module)
                patch(module)

            spec.loader.exec_module = exec_and_patch
            return spec

    sys.meta_path.insert(0, PatchOnImport())
    sys.argv = [os.path.join(ROOT, "train.py"), *train_args]
    runpy.run_path(sys.argv[0], run_name="__main__")
    raise SystemExit("train.py ended before its first step")


def run_train(config: str, cache: str, cache_dir: str, workdir: str, args) -> dict:
    """One train.py run in a fresh process: seconds from its start to the end of step 1."""
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    if cache == "off":
        env["JAX_ENABLE_COMPILATION_CACHE"] = "false"
    else:
        env.pop("JAX_ENABLE_COMPILATION_CACHE", None)
        env["JAX_COMPILATION_CACHE_DIR"] = cache_dir
    cmd = [sys.executable, os.path.abspath(__file__), "--out", os.devnull, "--train-worker",
           "--", "--config", config, "--workdir", workdir]
    load = os.getloadavg()[0]
    start = time.time()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT,
                              timeout=args.per_run_s)
    except subprocess.TimeoutExpired:
        return {"cache": cache, "load_1min": load,
                "error": f"timed out after {args.per_run_s:.0f} s (--per-run-s)"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith('{"first_step_end"')]
    if proc.returncode != 0 or not lines:
        tail = (proc.stdout + proc.stderr).strip().splitlines()
        return {"cache": cache, "load_1min": load,
                "error": tail[-1] if tail else f"exit {proc.returncode}"}
    return {"cache": cache, "load_1min": load,
            "first_step_s": json.loads(lines[-1])["first_step_end"] - start}


def train_main(args) -> int:
    import tempfile
    states = args.cache.split(",")
    results = []
    with tempfile.TemporaryDirectory(prefix="ls_jax_startup_") as tmp:
        warm_dir = None
        for state in ("off", "cold", "warm"):  # warm needs a cold run's cache
            if state not in states and not (state == "cold" and "warm" in states):
                continue
            for i in range(args.repeats if state in states else 1):
                cache_dir = warm_dir if state == "warm" else os.path.join(tmp, f"cache_{state}{i}")
                r = run_train(args.config, state, cache_dir, os.path.join(tmp, f"run_{state}{i}"),
                              args)
                if state == "cold" and "error" not in r:
                    warm_dir = cache_dir
                if state in states:
                    results.append(r)
                    print(json.dumps(r), flush=True)
            if state == "cold" and warm_dir is None and "warm" in states:
                results.append({"cache": "warm", "error": "no cold run filled a cache"})
    rows = ["| cache | first step at s (median) | runs s | 1-min load |", "|---|---|---|---|"]
    summary = {}
    for state in states:
        ok = [r["first_step_s"] for r in results if r["cache"] == state and "first_step_s" in r]
        loads = [r["load_1min"] for r in results if r["cache"] == state and "load_1min" in r]
        if ok:
            summary[state] = statistics.median(ok)
            rows.append(f"| {state} | {summary[state]:.1f} | "
                        f"{', '.join(f'{t:.1f}' for t in ok)} | "
                        f"{', '.join(f'{x:.1f}' for x in loads)} |")
        else:
            rows.append(f"| {state} | error | | |")
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "results": results, "median_s": summary,
                   "cpu_count": os.cpu_count()}, f, indent=2)
    for state, t in summary.items():
        print(f"{args.config} first step, {state} cache: {t:.1f} s (target <= "
              f"{FIRST_STEP_TARGET_S:g} s): {'PASS' if t <= FIRST_STEP_TARGET_S else 'MISS'}")
    print("\n".join(rows))
    return 0 if all("error" not in r for r in results) else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON output path")
    parser.add_argument("--shapes", default=None,
                        help=f"comma-separated subset of {list(SHAPES)} (default: all; "
                        f"--tiny: {list(SMOKE_SHAPES)})")
    parser.add_argument("--attention", default=None,
                        help=f"comma-separated backends from {list(ATTENTIONS)} (default: "
                        "default,cudnn; --tiny: default)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="steps before the timed ones")
    parser.add_argument("--per-run-s", type=float, default=900.0,
                        help="time limit of one (shape, attention) run")
    parser.add_argument("--baseline", default=None,
                        help="an earlier --out JSON: the table adds each step time against it")
    parser.add_argument("--tiny", action="store_true",
                        help="the smoke shape, 2 steps (a CPU check in seconds)")
    parser.add_argument("--train", action="store_true",
                        help="time train.py to the end of its first step instead (see above)")
    parser.add_argument("--config", default="tiny", help="--train: the config (default tiny)")
    parser.add_argument("--cache", default="cold,warm",
                        help=f"--train: comma-separated states from {list(CACHE_STATES)} "
                        "(default cold,warm)")
    parser.add_argument("--repeats", type=int, default=3, help="--train: runs per cache state")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--train-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("train_args", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.train_worker:
        train_worker(args.train_args)
    if args.train:
        for state in args.cache.split(","):
            if state not in CACHE_STATES:
                parser.error(f"--cache: expected names from {list(CACHE_STATES)}, got {state!r}")
        if args.repeats < 1:
            parser.error(f"--repeats: expected an int >= 1, got {args.repeats}")
        if not args.per_run_s > 0:
            parser.error(f"--per-run-s: expected seconds > 0, got {args.per_run_s}")
        return train_main(args)
    shapes = SMOKE_SHAPES if args.tiny else SHAPES
    if args.tiny:
        args.steps, args.warmup = min(args.steps, 2), min(args.warmup, 1)
    for name in ("steps", "warmup"):
        minimum = 1 if name == "steps" else 0
        if getattr(args, name) < minimum:
            parser.error(f"--{name}: expected an int >= {minimum}, got {getattr(args, name)}")
    if not args.per_run_s > 0:
        parser.error(f"--per-run-s: expected seconds > 0, got {args.per_run_s}")
    names = args.shapes.split(",") if args.shapes else list(shapes)
    for name in names:
        if name not in shapes:
            parser.error(f"--shapes: expected names from {list(shapes)}, got {name!r}")
    attentions = (args.attention or ("default" if args.tiny else "default,cudnn")).split(",")
    for a in attentions:
        if a not in ATTENTIONS:
            parser.error(f"--attention: expected names from {list(ATTENTIONS)}, got {a!r}")

    if args.worker:
        print(json.dumps(worker(args.worker, shapes[args.worker], attentions[0], args.steps,
                                args.warmup)), flush=True)
        return 0

    try:
        baseline = load_baseline(args.baseline)
    except (OSError, ValueError, KeyError, TypeError) as e:
        parser.error(f"--baseline: expected a JSON file written by --out, got {args.baseline!r} "
                     f"({type(e).__name__}: {e})")
    results = []
    for name in names:
        for attention in attentions:
            r = run_one(name, attention, args)
            results.append(r)
            print(json.dumps({k: v for k, v in r.items() if k != "stderr_tail"}), flush=True)
    lines = targets(results)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "results": results, "targets": lines}, f, indent=2)
    for line in lines:
        print(line)
    print(table(results, baseline))
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
