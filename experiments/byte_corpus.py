"""A byte-level corpus of Python sources, held in memory, and a deterministic batch sampler.

The GPU image has no grain, TFDS or tensorboardX, so the stability experiments that run there
read their data with numpy alone:

* ``build_corpus("stdlib")``: the ``.py`` files of the running Python's standard library;
  ``build_corpus("python")``: those plus every ``.py`` file of the installed packages
  (``site-packages`` / ``dist-packages``). ``max_bytes`` caps the corpus: files are taken in the
  order of a hash of their path until the cap, so a cap gives a fixed, spread-out subset.
* Tokens are the library's byte tokens (``ls_jax.tokenizer.ByteTokenizer``: UTF-8 bytes, NUL
  removed, id 0 ends each document), stored as one uint8 array per split; validation is the
  files whose path hash falls below ``validation_percent`` (``ls_jax.sources.hash_percent``,
  the rule of the library's local sources).
* ``WindowSampler`` cuts a split into non-overlapping windows of T + 1 tokens and returns the
  windows of step ``s`` in a seeded order that is a new permutation each epoch. A batch depends
  only on (tokens, T, batch size, seed, step): every run with those sees the same data in the
  same order, and a run can start at any step.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import os
import site
import sysconfig
import time

import numpy as np

from ls_jax.sources import hash_percent, stdlib_root
from ls_jax.tokenizer import ByteTokenizer

SOURCES = ("stdlib", "python")
_PACKAGE_DIRS = frozenset({"site-packages", "dist-packages"})


def source_roots(source: str) -> list[tuple[str, str]]:
    """(label, directory) of each tree a source reads: the stdlib, then the package dirs."""
    if source not in SOURCES:
        raise ValueError(f"source: expected one of {SOURCES}, got {source!r}")
    roots = [("stdlib", os.path.realpath(stdlib_root()))]
    if source == "python":
        dirs = [sysconfig.get_paths()[k] for k in ("purelib", "platlib")] + site.getsitepackages()
        seen = set()
        for d in dirs:
            real = os.path.realpath(d)
            if os.path.isdir(real) and real not in seen:
                seen.add(real)
                roots.append((real, real))
    return roots


def _py_files(label: str, root: str) -> list[tuple[str, str]]:
    """(key, path) of the .py files under root; the stdlib walk skips package dirs."""
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__"
                             and not (label == "stdlib" and d in _PACKAGE_DIRS))
        rel_dir = os.path.relpath(dirpath, root)
        for name in filenames:
            if name.endswith(".py"):
                rel = name if rel_dir == "." else f"{rel_dir}/{name}"
                files.append((f"{label}/{rel}", os.path.join(dirpath, name)))
    return files


@dataclasses.dataclass
class ByteCorpus:
    train_N: np.ndarray  # uint8 tokens of the training files, each followed by EOS (0)
    validation_N: np.ndarray
    source: str
    roots: list[str]
    train_files: int
    validation_files: int
    skipped_files: int  # unreadable
    seconds: float  # to find, read and tokenize

    def describe(self) -> dict:
        return {"source": self.source, "roots": self.roots, "train_files": self.train_files,
                "validation_files": self.validation_files, "skipped_files": self.skipped_files,
                "train_tokens": int(self.train_N.size),
                "validation_tokens": int(self.validation_N.size),
                "build_seconds": round(self.seconds, 1)}


def _read_tokens(path: str) -> np.ndarray | None:
    try:
        with open(path, "rb") as f:
            text = f.read().decode("utf-8", errors="replace")
    except OSError:
        return None
    tokens_N = ByteTokenizer().encode(text).astype(np.uint8)
    return np.concatenate([tokens_N, np.zeros(1, np.uint8)])  # EOS


def build_corpus(source: str, *, max_bytes: int | None = None, validation_percent: int = 1,
                 threads: int = 16) -> ByteCorpus:
    """Reads and tokenizes a source's files (see the module docstring)."""
    if not isinstance(validation_percent, int) or not 0 < validation_percent < 100:
        raise ValueError(f"validation_percent: expected an int in [1, 99], got {validation_percent!r}")
    if max_bytes is not None and (not isinstance(max_bytes, int) or max_bytes < 1):
        raise ValueError(f"max_bytes: expected None or an int >= 1, got {max_bytes!r}")
    t0 = time.time()
    roots = source_roots(source)
    files = [f for label, root in roots for f in _py_files(label, root)]
    if not files:
        raise FileNotFoundError(f"source: {source!r} found no .py files under "
                                f"{[r for _, r in roots]}")
    files.sort(key=lambda kp: hashlib.sha256(kp[0].encode("utf-8")).digest())
    if max_bytes is not None:
        chosen, total = [], 0
        for key, path in files:
            if total >= max_bytes:
                break
            try:
                total += os.path.getsize(path)
            except OSError:
                continue
            chosen.append((key, path))
        files = chosen
    splits = {"train": [], "validation": []}
    for key, path in sorted(files):
        splits["validation" if hash_percent(key) < validation_percent else "train"].append(path)
    arrays, skipped = {}, 0
    with concurrent.futures.ThreadPoolExecutor(max(1, threads)) as pool:
        for name, paths in splits.items():
            parts = [t for t in pool.map(_read_tokens, paths) if t is not None]
            skipped += len(paths) - len(parts)
            arrays[name] = np.concatenate(parts) if parts else np.zeros(0, np.uint8)
    return ByteCorpus(arrays["train"], arrays["validation"], source, [r for _, r in roots],
                      len(splits["train"]), len(splits["validation"]), skipped, time.time() - t0)


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
        """How many times ``steps`` steps go over the windows."""
        return steps * self.batch_size / self.n_windows

    def fixed_batches(self, count: int) -> list[np.ndarray]:
        """The first ``count`` batches in corpus order (evaluation); fewer if the split is short."""
        count = min(count, self.n_windows // self.batch_size)
        return [self.windows_WxT1[i * self.batch_size:(i + 1) * self.batch_size]
                for i in range(count)]
