"""Typed, validated configuration: model, data, training, and the whole run.

Configs are frozen dataclasses. ``Config.override(["train.lr=1e-3", "model.n_layer=4"])``
applies command-line ``section.key=value`` overrides with type checking; an unknown key or a bad
value raises a one-line ``ValueError`` (an unknown key names the closest valid ones).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import types
import typing
from typing import Any

DTYPES = ("float32", "bfloat16", "float16")
POS_EMBEDDINGS = ("learned", "rope", "none")
# activation checkpointing of each block: "none", "full" (recompute the whole block in the
# backward pass) or "dots" (keep matmul outputs, recompute the rest); see model.REMAT_POLICIES
REMAT = ("none", "full", "dots")


def _fail(section: str, key: str, expected: str, got: Any):
    raise ValueError(f"{section}.{key}: expected {expected}, got {got!r}")


def _check_positive_int(section, key, value, minimum=1):
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        _fail(section, key, f"an int >= {minimum}", value)


def _check_choice(section, key, value, choices):
    if value not in choices:
        _fail(section, key, f"one of {choices}", value)


def _check_float(section, key, value, lo=None, hi=None, lo_open=False):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        _fail(section, key, "a finite number", value)
    if lo is not None and (value <= lo if lo_open else value < lo):
        _fail(section, key, f"a number {'>' if lo_open else '>='} {lo}", value)
    if hi is not None and value > hi:
        _fail(section, key, f"a number <= {hi}", value)


def layer_window_sizes(n_head: int, n_global_heads: int, window: int) -> tuple[int | None, ...]:
    """None for the first ``n_global_heads`` heads (global), ``window`` for the others (local)."""
    if not 0 <= n_global_heads <= n_head:
        raise ValueError(
            f"n_global_heads: expected an int in [0, n_head={n_head}], got {n_global_heads}")
    return (None,) * n_global_heads + (window,) * (n_head - n_global_heads)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """GPT-2-style decoder with LS-attention.

    Per layer, heads ``0 .. n_global_heads - 1`` are global and the remaining heads are local
    with window ``window`` (query i sees keys i - window < j <= i). ``n_global_heads == n_head``
    is plain multi-head self-attention (MHSA).
    """

    vocab_size: int = 256
    n_layer: int = 6
    d_model: int = 192
    n_head: int = 6
    head_dim: int = 32
    n_kv_head: int | None = None  # None: same as n_head; fewer: grouped-query attention
    n_global_heads: int = 1
    window: int = 50
    max_seq_len: int = 2048  # size of the learned position table
    pos_embedding: str = "learned"  # "learned" (the paper), "rope" or "none"
    rope_theta: float = 10_000.0
    mlp_ratio: int = 4
    use_bias: bool = False
    tie_embeddings: bool = False
    qk_norm: bool = False  # a baseline: LayerNorm on q and k per head before the dot product
    param_dtype: str = "float32"
    compute_dtype: str = "float32"  # "bfloat16" for mixed precision
    attn_implementation: str | None = None  # None: best for the platform (see kernels)
    init_std: float = 0.02
    remat: str = "none"  # activation checkpointing per block: one of REMAT

    def __post_init__(self):
        s = "model"
        for key in ("vocab_size", "n_layer", "d_model", "n_head", "head_dim", "window",
                    "max_seq_len", "mlp_ratio"):
            _check_positive_int(s, key, getattr(self, key))
        _check_positive_int(s, "n_global_heads", self.n_global_heads, minimum=0)
        if self.n_global_heads > self.n_head:
            _fail(s, "n_global_heads", f"an int in [0, n_head={self.n_head}]", self.n_global_heads)
        if self.n_kv_head is not None:
            _check_positive_int(s, "n_kv_head", self.n_kv_head)
            if self.n_head % self.n_kv_head:
                _fail(s, "n_kv_head", f"a divisor of n_head={self.n_head}", self.n_kv_head)
        _check_choice(s, "pos_embedding", self.pos_embedding, POS_EMBEDDINGS)
        if self.pos_embedding == "rope" and self.head_dim % 2:
            _fail(s, "head_dim", "an even number with pos_embedding='rope'", self.head_dim)
        _check_float(s, "rope_theta", self.rope_theta, lo=0, lo_open=True)
        _check_float(s, "init_std", self.init_std, lo=0, lo_open=True)
        _check_choice(s, "param_dtype", self.param_dtype, DTYPES)
        _check_choice(s, "compute_dtype", self.compute_dtype, DTYPES)
        from ls_jax.kernels.dispatch import IMPLEMENTATIONS
        _check_choice(s, "attn_implementation", self.attn_implementation,
                      (None,) + IMPLEMENTATIONS)
        _check_choice(s, "remat", self.remat, REMAT)

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def window_sizes(self) -> tuple[int | None, ...]:
        """Per-head windows of every layer: None for the global heads, ``window`` for the rest."""
        return layer_window_sizes(self.n_head, self.n_global_heads, self.window)


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Input pipeline.

    source: "stdlib" (offline default: the Python standard library's .py files), "text:<glob>"
      (local text files) or "tfds:<name>[:<config>]" (tfds.data_source; pg19 for real runs).
    tokenizer: "bytes" (vocab 256) or "sentencepiece:<path to .model>".
    """

    source: str = "stdlib"
    train_split: str = "train"
    eval_split: str = "validation"
    text_field: str = "book_text"  # the tfds feature holding the text (pg19: "book_text")
    data_dir: str | None = None  # tfds data_dir (None: TFDS_DATA_DIR or ~/tensorflow_datasets)
    tokenizer: str = "bytes"
    seq_len: int = 256
    validation_percent: int = 5  # stdlib/text sources: share of files held out, by path hash
    shuffle_seed: int = 0
    shuffle_window: int = 1024  # packed sequences shuffled within a window of this many
    worker_threads: int = 2
    prefetch: int = 2

    def __post_init__(self):
        s = "data"
        if not isinstance(self.source, str) or not (
                self.source == "stdlib" or self.source.startswith(("text:", "tfds:"))):
            _fail(s, "source", "'stdlib', 'text:<glob>' or 'tfds:<name>[:<config>]'", self.source)
        if not isinstance(self.tokenizer, str) or not (
                self.tokenizer == "bytes" or self.tokenizer.startswith("sentencepiece:")):
            _fail(s, "tokenizer", "'bytes' or 'sentencepiece:<path>'", self.tokenizer)
        _check_positive_int(s, "seq_len", self.seq_len)
        _check_positive_int(s, "validation_percent", self.validation_percent)
        if self.validation_percent >= 100:
            _fail(s, "validation_percent", "an int in [1, 99]", self.validation_percent)
        _check_positive_int(s, "shuffle_seed", self.shuffle_seed, minimum=0)
        _check_positive_int(s, "shuffle_window", self.shuffle_window)
        _check_positive_int(s, "worker_threads", self.worker_threads, minimum=0)
        _check_positive_int(s, "prefetch", self.prefetch, minimum=0)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Optimisation and bookkeeping. ``batch_size`` is global (all devices) per optimizer step."""

    seed: int = 0
    batch_size: int = 16
    grad_accum_steps: int = 1
    num_steps: int = 1000
    lr: float = 6e-4
    min_lr: float = 6e-5
    warmup_steps: int = 100
    decay_steps: int | None = None  # cosine decay length after warmup; None: until num_steps
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    decay_embeddings: bool = False  # weight decay on embeddings / position tables
    decay_norms_and_biases: bool = False
    grad_clip: float = 1.0  # global-norm clip; 0 disables
    z_loss: float = 0.0  # a baseline: coefficient of logsumexp(lm logits)^2 in the loss
    log_every: int = 10
    eval_every: int = 0  # 0: only at the end
    eval_batches: int = 8
    save_every: int = 200
    keep_checkpoints: int = 3
    async_checkpoints: bool = True
    progress: bool = True
    profile_steps: str | None = None  # "a:b": JAX profiler trace of steps a..b (inclusive)

    def __post_init__(self):
        s = "train"
        _ = self.profile_range  # raises on a malformed profile_steps
        for key in ("batch_size", "grad_accum_steps", "num_steps", "log_every", "eval_batches",
                    "save_every", "keep_checkpoints"):
            _check_positive_int(s, key, getattr(self, key))
        for key in ("seed", "warmup_steps", "eval_every"):
            _check_positive_int(s, key, getattr(self, key), minimum=0)
        if self.decay_steps is not None:
            _check_positive_int(s, "decay_steps", self.decay_steps)
        if self.batch_size % self.grad_accum_steps:
            _fail(s, "grad_accum_steps", f"a divisor of batch_size={self.batch_size}",
                  self.grad_accum_steps)
        _check_float(s, "lr", self.lr, lo=0, lo_open=True)
        _check_float(s, "min_lr", self.min_lr, lo=0)
        if self.min_lr > self.lr:
            _fail(s, "min_lr", f"a number <= lr={self.lr}", self.min_lr)
        _check_float(s, "b1", self.b1, lo=0, hi=1)
        _check_float(s, "b2", self.b2, lo=0, hi=1)
        _check_float(s, "eps", self.eps, lo=0, lo_open=True)
        _check_float(s, "weight_decay", self.weight_decay, lo=0)
        _check_float(s, "grad_clip", self.grad_clip, lo=0)
        _check_float(s, "z_loss", self.z_loss, lo=0)

    @property
    def profile_range(self) -> tuple[int, int] | None:
        """(first, last) step of ``profile_steps`` (1-based, inclusive), or None."""
        if self.profile_steps is None:
            return None
        first, sep, last = str(self.profile_steps).partition(":")
        try:
            a, b = int(first), int(last)
        except ValueError:
            a = b = 0
        if not sep or not 1 <= a <= b:
            _fail("train", "profile_steps", "'a:b' with 1 <= a <= b (steps to trace)",
                  self.profile_steps)
        return a, b


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Device mesh axes (see ls_jax/sharding.py): their product is the device count; one of
    them may be -1, meaning every device left over. The batch is split over data x fsdp,
    parameters and optimizer state over fsdp (and heads / MLP units over tensor).

    Not part of a run's identity: a run saved on one mesh resumes on another."""

    data: int = -1
    fsdp: int = 1
    tensor: int = 1

    def __post_init__(self):
        s = "mesh"
        for key in ("data", "fsdp", "tensor"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or not (
                    value == -1 or value >= 1):
                _fail(s, key, "an int >= 1 or -1 (the rest of the devices)", value)
        if [self.data, self.fsdp, self.tensor].count(-1) > 1:
            _fail(s, "data", "at most one of mesh.data, mesh.fsdp, mesh.tensor to be -1",
                  (self.data, self.fsdp, self.tensor))


@dataclasses.dataclass(frozen=True)
class Config:
    """A whole run: the sections plus the config's name."""

    name: str = "tiny"
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)

    def __post_init__(self):
        if self.model.pos_embedding == "learned" and self.data.seq_len > self.model.max_seq_len:
            raise ValueError(
                f"data.seq_len: expected <= model.max_seq_len={self.model.max_seq_len} with "
                f"learned positions, got {self.data.seq_len}")
        # a window of the whole sequence sees every earlier key: the local heads would be global
        n_local = self.model.n_head - self.model.n_global_heads
        if n_local and self.model.window >= self.data.seq_len:
            raise ValueError(
                f"model.window: expected < data.seq_len={self.data.seq_len} (the {n_local} local "
                f"head(s) would see the whole sequence, as global heads; for that set "
                f"model.n_global_heads={self.model.n_head}), got {self.model.window}")

    # -- overrides -------------------------------------------------------------------------
    def override(self, assignments: list[str] | tuple[str, ...]) -> "Config":
        """Applies ``section.key=value`` strings (value parsed by the field's type)."""
        sections = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                    if dataclasses.is_dataclass(getattr(self, f.name))}
        changes: dict[str, dict[str, Any]] = {name: {} for name in sections}
        for item in assignments:
            if "=" not in item:
                hint = (f"; did you mean {item.strip()}=<value>?" if item.strip() in valid_keys(self)
                        else _did_you_mean(item.strip(), valid_keys(self)))
                raise ValueError(f"override: expected 'section.key=value', got {item!r}{hint}")
            path, raw = item.split("=", 1)
            section, _, key = path.strip().partition(".")
            fields = {f.name: f for f in dataclasses.fields(sections[section])} \
                if section in sections else {}
            if key not in fields:
                raise ValueError(
                    f"override: unknown key {path.strip()!r}"
                    f"{_did_you_mean(path.strip(), valid_keys(self))}")
            hint = typing.get_type_hints(type(sections[section]))[key]
            changes[section][key] = parse_value(path.strip(), raw.strip(), hint)
        new = {name: dataclasses.replace(sec, **changes[name]) for name, sec in sections.items()}
        return dataclasses.replace(self, **new)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict) -> "Config":
        def build(dc, values):
            names = {f.name for f in dataclasses.fields(dc)}
            unknown = set(values) - names
            if unknown:
                raise ValueError(f"config: unknown keys {sorted(unknown)} for {dc.__name__}; "
                                 f"valid keys: {sorted(names)}")
            return dc(**values)
        return cls(name=d.get("name", "custom"), model=build(ModelConfig, d.get("model", {})),
                   data=build(DataConfig, d.get("data", {})),
                   train=build(TrainConfig, d.get("train", {})),
                   mesh=build(MeshConfig, d.get("mesh", {})))


