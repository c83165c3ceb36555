"""Tokenizers: raw UTF-8 bytes, or a SentencePiece model (and a trainer for one).

``make_tokenizer(spec)`` builds one from its spec string:

* ``"bytes"``: vocabulary of 256, token id = byte value of the UTF-8 encoding. Id 0 (the NUL
  byte) is the end-of-document token, so NUL characters are removed from text before encoding.
* ``"sentencepiece:<path to .model>"``: a SentencePiece model whose EOS id ends documents.

Every tokenizer reports ``token_byte_lengths()``: the number of UTF-8 bytes each token stands
for (0 for control tokens such as EOS), so that a loss in nats/token converts to bits per byte.

Train a SentencePiece model on a source's documents with ``train_sentencepiece`` or the CLI::

    python -m ls_jax.inputs.tokenizer --source tfds:pg19 --vocab-size 10000 --output DIR/pg19_10k

Models trained here use identity normalization, no dummy-prefix space and byte fallback, so
``decode(encode(text)) == text`` for any text, and the byte lengths of the tokens of a text sum
to the text's UTF-8 length exactly.
"""

from __future__ import annotations

import abc
import argparse
import os
import pathlib
import sys
from collections.abc import Iterator, Sequence

import numpy as np

from ls_jax.inputs.sources import load_documents

BYTES_SPEC = "bytes"
SENTENCEPIECE_PREFIX = "sentencepiece:"
_SPM_WHITESPACE = "\u2581"  # SentencePiece's visible space "▁"
# Ids reserved by models trained here: <unk>, </s>, then 256 byte-fallback pieces.
_SPM_RESERVED_PIECES = 2 + 256


class Tokenizer(abc.ABC):
    """Text <-> int32 token ids. ``encode`` never appends EOS; the pipeline does."""

    name: str
    vocab_size: int
    eos_id: int

    @abc.abstractmethod
    def encode(self, text: str) -> np.ndarray:
        """Token ids of ``text`` as int32 [n], without EOS."""

    @abc.abstractmethod
    def decode(self, ids) -> str:
        """Text of ``ids``; control tokens (EOS) are dropped."""

    @abc.abstractmethod
    def token_byte_lengths(self) -> np.ndarray:
        """int32 [vocab_size]: UTF-8 bytes each token stands for, 0 for control tokens."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, vocab_size={self.vocab_size})"


def _ids_as_array(ids, vocab_size: int) -> np.ndarray:
    ids_N = np.asarray(ids)
    if ids_N.size == 0:
        return ids_N.reshape(0).astype(np.int64)
    if ids_N.ndim != 1 or not np.issubdtype(ids_N.dtype, np.integer):
        raise ValueError(f"ids: expected a 1-D sequence of ints, got shape {ids_N.shape} "
                         f"dtype {ids_N.dtype}")
    if ids_N.min() < 0 or ids_N.max() >= vocab_size:
        raise ValueError(f"ids: expected values in [0, {vocab_size}), got min {ids_N.min()} "
                         f"max {ids_N.max()}")
    return ids_N


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as tokens (vocab 256); EOS is 0, so NUL characters are stripped."""

    name = BYTES_SPEC
    vocab_size = 256
    eos_id = 0

    def encode(self, text: str) -> np.ndarray:
        data = text.encode("utf-8", errors="replace").replace(b"\0", b"")
        return np.frombuffer(data, dtype=np.uint8).astype(np.int32)

    def decode(self, ids) -> str:
        ids_N = _ids_as_array(ids, self.vocab_size)
        data = ids_N[ids_N != self.eos_id].astype(np.uint8).tobytes()
        return data.decode("utf-8", errors="replace")

    def token_byte_lengths(self) -> np.ndarray:
        lengths_V = np.ones(self.vocab_size, np.int32)
        lengths_V[self.eos_id] = 0
        return lengths_V


