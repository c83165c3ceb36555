"""Where an LS-attention call's time goes, kernel by kernel: one forward+backward call under
Nsight Compute (``ncu``), each kernel's duration, grid and registers, named by the call's plan.

For one case (default: the paper's layer, B=4, T=8192, 16 heads of D=64, 1 global + 15 local
heads of window 128, bf16) the script runs itself under ``ncu`` (``--child``): the child
compiles the call, runs it three times, then once between ``cuProfilerStart`` and
``cuProfilerStop``. Attention kernels are named by the heuristics' launches in order (a
Hopper or Triton backward is two kernels, dQ then dK/dV); any other kernel is XLA's, by its
own name. Writes one table of docs/performance/ (``--out``); ``--csv`` converts a saved ncu
CSV of such a call instead. Then ``python bench/perf_page.py`` rewrites docs/performance.md.

  python bench/kernel_times.py --out docs/performance/15_kernel_times.json
  python bench/kernel_times.py --csv ncu.csv --card "NVIDIA H200, jax 0.11.2" --commit C \\
      --out docs/performance/15_kernel_times.json
"""

from __future__ import annotations

import argparse
import csv
import io
import shutil
import subprocess
import sys

import jax.numpy as jnp

from attention import head_windows  # bench/, beside this script
from parts import add_case_arguments  # bench/, beside this script
from perf_page import current_card, current_commit, recorded_args, write_table  # bench/
from ls_jax.kernels.pallas_gpu import heuristics

METRICS = ("gpu__time_duration.sum", "launch__grid_size", "launch__registers_per_thread")
# the kernels of our launches, by the names ncu gives them (Mosaic GPU; Pallas Triton)
ATTENTION_KERNELS = ("entry_mosaic_gpu_kernel", "ls_attention_")
# the kernels of one launch, in order: a Hopper or Triton backward runs dQ, then dK/dV
KERNELS_PER_LAUNCH = {
    ("forward", "hopper"): ("forward",), ("forward", "strip"): ("forward",),
    ("forward", "triton"): ("forward",), ("backward", "hopper"): ("dQ", "dK/dV"),
    ("backward", "strip"): ("dQ+dK/dV",), ("backward", "triton"): ("dQ", "dK/dV")}


def case_of(args, gpu: heuristics.Gpu) -> heuristics.Case:
    windows = head_windows(args.mix, args.heads, args.p)
    return heuristics.Case(dtype=jnp.bfloat16, head_dim=args.d, windows=windows,
                           seq_len=args.n, batch=args.batch_size, num_kv_heads=args.heads,
                           has_segments=False, gpu=gpu)


def roles(case: heuristics.Case) -> list[str]:
    """Names of the call's attention kernels in launch order."""
    launches = heuristics.launches(case)
    names = []
    for pass_, group in (("forward", launches.forward), ("backward", launches.backward)):
        for launch in group:
            heads = {(case.windows[h] is None) for h in launch.heads}
            who = "global heads" if heads == {True} else "local heads" if heads == {False} \
                else "every head"
            for kernel in KERNELS_PER_LAUNCH[(pass_, launch.lowering)]:
                names.append(f"{pass_}, {who}: {launch.lowering} {kernel}")
    return names


def parse_ncu_csv(text: str) -> list[dict]:
    """Kernels of ``ncu --csv`` output in launch order: {name, us, grid, registers}; other
    lines (the program's own, ncu's notes) are skipped."""
    lines = [line for line in text.splitlines() if line.startswith('"')]
    kernels: dict[str, dict] = {}
    for row in csv.DictReader(io.StringIO("\n".join(lines))):
        kernel = kernels.setdefault(row["ID"], {"name": row["Kernel Name"]})
        value = float(row["Metric Value"].replace(",", ""))
        metric = row["Metric Name"]
        if metric == METRICS[0]:
            scale = {"ns": 1e-3, "us": 1.0, "ms": 1e3, "nsecond": 1e-3, "usecond": 1.0,
                     "msecond": 1e3}[row["Metric Unit"]]
            kernel["us"] = value * scale
        elif metric in METRICS[1:]:
            kernel[{METRICS[1]: "grid", METRICS[2]: "registers"}[metric]] = int(value)
    return [k for k in kernels.values() if "us" in k]