def valid_keys(cfg: Config) -> list[str]:
    keys = []
    for f in dataclasses.fields(cfg):
        sec = getattr(cfg, f.name)
        if dataclasses.is_dataclass(sec):
            keys += [f"{f.name}.{g.name}" for g in dataclasses.fields(sec)]
    return keys


def close_keys(key: str, keys: list[str], n: int = 3) -> list[str]:
    """Up to ``n`` of ``keys`` closest to ``key`` (``section.key``), best first: the same key
    name in another section, else the closest spellings of the whole key or of its name; a
    suggestion scores at least 0.75 (difflib's ratio) and within 0.1 of the best."""
    name = key.rpartition(".")[2]

    def score(k: str) -> float:
        k_name = k.rpartition(".")[2]
        if k_name == name:
            return 1.0
        return max(difflib.SequenceMatcher(None, key, k).ratio(),
                   difflib.SequenceMatcher(None, name, k_name).ratio())

    scored = sorted(((score(k), k) for k in keys if k != key), key=lambda sk: -sk[0])
    if not scored or scored[0][0] < 0.75:
        return []
    return [k for s, k in scored if s >= max(0.75, scored[0][0] - 0.1)][:n]


def _did_you_mean(key: str, keys: list[str]) -> str:
    """The end of an unknown key's error: ``"; did you mean a or b?"``, else the keys of its
    section, else the sections (``train.py --help`` lists every key)."""
    close = close_keys(key, keys)
    if close:
        return f"; did you mean {' or '.join(close)}?"
    section = key.partition(".")[0]
    in_section = [k.partition(".")[2] for k in keys if k.partition(".")[0] == section]
    if in_section:
        return f"; the keys of {section}: {', '.join(in_section)}"
    sections = list(dict.fromkeys(k.partition(".")[0] for k in keys))
    return (f"; expected <section>.<key> with a section of {', '.join(sections)} "
            f"(train.py --help lists the keys)")


def parse_value(name: str, raw: str, hint) -> Any:
    """Parses ``raw`` as the annotated type (int, float, bool, str, or Optional of those)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if raw.lower() in ("none", "null"):
            return None
        hint = args[0]
    if hint is bool:
        if raw.lower() in ("true", "1", "yes"):
            return True
        if raw.lower() in ("false", "0", "no"):
            return False
        raise ValueError(f"{name}: expected a bool (true/false), got {raw!r}")
    if hint is int:
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"{name}: expected an int, got {raw!r}") from None
    if hint is float:
        try:
            return float(raw)
        except ValueError:
            raise ValueError(f"{name}: expected a float, got {raw!r}") from None
    return raw
