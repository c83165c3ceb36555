"""Input pipeline: sources and splits, packing, determinism, sharding, exact resume, TFDS."""

import json
import math
import pathlib
import re
import shutil
import sysconfig
import time

import numpy as np
import pytest

grain = pytest.importorskip("grain", reason="the training loop needs the [train] extra")

from ls_jax.inputs import pipeline as data
from ls_jax.inputs import sources
from ls_jax.config import DataConfig

T = 32  # seq_len of the small configs
N_DOCS = 40


def _doc_text(i: int) -> str:
    # > 2 * (T + 1) bytes, so the dropped tail of a finite stream never holds a document start.
    return f"<doc{i:03d}> " + "caf\u00e9 na\u00efve words " * (4 + i % 7) + f"end{i}\n"


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory) -> pathlib.Path:
    root = tmp_path_factory.mktemp("corpus")
    for i in range(N_DOCS):
        sub = root / ("a" if i % 2 else "b") / ("deep" if i % 3 == 0 else "")
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"doc{i:03d}.txt").write_text(_doc_text(i), encoding="utf-8")
    return root


def _text_source(root: pathlib.Path) -> str:
    return f"text:{root}/**/*.txt"


def _small_cfg(source: str, **overrides) -> DataConfig:
    settings = dict(source=source, seq_len=T, shuffle_window=8, worker_threads=1, prefetch=1,
                    validation_percent=20)
    settings.update(overrides)
    return DataConfig(**settings)


def _take(dataset, n):
    it = iter(dataset)
    try:
        return [next(it) for _ in range(n)]
    finally:
        it.close()


def _sequences(batches) -> np.ndarray:
    """The packed T + 1 sequences behind batches: inputs plus the last target."""
    return np.concatenate(
        [np.concatenate([b["inputs"], b["targets"][:, -1:]], axis=1) for b in batches])


def _all_files(root: pathlib.Path, suffix: str) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob(f"*{suffix}") if p.is_file()}


def _equal_batches(a, b) -> bool:
    return len(a) == len(b) and all(
        np.array_equal(x["inputs"], y["inputs"]) and np.array_equal(x["targets"], y["targets"])
        for x, y in zip(a, b))


# -- sources and splits --------------------------------------------------------------------

def test_text_source_splits_are_disjoint_sorted_and_cover_all_files(corpus_dir):
    source = _text_source(corpus_dir)
    train = sources.load_documents(source, "train", validation_percent=20)
    validation = sources.load_documents(source, "validation", validation_percent=20)
    assert len(train) > 0 and len(validation) > 0
    assert not set(train.relative_paths) & set(validation.relative_paths)
    assert set(train.relative_paths) | set(validation.relative_paths) == \
        _all_files(corpus_dir, ".txt")
    assert list(train.relative_paths) == sorted(train.relative_paths)
    for i in (0, len(train) - 1):
        assert train[i] == (corpus_dir / train.relative_paths[i]).read_text(encoding="utf-8")


def test_split_depends_only_on_relative_path(corpus_dir, tmp_path):
    """Moving the corpus or adding files must not move existing files between splits."""
    moved = tmp_path / "elsewhere" / "copy"
    shutil.copytree(corpus_dir, moved)
    for i in range(10):
        (moved / "a" / f"extra{i}.txt").write_text(f"extra {i}\n")
    for split in sources.LOCAL_SPLITS:
        before = set(sources.load_documents(_text_source(corpus_dir), split,
                                         validation_percent=20).relative_paths)
        after = set(sources.load_documents(_text_source(moved), split,
                                        validation_percent=20).relative_paths)
        assert before == {p for p in after if not p.startswith("a/extra")}


def test_stdlib_source_is_the_standard_library_split_disjointly():
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    expected = {p for p in _all_files(root, ".py")
                if "site-packages" not in p.split("/") and "dist-packages" not in p.split("/")}
    train = sources.load_documents("stdlib", "train")
    validation = sources.load_documents("stdlib", "validation")
    assert not set(train.relative_paths) & set(validation.relative_paths)
    assert set(train.relative_paths) | set(validation.relative_paths) == expected
    share = len(validation) / len(expected)
    assert 0.02 < share < 0.10, share  # validation_percent=5
    assert "os.py" in train.relative_paths or "os.py" in validation.relative_paths
    assert train[0] == (root / train.relative_paths[0]).read_bytes().decode("utf-8", "replace")


# -- packing -------------------------------------------------------------------------------

