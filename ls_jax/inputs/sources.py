"""Document sources: where a split's documents come from, as a random-access sequence of strings.

``load_documents(source, split)`` (or ``load_split(data_cfg, split)``) understands three forms:

* ``"stdlib"``: the ``.py`` files of the running Python's standard library (no site-packages),
  ordered by relative path. Always present, so tests and smoke runs need no download.
* ``"text:<glob>"``: local text files matching a (recursive, ``**``) glob.
* ``"tfds:<name>[:<config>]"``: ``tfds.data_source`` of a prepared TFDS dataset (array_record);
  the text is the feature ``text_field`` (pg19: ``"book_text"``). tensorflow_datasets is
  imported only here, so the other sources work without it.

The local sources split their files into "train" and "validation" by a stable hash of the
relative path (validation when ``hash % 100 < validation_percent``). A ``text:`` file that
looks binary (a NUL byte in its first ``BINARY_SNIFF_BYTES``) is refused by name. A ``text:`` glob that
matches a single file is split by position instead: its last ``validation_percent`` % of bytes
(from the next line start) are the validation document, the rest the training document. A
split whose files are all empty is an error.

Both the input pipeline (``ls_jax.inputs.pipeline``) and the tokenizer trainer (``ls_jax.inputs.tokenizer``) read
documents through this module.
"""

from __future__ import annotations

import functools
import glob
import hashlib
import os
import pathlib
import re
import sysconfig
from collections.abc import Sequence

import numpy as np

from ls_jax.config import DataConfig

LOCAL_SPLITS = ("train", "validation")
BINARY_SNIFF_BYTES = 8192  # text (UTF-8) never holds a NUL byte; executables, archives, images do
_EXCLUDED_STDLIB_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
_SOURCE_FORMS = "'stdlib', 'text:<glob>' or 'tfds:<name>[:<config>]'"


def hash_percent(relative_path: str) -> int:
    """Stable bucket in [0, 100) of a path (same on every machine and Python run)."""
    digest = hashlib.sha256(relative_path.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "little") % 100


def split_of(relative_path: str, validation_percent: int) -> str:
    """"validation" for the ``validation_percent`` % of paths whose hash falls below it."""
    return "validation" if hash_percent(relative_path) < validation_percent else "train"


class TextFileDocuments:
    """Random-access text files: document i is the text of ``root / relative_paths[i]``.

    Files are read lazily as UTF-8 (undecodable bytes become U+FFFD).
    """

    def __init__(self, root: pathlib.Path, relative_paths: Sequence[str], description: str):
        self.root = pathlib.Path(root)
        self.relative_paths = tuple(relative_paths)
        self.description = description

    def __len__(self) -> int:
        return len(self.relative_paths)

    def __getitem__(self, index: int) -> str:
        path = self.root / self.relative_paths[index]
        return path.read_bytes().decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return f"TextFileDocuments({self.description}, {len(self)} files under {self.root})"


class TextSliceDocuments:
    """One document: bytes ``[start, end)`` of the file ``path`` (read lazily, as UTF-8)."""

    def __init__(self, path: pathlib.Path, start: int, end: int, description: str):
        self.path, self.start, self.end = pathlib.Path(path), start, end
        self.description = description

    def __len__(self) -> int:
        return 1

    def __getitem__(self, index: int) -> str:
        if index not in (0, -1):
            raise IndexError(f"index: expected 0 (one document), got {index}")
        with open(self.path, "rb") as f:
            f.seek(self.start)
            return f.read(self.end - self.start).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return (f"TextSliceDocuments({self.description}, bytes [{self.start}, {self.end}) of "
                f"{self.path})")


def position_cut(path: str | os.PathLike, validation_percent: int) -> int:
    """Byte offset where a single file's validation part starts: ``validation_percent`` % from
    the end, moved forward to the next line start (if one follows within 64 KiB)."""
    size = os.path.getsize(path)
    cut = size - size * validation_percent // 100
    if cut <= 0:
        return cut
    with open(path, "rb") as f:
        f.seek(cut - 1)  # a newline right before the cut already starts a line there
        ahead = f.read(1 << 16)
    newline = ahead.find(b"\n")
    if newline >= 0 and cut + newline < size:
        cut += newline
    return cut


