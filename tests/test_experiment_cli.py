"""The experiments' command lines: an ``--out`` that is a file is one line before anything
runs (a folder, new or an earlier run's, is what they write and resume)."""

import importlib

import pytest


@pytest.mark.parametrize("module,args", [
    ("lr_sweep", ["--smoke"]),
    ("paper_batch", ["--smoke"]),
    ("stability", ["--preset", "smoke"]),
])
def test_an_out_that_is_a_file_is_one_line(tmp_path, capsys, module, args):
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    main = importlib.import_module(f"experiments.{module}").main
    with pytest.raises(SystemExit) as e:
        main(["--out", str(notes), *args])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.endswith(f": error: argument --out: {notes} is a file; expected a results "
                        "folder (a new one, or an earlier run's to resume)")
    assert notes.read_text() == "mine"