def table(kernels: list[dict], names: list[str], args, card: str, commit: str) -> dict:
    """The table of ``kernels`` (``parse_ncu_csv``), ours named ``names`` in order."""
    ours = [k["name"].startswith(ATTENTION_KERNELS) for k in kernels]
    if sum(ours) != len(names):
        raise SystemExit(f"error: expected {len(names)} attention kernels ({', '.join(names)}), "
                         f"ncu reported {sum(ours)}")
    named = iter(names)
    total = sum(k["us"] for k in kernels)
    rows = [{"kernel": next(named) if mine else f"XLA: {k['name']}",
             "ms": k["us"] / 1e3, "grid": k.get("grid", 0), "registers": k.get("registers", 0),
             "share": 100 * k["us"] / total} for k, mine in zip(kernels, ours)]
    return {
        "section": "kernel",
        "title": (f"Where the time goes, kernel by kernel (one call under ncu): {args.mix} "
                  f"(p={args.p}), B={args.batch_size}, T={args.n}, D={args.d}, f+b"),
        "card": card,
        "commit": commit,
        "commands": [" ".join(["python bench/kernel_times.py"] + args.argv)],
        "columns": [
            {"header": "kernel", "cell": "{kernel}"},
            {"header": "ms", "cell": "{ms:.3f}"},
            {"header": "share", "cell": "{share:.0f}%"},
            {"header": "programs", "cell": "{grid}"},
            {"header": "registers a thread", "cell": "{registers}"},
        ],
        "rows": rows,
    }


def child(args) -> None:
    """The profiled program: the call compiled and warmed up, then one call profiled."""
    import ctypes

    import jax

    from attention import attention_fns, make_input_sets
    sets = make_input_sets(args.batch_size, args.n, args.heads, args.d, jnp.bfloat16, seed=0)
    windows = head_windows(args.mix, args.heads, args.p)
    _, fwd_bwd = attention_fns("ours", windows, args.d, None)
    for _ in range(3):
        jax.block_until_ready(fwd_bwd(*sets[0]))
    cuda = ctypes.CDLL("libcuda.so.1")
    cuda.cuProfilerStart()
    jax.block_until_ready(fwd_bwd(*sets[-1]))
    cuda.cuProfilerStop()


def profile(case_argv: list[str]) -> str:
    """ncu's CSV of the child's profiled call (``case_argv``: the case's options)."""
    ncu = shutil.which("ncu")
    if ncu is None:
        raise SystemExit("error: ncu (Nsight Compute) is not on PATH")
    command = [ncu, "--clock-control", "none", "--profile-from-start", "off", "--csv",
               "--metrics", ",".join(METRICS), sys.executable, __file__, "--child", *case_argv]
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode:
        tail = (proc.stderr.strip().splitlines() or ["?"])[-1][:300]
        raise SystemExit(f"error: the profiled call failed: {tail}")
    return proc.stdout


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="the JSON table to write")
    add_case_arguments(ap)
    ap.add_argument("--csv", help="a saved ncu CSV of the call, instead of profiling it")
    ap.add_argument("--card", help="with --csv: the GPU and jax, as '<device kind>, jax <v>'")
    ap.add_argument("--commit", help="the commit measured (default: git's HEAD here)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    argv = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(argv)
    head_windows(args.mix, args.heads, args.p)  # a bad --mix: one line, before anything runs
    if args.child:
        return child(args)
    if not args.out:
        ap.error("--out is required")
    args.argv = recorded_args(argv, ("--commit", "--csv", "--card"))
    if args.csv:
        if not args.card or not args.commit:
            ap.error("--csv needs --card and --commit")
        with open(args.csv) as f:
            text = f.read()
        card = args.card
    else:
        text = profile(recorded_args(args.argv, ("--out",)))
        card = current_card()
    commit = args.commit or current_commit()
    gpu = heuristics.gpu_of_kind(card.split(",")[0])
    out = table(parse_ncu_csv(text), roles(case_of(args, gpu)), args, card, commit)
    write_table(args.out, out)
    for row in out["rows"]:
        print(f"{row['ms']:7.3f} ms  {row['share']:3.0f}%  {row['kernel']}")
    print(f"{sum(row['ms'] for row in out['rows']):7.3f} ms in all")


if __name__ == "__main__":
    main()
