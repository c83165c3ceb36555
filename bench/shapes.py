"""What users get (``ls_attention`` with its default backend) against the cuDNN composition on
shapes around the tables' ones: heads, batch, length, head size, GQA and windows varied, forward
and forward+backward, with each row's largest relative error against the composition (output
and gradients). A row below --min-ratio in a direction where the default runs our kernels is
marked "slower" (where it runs cuDNN, the composition itself, the ratio is 1 but for noise);
--check makes any such row an exit status of 1.

  python bench/shapes.py                          # every shape
  python bench/shapes.py --shapes d256-mix,d64-wide-windows --check
  python bench/shapes.py --list                   # the shapes, one a line

Timing as in bench/attention.py (fresh bf16 inputs, the median of --reps samples). Prints a
markdown table and each row as a JSON line when measured; with --out, the rows as JSON, the
file rewritten after each row, so that a run stopped part-way keeps what it measured and
--resume goes on from there (one detached run, collected by short calls):

  setsid python bench/shapes.py --out shapes.json --resume > shapes.log 2>&1 &
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp

import attention as bench  # bench/attention.py, beside this script
from ls_jax.kernels import explain

# name: (D, batch, T, query heads, kv heads, global heads, local windows cycled over the rest)
SHAPES = {
    "paper-layer": (64, 4, 8192, 16, 16, 1, (128,)),
    "d64-batch1-t4096": (64, 1, 4096, 16, 16, 1, (128,)),
    "d64-batch2-t16384": (64, 2, 16384, 16, 16, 1, (128,)),
    "d64-batch8-p64": (64, 8, 8192, 16, 16, 1, (64,)),
    "d64-batch16-t1024": (64, 16, 1024, 16, 16, 1, (128,)),
    "d64-batch32-t512": (64, 32, 512, 8, 8, 1, (64,)),
    "d64-gqa": (64, 4, 8192, 16, 4, 1, (128,)),
    "d64-mqa": (64, 4, 8192, 16, 1, 1, (128,)),
    "d64-gqa-all-local": (64, 4, 8192, 16, 2, 0, (128,)),
    "d64-gqa-t32768": (64, 2, 32768, 16, 4, 2, (128,)),
    "d64-12-heads-p100": (64, 4, 8192, 12, 12, 1, (100,)),
    "d64-32-heads": (64, 2, 8192, 32, 32, 2, (128,)),
    "d64-8-heads": (64, 4, 8192, 8, 8, 1, (128,)),
    "d64-half-global": (64, 4, 8192, 16, 16, 8, (128,)),
    "d64-one-local-head": (64, 4, 8192, 16, 16, 15, (128,)),
    "d64-p1": (64, 4, 8192, 16, 16, 1, (1,)),
    "d64-p32-4-global": (64, 4, 8192, 16, 16, 4, (32,)),
    "d64-p256-2-global": (64, 4, 8192, 16, 16, 2, (256,)),
    "d64-p512": (64, 4, 8192, 16, 16, 1, (512,)),
    "d64-wide-windows": (64, 4, 8192, 16, 16, 1, (4000,)),
    "d64-mixed-windows": (64, 4, 8192, 16, 16, 1, (32, 128, 256)),
    "d64-t6000": (64, 4, 6000, 16, 16, 1, (128,)),
    "d64-t2048": (64, 4, 2048, 16, 16, 1, (64,)),
    "d64-all-local-p96": (64, 4, 8192, 16, 16, 0, (96,)),
    "d64-all-local-p1024": (64, 4, 8192, 16, 16, 0, (1024,)),
    "d64-all-local-p2048-gqa": (64, 2, 16384, 16, 4, 0, (2048,)),
    "d128-mix": (128, 4, 8192, 16, 16, 1, (128,)),
    "d128-all-local": (128, 4, 8192, 16, 16, 0, (128,)),
    "d128-all-local-p256": (128, 2, 16384, 16, 16, 0, (256,)),
    "d128-gqa-p256": (128, 2, 16384, 8, 2, 1, (256,)),
    "d128-4-global-p512": (128, 4, 8192, 16, 16, 4, (512,)),
    "d128-batch1-t32768": (128, 1, 32768, 8, 8, 1, (512,)),
    "d32-mix": (32, 4, 8192, 16, 16, 1, (128,)),
    "d32-all-local-t32768": (32, 1, 32768, 16, 16, 0, (50,)),
    "d16-mix": (16, 4, 8192, 16, 16, 1, (128,)),
    "d48-mix": (48, 4, 8192, 16, 16, 1, (128,)),
    "d96-mix": (96, 4, 8192, 16, 16, 1, (128,)),
    "d192-mix": (192, 2, 4096, 8, 8, 1, (128,)),
    "d256-mix": (256, 2, 4096, 8, 8, 1, (128,)),
    "d256-all-global": (256, 2, 4096, 8, 8, 8, ()),
}


def windows_of(shape) -> tuple:
    """The call's windows: the global heads first (None), then the local windows in turn."""
    _, _, _, H, _, n_global, local = shape
    return (None,) * n_global + tuple(local[i % len(local)] for i in range(H - n_global))


