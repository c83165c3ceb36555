"""A byte-level corpus of the text on this machine, held in memory, and a deterministic batch
sampler.

    python -m experiments.byte_corpus --source offline      # build it and print its report

The GPU image has no grain, TFDS or tensorboardX, so the stability experiments that run there
read their data with numpy alone. Sources (``SOURCES``):

* ``stdlib``: the ``.py`` files of the running Python's standard library;
* ``python``: those and the ``.py`` files of the installed packages (``package_dirs``);
* ``offline``: those, the packages' other sources (``.pyi`` stubs, C, C++ and CUDA sources and
  headers) and docs (``.md``, ``.rst``), and the ``.md``, ``.rst`` and ``.txt`` files of
  ``/usr/share/doc``. A package's ``.txt`` files are left out: in package directories they are
  mostly data (label lists, URL checksums, numeric test tables), not prose.

Every file counts once: a file whose content (its SHA-256) an earlier file had is dropped, so a
file vendored by several packages, or a package installed in two places, is read once and
cannot be both trained on and held out. Empty files and files with a NUL byte (binary) are
skipped. Files are taken in the order of a hash of their path (``max_bytes`` stops at the first
file past the cap, so a cap gives a fixed, spread-out subset); of duplicates the first in that
order stays. ``ByteCorpus.describe()`` is the report: files and tokens per split, bytes per
kind of file, duplicates dropped.

Tokens are the library's byte tokens (``ls_jax.inputs.tokenizer.ByteTokenizer``: UTF-8 bytes, id 0
ends each document), stored as one uint8 array per split; validation is the files whose path
hash falls below ``validation_percent`` (``ls_jax.inputs.sources.hash_percent``, the rule of the
library's local sources).

``WindowSampler`` cuts a split into non-overlapping windows of T + 1 tokens and returns the
windows of step ``s`` in a seeded order that is a new permutation each epoch. A batch depends
only on (tokens, T, batch size, seed, step): every run with those sees the same data in the same
order, and a run can start at any step. ``epochs(steps)`` is how many passes over the split's
windows ``steps`` steps make; the experiments report it for every run.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import hashlib
import json
import os
import site
import sys
import sysconfig
import time

import numpy as np

from ls_jax.inputs.sources import hash_percent, stdlib_root
from ls_jax.inputs.tokenizer import ByteTokenizer

SOURCES = ("stdlib", "python", "offline")
SYSTEM_DOC_DIR = "/usr/share/doc"
_PACKAGE_DIRS = frozenset({"site-packages", "dist-packages"})
# file kind -> extensions; a source reads some kinds from each of its roots
KINDS = {
    "python": (".py",),
    "code": (".pyi", ".c", ".h", ".cc", ".cpp", ".cxx", ".hpp", ".cu", ".cuh"),
    "docs": (".md", ".rst"),
    "system docs": (".md", ".rst", ".txt"),
}
_READ_CHUNK = 512  # files read at a time: a cap stops reading within one chunk of it


@dataclasses.dataclass(frozen=True)
class Root:
    """A directory a source reads: the files of ``kinds`` under it, keyed ``label/relative``."""
    label: str
    path: str
    kinds: tuple[str, ...]
    skip_dirs: frozenset = frozenset({"__pycache__"})


def package_dirs() -> list[str]:
    """The installed packages' directories: the interpreter's (``sysconfig``, ``site``) and any
    ``site-packages`` / ``dist-packages`` on ``sys.path`` (a venv that reuses another's)."""
    dirs = [sysconfig.get_paths()[k] for k in ("purelib", "platlib")] + site.getsitepackages()
    dirs += [p for p in sys.path if os.path.basename(os.path.normpath(p or ".")) in _PACKAGE_DIRS]
    out = []
    for d in dirs:
        real = os.path.realpath(d)
        if os.path.isdir(real) and real not in out:
            out.append(real)
    return out


def source_roots(source: str) -> list[Root]:
    """The roots a source reads: the stdlib, then the package dirs, then the system docs."""
    if source not in SOURCES:
        raise ValueError(f"source: expected one of {SOURCES}, got {source!r}")
    roots = [Root("stdlib", os.path.realpath(stdlib_root()), ("python",),
                  frozenset({"__pycache__", *_PACKAGE_DIRS}))]
    if source == "stdlib":
        return roots
    kinds = ("python",) if source == "python" else ("python", "code", "docs")
    roots += [Root(d, d, kinds) for d in package_dirs()]
    if source == "offline" and os.path.isdir(SYSTEM_DOC_DIR):
        real = os.path.realpath(SYSTEM_DOC_DIR)
        roots.append(Root(real, real, ("system docs",)))
    return roots


def _files(root: Root) -> list[tuple[str, str, str]]:
    """(key, path, kind) of the files of the root's kinds under it."""
    kind_of = {ext: kind for kind in reversed(root.kinds) for ext in KINDS[kind]}
    files = []
    for dirpath, dirnames, filenames in os.walk(root.path):
        dirnames[:] = sorted(d for d in dirnames if d not in root.skip_dirs)
        rel_dir = os.path.relpath(dirpath, root.path)
        for name in filenames:
            kind = kind_of.get(os.path.splitext(name)[1])
            if kind is not None:
                rel = name if rel_dir == "." else f"{rel_dir}/{name}"
                files.append((f"{root.label}/{rel}", os.path.join(dirpath, name), kind))
    return files


@dataclasses.dataclass
class ByteCorpus:
    train_N: np.ndarray  # uint8 tokens of the training files, each followed by EOS (0)
    validation_N: np.ndarray
    source: str
    roots: list[str]
    train_files: int
    validation_files: int
    skipped_files: int  # unreadable or binary (a NUL byte)
    empty_files: int
    duplicate_files: int  # dropped: their content was read already
    duplicate_bytes: int
    kinds: dict  # kind -> {"files", "bytes"} of the files kept
    seconds: float  # to find, read, hash and tokenize

    def describe(self) -> dict:
        """The corpus report (what the experiments record with their results)."""
        return {"source": self.source, "roots": self.roots, "train_files": self.train_files,
                "validation_files": self.validation_files,
                "train_tokens": int(self.train_N.size),
                "validation_tokens": int(self.validation_N.size),
                "kinds": self.kinds, "duplicate_files": self.duplicate_files,
                "duplicate_bytes": self.duplicate_bytes, "empty_files": self.empty_files,
                "skipped_files": self.skipped_files, "build_seconds": round(self.seconds, 1)}


def summary_line(desc: dict) -> str:
    """One line of a corpus report (``ByteCorpus.describe()``) for a results table."""
    kinds = desc.get("kinds") or {}
    what = ", ".join(f"{k} {v['files']:,} files ({v['bytes'] / 1e6:.1f} MB)"
                     for k, v in kinds.items())
    dup = desc.get("duplicate_files")
    return (f"Corpus {desc.get('source', '?')!r}: {desc.get('train_files', 0):,} training files, "
            f"{desc.get('train_tokens', 0) / 1e6:.1f}M byte tokens; held out "
            f"{desc.get('validation_files', 0):,} files, "
            f"{desc.get('validation_tokens', 0) / 1e6:.2f}M tokens"
            + (f"; kept: {what}" if what else "")
            + ("" if dup is None else
               f"; {dup:,} duplicate files ({desc['duplicate_bytes'] / 1e6:.1f} MB) dropped") + ".")


def _read(path: str):
    """(status, bytes read, content digest, tokens + EOS) of one file."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return "skipped", 0, None, None
    if not data:
        return "empty", 0, None, None
    if b"\0" in data:
        return "skipped", len(data), None, None
    tokens_N = ByteTokenizer().encode(data.decode("utf-8", errors="replace")).astype(np.uint8)
    return "ok", len(data), hashlib.sha256(data).digest(), np.append(tokens_N, np.uint8(0))


def build_corpus(source: str, *, max_bytes: int | None = None, validation_percent: int = 1,
                 threads: int = 16, cache_dir: str | None = None) -> ByteCorpus:
    """Reads a source's files (see the module docstring). With ``cache_dir``, a corpus built
    with the same source, roots, cap and split is loaded from there, and one built here is
    saved there: the experiment processes of one machine read its files once. The cache does
    not see files that change under the roots; delete it to rebuild."""
    roots = source_roots(source)
    if cache_dir is None:
        return read_roots(roots, source=source, max_bytes=max_bytes,
                          validation_percent=validation_percent, threads=threads)
    key = json.dumps([source, [dataclasses.astuple(r) for r in roots], max_bytes,
                      validation_percent], default=sorted)
    path = os.path.join(cache_dir, f"{source}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.npz")
    if os.path.exists(path):
        return _load_corpus(path)
    corpus = read_roots(roots, source=source, max_bytes=max_bytes,
                        validation_percent=validation_percent, threads=threads)
    _save_corpus(corpus, path)
    return corpus


def _save_corpus(corpus: ByteCorpus, path: str) -> None:
    """Whole-file replace: processes that build the same corpus at once leave one copy."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    meta = {f.name: getattr(corpus, f.name) for f in dataclasses.fields(corpus)
            if f.name not in ("train_N", "validation_N")}
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        np.savez(f, train_N=corpus.train_N, validation_N=corpus.validation_N,
                 meta=np.frombuffer(json.dumps(meta).encode(), np.uint8))
    os.replace(tmp, path)


