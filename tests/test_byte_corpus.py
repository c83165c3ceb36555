"""The experiments' byte corpus: deduplicated sources, the report, the splits, the sampler."""

import hashlib
import os

import numpy as np
import pytest

from experiments import byte_corpus
from experiments.byte_corpus import Root, WindowSampler, build_corpus, read_roots, summary_line


def _write(path, data: bytes):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def _documents(tokens_N: np.ndarray) -> list[bytes]:
    """The files of a split, as the bytes before each EOS."""
    return tokens_N.tobytes().split(b"\0")[:-1]


@pytest.fixture
def tree(tmp_path):
    """Two package dirs and a doc dir: a file vendored twice, a package in both dirs, an empty
    file, a binary one, docs, a data table."""
    a, b, d = tmp_path / "a" / "site-packages", tmp_path / "b" / "dist-packages", tmp_path / "doc"
    shared = b"def shared():\n    return 'the same bytes'\n"
    files = {
        a / "pkg" / "core.py": shared,
        a / "pkg" / "_vendor" / "dep" / "core.py": shared,  # vendored copy
        b / "pkg" / "core.py": shared,  # the package installed twice
        a / "pkg" / "util.py": b"x = 1\n",
        a / "pkg" / "__init__.py": b"",
        a / "pkg" / "blob.py": b"ab\0cd",
        a / "pkg" / "__pycache__" / "util.py": b"never read\n",
        a / "pkg" / "README.md": b"# pkg\n\nProse.\n",
        a / "pkg" / "ops.h": b"int op(void);\n",
        a / "pkg" / "labels.txt": b"cat\ndog\n",  # package .txt: data, not read
        d / "tool" / "NEWS.txt": b"Release notes.\n",
        d / "tool" / "README.md": b"# pkg\n\nProse.\n",  # the package's README again
    }
    for path, data in files.items():
        _write(str(path), data)
    roots = [Root(str(a), str(a), ("python", "code", "docs")), Root(str(b), str(b), ("python",)),
             Root(str(d), str(d), ("system docs",))]
    unique = [shared, b"x = 1\n", b"# pkg\n\nProse.\n", b"int op(void);\n", b"Release notes.\n"]
    return roots, unique, len(shared)


def test_every_content_counts_once_and_the_report_says_what_was_dropped(tree):
    roots, unique, shared_size = tree
    c = read_roots(roots, source="test", validation_percent=50)
    docs = _documents(c.train_N) + _documents(c.validation_N)
    assert sorted(docs) == sorted(unique)  # each content once, over both splits
    assert (c.train_files, c.validation_files) == (len(_documents(c.train_N)),
                                                   len(_documents(c.validation_N)))
    assert c.train_files + c.validation_files == len(unique)
    d = c.describe()
    assert (d["duplicate_files"], d["duplicate_bytes"]) == (3, 2 * shared_size + len(unique[2]))
    assert (d["empty_files"], d["skipped_files"]) == (1, 1)
    # of the README's two copies the first in path-hash order stays
    copies = {"docs": f"{roots[0].label}/pkg/README.md",
              "system docs": f"{roots[2].label}/tool/README.md"}
    kept = min(copies, key=lambda k: hashlib.sha256(copies[k].encode()).digest())
    expected = {"python": 2, "code": 1, "docs": 0, "system docs": 1}
    expected[kept] += 1
    assert {k: v["files"] for k, v in d["kinds"].items()} == {
        k: n for k, n in expected.items() if n}
    assert sum(v["bytes"] for v in d["kinds"].values()) == sum(map(len, unique))
    assert d["train_tokens"] + d["validation_tokens"] == sum(map(len, unique)) + len(unique)
    assert "3 duplicate files" in summary_line(d)
    again = read_roots(roots, source="test", validation_percent=50)
    assert np.array_equal(again.train_N, c.train_N)
    assert np.array_equal(again.validation_N, c.validation_N)


