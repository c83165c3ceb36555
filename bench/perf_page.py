"""Writes docs/performance.md from the measured tables in docs/performance/*.json.

    python bench/perf_page.py            # rewrite the page
    python bench/perf_page.py --check    # exit 1 if the page differs from what the JSON gives

Each JSON file is one table: ``section`` (a key of ``SECTIONS``), ``title``, ``card``, ``commit``,
``commands`` (what regenerates the rows), optional ``note`` (markdown after the table),
``columns`` (``header`` and a ``cell`` template in ``str.format`` syntax over a row's fields)
and ``rows`` (the measured fields). Files are read in name order; a new measurement replaces
a file's rows, card, commit and commands, and this script rewrites the page.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TABLES = os.path.join(ROOT, "docs", "performance")
PAGE = os.path.join(ROOT, "docs", "performance.md")
REQUIRED = ("section", "title", "card", "commit", "commands", "columns", "rows")

INTRO = """\
# Performance

Measured tables with card, commit and the commands that regenerate them, written by `python
bench/perf_page.py` from `docs/performance/*.json` (`tests/test_perf_page.py` checks that the
two agree); `python bench/kernel_tables.py docs/performance/<table>.json` reruns a kernel
table's commands. Why the kernels are built as they are: [kernel-notes.md](kernel-notes.md).
Shapes beyond the tables, against the composition: `python bench/shapes.py --check`.

How to read the kernel tables (`bench/attention.py`):
- **Timing**: a sample is the mean of `--batch` back-to-back calls on fresh inputs (more if they
  last under 20 ms), a row the median of `--reps` samples after warm-up; ms; bf16, batch 4, 16
  query heads unless a row says otherwise. Compare inside a table, not across machines.
- **Peers**: "comp." is `implementation="cudnn"` (one cuDNN call for the global heads, one per
  window with `local_window_size=(p-1, 0)`); "cuDNN" is causal cuDNN `dot_product_attention`.
- **Ratio** = the peer's time over ours (above 1, ours is faster). **% of floor** = the floor
  over ours: the larger of the band's FLOPs and bytes at the card's peaks (`bench/hardware.py`).
- **Head mixes**: `1g15l` = 1 global + 15 local heads of window p, `local`/`global` every head
  so; "with stats" = `return_logit_stats=True`; `--check` compares rows with the reference.
"""

SECTIONS = {
    "kernel": "The attention kernels (`implementation=None` on a GPU)",
    "inference": "Inference: prefill and decoding, LS against MHSA (`bench/inference.py`)",
    "devices": "Many GPUs",
    "startup": "Start-up on a GPU (`bench/startup.py`)",
    "cpu": "On CPU",
}


# the options by which a benchmark names the table file it writes
TABLE_FILE_OPTIONS = ("--out", "--decode-table", "--prefill-table")


def recorded_args(argv: list[str], drop: tuple[str, ...] = ("--commit",)) -> list[str]:
    """A benchmark's arguments as its table's command records them: without the options
    ``drop`` and their values (``--x v`` or ``--x=v``), ``--commit`` by default; a table's own
    file (``TABLE_FILE_OPTIONS``) as its place in docs/performance/, where the page reads it,
    whatever folder the run wrote to."""
    kept, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in drop:
            skip = True
        elif not a.startswith(tuple(o + "=" for o in drop)):
            kept.append(a)
    for n, a in enumerate(kept):
        if n and kept[n - 1] in TABLE_FILE_OPTIONS:
            kept[n] = f"docs/performance/{os.path.basename(a)}"
        elif a.startswith(tuple(o + "=" for o in TABLE_FILE_OPTIONS)):
            option, path = a.split("=", 1)
            kept[n] = f"{option}=docs/performance/{os.path.basename(path)}"
    return kept


def current_card() -> str:
    """A table's ``card`` for a run here: the first device's kind and the jax version."""
    import jax
    return f"{jax.devices()[0].device_kind}, jax {jax.__version__}"


def current_commit() -> str:
    """A table's ``commit`` for a run here: this repository's HEAD, short."""
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                          capture_output=True, text=True).stdout.strip()


def write_table(path: str, table: dict) -> None:
    """One table's JSON file, its folder made if missing."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(table, f, indent=1)
        f.write("\n")


def load_tables(folder: str = TABLES) -> list[dict]:
    """The tables of ``folder`` in file-name order, each checked for the required fields."""
    tables = []
    for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
        with open(path) as f:
            table = json.load(f)
        missing = [k for k in REQUIRED if not table.get(k)]
        if missing:
            raise ValueError(f"{path}: expected the fields {list(REQUIRED)}, missing {missing}")
        if table["section"] not in SECTIONS:
            raise ValueError(f"{path}: section: expected one of {list(SECTIONS)}, "
                             f"got {table['section']!r}")
        table["file"] = os.path.relpath(path, ROOT)
        tables.append(table)
    return tables


def render_table(table: dict) -> str:
    lines = [f"### {table['title']}", "",
             f"Measured on {table['card']}, commit {table['commit']}; `{table['file']}`; "
             f"regenerate:", ""]
    lines += [f"    {command}" for command in table["commands"]]
    headers = [c["header"] for c in table["columns"]]
    lines += ["", "| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for row in table["rows"]:
        lines.append("| " + " | ".join(c["cell"].format(**row) for c in table["columns"]) + " |")
    if table.get("note"):
        lines += ["", textwrap.fill(table["note"], 96, break_long_words=False,
                                    break_on_hyphens=False)]
    return "\n".join(lines)


def render(tables: list[dict]) -> str:
    parts = [INTRO]
    for key, heading in SECTIONS.items():
        inside = [t for t in tables if t["section"] == key]
        if inside:
            parts.append(f"## {heading}")
            parts += [render_table(t) for t in inside]
    return "\n\n".join(p.rstrip("\n") for p in parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="compare the page with the JSON instead of writing it")
    args = parser.parse_args(argv)
    text = render(load_tables())
    if args.check:
        with open(PAGE) as f:
            if f.read() != text:
                print(f"error: {os.path.relpath(PAGE)} differs from docs/performance/*.json: "
                      f"run python bench/perf_page.py", file=sys.stderr)
                return 1
        return 0
    with open(PAGE, "w") as f:
        f.write(text)
    print(f"wrote {os.path.relpath(PAGE)} from {len(load_tables())} tables")
    return 0


if __name__ == "__main__":
    sys.exit(main())