def test_packed_stream_is_the_documents_joined_by_eos(corpus_dir):
    """shuffle=False, one epoch: the packed sequences, read in order, are the train documents
    (in file order) each followed by EOS, cut every T + 1 tokens; the tail is dropped."""
    cfg = _small_cfg(_text_source(corpus_dir))
    batch_size = 2
    batches = list(data.make_dataset(cfg, "train", batch_size=batch_size, seed=0,
                                     num_epochs=1, shuffle=False))
    train = sources.load_documents(cfg.source, "train", validation_percent=20)
    expected = b"".join((corpus_dir / rel).read_bytes() + b"\0" for rel in train.relative_paths)
    expected_sequences = len(expected) // (T + 1) // batch_size * batch_size
    assert len(batches) == expected_sequences // batch_size
    for batch in batches:
        assert batch["inputs"].shape == (batch_size, T) and batch["inputs"].dtype == np.int32
        assert batch["targets"].shape == (batch_size, T) and batch["targets"].dtype == np.int32
        np.testing.assert_array_equal(batch["inputs"][:, 1:], batch["targets"][:, :-1])
    stream = _sequences(batches).reshape(-1).astype(np.uint8).tobytes()
    assert len(stream) == expected_sequences * (T + 1)
    assert stream == expected[:len(stream)]
    # EOS (NUL for bytes) sits exactly between documents.
    documents = stream.split(b"\0")[:-1]
    assert [d.decode("utf-8") for d in documents] == \
        [train[i] for i in range(len(documents))]


def test_packer_cuts_the_concatenation_and_resumes_at_every_step():
    """PackSequencesIterDataset alone, on tiny documents: output = the concatenation cut every
    `length` tokens (partial tail dropped), and a JSON round-tripped state taken before any
    output restores the exact remaining outputs."""
    docs = [np.arange(100 * i, 100 * i + n, dtype=np.int32)
            for i, n in enumerate([5, 3, 9, 2, 7, 4, 1, 8])]
    length = 4

    def build():
        parent = grain.MapDataset.source(docs).to_iter_dataset()
        return data.PackSequencesIterDataset(parent, length=length)

    stream = np.concatenate(docs)
    expected = [stream[i:i + length].tolist()
                for i in range(0, len(stream) - length + 1, length)]
    outputs = [x.tolist() for x in build()]
    assert outputs == expected
    for k in range(len(expected) + 1):
        it = iter(build())
        for _ in range(k):
            next(it)
        state = json.loads(json.dumps(it.get_state()))
        restored = iter(build())
        restored.set_state(state)
        assert [x.tolist() for x in restored] == expected[k:], f"resume after {k} outputs"


def test_shuffled_epoch_covers_every_token_once(corpus_dir):
    cfg = _small_cfg(_text_source(corpus_dir))
    shuffled = list(data.make_dataset(cfg, "train", batch_size=1, seed=1, num_epochs=1))
    ordered = _take(data.make_dataset(cfg, "train", batch_size=1, seed=1, shuffle=False), 4)
    assert not _equal_batches(shuffled[:4], ordered)
    train = sources.load_documents(cfg.source, "train", validation_percent=20)
    expected = np.frombuffer(b"".join(train[i].encode() + b"\0" for i in range(len(train))),
                             np.uint8)
    missing = np.bincount(expected, minlength=256) - \
        np.bincount(_sequences(shuffled).reshape(-1), minlength=256)
    assert (missing >= 0).all()
    assert missing.sum() < T + 1  # only the final partial sequence is dropped


def test_targets_are_inputs_shifted_with_shuffling():
    cfg = DataConfig(seq_len=48, shuffle_window=16, worker_threads=2, prefetch=2)
    for batch in _take(data.make_dataset(cfg, "train", batch_size=4, seed=0), 5):
        np.testing.assert_array_equal(batch["inputs"][:, 1:], batch["targets"][:, :-1])


# -- determinism and sharding --------------------------------------------------------------

def test_same_seed_same_batches_different_seed_different():
    cfg = DataConfig(seq_len=64, shuffle_window=16, worker_threads=2, prefetch=2)
    first = _take(data.make_dataset(cfg, "train", batch_size=4, seed=7), 4)
    again = _take(data.make_dataset(cfg, "train", batch_size=4, seed=7), 4)
    other = _take(data.make_dataset(cfg, "train", batch_size=4, seed=8), 4)
    other_data_seed = _take(
        data.make_dataset(DataConfig(seq_len=64, shuffle_window=16, shuffle_seed=1), "train",
                          batch_size=4, seed=7), 4)
    no_threads = _take(data.make_dataset(
        DataConfig(seq_len=64, shuffle_window=16, worker_threads=0, prefetch=0), "train",
        batch_size=4, seed=7), 4)
    assert _equal_batches(first, again)
    assert _equal_batches(first, no_threads)
    assert not _equal_batches(first, other)
    assert not _equal_batches(first, other_data_seed)