class SentencePieceTokenizer(Tokenizer):
    """A trained SentencePiece model; its EOS id ends documents."""

    def __init__(self, model_path: str | os.PathLike, name: str | None = None):
        path = pathlib.Path(model_path)
        if not path.is_file():
            raise FileNotFoundError(
                f"tokenizer: SentencePiece model file not found: '{path}'. Train one with "
                f"`python -m ls_jax.inputs.tokenizer --source stdlib --vocab-size 10000 --output "
                f"DIR/spm` (writes DIR/spm.model)")
        import sentencepiece as spm

        self._sp = spm.SentencePieceProcessor(model_file=str(path))
        self.model_path = str(path)
        self.name = name or f"{SENTENCEPIECE_PREFIX}{path}"
        self.vocab_size = int(self._sp.get_piece_size())
        self.eos_id = int(self._sp.eos_id())
        self._byte_lengths_V: np.ndarray | None = None
        if self.eos_id < 0:
            raise ValueError(
                f"tokenizer: SentencePiece model '{path}' has no EOS token (eos_id=-1); "
                f"train it with eos_id >= 0 (train_sentencepiece does)")

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._sp.encode(text), dtype=np.int32)

    def decode(self, ids) -> str:
        ids_N = _ids_as_array(ids, self.vocab_size)
        return self._sp.decode([int(i) for i in ids_N])

    def token_byte_lengths(self) -> np.ndarray:
        if self._byte_lengths_V is None:
            self._byte_lengths_V = self._compute_token_byte_lengths()
        return self._byte_lengths_V.copy()

    def _compute_token_byte_lengths(self) -> np.ndarray:
        lengths_V = np.zeros(self.vocab_size, np.int32)
        for i in range(self.vocab_size):
            if self._sp.is_control(i) or self._sp.is_unknown(i):
                continue
            if self._sp.is_byte(i):
                lengths_V[i] = 1
            else:
                piece = self._sp.id_to_piece(i).replace(_SPM_WHITESPACE, " ")
                lengths_V[i] = len(piece.encode("utf-8"))
        return lengths_V


def make_tokenizer(spec: str) -> Tokenizer:
    """``"bytes"`` or ``"sentencepiece:<path to .model>"`` -> a Tokenizer."""
    if spec == BYTES_SPEC:
        return ByteTokenizer()
    if isinstance(spec, str) and spec.startswith(SENTENCEPIECE_PREFIX):
        path = spec[len(SENTENCEPIECE_PREFIX):]
        if not path:
            raise ValueError(f"tokenizer: expected 'bytes' or 'sentencepiece:<path to .model>', "
                             f"got {spec!r} (empty path)")
        return SentencePieceTokenizer(path, name=spec)
    raise ValueError(f"tokenizer: expected 'bytes' or 'sentencepiece:<path to .model>', "
                     f"got {spec!r}")


# -- training ------------------------------------------------------------------------------

def _training_chunks(documents: Sequence[str], *, max_chars: int, max_chars_per_document: int,
                     chunk_chars: int, seed: int) -> Iterator[str]:
    """Line-aligned chunks of at most ``chunk_chars`` characters (newlines kept, so they can
    become pieces), taken from documents in a seeded order until ``max_chars`` in total."""
    order = np.random.default_rng(seed).permutation(len(documents))
    total = 0
    for index in order:
        text = documents[int(index)].replace("\0", "")[:max_chars_per_document]
        chunk = []
        chunk_len = 0
        for line in text.splitlines(keepends=True):
            while len(line) > chunk_chars:  # a very long line: hard split
                yield line[:chunk_chars]
                total += chunk_chars
                line = line[chunk_chars:]
            if chunk_len + len(line) > chunk_chars and chunk:
                yield "".join(chunk)
                total += chunk_len
                chunk, chunk_len = [], 0
                if total >= max_chars:
                    return
            chunk.append(line)
            chunk_len += len(line)
        if chunk:
            yield "".join(chunk)
            total += chunk_len
        if total >= max_chars:
            return


