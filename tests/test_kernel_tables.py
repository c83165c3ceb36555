"""bench/kernel_tables.py: a kernel table of docs/performance regenerated from its recorded
bench/attention.py commands, checked on CPU with benchmark rows made up for those commands."""

import argparse
import json
import os
import shlex

import pytest

from bench_scripts import load  # tests/, beside this file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

kernel_tables = load("kernel_tables")
perf_page = kernel_tables.perf_page


def made_up_rows(command: str) -> list[dict]:
    """The rows bench/attention.py prints for ``command``, in its order, with made-up times:
    per head size and length the every-head-global rows, then per window and mix the peers
    and ours under each launch choice."""
    ap = argparse.ArgumentParser(allow_abbrev=False)
    for option, default in (("--d", "64,32"), ("--n", "2048,8192,32768"), ("--p", "50,128,512"),
                            ("--mix", "1g15l,global,local"),
                            ("--impl", "ours,cudnn_ls,cudnn_causal,triton_mha"),
                            ("--launches", "default")):
        ap.add_argument(option, default=default)
    args, _ = ap.parse_known_args(shlex.split(command)[2:])
    impls, mixes = args.impl.split(","), args.mix.split(",")
    ours = [i for i in ("ours", "ours_stats") if i in impls]
    variants = [i + ("" if v == "default" else f"[{v}]") for i in ours
                for v in args.launches.split(",")]
    rows = []

    def row(d, n, p, mix, impl):
        ms = d * n / 1e5 * (1 + len(rows) % 3) / (2 if impl.startswith("ours") else 1)
        rows.append({"D": d, "n": n, "p": p, "mix": mix, "impl": impl, "fwd_ms": ms,
                     "fb_ms": 3 * ms, "fwd_floor_pct": 30.4, "fb_floor_pct": 25.6})

    for d in map(int, args.d.split(",")):
        for n in map(int, args.n.split(",")):
            for impl in ("cudnn_causal", "triton_mha", "auto"):
                if impl in impls:
                    row(d, n, "-", "causal", impl)
            for impl in variants if "global" in mixes else ():
                row(d, n, "-", "causal", impl)
            for p in map(int, args.p.split(",")):
                for mix in (m for m in mixes if m != "global"):
                    for impl in [i for i in ("cudnn_ls", "split", "auto") if i in impls]:
                        row(d, n, p, mix, impl)
                    for impl in variants:
                        row(d, n, p, mix, impl)
    return rows


KERNEL_TABLES = [t for t in perf_page.load_tables()
                 if all(c.split()[1:2] == [kernel_tables.BENCH] for c in t["commands"])]


def test_the_kernel_tables_are_those_of_bench_attention():
    assert {os.path.basename(t["file"])[:2] for t in KERNEL_TABLES} == {
        "10", "11", "12", "13", "14", "18"}


@pytest.mark.parametrize("table", KERNEL_TABLES, ids=lambda t: os.path.basename(t["file"]))
def test_a_kernel_table_is_regenerated_from_its_commands(table):
    """Its commands' rows give the table's rows: as many, in its order, with the same labels,
    and every column renders from them."""
    rows = kernel_tables.table_rows(table, [made_up_rows(c) for c in table["commands"]])
    labels = [k for k in ("d", "kv_heads", "n", "heads", "p", "ours", "batch")
              if k in table["rows"][0]]
    assert [[r[k] for k in labels] for r in rows] == [
        [r[k] for k in labels] for r in table["rows"]]
    page = perf_page.render_table({**table, "rows": rows})
    assert page.count("\n| ") == len(rows) + 1


def bench_row(impl, fwd, fb, mix="1g15l", p=128, n=8192, **extra):
    return {"D": 64, "n": n, "p": p, "mix": mix, "impl": impl, "fwd_ms": fwd, "fb_ms": fb,
            "fwd_floor_pct": 33.6, "fb_floor_pct": 26.5, **extra}


def test_composition_rows_give_ratios_statistics_and_batch_labels():
    table = {"rows_from": "composition", "columns": [{"header": "s", "cell": "{stats}"}],
             "commands": [f"python {kernel_tables.BENCH} --batch-size 1 --batch 3"]}
    (row,) = kernel_tables.table_rows(table, [[
        bench_row("cudnn_ls", 0.5, 1.2), bench_row("ours", 0.2, 0.6),
        bench_row("ours_stats", 0.25, 0.8)]])
    assert row["n"] == "8192 (B=1)" and row["heads"] == "1g15l" and row["p"] == 128
    assert (row["r_fwd"], row["r_fb"]) == (2.5, 2.0)
    assert row["stats"] == "2.00x, 1.50x"
    assert (row["floor_fwd"], row["floor_fb"]) == (34, 26)


