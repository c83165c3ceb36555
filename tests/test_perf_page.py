"""docs/performance.md is what bench/perf_page.py writes from docs/performance/*.json: every
table names its card, commit and commands, and the committed page matches its JSON files."""

import json
import os

import pytest

from bench_scripts import load  # tests/, beside this file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
perf_page = load("perf_page")


def test_committed_page_matches_its_json():
    with open(perf_page.PAGE) as f:
        assert f.read() == perf_page.render(perf_page.load_tables()), (
            "docs/performance.md differs from docs/performance/*.json: "
            "run python bench/perf_page.py")


def test_every_table_names_card_commit_and_a_command():
    tables = perf_page.load_tables()
    assert tables
    for t in tables:
        assert t["card"].strip() and t["commit"].strip(), t["file"]
        for command in t["commands"]:
            assert command.split()[0] in ("python", "time"), (t["file"], command)


LS_MIX_TABLES = ("10_kernel_d128", "11_kernel_d64", "12_kernel_d32")


def test_readme_result_gives_the_ls_mix_tables_ranges():
    """The README's result sentence states the lowest and highest ratio to the cuDNN
    composition, forward and forward+backward, over the LS-mix tables, and their card."""
    tables = [t for t in perf_page.load_tables()
              if os.path.splitext(os.path.basename(t["file"]))[0] in LS_MIX_TABLES]
    assert len(tables) == len(LS_MIX_TABLES)
    fwd = [r["r_fwd"] for t in tables for r in t["rows"]]
    fb = [r["r_fb"] for t in tables for r in t["rows"]]
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = " ".join(f.read().split())
    assert (f"{min(fwd):.2f}-{max(fwd):.2f}x faster forward and "
            f"{min(fb):.2f}-{max(fb):.2f}x faster forward + backward") in readme
    cards = {t["card"].split(",")[0] for t in tables}
    assert len(cards) == 1 and f"On an {cards.pop().removeprefix('NVIDIA ')} " in readme


@pytest.mark.parametrize("field", ["card", "commit", "commands"])
def test_a_table_without_its_provenance_is_refused(tmp_path, field):
    table = {"section": "kernel", "title": "t", "card": "c", "commit": "abc1234",
             "commands": ["python bench/attention.py"], "columns": [{"header": "n", "cell": "{n}"}],
             "rows": [{"n": 1}]}
    del table[field]
    (tmp_path / "t.json").write_text(json.dumps(table))
    with pytest.raises(ValueError, match=f"missing \\['{field}'\\]"):
        perf_page.load_tables(str(tmp_path))


def test_the_parts_benchmark_writes_a_table_the_page_takes(tmp_path):
    """bench/parts.py (tiny sizes on CPU) writes one table of the page's format whose limits
    follow from its rows."""
    import subprocess
    import sys
    out = tmp_path / "tables" / "16_parts.json"
    subprocess.run([sys.executable, os.path.join(ROOT, "bench", "parts.py"), "--smoke",
                    "--out", str(out)], check=True, capture_output=True, cwd=ROOT)
    (table,) = perf_page.load_tables(str(out.parent))
    rows = {r["part"]: r for r in table["rows"]}
    total = rows["local heads"]["fb"] + rows["global (ours)"]["fb"]
    assert table["limits"]["sum"][1] == pytest.approx(rows["composition"]["fb"] / total)
    assert table["commands"] == ["python bench/parts.py --smoke --out "
                                 "docs/performance/16_parts.json"]
    assert "### Where the time goes" in perf_page.render([table])


def test_the_model_step_benchmark_writes_a_table_the_page_takes(tmp_path):
    """bench/model_step.py (a tiny model on CPU): a row per variant against MHSA."""
    import subprocess
    import sys
    out = tmp_path / "tables" / "17_model_step.json"
    subprocess.run([sys.executable, os.path.join(ROOT, "bench", "model_step.py"), "--smoke",
                    "--commit", "abc1234", "--out", str(out)], check=True, capture_output=True,
                   cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    (table,) = perf_page.load_tables(str(out.parent))
    assert [r["variant"] for r in table["rows"]] == ["LS p=50", "LS p=128", "MHSA"]
    assert all(r["ms"] > 0 for r in table["rows"]) and table["rows"][-1]["x"] == 1.0
    assert table["commit"] == "abc1234"
    assert table["commands"] == [f"python bench/model_step.py --smoke --out "
                                 f"docs/performance/{out.name}"]
    assert "| MHSA | " in perf_page.render([table])


def test_the_model_step_benchmark_refuses_no_timed_steps():
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "model_step.py"),
                           "--out", "/tmp/never.json", "--reps", "0"], capture_output=True,
                          text=True, cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "model_step.py: error: --reps: expected an int >= 1, got 0")


