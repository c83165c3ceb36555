"""Evaluation: loss, perplexity, bits per byte and logit-norm statistics on a data split.

``evaluate_model`` works on an in-memory model (used during training); ``evaluate_checkpoint``
restores a run directory written by ``train`` (what ``eval.py`` runs).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ls_jax.inputs import pipeline as data_lib
from ls_jax import sharding as sharding_lib
from ls_jax.config import Config
from ls_jax.training.loss import lm_loss
from ls_jax.training.metrics import logit_norm_summary
from ls_jax.training.rundir import RunDir, write_atomically
from ls_jax.training.state import restore_model
from ls_jax.inputs.tokenizer import make_tokenizer

_EVAL_FNS: dict[Any, Any] = {}
# exp(loss) is a float64 up to this loss; a larger one (a diverged model) has no perplexity
_MAX_EXP_LOSS = math.log(sys.float_info.max)


def perplexity(loss: float) -> float | None:
    """exp(``loss``), or None where it is not a finite float64 (a loss above ~709.8 nats, or
    a non-finite one): no number a reader could use, so none is reported."""
    return math.exp(loss) if math.isfinite(loss) and loss <= _MAX_EXP_LOSS else None


def format_perplexity(ppl: float | None) -> str:
    """A perplexity as printed: fixed-point up to 1e5, then 4 significant digits
    ("2.688e+43"); None as "inf" (``perplexity``)."""
    if ppl is None:
        return "inf"
    return f"{ppl:.3f}" if ppl < 1e5 else f"{ppl:.3e}"


def _eval_fn(graphdef):
    """jit-compiled (state, batch, byte_lengths) -> sums, one per model structure."""
    if graphdef not in _EVAL_FNS:
        def fn(state, batch, byte_lengths_V):
            model = nnx.merge(graphdef, state)
            logits_BxTxV, stats = model(batch["inputs"], return_stats=True)
            _, parts = lm_loss(logits_BxTxV, batch["targets"])
            n_tokens = batch["targets"].size
            return {
                "nats": parts["ce"] * n_tokens,
                "tokens": jnp.float32(n_tokens),
                "bytes": jnp.sum(byte_lengths_V[batch["targets"]]).astype(jnp.float32),
                **stats,
            }
        _EVAL_FNS[graphdef] = jax.jit(fn)
    return _EVAL_FNS[graphdef]


def _check_at_least_one(name: str, value) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name}: expected an int >= 1 or None, got {value!r}")


def eval_batch_size(cfg: Config, batch_size: int | None = None) -> int:
    """The global batch an evaluation uses: ``batch_size`` (default: training's), rounded down
    to a multiple of the devices it splits over (at least one row each)."""
    _check_at_least_one("batch_size", batch_size)
    n_dev = sharding_lib.batch_divisor(sharding_lib.make_mesh(cfg.mesh))
    batch_size = batch_size or cfg.train.batch_size
    return max(n_dev, batch_size - batch_size % n_dev)


def evaluate_model(model: nnx.Module, cfg: Config, *, split: str | None = None,
                   seq_len: int | None = None, max_batches: int | None = None,
                   batch_size: int | None = None,
                   should_stop: Callable[[], bool] | None = None,
                   on_batch: Callable[[], None] | None = None) -> dict[str, Any] | None:
    """Mean loss (nats/token), perplexity, bits per byte and max |logit| stats over a split.

    seq_len may differ from training (length generalisation); the whole split is read once,
    in order, unless ``max_batches`` caps it (the training run's evals read the first
    ``train.eval_batches``). ``should_stop``: checked before each batch; once it returns True
    the evaluation ends and returns None. ``on_batch``: called after each batch (a progress
    bar's update).
    """
    for name, value in (("seq_len", seq_len), ("max_batches", max_batches)):
        _check_at_least_one(name, value)
    split = split or cfg.data.eval_split
    seq_len = seq_len or cfg.data.seq_len
    if cfg.model.pos_embedding == "learned" and seq_len > cfg.model.max_seq_len:
        raise ValueError(
            f"seq_len: expected <= model.max_seq_len={cfg.model.max_seq_len} (learned positions "
            f"cannot extrapolate), got {seq_len}")
    n_proc = jax.process_count()
    mesh = sharding_lib.make_mesh(cfg.mesh)
    if n_proc > 1 and max_batches is None:
        # unshuffled single-epoch shards can hold different numbers of batches; every process
        # must run the same number of (collective) steps
        raise ValueError(f"max_batches: expected an int with {n_proc} processes, got None")
    batch_size = eval_batch_size(cfg, batch_size)
    dcfg = dataclasses.replace(cfg.data, seq_len=seq_len)
    tokenizer = make_tokenizer(dcfg.tokenizer)
    byte_lengths = jnp.asarray(np.pad(tokenizer.token_byte_lengths(),
                                      (0, cfg.model.vocab_size - tokenizer.vocab_size)))
    dataset = data_lib.make_dataset(dcfg, split, batch_size=batch_size // n_proc,
                                    seed=dcfg.shuffle_seed, shard_index=jax.process_index(),
                                    shard_count=n_proc, num_epochs=1, shuffle=False)
    graphdef, state = nnx.split(model)
    fn = _eval_fn(graphdef)
    sharding = sharding_lib.batch_sharding(mesh)
    totals = None
    n_batches = 0
    data_iter = iter(dataset)
    try:
        for batch in data_iter:
            if should_stop is not None and should_stop():
                return None
            batch = sharding_lib.global_batch(batch, sharding)
            with jax.set_mesh(mesh):
                out = jax.device_get(fn(state, batch, byte_lengths))
            if totals is None:
                totals = out
            else:
                totals = {k: (np.maximum(totals[k], v) if k.endswith("max_abs_logit")
                              else totals[k] + v) for k, v in out.items()}
            n_batches += 1
            if on_batch is not None:
                on_batch()
            if max_batches is not None and n_batches >= max_batches:
                break
    finally:
        if hasattr(data_iter, "close"):
            data_iter.close()
    if totals is None:
        raise ValueError(
            f"split: {split!r} of {dcfg.source!r} gave no full batch of {batch_size} x {seq_len} "
            f"tokens; use a smaller batch or seq_len")
    loss = float(totals["nats"] / totals["tokens"])
    return {
        "split": split,
        "seq_len": seq_len,
        "batch_size": batch_size,
        "max_batches": max_batches,
        "batches": n_batches,
        "tokens": int(totals["tokens"]),
        "loss": loss,
        "perplexity": perplexity(loss),
        "bits_per_byte": float(totals["nats"] / math.log(2) / max(totals["bytes"], 1.0)),
        **logit_norm_summary(totals["attn_max_abs_logit"], totals["lm_head_max_abs_logit"]),
    }


# model.* keys evaluation may override: they choose how, not what, the model computes
EVAL_MODEL_KEYS = ("model.attn_implementation",)


def eval_config(cfg: Config, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """The run's config with evaluation-time ``section.key=value`` overrides (``data.*``, e.g. a
    moved ``data.data_dir`` or tokenizer path, and ``train.*``). ``model.*`` is refused: the
    checkpoint's parameters fix the model."""
    for item in overrides:
        key = item.split("=", 1)[0].strip()
        if key.startswith("model.") and key not in EVAL_MODEL_KEYS:
            raise ValueError(
                f"override: expected data.*, train.* or {', '.join(EVAL_MODEL_KEYS)} at "
                f"evaluation (the checkpoint fixes the model), got {item!r}")
    return cfg.override(list(overrides))


# the fields every result of ``evaluate_checkpoint`` holds, by which a file is recognised as one
RESULT_FIELDS = ("workdir", "step", "config", "overrides")


def check_output(path: str) -> None:
    """An ``output`` to write: a new file, or an earlier evaluation's result (the same
    evaluation again rewrites it); anything else is refused before anything runs, in one line,
    so that no file of another kind is overwritten."""
    if not os.path.lexists(path):
        return
    if os.path.isdir(path):
        raise ValueError(f"output: {path} is a directory; expected a path for the JSON result")
    try:
        with open(path) as f:
            earlier = json.load(f)
        ours = isinstance(earlier, dict) and all(k in earlier for k in RESULT_FIELDS)
    except (OSError, ValueError):
        ours = False
    if not ours:
        raise ValueError(f"output: {path} exists and is not an evaluation result; name a new "
                         "path (or an earlier result to rewrite)")


def evaluate_checkpoint(workdir: str, *, step: int | None = None, split: str | None = None,
                        seq_len: int | None = None, max_batches: int | None = None,
                        batch_size: int | None = None, output: str | None = None,
                        overrides: list[str] | tuple[str, ...] = (),
                        on_batch: Callable[[], None] | None = None) -> dict[str, Any]:
    """Restores the parameters of ``step`` (default: latest) of the run in ``workdir`` (not the
    optimizer state) and evaluates them, with ``eval_config`` overrides applied.

    Writes the result as JSON to ``output`` (default ``RunDir.eval_path``, one name per
    evaluation: ``<workdir>/eval_step<S>_<split>_T<T>_B<B>_<all|first<K>>[_o<hash>].json``).
    If it cannot be written, the result has ``output=None`` and ``output_error`` says why.
    ``on_batch``: as in ``evaluate_model``.
    """
    for name, value in (("seq_len", seq_len), ("max_batches", max_batches),
                        ("batch_size", batch_size)):
        _check_at_least_one(name, value)
    if output is not None:
        check_output(output)
    run = RunDir(workdir)
    cfg, step, model = restore_model(run, step, eval_config(run.load_config(), overrides))
    split = split or cfg.data.eval_split
    seq_len = seq_len or cfg.data.seq_len
    batch_size = eval_batch_size(cfg, batch_size)
    output = output or run.eval_path(step, split, seq_len, batch_size, max_batches, overrides)
    result = {"workdir": os.path.abspath(workdir), "step": step, "config": cfg.name,
              "overrides": list(overrides),
              **evaluate_model(model, cfg, split=split, seq_len=seq_len, max_batches=max_batches,
                               batch_size=batch_size, on_batch=on_batch)}
    try:
        write_atomically(output, json.dumps(result, indent=2))
    except OSError as e:  # e.g. a read-only run directory: the numbers are still returned
        result["output"] = None
        result["output_error"] = f"output: {e}; or pass --output with a writable path"
        return result
    result["output"] = output
    return result