def _split_one_file(source: str, path: str, split: str,
                    validation_percent: int) -> TextSliceDocuments:
    size = os.path.getsize(path)
    if size == 0:
        raise ValueError(f"source: {source!r} matches one file, {path}, and it is empty; "
                         f"expected text to train on")
    cut = position_cut(path, validation_percent)
    start, end = (0, cut) if split == "train" else (cut, size)
    if end <= start:
        raise ValueError(
            f"source: {source!r} matches one file, {path}, of {size} bytes: too small to split "
            f"into train and validation (validation_percent={validation_percent}); add text")
    return TextSliceDocuments(pathlib.Path(path), start, end, f"{source} {split}")


class TfdsTextDocuments:
    """Text feature ``text_field`` of a TFDS random-access data source (bytes -> UTF-8)."""

    def __init__(self, data_source, text_field: str, description: str):
        self._data_source = data_source
        self.text_field = text_field
        self.description = description

    def __len__(self) -> int:
        return len(self._data_source)

    def __getitem__(self, index: int) -> str:
        value = self._data_source[index][self.text_field]
        if isinstance(value, np.ndarray):
            value = value.item()
        if isinstance(value, bytes):
            return value.decode("utf-8", errors="replace")
        return str(value)

    def __repr__(self) -> str:
        return f"TfdsTextDocuments({self.description}, {len(self)} documents)"


def _check_local_split(source: str, split: str):
    if split not in LOCAL_SPLITS:
        raise ValueError(f"split: expected one of {LOCAL_SPLITS} for source {source!r}, "
                         f"got {split!r}")


def _split_files(source: str, root: pathlib.Path, relative_paths: list[str], split: str,
                 validation_percent: int) -> TextFileDocuments:
    chosen = [p for p in relative_paths if split_of(p, validation_percent) == split]
    if not chosen:
        raise ValueError(
            f"split: source {source!r} has no documents in split {split!r}: all "
            f"{len(relative_paths)} files hash to the other split with "
            f"validation_percent={validation_percent}; add files or change validation_percent")
    if all(os.path.getsize(root / p) == 0 for p in chosen):
        raise ValueError(f"source: the {len(chosen)} file(s) of split {split!r} of {source!r} "
                         f"are all empty; expected text")
    return TextFileDocuments(root, chosen, f"{source} {split}")


def stdlib_root() -> pathlib.Path:
    return pathlib.Path(sysconfig.get_paths()["stdlib"])


@functools.cache
def _stdlib_files(root: str) -> tuple[str, ...]:
    """The ``.py`` files under ``root`` (symbolic links to files included, directories behind
    links and the excluded ones not entered, unreadable ones skipped), as sorted relative POSIX
    paths. Listed once per process: the standard library does not change while Python runs,
    and a run reads the listing for each split and each pipeline it builds."""
    found = []
    pending = [("", root)]
    while pending:
        prefix, directory = pending.pop()
        try:
            with os.scandir(directory) as listing:
                entries = list(listing)
        except OSError:
            continue
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                if entry.name not in _EXCLUDED_STDLIB_DIRS:
                    pending.append((f"{prefix}{entry.name}/", entry.path))
            elif entry.name.endswith(".py") and entry.is_file():
                found.append(prefix + entry.name)
    return tuple(sorted(found))


def _stdlib_documents(split: str, validation_percent: int) -> TextFileDocuments:
    root = stdlib_root()
    relative_paths = list(_stdlib_files(str(root)))
    if not relative_paths:
        raise FileNotFoundError(f"source: 'stdlib' found no .py files under {root}")
    return _split_files("stdlib", root, relative_paths, split, validation_percent)


def _glob_root(pattern: str) -> pathlib.Path:
    """The directory part of ``pattern`` before its first wildcard (paths hash relative to it,
    so the split does not depend on where the data lives or which other files exist)."""
    parts = pathlib.Path(pattern).parts
    fixed = []
    for part in parts[:-1]:
        if glob.has_magic(part):
            break
        fixed.append(part)
    return pathlib.Path(*fixed) if fixed else pathlib.Path(".")