def _document_markers(batches) -> list[int]:
    text = _sequences(batches).reshape(-1).astype(np.uint8).tobytes().decode("utf-8")
    return [int(m) for m in re.findall(r"<doc(\d{3})>", text)]


def test_process_shards_are_disjoint_and_cover_the_split(corpus_dir):
    cfg = _small_cfg(_text_source(corpus_dir))
    train = sources.load_documents(cfg.source, "train", validation_percent=20)
    all_markers = [int(re.match(r"<doc(\d{3})>", train[i]).group(1)) for i in range(len(train))]
    shard_markers = []
    for shard_index in range(3):
        batches = list(data.make_dataset(cfg, "train", batch_size=1, seed=0,
                                         shard_index=shard_index, shard_count=3,
                                         num_epochs=1, shuffle=False))
        shard_markers.append(_document_markers(batches))
    seen = [m for markers in shard_markers for m in markers]
    assert len(seen) == len(set(seen)), "a document was read by two processes"
    assert sorted(seen) == sorted(all_markers)
    assert all(len(markers) > 0 for markers in shard_markers)


# -- checkpointing -------------------------------------------------------------------------

def _values_of(state, key):
    if isinstance(state, dict):
        for k, v in state.items():
            if k == key:
                yield v
            yield from _values_of(v, key)


RESUME_CFG = DataConfig(seq_len=64, shuffle_window=16, worker_threads=2, prefetch=2)
RESUME_BATCH = 4


def _resume_dataset(shuffle=True):
    return data.make_dataset(RESUME_CFG, "train", batch_size=RESUME_BATCH, seed=5,
                             shuffle=shuffle)


@pytest.mark.parametrize("shuffle", [True, False])
def test_iterator_state_round_trip_is_exact(shuffle):
    """Restoring a JSON round-tripped state mid-document (and, shuffled, mid-window) yields
    exactly the batches an uninterrupted iterator yields next."""
    reference = _take(_resume_dataset(shuffle), 30)
    saw_mid_document = saw_mid_window = False
    for k in (3, 11, 22):
        it = iter(_resume_dataset(shuffle))
        for _ in range(k):
            next(it)
        state = json.loads(json.dumps(it.get_state()))
        it.close()
        saw_mid_document |= any(offset > 0 for offset in _values_of(state, "offset"))
        saw_mid_window |= any(pos % RESUME_CFG.shuffle_window != 0
                              for pos in _values_of(state, "pos_in_window"))
        restored = iter(_resume_dataset(shuffle))
        for _ in range(25):  # an iterator that has run ahead must also restore
            next(restored)
        restored.set_state(state)
        resumed = [next(restored) for _ in range(6)]
        restored.close()
        assert _equal_batches(resumed, reference[k:k + 6]), f"resume at batch {k}"
    assert saw_mid_document
    assert saw_mid_window == shuffle