def train_sentencepiece(source: str, output_prefix: str | os.PathLike, vocab_size: int, *,
                        split: str = "train", text_field: str = "book_text",
                        data_dir: str | None = None, validation_percent: int = 5,
                        max_chars: int = 20_000_000, max_chars_per_document: int = 200_000,
                        model_type: str = "unigram", seed: int = 0,
                        num_threads: int | None = None) -> str:
    """Trains a SentencePiece model on the documents of ``source``/``split``.

    Reads documents in a seeded random order, at most ``max_chars_per_document`` characters of
    each (so many documents are seen), until ``max_chars`` characters in total. The model keeps
    text exactly (identity normalization, whitespace kept, no dummy prefix, byte fallback for
    characters outside the vocabulary); id 0 is <unk>, id 1 is EOS </s>, no BOS or padding.

    Returns the path of the written ``<output_prefix>.model`` (a ``.vocab`` file sits beside it);
    an existing ``.model`` there is refused, never replaced.
    """
    import sentencepiece as spm

    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or \
            vocab_size <= _SPM_RESERVED_PIECES:
        raise ValueError(f"vocab_size: expected an int > {_SPM_RESERVED_PIECES} (<unk>, </s> and "
                         f"256 byte pieces are reserved), got {vocab_size!r}")
    for key, value in (("max_chars", max_chars),
                       ("max_chars_per_document", max_chars_per_document)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{key}: expected an int >= 1, got {value!r}")
    if model_type not in ("unigram", "bpe"):
        raise ValueError(f"model_type: expected 'unigram' or 'bpe', got {model_type!r}")
    prefix = pathlib.Path(output_prefix)
    if prefix.name.endswith(".model"):
        prefix = prefix.with_name(prefix.name[:-len(".model")])
    model_path = prefix.with_name(prefix.name + ".model")
    if model_path.exists():  # a run trained with it reads the same ids from it
        raise ValueError(f"output: {model_path} exists (the runs trained with it need it as it "
                         "is); name a new prefix, or delete it first")
    prefix.parent.mkdir(parents=True, exist_ok=True)

    documents = load_documents(source, split, text_field=text_field, data_dir=data_dir,
                               validation_percent=validation_percent)
    chunk_chars = 2000
    chunks = _training_chunks(documents, max_chars=max_chars,
                              max_chars_per_document=max_chars_per_document,
                              chunk_chars=chunk_chars, seed=seed)
    spm.set_random_generator_seed(seed)
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=chunks, model_prefix=str(prefix), vocab_size=vocab_size,
            model_type=model_type, normalization_rule_name="identity",
            remove_extra_whitespaces=False, add_dummy_prefix=False, byte_fallback=True,
            allow_whitespace_only_pieces=True, character_coverage=0.9995,
            unk_id=0, eos_id=1, bos_id=-1, pad_id=-1,
            max_sentence_length=4 * chunk_chars, shuffle_input_sentence=True,
            num_threads=num_threads or os.cpu_count() or 1, minloglevel=2)
    except RuntimeError as e:
        raise ValueError(
            f"train_sentencepiece: SentencePiece training failed for source={source!r} "
            f"split={split!r} vocab_size={vocab_size} max_chars={max_chars}: {e} (a vocabulary "
            f"too large for the text needs a larger max_chars or a smaller vocab_size)") from e
    return str(model_path)


def main(argv: Sequence[str] | None = None) -> str:
    """The command line: the written model's path; bad input is one ``error:`` line on stderr
    and exit status 2."""
    parser = argparse.ArgumentParser(
        prog="python -m ls_jax.inputs.tokenizer",
        description="Train a SentencePiece tokenizer on a data source's documents.")
    parser.add_argument("--source", required=True,
                        help="'stdlib', 'text:<glob>' or 'tfds:<name>[:<config>]'")
    parser.add_argument("--split", default="train")
    parser.add_argument("--text-field", default="book_text", help="tfds feature with the text")
    parser.add_argument("--data-dir", default=None, help="tfds data_dir")
    parser.add_argument("--validation-percent", type=int, default=5)
    parser.add_argument("--vocab-size", type=int, required=True)
    parser.add_argument("--output", required=True, help="output prefix: writes <output>.model")
    parser.add_argument("--max-chars", type=int, default=20_000_000)
    parser.add_argument("--max-chars-per-document", type=int, default=200_000)
    parser.add_argument("--model-type", default="unigram", choices=("unigram", "bpe"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        path = train_sentencepiece(
            args.source, args.output, args.vocab_size, split=args.split,
            text_field=args.text_field, data_dir=args.data_dir,
            validation_percent=args.validation_percent, max_chars=args.max_chars,
            max_chars_per_document=args.max_chars_per_document, model_type=args.model_type,
            seed=args.seed)
    except (ValueError, OSError) as e:  # bad input, an unreadable source: one line, exit 2
        print(f"error: {str(e).splitlines()[0] if str(e) else type(e).__name__}",
              file=sys.stderr)
        raise SystemExit(2) from None
    tok = make_tokenizer(SENTENCEPIECE_PREFIX + path)
    print(f"wrote {path} (vocab_size={tok.vocab_size}, eos_id={tok.eos_id})")
    print(f"use it with: data.tokenizer={SENTENCEPIECE_PREFIX}{path} "
          f"model.vocab_size={tok.vocab_size}")
    return path


if __name__ == "__main__":
    main()