def default_backends(name: str, **plan_for) -> tuple[str, str]:
    """(forward alone, forward+backward): the backends ``ls_attention``'s default runs for the
    shape (``plan_for``: ``explain``'s platform and device_kind; default: this machine)."""
    D, B, T, H, Hkv, _, _ = SHAPES[name]
    q = jax.ShapeDtypeStruct((B, T, H, D), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((B, T, Hkv, D), jnp.bfloat16)
    route = explain(q, kv, kv, windows_of(SHAPES[name]), **plan_for).routes[0]
    return route.primal, route.differentiated


def slower(row: dict, min_ratio: float) -> bool:
    """Whether a direction that runs our kernels is below ``min_ratio`` of the composition."""
    return any(row[ratio] < min_ratio
               for ratio, backend in (("r_fwd", row["fwd_backend"]), ("r_fb", row["fb_backend"]))
               if backend != "cudnn")


def measure(name: str, args) -> dict:
    D, B, T, H, Hkv, _, _ = SHAPES[name]
    windows = windows_of(SHAPES[name])
    row = {"shape": name, "D": D, "B": B, "T": T, "H": H, "Hkv": Hkv}
    row["fwd_backend"], row["fb_backend"] = default_backends(name)
    sets = bench.make_input_sets(B, T, H, D, jnp.bfloat16, seed=T + D, kv_heads=Hkv)
    ours, ours_grad = bench.attention_fns("auto", windows, D, None)
    comp, comp_grad = bench.attention_fns("cudnn_ls", windows, D, None)
    x = sets[0]
    row["error"] = max([bench.rel_err(ours(*x), comp(*x))]
                       + [bench.rel_err(g, w) for g, w in zip(ours_grad(*x), comp_grad(*x))])
    for key, fn in (("fwd_ours", ours), ("fwd_comp", comp), ("fb_ours", ours_grad),
                    ("fb_comp", comp_grad)):
        row[key] = bench.time_ms(fn, sets, args.reps, args.warmup, args.batch)
    row["r_fwd"] = row["fwd_comp"] / row["fwd_ours"]
    row["r_fb"] = row["fb_comp"] / row["fb_ours"]
    row["slower"] = slower(row, args.min_ratio)
    return row


def print_table(rows, args):
    print(f"\n## {jax.devices()[0].device_kind}, jax {jax.__version__}, bf16, ours = "
          f"ls_attention's default, comp. = the cuDNN composition, median of {args.reps}")
    print("| shape | D | B | T | H / kv | backends: fwd, f+b | fwd ms: ours / comp. | "
          "f+b ms: ours / comp. | ratio fwd, f+b | max rel. error | |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['D']} | {r['B']} | {r['T']} | {r['H']} / {r['Hkv']} | "
              f"{r['fwd_backend']}, {r['fb_backend']} | "
              f"{r['fwd_ours']:.3f} / {r['fwd_comp']:.3f} | {r['fb_ours']:.3f} / "
              f"{r['fb_comp']:.3f} | {r['r_fwd']:.2f}x, {r['r_fb']:.2f}x | {r['error']:.1e} | "
              f"{'slower' if r['slower'] else ''} |")


def settings(args) -> dict:
    """The timing options a row was measured with; rows of one file share them."""
    return {"reps": args.reps, "warmup": args.warmup, "batch": args.batch}


def read_rows(path: str, card: str, args) -> dict[str, dict]:
    """The rows of an earlier ``--out`` file by shape: none where there is no file; the run
    they continue must be on the same card and JAX with the same timing options (``fail``
    otherwise)."""
    if not os.path.exists(path):
        return {}
    try:
        with open(path) as f:
            earlier = json.load(f)
        rows = {r["shape"]: r for r in earlier["rows"]}
        theirs = (earlier["card"], earlier["jax"], earlier["settings"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        fail(f"--resume: {path} is not a shapes.py --out file ({e})")
    ours = (card, jax.__version__, settings(args))
    if theirs != ours:
        fail(f"--resume: {path} holds rows of {theirs[0]}, jax {theirs[1]}, {theirs[2]}; this "
             f"run is on {ours[0]}, jax {ours[1]}, {ours[2]}: name another --out")
    return rows


def write_rows(path: str, card: str, args, rows: dict[str, dict]) -> None:
    """``rows`` (by shape, in ``SHAPES``' order, then any others) to ``path``, all or
    nothing."""
    order = [n for n in SHAPES if n in rows] + [n for n in rows if n not in SHAPES]
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"card": card, "jax": jax.__version__, "settings": settings(args),
                   "rows": [rows[n] for n in order]}, f, indent=1)
    os.replace(tmp, path)


def measure_all(names: list[str], args, card: str, measure=measure) -> list[dict]:
    """The rows of ``names`` in turn, each printed as a JSON line when measured; with
    ``args.out`` the file rewritten after each row, and with ``args.resume`` the rows it holds
    kept (their shapes not measured again; rows of other shapes kept in the file too)."""
    rows = read_rows(args.out, card, args) if args.resume else {}
    for name in names:
        if name in rows:
            continue
        start = time.perf_counter()
        row = measure(name, args)
        row["seconds"] = round(time.perf_counter() - start, 1)
        rows[name] = row
        print(json.dumps(row), flush=True)
        if args.out:
            write_rows(args.out, card, args, rows)
    return [rows[n] for n in names]


def fail(message: str):
    print(f"shapes.py: {message}", file=sys.stderr)
    sys.exit(2)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES), help="names, comma separated")
    ap.add_argument("--list", action="store_true", help="print the shapes and exit")
    ap.add_argument("--min-ratio", type=float, default=1.0,
                    help="composition / ours below this marks a row slower")
    ap.add_argument("--check", action="store_true", help="exit 1 if a row is slower")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batch", type=int, default=3, help="back-to-back calls per sample")
    ap.add_argument("--out", help="write the rows here as JSON, after each row")
    ap.add_argument("--resume", action="store_true",
                    help="with --out: keep its rows and measure only the shapes it lacks")
    args = ap.parse_args(argv)
    if args.list:
        for name, (D, B, T, H, Hkv, n_global, local) in SHAPES.items():
            print(f"{name}: D={D} B={B} T={T} heads {H} (kv {Hkv}), {n_global} global, "
                  f"local windows {local}")
        return
    names = [n for n in args.shapes.split(",") if n]
    unknown = [n for n in names if n not in SHAPES] or ([] if names else [args.shapes])
    if unknown:
        fail(f"--shapes: expected names from `python bench/shapes.py --list`, got "
             f"{unknown[0]!r}")
    for option, least in (("reps", 1), ("batch", 1), ("warmup", 0)):
        if getattr(args, option) < least:
            fail(f"--{option}: expected an int >= {least}, got {getattr(args, option)}")
    if args.resume and not args.out:
        fail("--resume: continues an --out file; name one")
    if args.out and not args.resume and os.path.exists(args.out):
        fail(f"--out: {args.out} exists; pass --resume to go on from its rows, or name "
             "another file")
    if jax.default_backend() != "gpu":
        fail(f"needs a CUDA GPU for the cuDNN composition; JAX backend is "
             f"{jax.default_backend()!r}")
    rows = measure_all(names, args, jax.devices()[0].device_kind)
    print_table(rows, args)
    if args.check and any(r["slower"] for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