def test_orbax_checkpoint_manager_restores_the_iterator(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    reference = _take(_resume_dataset(), 16)
    it = iter(_resume_dataset())
    for _ in range(9):
        next(it)
    manager = ocp.CheckpointManager(tmp_path / "ckpt")
    manager.save(9, args=ocp.args.Composite(data_iter=grain.checkpoint.CheckpointSave(it)))
    manager.wait_until_finished()
    it.close()
    restored = iter(_resume_dataset())
    manager.restore(9, args=ocp.args.Composite(
        data_iter=grain.checkpoint.CheckpointRestore(restored)))
    resumed = [next(restored) for _ in range(7)]
    restored.close()
    manager.close()
    assert _equal_batches(resumed, reference[9:16])


# -- statistics ----------------------------------------------------------------------------

def test_unigram_entropy_and_token_counts_match_hand_computation(tmp_path):
    for i in range(10):
        (tmp_path / f"f{i}.txt").write_text("ab" * 50)
    cfg = DataConfig(source=f"text:{tmp_path}/*.txt", validation_percent=10)
    # Every document: 50 'a', 50 'b', 1 EOS.
    p = np.array([50, 50, 1]) / 101
    expected = float(-(p * np.log(p)).sum())
    assert data.unigram_entropy(cfg, "train") == pytest.approx(expected, rel=1e-12)
    assert data.unigram_entropy(cfg, "train", max_tokens=101) == pytest.approx(expected)
    n_train = len(sources.load_documents(cfg.source, "train", validation_percent=10))
    assert data.count_tokens(cfg, "train") == 101 * n_train
    assert data.count_tokens(cfg, "train", max_tokens=150) == 150
    assert data.bytes_per_token(cfg, "train") == pytest.approx(100 / 101)


def test_unigram_entropy_of_python_bytes_is_below_uniform():
    cfg = DataConfig()
    entropy = data.unigram_entropy(cfg, "validation", max_tokens=200_000)
    assert 1.0 < entropy < math.log(256)


# -- TFDS ----------------------------------------------------------------------------------

def test_tfds_pg19_with_mock_data():
    tfds = pytest.importorskip("tensorflow_datasets")
    with tfds.testing.mock_data(num_examples=24):
        docs = sources.load_documents("tfds:pg19", "train")
        assert len(docs) == 24
        texts = [docs[i] for i in range(len(docs))]
        assert all(isinstance(t, str) and t for t in texts)
        cfg = DataConfig(source="tfds:pg19", seq_len=16, worker_threads=1, prefetch=1)
        batches = list(data.make_dataset(cfg, "train", batch_size=2, seed=0, num_epochs=1,
                                         shuffle=False))
        shuffled = _take(data.make_dataset(cfg, "train", batch_size=2, seed=0), 3)
    expected = b"".join(t.encode("utf-8") + b"\0" for t in texts)
    stream = _sequences(batches).reshape(-1).astype(np.uint8).tobytes()
    assert len(batches) == len(expected) // 17 // 2
    assert stream == expected[:len(stream)]
    assert len(shuffled) == 3 and shuffled[0]["inputs"].shape == (2, 16)


@pytest.fixture(scope="module")
def tiny_tfds_dir(tmp_path_factory):
    """A real prepared (array_record) TFDS dataset with text stored as bytes."""
    tfds = pytest.importorskip("tensorflow_datasets")

    class LsJaxTinyText(tfds.core.GeneratorBasedBuilder):
        VERSION = tfds.core.Version("1.0.0")

        def _info(self):
            return tfds.core.DatasetInfo(
                builder=self, features=tfds.features.FeaturesDict({"text": tfds.features.Text()}))

        def _split_generators(self, dl_manager):
            return {"train": self._generate_examples(0, 6),
                    "validation": self._generate_examples(6, 8)}

        def _generate_examples(self, start, stop):
            for i in range(start, stop):
                yield i, {"text": f"tiny document {i} \u00e9\u00e8 \U0001f642\n" * 3}

    data_dir = tmp_path_factory.mktemp("tfds")
    LsJaxTinyText(data_dir=str(data_dir), file_format="array_record").download_and_prepare()
    return str(data_dir)


def test_tfds_prepared_dataset_decodes_text(tiny_tfds_dir):
    docs = sources.load_documents("tfds:ls_jax_tiny_text", "validation", text_field="text",
                               data_dir=tiny_tfds_dir)
    assert sorted(docs[i] for i in range(len(docs))) == \
        [f"tiny document {i} \u00e9\u00e8 \U0001f642\n" * 3 for i in (6, 7)]
    cfg = DataConfig(source="tfds:ls_jax_tiny_text", text_field="text", data_dir=tiny_tfds_dir,
                     seq_len=16, shuffle_window=4, worker_threads=1, prefetch=1)
    assert len(_take(data.make_dataset(cfg, "train", batch_size=2, seed=0), 3)) == 3


def test_tfds_unknown_split_and_field_raise(tiny_tfds_dir):
    with pytest.raises(ValueError, match=r"split: expected one of \['train', 'validation'\].*"
                                         r"got 'test'"):
        sources.load_documents("tfds:ls_jax_tiny_text", "test", text_field="text",
                            data_dir=tiny_tfds_dir)
    with pytest.raises(ValueError, match=r"text_field: expected one of the features \['text'\]"):
        sources.load_documents("tfds:ls_jax_tiny_text", "train", text_field="book_text",
                            data_dir=tiny_tfds_dir)


def test_tfds_unprepared_or_unknown_dataset_raises(tmp_path):
    pytest.importorskip("tensorflow_datasets")
    with pytest.raises(FileNotFoundError, match="'pg19' is not prepared"):
        sources.load_documents("tfds:pg19", "train", data_dir=str(tmp_path))
    with pytest.raises(ValueError, match="unknown TFDS dataset 'no_such_dataset_xyz'"):
        sources.load_documents("tfds:no_such_dataset_xyz", "train")


# -- bad inputs ----------------------------------------------------------------------------

def test_bad_sources_and_splits_raise_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="source: expected 'stdlib', 'text:<glob>' or 'tfds:"):
        sources.load_documents("hf:wikitext", "train")
    with pytest.raises(FileNotFoundError, match="no files match the glob"):
        sources.load_documents(f"text:{tmp_path}/**/*.nothing", "train")
    with pytest.raises(ValueError, match=r"split: expected one of \('train', 'validation'\) "
                                         r"for source 'stdlib', got 'test'"):
        sources.load_documents("stdlib", "test")
    # two files that hash to the same split leave the other one empty
    names = [f"f{i}.txt" for i in range(100)]
    a = names[0]
    b = next(n for n in names[1:] if sources.split_of(n, 50) == sources.split_of(a, 50))
    (tmp_path / a).write_text("one file")
    (tmp_path / b).write_text("another")
    other = "train" if sources.split_of(a, 50) == "validation" else "validation"
    with pytest.raises(ValueError, match=f"has no documents in split '{other}'"):
        sources.load_documents(f"text:{tmp_path}/*.txt", other, validation_percent=50)


