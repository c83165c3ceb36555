"""Regenerates a kernel table of docs/performance from its recorded `bench/attention.py` commands.

    python bench/kernel_tables.py docs/performance/11_kernel_d64.json    # run them, rewrite it
    python bench/kernel_tables.py docs/performance/18_kernel_strip_backward.json \\
        --rows cmd1.jsonl cmd2.jsonl --commit 1eac721 --card "NVIDIA H200, jax 0.11.2"

The first form runs the table's commands here (a GPU), the second converts their saved output
(the JSON lines `bench/attention.py` prints, one file per command, in the table's order) from
a run elsewhere. The table's ``rows_from`` names how the benchmark's rows become its rows
(``KINDS``); its title, columns and note are kept, its rows, card and commit replaced. Then
`python bench/perf_page.py` rewrites docs/performance.md. Nothing is written when a command
fails, a row reports an error or a wrong result (``--check``), or a compared row is missing.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys

import perf_page  # bench/, beside this script

BENCH = "bench/attention.py"
DEFAULT_BATCH = 4  # bench/attention.py's --batch-size; other batch sizes are labelled in n


class TableError(Exception):
    """A table that cannot be regenerated from these rows: the one line to print."""


def command_options(command: str) -> dict:
    """The options of a recorded ``python bench/attention.py ...`` command that label its rows:
    batch size and kv heads (0: one per query head)."""
    words = shlex.split(command)
    if len(words) < 2 or words[1] != BENCH:
        raise TableError(f"expected commands of {BENCH}, got {command!r}")
    ap = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    ap.add_argument("--batch-size", type=int, default=DEFAULT_BATCH)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=0)
    known, _ = ap.parse_known_args(words[2:])
    return {"batch": known.batch_size, "kv_heads": known.kv_heads or known.heads}


def _ms(x: float) -> float:
    return round(x, 3)


def _ratio(peer: float, ours: float) -> float:
    return round(peer / ours, 2)


def _n_label(n: int, batch: int):
    return n if batch == DEFAULT_BATCH else f"{n} (B={batch})"


def _group(rows: list[dict], key) -> dict:
    """{key(row): {impl: row}} in the order the keys first appear."""
    groups: dict = {}
    for row in rows:
        groups.setdefault(key(row), {})[row["impl"]] = row
    return groups


def _need(impls: dict, impl: str, where) -> dict:
    if impl not in impls:
        raise TableError(f"no {impl!r} row for {where}")
    return impls[impl]


def composition_rows(runs, with_stats: bool) -> list[dict]:
    """Ours against the cuDNN composition per (D, n, mix, p) of the LS mixes: times, ratios,
    % of floor, and with the statistics on (``ours_stats``) the ratios as "fwd, f+b"."""
    out = []
    for options, rows in runs:
        mixes = [r for r in rows if r["mix"] != "causal"]
        for (d, n, mix, p), impls in _group(
                mixes, lambda r: (r["D"], r["n"], r["mix"], r["p"])).items():
            where = f"D={d} n={n} {mix} p={p}"
            ours, comp = _need(impls, "ours", where), _need(impls, "cudnn_ls", where)
            row = {"d": d, "kv_heads": options["kv_heads"], "n": _n_label(n, options["batch"]),
                   "heads": mix, "p": p, "fwd_ours": _ms(ours["fwd_ms"]),
                   "fwd_comp": _ms(comp["fwd_ms"]), "fb_ours": _ms(ours["fb_ms"]),
                   "fb_comp": _ms(comp["fb_ms"]), "r_fwd": _ratio(comp["fwd_ms"], ours["fwd_ms"]),
                   "r_fb": _ratio(comp["fb_ms"], ours["fb_ms"]),
                   "floor_fwd": round(ours["fwd_floor_pct"]),
                   "floor_fb": round(ours["fb_floor_pct"])}
            if with_stats:
                stats = impls.get("ours_stats")
                row["stats"] = (f"{comp['fwd_ms'] / stats['fwd_ms']:.2f}x, "
                                f"{comp['fb_ms'] / stats['fb_ms']:.2f}x") if stats else "-"
            out.append(row)
    return out


def global_rows(runs, with_stats: bool) -> list[dict]:
    """Ours (plain, and with the statistics where measured) against cuDNN's causal attention
    per (D, n) with every head global, grouped by head size in the order it first appears."""
    del with_stats  # a "with stats" row wherever ours_stats ran
    out = []
    for options, rows in runs:
        causal = [r for r in rows if r["mix"] == "causal"]
        for (d, n), impls in _group(causal, lambda r: (r["D"], r["n"])).items():
            cudnn = _need(impls, "cudnn_causal", f"D={d} n={n} global")
            for impl, label in (("ours", "plain"), ("ours_stats", "with stats")):
                if impl in impls:
                    ours = impls[impl]
                    out.append({"d": d, "n": _n_label(n, options["batch"]), "ours": label,
                                "fwd_ours": _ms(ours["fwd_ms"]),
                                "fwd_cudnn": _ms(cudnn["fwd_ms"]),
                                "fb_ours": _ms(ours["fb_ms"]), "fb_cudnn": _ms(cudnn["fb_ms"]),
                                "r_fwd": _ratio(cudnn["fwd_ms"], ours["fwd_ms"]),
                                "r_fb": _ratio(cudnn["fb_ms"], ours["fb_ms"])})
    order = list(dict.fromkeys(row["d"] for row in out))
    return sorted(out, key=lambda row: order.index(row["d"]))  # stable: n order kept


def strip_rows(runs, with_stats: bool) -> list[dict]:
    """The default launches (the local heads' strip backward) against the same call with the
    Triton backward (``--launches default,triton-backward``) per (n, p, mix)."""
    del with_stats
    out = []
    for options, rows in runs:
        for (n, p, mix), impls in _group(rows, lambda r: (r["n"], r["p"], r["mix"])).items():
            where = f"n={n} {mix} p={p}"
            strip = _need(impls, "ours", where)
            triton = _need(impls, "ours[triton-backward]", where)
            out.append({"n": n, "batch": options["batch"], "heads": mix, "p": p,
                        "fb_strip": _ms(strip["fb_ms"]), "fb_triton": _ms(triton["fb_ms"]),
                        "ratio": _ratio(triton["fb_ms"], strip["fb_ms"]),
                        "fwd": f"{strip['fwd_ms']:.3f}, {triton['fwd_ms']:.3f}"})
    return out


KINDS = {"composition": composition_rows, "global": global_rows, "strips": strip_rows}


def checked(rows: list[dict], command: str) -> list[dict]:
    """The benchmark's rows of one command, refused if any failed or was wrong."""
    if not rows:
        raise TableError(f"no rows from {command!r}")
    for row in rows:
        if row.get("error") or str(row.get("check", "")).startswith("WRONG"):
            raise TableError(f"{command!r}: {row['impl']} at D={row.get('D')} n={row.get('n')} "
                             f"p={row.get('p')} {row.get('mix')}: "
                             f"{row.get('error') or row.get('check')}")
    return rows


def table_rows(table: dict, outputs: list[list[dict]]) -> list[dict]:
    """A table's rows from its commands' outputs (one list of benchmark rows per command)."""
    kind = table.get("rows_from")
    if kind not in KINDS:
        raise TableError(f"rows_from: expected one of {sorted(KINDS)}, got {kind!r}")
    commands = table["commands"]
    if len(outputs) != len(commands):
        raise TableError(f"expected the output of {len(commands)} commands, got {len(outputs)}")
    runs = [(command_options(c), checked(rows, c)) for c, rows in zip(commands, outputs)]
    with_stats = any("{stats}" in column["cell"] for column in table["columns"])
    return KINDS[kind](runs, with_stats)


def run_command(command: str) -> list[dict]:
    """Runs a recorded command here (its ``python`` this interpreter) and returns its rows."""
    words = shlex.split(command)
    proc = subprocess.run([sys.executable, *words[1:]], cwd=perf_page.ROOT,
                          capture_output=True, text=True)
    if proc.returncode:
        last = (proc.stderr.strip().splitlines() or ["?"])[-1][:300]
        raise TableError(f"{command!r} failed: {last}")
    return read_rows(proc.stdout.splitlines())


def read_rows(lines) -> list[dict]:
    return [json.loads(line) for line in lines if line.startswith("{")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("table", help="the table's JSON file (docs/performance/*.json)")
    ap.add_argument("--rows", nargs="+", metavar="FILE",
                    help="saved output of the table's commands, one file each, in order")
    ap.add_argument("--commit", help="the commit measured (default: git's HEAD here)")
    ap.add_argument("--card", help="the card measured on (default: this machine's GPU)")
    args = ap.parse_args(argv)
    if args.rows and not (args.commit and args.card):
        ap.error("--rows: also give --commit and --card (the run's, not this machine's)")
    try:
        with open(args.table) as f:
            table = json.load(f)
        if args.rows:
            outputs = []
            for path in args.rows:
                with open(path) as f:
                    outputs.append(read_rows(f))
        else:
            outputs = [run_command(c) for c in table["commands"]]
        rows = table_rows(table, outputs)
        card = args.card or perf_page.current_card()
        commit = args.commit or perf_page.current_commit()
    except (OSError, ValueError, KeyError, TypeError, TableError) as e:
        print(f"error: {args.table}: {e}", file=sys.stderr)
        return 1
    perf_page.write_table(args.table, {**table, "rows": rows, "card": card, "commit": commit})
    print(f"wrote {len(rows)} rows to {args.table}; now run python bench/perf_page.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