def _text_documents(source: str, split: str, validation_percent: int):
    pattern = os.path.expanduser(source[len("text:"):])
    if not pattern:
        raise ValueError(f"source: expected 'text:<glob>', got {source!r} (empty glob)")
    files = sorted(f for f in glob.glob(pattern, recursive=True) if os.path.isfile(f))
    if not files:
        raise FileNotFoundError(f"source: no files match the glob {pattern!r} (source {source!r})")
    for f in files:
        _check_text(source, f)
    if len(files) == 1:
        return _split_one_file(source, files[0], split, validation_percent)
    root = _glob_root(pattern)
    relative_paths = sorted(pathlib.Path(os.path.relpath(f, root)).as_posix() for f in files)
    return _split_files(source, root, relative_paths, split, validation_percent)


def _check_text(source: str, path: str) -> None:
    with open(path, "rb") as f:
        head = f.read(BINARY_SNIFF_BYTES)
    if b"\0" in head:
        raise ValueError(f"source: {path} (matched by {source!r}) looks binary (a NUL byte in "
                         f"its first {len(head)} bytes); expected text files: narrow the glob")


def _split_names(split: str) -> list[str]:
    """Base split names of a TFDS split expression ("train[:10%]+validation" -> both)."""
    return [re.sub(r"\[.*\]$", "", part.strip()) for part in split.split("+")]


def _tfds_documents(source: str, split: str, text_field: str,
                    data_dir: str | None) -> TfdsTextDocuments:
    spec = source[len("tfds:"):]
    name, _, config = spec.partition(":")
    if not name or ":" in config:
        raise ValueError(f"source: expected 'tfds:<name>[:<config>]', got {source!r}")
    try:
        import tensorflow_datasets as tfds  # lazy: the stdlib/text sources must not need it
    except ImportError as e:
        raise ImportError(f"source {source!r} needs tensorflow-datasets (pip install "
                          f"tensorflow-datasets); the 'stdlib' and 'text:' sources do not") from e
    tfds_name = f"{name}/{config}" if config else name
    try:
        builder = tfds.builder(tfds_name, data_dir=data_dir)
    except tfds.core.registered.DatasetNotFoundError as e:
        raise ValueError(f"source: unknown TFDS dataset {tfds_name!r} (source {source!r})") from e
    features = list(builder.info.features.keys()) if builder.info.features else []
    if features and text_field not in features:
        raise ValueError(f"text_field: expected one of the features {features} of "
                         f"{tfds_name!r}, got {text_field!r}")
    known_splits = list(builder.info.splits.keys())
    if known_splits:  # known once the dataset is prepared (a mocked dataset knows none)
        for base in _split_names(split):
            if base not in known_splits:
                raise ValueError(f"split: expected one of {known_splits} for source "
                                 f"{source!r}, got {split!r}")
    try:
        data_source = tfds.data_source(tfds_name, split=split, data_dir=data_dir, download=False)
    except Exception as e:
        if not builder.is_prepared():
            raise FileNotFoundError(
                f"source: TFDS dataset {tfds_name!r} is not prepared in data_dir "
                f"{data_dir or os.environ.get('TFDS_DATA_DIR', '~/tensorflow_datasets')!r}. "
                f"Prepare it once (needs tensorflow for pg19) with: python -c \"import "
                f"tensorflow_datasets as tfds; tfds.builder('{tfds_name}', data_dir=DIR)"
                f".download_and_prepare(file_format='array_record')\"") from e
        raise
    return TfdsTextDocuments(data_source, text_field, f"{source} {split}")


def load_documents(source: str, split: str, *, text_field: str = "book_text",
                   data_dir: str | None = None, validation_percent: int = 5):
    """A random-access sequence (``len``, ``[i] -> str``) of the documents of a split."""
    if not isinstance(split, str) or not split:
        raise ValueError(f"split: expected a non-empty split name, got {split!r}")
    if source == "stdlib":
        _check_local_split(source, split)
        return _stdlib_documents(split, validation_percent)
    if isinstance(source, str) and source.startswith("text:"):
        _check_local_split(source, split)
        return _text_documents(source, split, validation_percent)
    if isinstance(source, str) and source.startswith("tfds:"):
        return _tfds_documents(source, split, text_field, data_dir)
    raise ValueError(f"source: expected {_SOURCE_FORMS}, got {source!r}")


def load_split(cfg: DataConfig, split: str):
    """``load_documents`` with the source settings of ``cfg``."""
    return load_documents(cfg.source, split, text_field=cfg.text_field, data_dir=cfg.data_dir,
                          validation_percent=cfg.validation_percent)