def test_the_inference_benchmark_writes_its_decode_and_prefill_tables(tmp_path):
    """bench/inference.py --decode-table and --prefill-table (tiny sizes on CPU): tables of the
    page's format, LS against MHSA's fastest decode backend and against MHSA's prefill."""
    import subprocess
    import sys
    out = tmp_path / "tables" / "20_decode.json"
    prefill_out = tmp_path / "tables" / "21_prefill.json"
    out.parent.mkdir()
    subprocess.run([sys.executable, os.path.join(ROOT, "bench", "inference.py"), "--smoke",
                    "--out", str(tmp_path / "raw.json"), "--decode-table", str(out),
                    "--prefill-table", str(prefill_out), "--commit", "abc1234"],
                   check=True, capture_output=True, cwd=ROOT,
                   env=dict(os.environ, JAX_PLATFORMS="cpu"))
    decode, prefill = perf_page.load_tables(str(out.parent))
    raw = json.loads((tmp_path / "raw.json").read_text())["results"]
    mhsa = max(r["tokens_per_s"] for r in raw if r["variant"] == "MHSA" and r["kind"] == "decode")
    (row,) = decode["rows"]
    assert row["mhsa"] == round(mhsa) and decode["commit"] == "abc1234"
    assert "--out decode.json" in decode["commands"][0]
    assert "--commit" not in decode["commands"][0]
    assert "| smoke | 3 |" in perf_page.render([decode])
    by = {r["variant"]: r for r in raw if r["kind"] == "prefill"}
    (row,) = prefill["rows"]
    assert row["mhsa"] == round(by["MHSA"]["ms"], 3) and row["ls4"] == round(by["LS p=4"]["ms"], 3)
    assert row["ls4_lower"] == round(100 * (1 - by["LS p=4"]["ms"] / by["MHSA"]["ms"]))
    assert "--out prefill.json" in prefill["commands"][0]
    assert "| smoke | 2 | 32 |" in perf_page.render([prefill])


@pytest.mark.parametrize("flag, empty, named", [
    ("--prefill-table", ["--seq-lens", ""], "--seq-lens"),
    ("--decode-table", ["--contexts", "", "--decode-batches", ""],
     "--contexts and --decode-batches"),
])
def test_the_inference_benchmark_refuses_a_table_it_would_have_no_rows_for(tmp_path, flag,
                                                                           empty, named):
    """A table flag whose rows the other flags leave out is one error line before any run, and
    nothing is written."""
    import subprocess
    import sys
    table = tmp_path / "t.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "inference.py"),
                           "--out", str(tmp_path / "raw.json"), flag, str(table), *empty],
                          capture_output=True, text=True, cwd=ROOT,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: {flag}: expected rows to write, got none: {named} name no value"]
    assert not table.exists() and not (tmp_path / "raw.json").exists()


@pytest.mark.parametrize("argv,drop,want", [
    pytest.param(["--out", "t.json", "--commit", "abc1234"], ("--commit",),
                 ["--out", "docs/performance/t.json"], id="commit-and-value"),
    pytest.param(["--commit=abc1234", "--p", "64"], ("--commit",), ["--p", "64"],
                 id="commit-equals"),
    pytest.param(["--csv", "x.csv", "--card=c", "--out", "t.json"], ("--csv", "--card"),
                 ["--out", "docs/performance/t.json"], id="other-options"),
    # the table's file is recorded where the page reads it, from any folder
    pytest.param(["--out", "/tmp/run/16_kernel_parts.json", "--reps", "5"], ("--commit",),
                 ["--out", "docs/performance/16_kernel_parts.json", "--reps", "5"],
                 id="out-elsewhere"),
    pytest.param(["--out=run/15.json"], ("--commit",), ["--out=docs/performance/15.json"],
                 id="out-equals-elsewhere"),
])
def test_a_tables_command_records_the_arguments_but_the_dropped(argv, drop, want):
    assert perf_page.recorded_args(argv, drop) == want
