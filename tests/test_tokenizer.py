"""Tokenizers: byte round trips, byte-length accounting, SentencePiece train/load/round trip."""

import numpy as np
import pytest

from ls_jax.inputs import tokenizer as tokenizer_lib
from ls_jax.inputs.tokenizer import make_tokenizer

SAMPLE_TEXTS = [
    "hello world",
    "def f(x):\n    return  x + 1\n\n\tindented\r\n",
    "accents: d\u00e9j\u00e0 vu, \u00fcber, na\u00efve",
    "CJK \u4e2d\u6587 and emoji \U0001f642 \U0001f680",
    "",
]


# -- bytes ---------------------------------------------------------------------------------

def test_bytes_tokenizer_properties():
    tok = make_tokenizer("bytes")
    assert tok.vocab_size == 256
    assert tok.eos_id == 0
    assert tok.name == "bytes"


@pytest.mark.parametrize("text", SAMPLE_TEXTS)
def test_bytes_encode_is_utf8_and_round_trips(text):
    tok = make_tokenizer("bytes")
    ids = tok.encode(text)
    assert ids.dtype == np.int32
    assert ids.tolist() == list(text.encode("utf-8"))
    assert tok.decode(ids) == text


def test_bytes_strips_nul_so_eos_never_appears_in_text():
    tok = make_tokenizer("bytes")
    ids = tok.encode("a\0b\0\0c")
    assert ids.tolist() == [ord("a"), ord("b"), ord("c")]
    assert tok.eos_id not in ids


def test_bytes_decode_drops_eos():
    tok = make_tokenizer("bytes")
    assert tok.decode([ord("h"), 0, ord("i"), 0]) == "hi"


@pytest.mark.parametrize("text", SAMPLE_TEXTS)
def test_bytes_token_byte_lengths_sum_to_utf8_length(text):
    tok = make_tokenizer("bytes")
    lengths = tok.token_byte_lengths()
    assert lengths.shape == (256,) and lengths.dtype == np.int32
    assert lengths[tok.eos_id] == 0
    assert lengths[tok.encode(text)].sum() == len(text.encode("utf-8"))


def test_bytes_decode_rejects_out_of_range_ids():
    tok = make_tokenizer("bytes")
    with pytest.raises(ValueError, match=r"ids: expected values in \[0, 256\)"):
        tok.decode([65, 300])


# -- bad specs -----------------------------------------------------------------------------

@pytest.mark.parametrize("spec", ["byte", "spm:foo.model", "", "sentencepiece:"])
def test_bad_spec_raises_naming_the_argument(spec):
    with pytest.raises(ValueError, match="tokenizer: expected 'bytes' or 'sentencepiece:"):
        make_tokenizer(spec)


def test_missing_sentencepiece_model_raises_with_path(tmp_path):
    missing = tmp_path / "nope.model"
    with pytest.raises(FileNotFoundError, match="SentencePiece model file not found.*nope.model"):
        make_tokenizer(f"sentencepiece:{missing}")


def test_train_rejects_too_small_vocab(tmp_path):
    pytest.importorskip("sentencepiece")
    with pytest.raises(ValueError, match="vocab_size: expected an int > 258"):
        tokenizer_lib.train_sentencepiece("stdlib", tmp_path / "spm", 100)


@pytest.mark.parametrize("args,message", [
    (["--vocab-size", "5"], "error: vocab_size: expected an int > 258"),
    (["--vocab-size", "400", "--source", "text:/no/such/*.txt"],
     "error: source: no files match the glob"),
], ids=["small-vocab", "no-files"])
def test_cli_bad_input_is_one_line(tmp_path, capsys, args, message):
    pytest.importorskip("sentencepiece")
    with pytest.raises(SystemExit) as e:
        tokenizer_lib.main(["--source", "stdlib", "--output", str(tmp_path / "spm"), *args])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1


def test_an_existing_model_is_never_replaced(tmp_path):
    pytest.importorskip("sentencepiece")
    (tmp_path / "spm.model").write_bytes(b"a model runs were trained with")
    with pytest.raises(ValueError, match=r"output: .*spm.model exists .*name a new prefix"):
        tokenizer_lib.train_sentencepiece("stdlib", tmp_path / "spm", 400)
    assert (tmp_path / "spm.model").read_bytes() == b"a model runs were trained with"


# -- SentencePiece -------------------------------------------------------------------------

SPM_VOCAB = 400


@pytest.fixture(scope="module")
def spm_model_path(tmp_path_factory):
    """A small model trained on part of the stdlib corpus through the CLI entry point."""
    pytest.importorskip("sentencepiece")
    prefix = tmp_path_factory.mktemp("spm") / "stdlib_400"
    path = tokenizer_lib.main(["--source", "stdlib", "--vocab-size", str(SPM_VOCAB),
                               "--output", str(prefix), "--max-chars", "300000"])
    return path


def test_sentencepiece_cli_writes_model(spm_model_path):
    assert spm_model_path.endswith("stdlib_400.model")
    tok = make_tokenizer(f"sentencepiece:{spm_model_path}")
    assert tok.vocab_size == SPM_VOCAB
    assert tok.eos_id == 1
    assert tok.name == f"sentencepiece:{spm_model_path}"


@pytest.mark.parametrize("text", SAMPLE_TEXTS)
def test_sentencepiece_round_trip_is_exact(spm_model_path, text):
    """Identity normalization + byte fallback: whitespace, newlines and unseen characters
    (CJK, emoji) all survive encode -> decode."""
    tok = make_tokenizer(f"sentencepiece:{spm_model_path}")
    ids = tok.encode(text)
    assert ids.dtype == np.int32
    assert ((ids >= 0) & (ids < tok.vocab_size)).all()
    assert tok.eos_id not in ids
    assert tok.decode(ids) == text


@pytest.mark.parametrize("text", SAMPLE_TEXTS)
def test_sentencepiece_token_byte_lengths_sum_to_utf8_length(spm_model_path, text):
    tok = make_tokenizer(f"sentencepiece:{spm_model_path}")
    lengths = tok.token_byte_lengths()
    assert lengths.shape == (SPM_VOCAB,) and lengths.dtype == np.int32
    assert lengths[tok.eos_id] == 0
    assert lengths[tok.encode(text)].sum() == len(text.encode("utf-8"))


def test_sentencepiece_compresses_python_source(spm_model_path):
    """A trained model must do better than bytes on held-out text of the same kind."""
    from ls_jax.inputs.sources import load_documents

    tok = make_tokenizer(f"sentencepiece:{spm_model_path}")
    docs = load_documents("stdlib", "validation")
    text = "".join(docs[i] for i in range(min(5, len(docs))))
    n_bytes = len(text.encode("utf-8"))
    n_tokens = len(tok.encode(text))
    assert n_tokens < 0.8 * n_bytes, (n_tokens, n_bytes)
    assert tok.decode(tok.encode(text)) == text


def test_sentencepiece_decode_drops_eos(spm_model_path):
    tok = make_tokenizer(f"sentencepiece:{spm_model_path}")
    ids = tok.encode("abc def")
    with_eos = np.concatenate([ids, [tok.eos_id], ids])
    assert tok.decode(with_eos) == "abc defabc def"
