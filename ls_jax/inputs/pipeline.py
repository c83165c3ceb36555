"""Input pipeline: documents -> tokens -> packed fixed-length sequences -> batches (grain).

Documents come from ``ls_jax.inputs.sources``. ``make_dataset`` builds the training/eval pipeline
(see docs/data.md):

    documents -> shard (per process) -> shuffle documents (seeded, new order each epoch)
      -> repeat -> tokenize + EOS (threads) -> pack into T + 1 tokens -> window shuffle
      -> batch {"inputs": [B, T], "targets": [B, T]} -> thread prefetch

Its iterator's ``get_state()``/``set_state()`` round-trip exactly (also through JSON, which is
what ``grain.checkpoint.CheckpointSave`` writes), so a restored run sees the same batches.
The statistics at the end (unigram entropy, token counts, bytes per token) read the same
documents through the same tokenizer.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import grain
import numpy as np

from ls_jax.config import DataConfig
from ls_jax.inputs.sources import load_split
from ls_jax.inputs.tokenizer import Tokenizer, make_tokenizer


# -- pipeline stages -----------------------------------------------------------------------

class TokenizeWithEos:
    """document str -> int32 [n + 1]: its tokens followed by EOS."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._eos_1 = np.array([tokenizer.eos_id], np.int32)

    def __call__(self, text: str) -> np.ndarray:
        return np.concatenate([self.tokenizer.encode(text), self._eos_1])


class PackSequencesIterDataset(grain.IterDataset):
    """Concatenates the parent's 1-D token arrays and cuts them into int32 [length] pieces.

    No padding: a document that does not fit continues in the next sequence. When the parent
    ends, the last partial sequence is dropped.
    """

    def __init__(self, parent: grain.IterDataset, *, length: int):
        super().__init__(parent)
        if isinstance(length, bool) or not isinstance(length, int) or length < 1:
            raise ValueError(f"length: expected an int >= 1, got {length!r}")
        self._length = length

    def __iter__(self) -> grain.DatasetIterator:
        return _PackSequencesIterator(self._parent.__iter__(), length=self._length)

    def __str__(self) -> str:
        return f"PackSequencesIterDataset(length={self._length})"


class _PackSequencesIterator(grain.DatasetIterator):
    """State = (parent state before the document holding the next token, offset in it).

    Restoring re-reads that one document and skips ``offset`` tokens; everything after is
    recomputed deterministically. The state is small, JSON-safe and exact.
    """

    def __init__(self, parent: grain.DatasetIterator, *, length: int):
        super().__init__(parent)
        self._length = length
        self._document_N: np.ndarray | None = None
        self._document_state = copy.deepcopy(self._parent.get_state())
        self._offset = 0
        self._exhausted = False

    def _next_document(self) -> bool:
        self._document_state = copy.deepcopy(self._parent.get_state())
        try:
            self._document_N = np.asarray(next(self._parent), dtype=np.int32)
        except StopIteration:
            self._document_N = None
            self._exhausted = True
            return False
        if self._document_N.ndim != 1:
            raise ValueError(f"PackSequencesIterDataset: expected 1-D token arrays, got shape "
                             f"{self._document_N.shape}")
        self._offset = 0
        return True

    def __next__(self) -> np.ndarray:
        if self._exhausted:
            raise StopIteration
        sequence_N = np.empty(self._length, np.int32)
        filled = 0
        while filled < self._length:
            if self._document_N is None or self._offset >= len(self._document_N):
                if not self._next_document():
                    raise StopIteration  # drops the partial sequence
                continue
            take = min(self._length - filled, len(self._document_N) - self._offset)
            sequence_N[filled:filled + take] = self._document_N[self._offset:self._offset + take]
            filled += take
            self._offset += take
        return sequence_N

    def get_state(self) -> dict[str, Any]:
        if self._document_N is None or self._offset >= len(self._document_N):
            # The next token starts the next document.
            return {"parent": copy.deepcopy(self._parent.get_state()), "offset": 0}
        return {"parent": copy.deepcopy(self._document_state), "offset": int(self._offset)}

    def set_state(self, state: dict[str, Any]):
        self._parent.set_state(copy.deepcopy(state["parent"]))
        self._exhausted = False
        self._document_N = None
        self._offset = 0
        offset = int(state["offset"])
        if offset > 0:
            if not self._next_document():
                raise ValueError(f"set_state: the parent ended where the state {state} "
                                 f"expects a document")
            self._offset = offset

    def __str__(self) -> str:
        return f"_PackSequencesIterator(length={self._length})"


def _shift_batch(sequences: Sequence[np.ndarray]) -> dict[str, np.ndarray]:
    seq_BxT1 = np.stack(sequences)
    return {"inputs": np.ascontiguousarray(seq_BxT1[:, :-1]),
            "targets": np.ascontiguousarray(seq_BxT1[:, 1:])}


def _pipeline_seeds(shuffle_seed: int, seed: int) -> tuple[int, int]:
    """Independent 31-bit seeds for the document shuffle and the window shuffle."""
    state = np.random.SeedSequence([shuffle_seed, seed]).generate_state(2)
    return int(state[0]) % 2**31, int(state[1]) % 2**31


def restart_seed(seed: int, step: int) -> int:
    """The pipeline ``seed`` for a pipeline restarted from its beginning at training ``step``
    (a data position that cannot carry over, e.g. to another number of processes), in place of
    one built from ``seed``: a new order, so the restart does not replay the run's first
    batches, the same on every process and for every restart at that step."""
    _check_int("seed", seed, 0)
    _check_int("step", step, 0)
    # the trailing 1 keeps this stream apart from _pipeline_seeds' [shuffle_seed, seed]
    return int(np.random.SeedSequence([seed, step, 1]).generate_state(1)[0]) % 2**31