def _load_corpus(path: str) -> ByteCorpus:
    with np.load(path) as z:
        meta = json.loads(z["meta"].tobytes())
        return ByteCorpus(train_N=z["train_N"], validation_N=z["validation_N"], **meta)


def read_roots(roots: list[Root], *, source: str, max_bytes: int | None = None,
               validation_percent: int = 1, threads: int = 16) -> ByteCorpus:
    """Reads, deduplicates, splits and tokenizes the files of ``roots``."""
    if not isinstance(validation_percent, int) or not 0 < validation_percent < 100:
        raise ValueError(f"validation_percent: expected an int in [1, 99], got {validation_percent!r}")
    if max_bytes is not None and (not isinstance(max_bytes, int) or max_bytes < 1):
        raise ValueError(f"max_bytes: expected None or an int >= 1, got {max_bytes!r}")
    t0 = time.time()
    files = [f for root in roots for f in _files(root)]
    if not files:
        raise FileNotFoundError(f"source: {source!r} found no files under "
                                f"{[r.path for r in roots]}")
    files.sort(key=lambda f: hashlib.sha256(f[0].encode("utf-8")).digest())
    seen, kept, total = set(), [], 0
    counts = {"skipped": 0, "empty": 0, "duplicate": 0, "duplicate_bytes": 0}
    kinds: dict[str, dict[str, int]] = {}
    with concurrent.futures.ThreadPoolExecutor(max(1, threads)) as pool:
        for start in range(0, len(files), _READ_CHUNK):
            chunk = files[start:start + _READ_CHUNK]
            for (key, _, kind), (status, size, digest, tokens_N) in zip(
                    chunk, pool.map(_read, [path for _, path, _ in chunk])):
                if status != "ok":
                    counts[status] += 1
                elif digest in seen:
                    counts["duplicate"] += 1
                    counts["duplicate_bytes"] += size
                else:
                    seen.add(digest)
                    kept.append((key, tokens_N))
                    k = kinds.setdefault(kind, {"files": 0, "bytes": 0})
                    k["files"] += 1
                    k["bytes"] += size
                    total += size
                    if max_bytes is not None and total >= max_bytes:
                        break
            if max_bytes is not None and total >= max_bytes:
                break
    splits = {"train": [], "validation": []}
    for key, tokens_N in sorted(kept, key=lambda kt: kt[0]):
        splits["validation" if hash_percent(key) < validation_percent else "train"].append(tokens_N)
    arrays = {name: np.concatenate(parts) if parts else np.zeros(0, np.uint8)
              for name, parts in splits.items()}
    return ByteCorpus(arrays["train"], arrays["validation"], source, [r.path for r in roots],
                      len(splits["train"]), len(splits["validation"]), counts["skipped"],
                      counts["empty"], counts["duplicate"], counts["duplicate_bytes"],
                      {k: kinds[k] for k in KINDS if k in kinds}, time.time() - t0)


