"""Where the time of an LS-attention call goes: each part of the call timed alone.

For one case (default: the paper's layer, B=4, T=8192, 16 heads of D=64, 1 global + 15 local
heads of window 128, bf16) it times, forward and forward+backward, through ``ls_attention``:

  all heads        the call users run (implementation=None)
  local heads      the local heads alone
  global (ours)    the global heads alone, implementation="pallas_gpu"
  global (cuDNN)   the same, implementation="cudnn"
  global, full     every head global (ours), per head: the global work at full occupancy
  local floor      an XLA elementwise pass over the local heads' bytes (forward: read q, k,
                   v, write o; backward: read q, k, v, o, dO, write dQ, dK, dV)
  composition      the cuDNN composition, implementation="cudnn", all heads

and writes them as one table of docs/performance/ (``--out``), with two limits of the ratio
composition / ours: the sum of parts (local + global, ours) and the floor (local floor +
global at full occupancy). Then ``python bench/perf_page.py`` rewrites docs/performance.md.

  python bench/parts.py --out docs/performance/16_kernel_parts.json
  python bench/parts.py --smoke --out /tmp/parts.json     # tiny sizes, any platform
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp

from attention import head_windows, make_input_sets, time_ms  # bench/, beside this script
from perf_page import current_card, current_commit, recorded_args, write_table  # bench/
from ls_jax.kernels import ls_attention

PARTS = ("all heads", "local heads", "global (ours)", "global (cuDNN)", "global, full",
         "local floor", "composition")


def attention_pair(windows, implementation):
    """jitted (forward fn(q, k, v, do), forward+backward fn(q, k, v, do))."""
    def attn(q, k, v):
        return ls_attention(q, k, v, windows, implementation=implementation)

    def fwd_bwd(q, k, v, do):
        _, vjp = jax.vjp(attn, q, k, v)
        return vjp(do)
    return jax.jit(lambda q, k, v, do: attn(q, k, v)), jax.jit(fwd_bwd)


def floor_pair():
    """An elementwise pass over the bytes attention must move: the forward reads q, k, v and
    writes o; the backward reads q, k, v, o, dO and writes dQ, dK, dV."""
    def fwd(q, k, v, do):
        return q + k + v

    def fwd_bwd(q, k, v, do):
        o = jax.lax.optimization_barrier(q + k + v)  # o written, then read again
        return q * o + do, k * o + do, v * o + do
    return jax.jit(fwd), jax.jit(fwd_bwd)


def time_part(pair, sets, args) -> tuple[float, float]:
    fwd, fwd_bwd = pair
    return (time_ms(fwd, sets, args.reps, args.warmup, args.batch),
            time_ms(fwd_bwd, sets, args.reps, args.warmup, args.batch))


def measure(args) -> dict:
    B, T, H, D = args.batch_size, args.n, args.heads, args.d
    windows = head_windows(args.mix, H, args.p)
    glob = tuple(w for w in windows if w is None)
    local = tuple(w for w in windows if w is not None)
    sets = lambda heads: make_input_sets(B, T, heads, D, jnp.bfloat16, seed=0)  # noqa: E731
    on_gpu = jax.default_backend() == "gpu"
    cudnn = "cudnn" if on_gpu else "reference"
    ours = "pallas_gpu" if on_gpu else "reference"
    times = {
        "all heads": time_part(attention_pair(windows, None), sets(H), args),
        "local heads": time_part(attention_pair(local, None), sets(len(local)), args),
        "global (ours)": time_part(attention_pair(glob, ours), sets(len(glob)), args),
        "global (cuDNN)": time_part(attention_pair(glob, cudnn), sets(len(glob)), args),
        "local floor": time_part(floor_pair(), sets(len(local)), args),
        "composition": time_part(attention_pair(windows, cudnn), sets(H), args),
    }
    full = time_part(attention_pair((None,) * H, ours), sets(H), args)
    times["global, full"] = tuple(t * len(glob) / H for t in full)
    return {"case": dict(batch=B, seq_len=T, heads=H, head_dim=D, mix=args.mix, window=args.p),
            "times": times}


def table(measured: dict, args) -> dict:
    t = measured["times"]
    rows = [{"part": name, "fwd": t[name][0], "fb": t[name][1],
             "fwd_x": t["composition"][0] / t[name][0], "fb_x": t["composition"][1] / t[name][1]}
            for name in PARTS]
    limits = {
        "sum": [t["composition"][i] / (t["local heads"][i] + t["global (ours)"][i])
                for i in (0, 1)],
        "floor": [t["composition"][i] / (t["local floor"][i] + t["global, full"][i])
                  for i in (0, 1)],
    }
    c = measured["case"]
    commit = args.commit or current_commit()
    note = (
        f"Limits of composition / ours, forward and forward+backward. Sum of parts, "
        f"composition / (local heads + global (ours)): {limits['sum'][0]:.2f}x and "
        f"{limits['sum'][1]:.2f}x. Floor, composition / (local floor + global, full): "
        f"{limits['floor'][0]:.2f}x and {limits['floor'][1]:.2f}x. \"global, full\" is the "
        f"all-global call (ours) per head: the global work at full occupancy. The call itself: "
        f"{rows[0]['fwd_x']:.2f}x and {rows[0]['fb_x']:.2f}x.")
    return {
        "section": "kernel",
        "title": (f"Where the time goes: {c['mix']} (p={c['window']}), B={c['batch']}, "
                  f"T={c['seq_len']}, D={c['head_dim']}"),
        "card": current_card(),
        "commit": commit,
        "commands": [" ".join(["python bench/parts.py"] + args.argv)],
        "note": note,
        "columns": [
            {"header": "part", "cell": "{part}"},
            {"header": "forward ms", "cell": "{fwd:.3f}"},
            {"header": "forward+backward ms", "cell": "{fb:.3f}"},
            {"header": "composition / part (fwd, f+b)", "cell": "{fwd_x:.2f}, {fb_x:.2f}"},
        ],
        "rows": rows,
        "limits": limits,
    }


def add_case_arguments(ap: argparse.ArgumentParser) -> None:
    """The one case a table of where the time goes measures (default: the paper's layer)."""
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--p", type=int, default=128)
    ap.add_argument("--mix", default="1g15l")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=4)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="the JSON table to write")
    add_case_arguments(ap)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=5, help="back-to-back calls per sample")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (a CPU check)")
    ap.add_argument("--commit", help="the commit measured (default: git's HEAD here)")
    argv = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(argv)
    args.argv = recorded_args(argv)
    if args.smoke:
        args.d, args.n, args.p, args.heads, args.batch_size = 16, 64, 8, 4, 1
        args.mix, args.reps, args.warmup, args.batch = "1g15l", 1, 1, 1
    out = table(measure(args), args)
    write_table(args.out, out)
    for row in out["rows"]:
        print(f"{row['part']:>16}  {row['fwd']:.3f}  {row['fb']:.3f} ms")
    print(out["note"])


if __name__ == "__main__":
    main()