def _check_int(name: str, value, minimum: int):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value!r}")


def make_dataset(cfg: DataConfig, split: str, *, batch_size: int, seed: int,
                 shard_index: int = 0, shard_count: int = 1, num_epochs: int | None = None,
                 shuffle: bool = True) -> grain.IterDataset:
    """Batches {"inputs": int32 [batch_size, T], "targets": int32 [batch_size, T]}, T = seq_len.

    ``targets`` is ``inputs`` shifted left by one token (both cut from one packed sequence of
    T + 1 tokens). Documents are separated by the tokenizer's EOS. ``batch_size`` is per
    process; process ``shard_index`` of ``shard_count`` reads every shard_count-th document.
    ``num_epochs=None`` repeats forever (training); evaluation uses ``shuffle=False,
    num_epochs=1``. The batch order depends only on (cfg, split, seed, shard), and the
    iterator checkpoints exactly (``get_state``/``set_state``, grain.checkpoint with orbax).
    """
    if not isinstance(cfg, DataConfig):
        raise ValueError(f"cfg: expected a DataConfig, got {type(cfg).__name__}")
    _check_int("batch_size", batch_size, 1)
    _check_int("seed", seed, 0)
    _check_int("shard_count", shard_count, 1)
    _check_int("shard_index", shard_index, 0)
    if shard_index >= shard_count:
        raise ValueError(f"shard_index: expected an int in [0, shard_count={shard_count}), "
                         f"got {shard_index}")
    if num_epochs is not None:
        _check_int("num_epochs", num_epochs, 1)

    documents = load_split(cfg, split)
    if len(documents) < shard_count:
        raise ValueError(f"shard_count: split {split!r} of {cfg.source!r} has "
                         f"{len(documents)} documents, fewer than shard_count={shard_count}")
    tokenizer = make_tokenizer(cfg.tokenizer)
    document_seed, window_seed = _pipeline_seeds(cfg.shuffle_seed, int(seed))

    ds = grain.MapDataset.source(documents)
    if shard_count > 1:
        ds = ds[shard_index::shard_count]
    if shuffle:
        ds = ds.shuffle(seed=document_seed)  # a new order each epoch (seed + epoch)
    ds = ds.repeat(num_epochs)
    ds = ds.map(TokenizeWithEos(tokenizer))
    read_options = grain.ReadOptions(num_threads=cfg.worker_threads,
                                     prefetch_buffer_size=2 * cfg.worker_threads)
    it = ds.to_iter_dataset(read_options)
    it = PackSequencesIterDataset(it, length=cfg.seq_len + 1)
    if shuffle and cfg.shuffle_window > 1:
        it = grain.experimental.WindowShuffleIterDataset(
            it, window_size=cfg.shuffle_window, seed=window_seed)
    it = it.batch(batch_size, drop_remainder=True, batch_fn=_shift_batch)
    if cfg.prefetch > 0:
        it = grain.experimental.ThreadPrefetchIterDataset(it, prefetch_buffer_size=cfg.prefetch)
    return it


# -- statistics ----------------------------------------------------------------------------

def _sample_token_counts(cfg: DataConfig, split: str,
                         max_tokens: int | None) -> tuple[np.ndarray, int]:
    """Token counts (with one EOS per document) over documents in a fixed seeded order."""
    documents = load_split(cfg, split)
    tokenize = TokenizeWithEos(make_tokenizer(cfg.tokenizer))
    counts_V = np.zeros(tokenize.tokenizer.vocab_size, np.int64)
    total = 0
    for index in np.random.default_rng(0).permutation(len(documents)):
        tokens_N = tokenize(documents[int(index)])
        if max_tokens is not None:
            tokens_N = tokens_N[:max_tokens - total]
        counts_V += np.bincount(tokens_N, minlength=len(counts_V))
        total += len(tokens_N)
        if max_tokens is not None and total >= max_tokens:
            break
    return counts_V, total


def unigram_entropy(cfg: DataConfig, split: str, *, max_tokens: int = 2_000_000) -> float:
    """Entropy (nats/token) of the unigram distribution of the split's tokens.

    Estimated on up to ``max_tokens`` tokens (documents in a fixed random order, EOS included):
    the loss a model that ignores context would reach, a floor any real model must beat.
    """
    _check_int("max_tokens", max_tokens, 1)
    counts_V, total = _sample_token_counts(cfg, split, max_tokens)
    p_V = counts_V[counts_V > 0] / total
    return float(-(p_V * np.log(p_V)).sum())


def count_tokens(cfg: DataConfig, split: str, *, max_tokens: int | None = None) -> int:
    """Tokens in the split (each document + EOS), counting up to ``max_tokens`` if given."""
    if max_tokens is not None:
        _check_int("max_tokens", max_tokens, 1)
    _, total = _sample_token_counts(cfg, split, max_tokens)
    return total


def bytes_per_token(cfg: DataConfig, split: str, *, max_tokens: int = 2_000_000) -> float:
    """Mean UTF-8 bytes per token of the split: nats/token / (ln 2 * this) = bits per byte."""
    _check_int("max_tokens", max_tokens, 1)
    counts_V, total = _sample_token_counts(cfg, split, max_tokens)
    lengths_V = make_tokenizer(cfg.tokenizer).token_byte_lengths()
    return float((counts_V * lengths_V).sum() / total)