def test_a_single_file_is_split_by_position(tmp_path):
    lines = [f"line {i:03d} " + "x" * 10 + "\n" for i in range(100)]  # 19 bytes each
    path = tmp_path / "book.txt"
    path.write_text("".join(lines))
    train_docs = sources.load_documents(f"text:{path}", "train", validation_percent=10)
    val_docs = sources.load_documents(f"text:{path}", "validation", validation_percent=10)
    assert len(train_docs) == len(val_docs) == 1
    # 1900 bytes, 10 % = 190 from the end: byte 1710 is the start of line 90 (90 * 19)
    assert train_docs[0] == "".join(lines[:90])
    assert val_docs[0] == "".join(lines[90:])
    # a file without newlines is cut at the exact position
    flat = tmp_path / "flat" / "a.txt"
    flat.parent.mkdir()
    flat.write_text("ab" * 50)
    assert sources.load_documents(f"text:{flat}", "validation", validation_percent=10)[0] == "ab" * 5


@pytest.mark.parametrize("glob", ["one", "many"])
def test_a_binary_file_in_a_text_source_is_refused_by_name(tmp_path, glob):
    """An executable or archive matched by the glob: refused before training, by file name."""
    binary = tmp_path / "tool.bin"
    binary.write_bytes(b"\x7fELF\x02\x01\x01" + bytes(64) + b"code" * 100)
    source = f"text:{binary}"
    if glob == "many":
        for i in range(5):
            (tmp_path / f"doc{i}.txt").write_text("plain text\n" * 50)
        source = f"text:{tmp_path}/*"
    with pytest.raises(ValueError, match=f"source: {binary} .*looks binary"):
        sources.load_documents(source, "train")
    binary.unlink()
    if glob == "many":  # the rest is text: accepted
        assert len(sources.load_documents(source, "train")) + \
            len(sources.load_documents(source, "validation")) == 5


def test_empty_files_are_a_clear_error(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match="matches one file, .*empty.txt, and it is empty"):
        sources.load_documents(f"text:{tmp_path}/*.txt", "train")
    for i in range(30):
        (tmp_path / f"e{i}.txt").write_text("")
    with pytest.raises(ValueError, match="split 'train' of .* are all empty"):
        sources.load_documents(f"text:{tmp_path}/*.txt", "train")
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "t.txt").write_text("a")
    with pytest.raises(ValueError, match="too small to split"):
        sources.load_documents(f"text:{tmp_path}/tiny/*.txt", "validation")


def test_make_dataset_rejects_bad_arguments():
    cfg = DataConfig()
    with pytest.raises(ValueError, match=r"shard_index: expected an int in \[0, shard_count=2\)"):
        data.make_dataset(cfg, "train", batch_size=4, seed=0, shard_index=2, shard_count=2)
    with pytest.raises(ValueError, match="batch_size: expected an int >= 1, got 0"):
        data.make_dataset(cfg, "train", batch_size=0, seed=0)
    with pytest.raises(ValueError, match="num_epochs: expected an int >= 1, got 0"):
        data.make_dataset(cfg, "train", batch_size=4, seed=0, num_epochs=0)
    with pytest.raises(ValueError, match="split: expected one of"):
        data.make_dataset(cfg, "eval", batch_size=4, seed=0)


# -- startup -------------------------------------------------------------------------------

def test_first_batch_is_fast_on_stdlib():
    """No pre-tokenization pass: the first batch (seq 256, batch 16, window 1024) comes quickly
    even on a loaded 2-core machine (typically ~0.2 s)."""
    start = time.perf_counter()
    it = iter(data.make_dataset(DataConfig(seq_len=256), "train", batch_size=16, seed=0))
    batch = next(it)
    elapsed = time.perf_counter() - start
    it.close()
    assert batch["inputs"].shape == (16, 256)
    assert elapsed < 15.0, elapsed
