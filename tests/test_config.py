"""Typed configs: the named presets, overrides and their errors."""

import pytest

from ls_jax.configs import CONFIGS, get_config
from ls_jax.config import Config, ModelConfig, TrainConfig


def test_paper_config_is_the_papers_setup():
    c = get_config("paper")
    m, t, d = c.model, c.train, c.data
    assert (m.n_layer, m.n_head, m.head_dim, m.d_model) == (6, 6, 32, 192)
    # the author's flash-attention window_size=(50, 0): query i sees keys i-50..i, 51 keys
    assert m.window_sizes == (None, 51, 51, 51, 51, 51)
    assert (m.vocab_size, d.seq_len, m.pos_embedding, m.compute_dtype) == (10_000, 2048, "learned", "bfloat16")
    assert (t.lr, t.b1, t.b2, t.weight_decay, t.grad_clip, t.warmup_steps) == (6e-4, 0.9, 0.95, 0.1, 1.0, 2000)
    assert t.batch_size * d.seq_len == 524_288  # the paper's 524K tokens per step
    assert d.source == "tfds:pg19" and d.text_field == "book_text"
    assert get_config("paper_mhsa").model.window_sizes == (None,) * 6
    assert get_config("paper_qknorm").model.qk_norm
    assert get_config("paper_zloss").train.z_loss == 1e-4


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_config_validates_and_round_trips(name):
    c = get_config(name)
    assert Config.from_dict(c.to_dict()) == c


def test_overrides_parse_types():
    c = get_config("tiny", ["train.lr=1e-3", "model.n_kv_head=2", "model.qk_norm=true",
                            "model.attn_implementation=none", "data.source=text:/tmp/*.txt"])
    assert c.train.lr == 1e-3 and c.model.n_kv_head == 2 and c.model.qk_norm is True
    assert c.model.attn_implementation is None and c.data.source == "text:/tmp/*.txt"


@pytest.mark.parametrize("override,pattern", [
    ("train.lrate=1", r"^override: unknown key 'train.lrate'; did you mean train.lr\?$"),
    ("train.num_step=3", r"^override: unknown key 'train.num_step'; did you mean train.num_steps\?$"),
    ("optim.lr=1", r"^override: unknown key 'optim.lr'; did you mean train.lr\?$"),
    ("train.learning_rate=1", r"^override: unknown key 'train.learning_rate'; the keys of train: seed, "),
    ("zzz.qqq=1", r"^override: unknown key 'zzz.qqq'; expected <section>.<key> with a section of "
                  r"model, data, train, mesh"),
    ("lr", r"^override: expected 'section.key=value', got 'lr'; did you mean train.lr\?$"),
    ("train.lr", r"^override: expected 'section.key=value', got 'train.lr'; did you mean "
                 r"train.lr=<value>\?$"),
    ("model.n_layer=two", r"model.n_layer: expected an int, got 'two'"),
    ("model.qk_norm=maybe", r"model.qk_norm: expected a bool"),
    ("model.n_global_heads=7", r"model.n_global_heads: expected an int in \[0, n_head=4\], got 7"),
    ("model.window=0", r"model.window: expected an int >= 1, got 0"),
    ("model.pos_embedding=alibi", r"model.pos_embedding: expected one of .*got 'alibi'"),
    ("train.min_lr=1", r"train.min_lr: expected a number <= lr="),
    ("train.grad_accum_steps=3", r"train.grad_accum_steps: expected a divisor of batch_size=16, got 3"),
    ("data.seq_len=512", r"data.seq_len: expected <= model.max_seq_len=256"),
    ("data.source=hf:foo", r"data.source: expected 'stdlib', 'text:<glob>' or 'tfds:"),
    ("model.attn_implementation=flash", r"model.attn_implementation: expected one of"),
    ("train.lr=nan", r"train.lr: expected a finite number, got nan"),
    ("train.lr=inf", r"train.lr: expected a finite number, got inf"),
    ("train.grad_clip=-inf", r"train.grad_clip: expected a finite number, got -inf"),
])
def test_bad_overrides_raise_clear_errors(override, pattern):
    with pytest.raises(ValueError, match=pattern):
        get_config("tiny", [override])


@pytest.mark.parametrize("window", [256, 300])
def test_a_local_window_as_long_as_the_sequence_is_refused(window):
    """query i of a local head sees keys i-p < j <= i: with p >= T that is every earlier key, so
    the head is global in all but name."""
    with pytest.raises(ValueError, match=rf"model.window: expected < data.seq_len=256 \(the 3 "
                                         rf"local head\(s\) .*, got {window}"):
        get_config("tiny", [f"model.window={window}"])
    get_config("tiny", ["model.window=255"])  # one key short of the sequence: still local
    # no local heads (MHSA): the window is unused, so any value passes
    get_config("tiny_mhsa", [f"model.window={window}"])


def test_unknown_config_name():
    with pytest.raises(ValueError, match=r"config: expected one of .*'tiny'.*got 'huge'"):
        get_config("huge")


def test_direct_construction_validates():
    with pytest.raises(ValueError, match=r"model.n_kv_head: expected a divisor of n_head=6, got 4"):
        ModelConfig(n_kv_head=4)
    with pytest.raises(ValueError, match=r"train.b2: expected a number <= 1"):
        TrainConfig(b2=1.5)
