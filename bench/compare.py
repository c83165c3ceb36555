"""Old against new: ``bench/attention.py`` from source trees, alternated, a table of ratios.

Each round runs the benchmark once from the old tree and once from each new one (in that
order, then the reverse in the next round), each in its own process with that tree first on
``sys.path``. Per new tree a table gives per row the median over rounds of forward and
forward+backward milliseconds and new/old; rows slower than ``--tolerance`` are marked.

  git archive <commit> | tar -x -C /tmp/old      # the old tree (repository layout)
  python bench/compare.py --old /tmp/old --rounds 2 -- --d 64 --n 8192 --mix 1g15l --impl ours
  python bench/compare.py --old /tmp/main --new /tmp/a --new /tmp/b -- --d 64 --impl ours

A tree in the repository layout keeps ``kernels/`` and ``configs/`` beside ``ls_jax/``; the
script links them into ``ls_jax/`` (as an install does) when the tree has no such links.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent
KEY = ("D", "n", "p", "mix", "impl")


def prepare(tree: pathlib.Path) -> pathlib.Path:
    """A directory whose ``ls_jax`` package holds ``kernels`` and ``configs`` (links made in a
    tree that keeps them beside it)."""
    if not (tree / "bench" / "attention.py").is_file() or not (tree / "ls_jax").is_dir():
        raise SystemExit(f"error: {tree}: expected a source tree (bench/attention.py, ls_jax/)")
    for name in ("kernels", "configs"):
        link = tree / "ls_jax" / name
        if not link.exists():
            link.symlink_to(pathlib.Path("..") / name)
    return tree


def run(tree: pathlib.Path, bench_args: list[str], timeout_s: int) -> dict:
    """The benchmark's rows from ``tree``: {key: row}; a run past ``timeout_s`` (0: none) is
    stopped with SIGTERM and keeps the rows it measured."""
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, str(tree / "bench" / "attention.py"), *bench_args]
    if timeout_s:
        command = ["timeout", str(timeout_s), *command]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, cwd=tree)
    rows = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            rows[tuple(row.get(k) for k in KEY)] = row
    if proc.returncode and not rows:
        raise SystemExit(f"error: the benchmark from {tree} failed: "
                         f"{(proc.stderr.strip().splitlines() or ['?'])[-1][:300]}")
    return rows


def tree_names(news: list[pathlib.Path]) -> list[str]:
    """"new" for one new tree, else "new<i> (<folder name>)"."""
    if len(news) == 1:
        return ["new"]
    return [f"new{i} ({path.name})" for i, path in enumerate(news, start=1)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--old", required=True, type=pathlib.Path, help="the old source tree")
    ap.add_argument("--new", type=pathlib.Path, action="append",
                    help="a new source tree, repeated for several (default: this one)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tolerance", type=float, default=1.03, help="new/old above this is marked")
    ap.add_argument("--json", type=pathlib.Path, help="write every row of every run here")
    ap.add_argument("--run-timeout-s", type=int, default=0,
                    help="stop each benchmark run after this many seconds (0: no limit)")
    ap.add_argument("bench_args", nargs=argparse.REMAINDER,
                    help="-- then the arguments of bench/attention.py")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds: expected an int >= 1, got {args.rounds}")
    news = args.new or [REPO]
    bench_args = [a for a in args.bench_args if a != "--"]
    trees = {"old": prepare(args.old.resolve())}
    trees.update(zip(tree_names(news), (prepare(path.resolve()) for path in news)))
    runs = {name: [] for name in trees}
    for r in range(args.rounds):
        for name in list(trees) if r % 2 == 0 else list(trees)[::-1]:
            runs[name].append(run(trees[name], bench_args, args.run_timeout_s))
            print(f"round {r + 1}: {name} done ({len(runs[name][-1])} rows)", flush=True)
    if args.json:
        args.json.write_text(json.dumps({k: [list(r.values()) for r in v]
                                         for k, v in runs.items()}))

    def median(name, key, field):
        values = [r[key][field] for r in runs[name] if key in r and r[key].get(field)]
        return statistics.median(values) if values else None

    slower = 0
    for new_name in list(trees)[1:]:
        keys = sorted({k for r in runs["old"] + runs[new_name] for k in r}, key=str)
        print(f"\n{new_name}: {trees[new_name]} against old: {trees['old']}")
        print("\n| D | n | p | heads | impl | fwd old | fwd new | new/old | f+b old | f+b new | "
              "new/old | check (new) |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for key in keys:
            cells = []
            for field in ("fwd_ms", "fb_ms"):
                old, new = median("old", key, field), median(new_name, key, field)
                ratio = new / old if old and new else None
                mark = " **slower**" if ratio and ratio > args.tolerance else ""
                slower += bool(mark)
                cells += [f"{old:.3f}" if old else "-", f"{new:.3f}" if new else "-",
                          f"{ratio:.3f}{mark}" if ratio else "-"]
            check = next((r[key].get("check", "") or r[key].get("error", "")
                          for r in runs[new_name] if key in r), "")
            print("| " + " | ".join(str(k) for k in key) + " | " + " | ".join(cells)
                  + f" | {check} |")
    print(f"\n{slower} cells more than {args.tolerance:.2f}x the old time")
    return 0


if __name__ == "__main__":
    sys.exit(main())
