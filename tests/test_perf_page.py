"""docs/performance.md is what bench/perf_page.py writes from docs/performance/*.json: every
table names its card, commit and commands, and the committed page matches its JSON files."""

import importlib.util
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("perf_page",
                                               os.path.join(ROOT, "bench", "perf_page.py"))
perf_page = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(perf_page)


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


@pytest.mark.parametrize("field", ["card", "commit", "commands"])
def test_a_table_without_its_provenance_is_refused(tmp_path, field):
    table = {"section": "kernel", "title": "t", "card": "c", "commit": "abc1234",
             "commands": ["python bench/attention.py"], "columns": [{"header": "n", "cell": "{n}"}],
             "rows": [{"n": 1}]}
    del table[field]
    (tmp_path / "t.json").write_text(json.dumps(table))
    with pytest.raises(ValueError, match=f"missing \\['{field}'\\]"):
        perf_page.load_tables(str(tmp_path))
