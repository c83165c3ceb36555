"""bench/compare.py: bench/attention.py from an old tree and one or more new ones, alternated
round by round, and a table of new/old per new tree (run with stand-in benchmarks on CPU)."""

import json
import os

import pytest

from bench_scripts import load  # tests/, beside this file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
compare = load("compare")

# a stand-in bench/attention.py: one row whose times are the tree's, and a line in the log
STAND_IN = """\
import json, os, sys
here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
with open(os.environ["COMPARE_LOG"], "a") as f:
    f.write(os.path.basename(here) + "\\n")
fwd = float(open(os.path.join(here, "ms")).read())
print(json.dumps({"D": 64, "n": 8192, "p": 128, "mix": "local", "impl": "ours",
                  "fwd_ms": fwd, "fb_ms": 3 * fwd}))
"""


def make_tree(tmp_path, name: str, ms: float):
    tree = tmp_path / name
    for folder in ("bench", "ls_jax", "kernels", "configs"):
        (tree / folder).mkdir(parents=True)
    (tree / "bench" / "attention.py").write_text(STAND_IN)
    (tree / "ms").write_text(str(ms))
    return tree


@pytest.fixture
def log(tmp_path, monkeypatch):
    path = tmp_path / "runs.log"
    monkeypatch.setenv("COMPARE_LOG", str(path))
    return path


def test_one_new_tree_alternates_with_the_old(tmp_path, log, capsys):
    old, new = make_tree(tmp_path, "main", 1.0), make_tree(tmp_path, "cand", 1.1)
    assert compare.main(["--old", str(old), "--new", str(new), "--rounds", "3"]) == 0
    assert log.read_text().split() == ["main", "cand", "cand", "main", "main", "cand"]
    out = capsys.readouterr().out
    assert "| 64 | 8192 | 128 | local | ours | 1.000 | 1.100 | 1.100 **slower** |" in out
    assert "2 cells more than 1.03x the old time" in out


def test_several_new_trees_get_a_table_each(tmp_path, log, capsys):
    old = make_tree(tmp_path, "main", 1.0)
    news = [make_tree(tmp_path, "a", 0.9), make_tree(tmp_path, "b", 1.2)]
    out_json = tmp_path / "runs.json"
    assert compare.main(["--old", str(old), "--new", str(news[0]), "--new", str(news[1]),
                         "--json", str(out_json), "--", "--d", "64"]) == 0
    assert log.read_text().split() == ["main", "a", "b", "b", "a", "main"]
    out = capsys.readouterr().out
    assert "new1 (a): " in out and "new2 (b): " in out
    assert "| 0.900 | 0.900 |" in out and "| 1.200 | 1.200 **slower** |" in out
    assert set(json.loads(out_json.read_text())) == {"old", "new1 (a)", "new2 (b)"}


def test_kernels_and_configs_are_linked_into_ls_jax(tmp_path, log):
    old, new = make_tree(tmp_path, "main", 1.0), make_tree(tmp_path, "cand", 1.0)
    compare.main(["--old", str(old), "--new", str(new), "--rounds", "1"])
    for tree in (old, new):
        assert os.path.realpath(tree / "ls_jax" / "kernels") == str(tree / "kernels")


def test_rounds_below_one_are_refused(tmp_path):
    with pytest.raises(SystemExit) as exit_:
        compare.main(["--old", str(tmp_path), "--rounds", "0"])
    assert exit_.value.code == 2


def test_a_folder_that_is_no_source_tree_is_refused(tmp_path, log):
    old = make_tree(tmp_path, "main", 1.0)
    with pytest.raises(SystemExit) as exit_:
        compare.main(["--old", str(old), "--new", str(tmp_path / "missing")])
    assert str(exit_.value) == (f"error: {tmp_path / 'missing'}: expected a source tree "
                                "(bench/attention.py, ls_jax/)")
    assert not log.exists()