def test_a_cap_stops_at_the_first_file_past_it(tree):
    roots, unique, _ = tree
    one = read_roots(roots, source="test", max_bytes=1)
    assert one.train_files + one.validation_files == 1
    assert sum(v["files"] for v in one.describe()["kinds"].values()) == 1
    with pytest.raises(ValueError, match="max_bytes: expected None or an int >= 1, got 0"):
        read_roots(roots, source="test", max_bytes=0)
    with pytest.raises(ValueError, match=r"validation_percent: expected an int in \[1, 99\]"):
        read_roots(roots, source="test", validation_percent=0)


def test_sources_read_their_kinds(monkeypatch, tmp_path):
    monkeypatch.setattr(byte_corpus, "package_dirs", lambda: [str(tmp_path)])
    stdlib, = byte_corpus.source_roots("stdlib")
    assert stdlib.kinds == ("python",) and "site-packages" in stdlib.skip_dirs
    python = byte_corpus.source_roots("python")
    assert [(r.path, r.kinds) for r in python[1:]] == [(str(tmp_path), ("python",))]
    offline = byte_corpus.source_roots("offline")
    assert offline[1].kinds == ("python", "code", "docs")
    assert all(r.kinds == ("system docs",) for r in offline[2:])
    with pytest.raises(ValueError, match="source: expected one of"):
        build_corpus("pg19")


def test_build_corpus_caps_splits_and_ends_documents():
    c = build_corpus("stdlib", max_bytes=300_000, validation_percent=10)
    assert 0 < c.train_N.size and 0 < c.validation_N.size and c.skipped_files == 0
    assert c.train_N.dtype == np.uint8 and c.train_N[-1] == 0  # EOS after each file
    assert int((c.train_N == 0).sum()) == c.train_files
    assert int((c.validation_N == 0).sum()) == c.validation_files
    # the cap stops at the first file past it: at most one file more than 300 KB
    assert 300_000 <= c.train_N.size + c.validation_N.size < 300_000 + 2_000_000


def test_window_sampler_is_a_seeded_permutation_per_epoch():
    tokens_N = np.arange(30, dtype=np.uint8)  # 10 windows of 3 tokens (T = 2)
    s = WindowSampler(tokens_N, seq_len=2, batch_size=4, seed=7)
    assert s.n_windows == 10
    rows = np.concatenate([s.batch(i) for i in range(5)])  # 20 windows = two epochs
    starts = rows[:, 0] // 3
    assert sorted(starts[:10]) == list(range(10)) and sorted(starts[10:]) == list(range(10))
    assert list(starts[:10]) != list(starts[10:])  # a new order in the second epoch
    assert np.array_equal(rows[:, 1], rows[:, 0] + 1)  # contiguous windows
    again = WindowSampler(tokens_N, seq_len=2, batch_size=4, seed=7)
    assert np.array_equal(again.batch(3), s.batch(3))  # depends only on the step
    assert s.epochs(5) == 2.0
    assert [b[:, 0].tolist() for b in s.fixed_batches(5)] == [[0, 3, 6, 9], [12, 15, 18, 21]]
    with pytest.raises(ValueError, match="tokens: expected at least batch_size=4 windows"):
        WindowSampler(tokens_N[:8], seq_len=2, batch_size=4, seed=0)


def test_build_corpus_cache_loads_what_it_saved_without_reading_files(tmp_path, monkeypatch):
    built = build_corpus("stdlib", max_bytes=200_000, validation_percent=10, cache_dir=str(tmp_path))
    assert len(list(tmp_path.glob("stdlib-*.npz"))) == 1
    monkeypatch.setattr(byte_corpus, "_read", lambda path: pytest.fail(f"read {path}"))
    loaded = build_corpus("stdlib", max_bytes=200_000, validation_percent=10,
                          cache_dir=str(tmp_path))
    assert np.array_equal(loaded.train_N, built.train_N)
    assert np.array_equal(loaded.validation_N, built.validation_N)
    assert loaded.describe() == built.describe()
    # another cap or split is another corpus: it is built, not loaded
    monkeypatch.undo()
    other = build_corpus("stdlib", max_bytes=100_000, validation_percent=10, cache_dir=str(tmp_path))
    assert other.train_N.size < built.train_N.size
    assert len(list(tmp_path.glob("stdlib-*.npz"))) == 2 and not list(tmp_path.glob("*.tmp"))