def test_strip_rows_compare_the_default_with_the_triton_backward():
    table = {"rows_from": "strips", "columns": [],
             "commands": [f"python {kernel_tables.BENCH} --p 64"]}
    (row,) = kernel_tables.table_rows(table, [[
        bench_row("ours", 0.1, 0.5, p=64), bench_row("ours[triton-backward]", 0.1, 0.6, p=64)]])
    assert row == {"n": 8192, "batch": 4, "heads": "1g15l", "p": 64, "fb_strip": 0.5,
                   "fb_triton": 0.6, "ratio": 1.2, "fwd": "0.100, 0.100"}


@pytest.fixture
def table_file(tmp_path):
    """A copy of the strip table and the saved output of its commands."""
    (table,) = [t for t in KERNEL_TABLES if t["rows_from"] == "strips"]
    table = {k: v for k, v in table.items() if k != "file"}
    path = tmp_path / "18.json"
    path.write_text(json.dumps(table))
    outputs = []
    for i, command in enumerate(table["commands"]):
        out = tmp_path / f"cmd{i}.jsonl"
        out.write_text("\n".join(json.dumps(r) for r in made_up_rows(command)) + "\n")
        outputs.append(str(out))
    return path, outputs


def test_saved_rows_rewrite_the_table_with_their_commit_and_card(table_file):
    path, outputs = table_file
    before = json.loads(path.read_text())
    assert kernel_tables.main([str(path), "--rows", *outputs, "--commit", "abc1234",
                               "--card", "NVIDIA H200, jax 0.11.2"]) == 0
    after = json.loads(path.read_text())
    assert (after["commit"], after["card"]) == ("abc1234", "NVIDIA H200, jax 0.11.2")
    assert {k: v for k, v in after.items() if k not in ("rows", "commit", "card")} == {
        k: v for k, v in before.items() if k not in ("rows", "commit", "card")}
    assert len(after["rows"]) == len(before["rows"])


def _spoil(kind):
    def spoil(rows):
        if kind == "error":
            rows[0]["error"] = "XlaRuntimeError: RESOURCE_EXHAUSTED"
        elif kind == "wrong":
            rows[0]["check"] = "WRONG (dq): out 1e-03 dq 5e-01"
        elif kind == "missing-peer":
            rows[:] = [r for r in rows if "triton" not in r["impl"]]
        elif kind == "no-rows":
            rows.clear()
        return rows
    return spoil


@pytest.mark.parametrize("kind", ["error", "wrong", "missing-peer", "no-rows"])
def test_a_run_that_failed_or_is_incomplete_writes_nothing(table_file, capsys, kind):
    path, outputs = table_file
    rows = [json.loads(line) for line in open(outputs[0])]
    with open(outputs[0], "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in _spoil(kind)(rows))
    before = path.read_text()
    assert kernel_tables.main([str(path), "--rows", *outputs, "--commit", "abc1234",
                               "--card", "H200"]) == 1
    assert path.read_text() == before
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"error: {path}: ")


def test_the_wrong_number_of_saved_outputs_is_refused(table_file, capsys):
    path, outputs = table_file
    assert kernel_tables.main([str(path), "--rows", outputs[0], "--commit", "a",
                               "--card", "H200"]) == 1
    assert "expected the output of 2 commands, got 1" in capsys.readouterr().err


def test_saved_rows_need_the_runs_commit_and_card(table_file):
    path, outputs = table_file
    with pytest.raises(SystemExit) as exit_:
        kernel_tables.main([str(path), "--rows", *outputs])
    assert exit_.value.code == 2


def test_a_table_without_a_known_row_kind_is_refused(table_file, capsys):
    path, outputs = table_file
    table = json.loads(path.read_text())
    path.write_text(json.dumps({**table, "rows_from": "decode"}))
    assert kernel_tables.main([str(path), "--rows", *outputs, "--commit", "a",
                               "--card", "H200"]) == 1
    assert "rows_from: expected one of" in capsys.readouterr().err


def test_without_saved_rows_the_commands_run_here(table_file, monkeypatch):
    path, _ = table_file
    ran = []

    def run(command):
        ran.append(command)
        return made_up_rows(command)

    monkeypatch.setattr(kernel_tables, "run_command", run)
    monkeypatch.setattr(perf_page, "current_card", lambda: "NVIDIA H200, jax 0.11.2")
    monkeypatch.setattr(perf_page, "current_commit", lambda: "abc1234")
    assert kernel_tables.main([str(path)]) == 0
    table = json.loads(path.read_text())
    assert ran == table["commands"]
    assert (table["commit"], table["card"]) == ("abc1234", "NVIDIA H200, jax 0.11.2")