class WindowSampler:
    """Batches uint8 [batch_size, seq_len + 1] of non-overlapping windows of ``tokens_N``."""

    def __init__(self, tokens_N: np.ndarray, *, seq_len: int, batch_size: int, seed: int):
        self.n_windows = tokens_N.size // (seq_len + 1)
        if self.n_windows < batch_size:
            raise ValueError(f"tokens: expected at least batch_size={batch_size} windows of "
                             f"{seq_len + 1} tokens, got {tokens_N.size} tokens")
        self.windows_WxT1 = tokens_N[:self.n_windows * (seq_len + 1)].reshape(self.n_windows, -1)
        self.batch_size, self.seed = batch_size, seed
        self._perms: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) > 2:
                self._perms.clear()
            rng = np.random.default_rng([self.seed, epoch])
            self._perms[epoch] = rng.permutation(self.n_windows)
        return self._perms[epoch]

    def batch(self, step: int) -> np.ndarray:
        """The batch of 0-based training step ``step``."""
        index = np.arange(step * self.batch_size, (step + 1) * self.batch_size)
        epoch, pos = np.divmod(index, self.n_windows)
        rows = np.array([self._perm(int(e))[p] for e, p in zip(epoch, pos)]) \
            if epoch[0] != epoch[-1] else self._perm(int(epoch[0]))[pos]
        return self.windows_WxT1[rows]

    def epochs(self, steps: int) -> float:
        """How many times ``steps`` steps go over the windows (tokens seen / tokens in the
        split's windows)."""
        return steps * self.batch_size / self.n_windows

    def fixed_batches(self, count: int) -> list[np.ndarray]:
        """The first ``count`` batches in corpus order (evaluation); fewer if the split is short."""
        count = min(count, self.n_windows // self.batch_size)
        return [self.windows_WxT1[i * self.batch_size:(i + 1) * self.batch_size]
                for i in range(count)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Builds a byte corpus and prints its report.")
    parser.add_argument("--source", default="offline", choices=SOURCES)
    parser.add_argument("--max-mb", type=int, default=None, help="cap the corpus at this many MB")
    parser.add_argument("--validation-percent", type=int, default=1)
    parser.add_argument("--cache", default=None, metavar="DIR",
                        help="save the corpus in DIR (or load it from there) for the experiments' "
                             "--corpus-cache")
    args = parser.parse_args(argv)
    try:
        corpus = build_corpus(args.source, validation_percent=args.validation_percent,
                              max_bytes=None if args.max_mb is None else args.max_mb * 2**20,
                              cache_dir=args.cache)
    except (ValueError, FileNotFoundError) as e:
        parser.error(str(e))
    print(json.dumps(corpus.describe(), indent=2))
    print(summary_line(corpus.describe()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
