"""End-to-end training on CPU: one step, learning, resume exactness, checkpoints, eval, stops."""

import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("grain", reason="the training loop needs the [train] extra")
from flax import nnx

import ls_jax.training.step as step_lib
from ls_jax.inputs import pipeline as data_lib
from ls_jax.configs import get_config
from ls_jax.training.checkpoint import CheckpointError, Checkpointer, DataLayout
from ls_jax.training.loss import lm_loss
from ls_jax.configs.cli import eval_main
from ls_jax.training.evaluate import evaluate_checkpoint
from ls_jax.training.metrics import read_jsonl
from ls_jax.training.state import abstract_train_state
from ls_jax.training.step import make_train_step
from ls_jax.training.train import TrainingDiverged, train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MICRO = [
    "model.n_layer=2", "model.d_model=64", "model.n_head=2", "model.head_dim=32", "model.window=8",
    "model.max_seq_len=64", "data.seq_len=64", "data.shuffle_window=64", "train.batch_size=8",
    "train.warmup_steps=5", "train.log_every=1", "train.eval_batches=2", "train.progress=false",
    "train.async_checkpoints=false",
]


def micro_config(*extra):
    return get_config("tiny", MICRO + list(extra))


def quiet(_msg):
    pass


def test_one_step_finite_then_fifty_steps_lower_the_loss(tmp_path):
    cfg = micro_config("train.num_steps=50", "train.save_every=50", "train.lr=3e-3")
    result = train(cfg, str(tmp_path), log=quiet)
    assert np.isfinite(result.losses[1])
    first, last = np.mean([result.losses[s] for s in (1, 2, 3)]), np.mean(
        [result.losses[s] for s in (48, 49, 50)])
    assert last < first - 1.0, (first, last)
    assert result.eval_metrics is not None and np.isfinite(result.eval_metrics["loss"])
    records = read_jsonl(os.path.join(tmp_path, "metrics.jsonl"))
    train_records = [r for r in records if "loss" in r]
    assert [r["step"] for r in train_records] == list(range(1, 51))
    assert all(len(r["attn_max_abs_logit"]) == 2 and len(r["attn_max_abs_logit"][0]) == 2
               for r in train_records)
    assert all(r["max_abs_logit"] == max(max(row) for row in r["attn_max_abs_logit"])
               for r in train_records)
    assert all(r["tokens_per_sec"] > 0 and r["lm_head_max_abs_logit"] > 0 for r in train_records)
    assert any(f.startswith("events.out.tfevents")
               for f in os.listdir(os.path.join(tmp_path, "tensorboard")))
    assert Checkpointer(str(tmp_path), create=False).all_steps() == [50]


@pytest.mark.slow
def test_logit_stats_are_computed_on_logged_steps_only(tmp_path):
    cfg = micro_config("train.num_steps=3", "train.save_every=3", "train.log_every=2")
    result = train(cfg, str(tmp_path), log=quiet)
    assert sorted(result.losses) == [1, 2, 3] and all(np.isfinite(list(result.losses.values())))
    records = [r for r in read_jsonl(os.path.join(tmp_path, "metrics.jsonl")) if "loss" in r]
    assert [r["step"] for r in records] == [2, 3]  # every 2nd step and the last
    assert all(np.array(r["attn_max_abs_logit"]).shape == (2, 2) for r in records)
    graphdef, abstract = abstract_train_state(cfg)
    batch = {k: jax.ShapeDtypeStruct((8, 64), jnp.int32) for k in ("inputs", "targets")}
    for with_stats in (False, True):
        step = make_train_step(graphdef, cfg, with_stats=with_stats)
        _, metrics = jax.eval_shape(step, abstract, batch)
        assert ("attn_max_abs_logit" in metrics) == with_stats
        assert {"loss", "grad_norm", "lr"} <= set(metrics)


def test_resume_is_bit_exact(tmp_path):
    """2N steps in one go == N steps, a stop (as a kill would), then the same call again."""
    n = 6
    cfg = micro_config(f"train.num_steps={2 * n}", f"train.save_every={n}")
    whole = train(cfg, str(tmp_path / "whole"), log=quiet)
    first = train(cfg, str(tmp_path / "split"), stop_after_steps=n, log=quiet)
    assert first.interrupted and first.final_step == n
    second = train(cfg, str(tmp_path / "split"), log=quiet)
    assert second.start_step == n
    assert sorted(second.losses) == list(range(n + 1, 2 * n + 1))
    for step in range(n + 1, 2 * n + 1):
        assert second.losses[step] == whole.losses[step], step  # bit for bit
    records = read_jsonl(str(tmp_path / "split" / "metrics.jsonl"))
    assert [r["step"] for r in records if "loss" in r] == list(range(1, 2 * n + 1))


@pytest.mark.slow
def test_resume_after_a_mid_interval_stop_replays_from_the_checkpoint(tmp_path):
    """A kill between checkpoints loses the steps after the last save, and only those."""
    cfg = micro_config("train.num_steps=8", "train.save_every=4")
    whole = train(cfg, str(tmp_path / "whole"), log=quiet)
    run = str(tmp_path / "run")
    train(cfg, run, stop_after_steps=4, log=quiet)
    ckpt = Checkpointer(run, create=False)
    assert ckpt.all_steps() == [4]
    ckpt.close()
    resumed = train(cfg, run, log=quiet)
    assert [resumed.losses[s] for s in range(5, 9)] == [whole.losses[s] for s in range(5, 9)]


def _as_saved_by_two_processes(step_dir):
    """Rewrites a step saved by one process as two processes save it: grain's iterator file per
    process and a data_meta naming 2 (the state arrays do not depend on the process count).
    Process 1's file holds process 0's state: a one-process resume must read neither."""
    data = os.path.join(step_dir, "data")
    own = os.path.join(data, "process_0-of-2.json")
    os.rename(os.path.join(data, "process_0-of-1.json"), own)
    shutil.copy(own, os.path.join(data, "process_1-of-2.json"))
    meta_path = os.path.join(step_dir, "data_meta", "metadata")  # orbax's JsonSave file
    with open(meta_path) as f:
        meta = json.load(f)
    assert meta["process_count"] == 1
    with open(meta_path, "w") as f:
        json.dump({**meta, "process_count": 2}, f)


def _layout(workdir, step):
    ckpt = Checkpointer(workdir, create=False)
    try:
        return ckpt.data_layout(step)
    finally:
        ckpt.close()


@pytest.mark.slow
def test_resume_on_another_number_of_processes_restarts_the_data_reseeded(tmp_path):
    """Saved by 2 processes at step 4, resumed by 1: the saved state, a fresh pipeline from a
    seed derived from (seed, step) (not the run's first batches), one warning, nothing moved
    aside; a later resume on the same count is exact again."""
    cfg = micro_config("train.num_steps=8", "train.save_every=2")
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    train(cfg, a, stop_after_steps=4, log=quiet)
    _as_saved_by_two_processes(os.path.join(a, "checkpoints", "4"))
    assert _layout(a, 4) == DataLayout(2, cfg.data.shuffle_seed)
    shutil.copytree(a, b)

    # what step 5 must see: the step-4 state on the first batch of the restarted pipeline
    seed = data_lib.restart_seed(cfg.data.shuffle_seed, 4)
    assert seed != cfg.data.shuffle_seed

    def pipeline(seed):
        return iter(data_lib.make_dataset(cfg.data, cfg.data.train_split, batch_size=8, seed=seed))

    def first_batch(seed):
        it = pipeline(seed)
        try:
            return next(it)
        finally:
            it.close()

    batch = first_batch(seed)
    assert not np.array_equal(batch["inputs"], first_batch(cfg.data.shuffle_seed)["inputs"])
    graphdef, abstract = abstract_train_state(cfg)
    ckpt = Checkpointer(a, create=False)
    it = pipeline(cfg.data.shuffle_seed)
    with pytest.raises(CheckpointError, match=r"step 4 .* by 2 process\(es\), this run has 1"):
        ckpt.restore(4, abstract, it)  # a position for other shards is never restored
    it.close()
    _, saved = ckpt.restore(4, abstract)
    ckpt.close()
    model = nnx.merge(graphdef, saved)[0]
    want_loss, _ = lm_loss(model(jnp.asarray(batch["inputs"])), jnp.asarray(batch["targets"]),
                           z_loss=cfg.train.z_loss)

    messages = []
    resumed = train(cfg, a, log=messages.append)
    warnings = [m for m in messages if m.startswith("warning:")]
    assert len(warnings) == 1, messages
    assert ("step 4 cannot carry over (saved by 2 process(es), now 1)" in warnings[0]
            and f"pipeline seed {seed}," in warnings[0]), warnings[0]
    assert resumed.start_step == 4 and sorted(resumed.losses) == [5, 6, 7, 8]
    assert resumed.losses[5] == pytest.approx(float(want_loss), rel=1e-5)
    assert not os.path.exists(os.path.join(a, "damaged_checkpoints"))
    assert _layout(a, 6) == DataLayout(1, seed)  # later checkpoints keep the new seed

    # the same reshard, stopped after 2 steps, then resumed on the same count: exact
    first = train(cfg, b, stop_after_steps=2, log=quiet)
    messages = []
    second = train(cfg, b, log=messages.append)
    assert not [m for m in messages if m.startswith("warning:")], messages
    assert second.start_step == 6
    assert {**first.losses, **second.losses} == resumed.losses  # bit for bit


@pytest.mark.slow
def test_a_checkpoint_without_data_meta_resumes_exactly(tmp_path):
    """A step saved before data_meta existed: the process count from grain's file names, the
    config's shuffle seed; the resume is exact and later steps store their layout."""
    cfg = micro_config("train.num_steps=4", "train.save_every=2")
    whole = train(cfg, str(tmp_path / "whole"), log=quiet)
    run = str(tmp_path / "run")
    train(cfg, run, stop_after_steps=2, log=quiet)
    step_dir = os.path.join(run, "checkpoints", "2")
    shutil.rmtree(os.path.join(step_dir, "data_meta"))
    with open(os.path.join(step_dir, "_CHECKPOINT_METADATA")) as f:
        meta = json.load(f)
    del meta["item_handlers"]["data_meta"]
    with open(os.path.join(step_dir, "_CHECKPOINT_METADATA"), "w") as f:
        json.dump(meta, f)
    assert _layout(run, 2) == DataLayout(1, None)
    messages = []
    resumed = train(cfg, run, log=messages.append)
    assert not [m for m in messages if m.startswith("warning:")], messages
    assert resumed.start_step == 2
    assert [resumed.losses[s] for s in (3, 4)] == [whole.losses[s] for s in (3, 4)]
    assert _layout(run, 4) == DataLayout(1, cfg.data.shuffle_seed)


@pytest.mark.slow
def test_grad_accumulation_matches_one_big_batch(tmp_path):
    a = train(micro_config("train.num_steps=2", "train.save_every=2"), str(tmp_path / "a"), log=quiet)
    b = train(micro_config("train.num_steps=2", "train.save_every=2", "train.grad_accum_steps=2"),
              str(tmp_path / "b"), log=quiet)
    assert a.losses[1] == pytest.approx(b.losses[1], rel=1e-5)
    assert a.losses[2] == pytest.approx(b.losses[2], rel=1e-4)


@pytest.mark.slow
def test_eval_on_a_fresh_checkpoint(tmp_path, capsys):
    cfg = micro_config("train.num_steps=4", "train.save_every=2")
    final = train(cfg, str(tmp_path), log=quiet).eval_metrics
    r = evaluate_checkpoint(str(tmp_path), max_batches=2)
    assert r["step"] == 4 and r["batches"] == 2 and r["tokens"] == 2 * 8 * 64
    # the run's final eval is the first train.eval_batches (2) batches of the split: eval.py
    # with --max-batches 2 gives its number exactly (by default eval.py reads the whole split)
    assert r["loss"] == final["loss"] and final["batches"] == cfg.train.eval_batches
    assert np.isfinite(r["loss"]) and r["perplexity"] == pytest.approx(np.exp(r["loss"]))
    # bytes tokenizer: one byte per token except EOS, so bits/byte is close to loss / ln 2
    assert r["bits_per_byte"] == pytest.approx(r["loss"] / np.log(2), rel=0.05)
    with open(r["output"]) as f:
        assert json.load(f)["loss"] == r["loss"]
    older = evaluate_checkpoint(str(tmp_path), step=2, max_batches=2, seq_len=32)
    assert older["step"] == 2 and older["seq_len"] == 32 and older["loss"] != r["loss"]
    assert eval_main(["--checkpoint", str(tmp_path), "--max-batches", "1"]) == 0
    out = capsys.readouterr().out
    assert "perplexity" in out and "layer 1:" in out


def test_eval_errors_are_clear(tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match="expected a run directory with config.json"):
        evaluate_checkpoint(str(tmp_path / "missing"))
    assert eval_main(["--checkpoint", str(tmp_path / "missing")]) == 2
    assert "config.json" in capsys.readouterr().err
    cfg = micro_config("train.num_steps=2", "train.save_every=2")
    train(cfg, str(tmp_path / "run"), log=quiet)
    with pytest.raises(CheckpointError, match=r"expected a step in \[2\].*got 7"):
        evaluate_checkpoint(str(tmp_path / "run"), step=7)
    with pytest.raises(ValueError, match="seq_len: expected <= model.max_seq_len=64"):
        evaluate_checkpoint(str(tmp_path / "run"), seq_len=128)
    # a truncated checkpoint: its array data deleted
    step_dir = tmp_path / "run" / "checkpoints" / "2" / "state"
    for root, _, files in os.walk(step_dir):
        for f in files:
            if not f.endswith(("_METADATA", "_CHECKPOINT_METADATA")):
                os.remove(os.path.join(root, f))
    with pytest.raises(CheckpointError, match="could not be restored"):
        evaluate_checkpoint(str(tmp_path / "run"))
    # an empty checkpoint directory
    empty = tmp_path / "empty"
    (empty / "checkpoints").mkdir(parents=True)
    (empty / "config.json").write_text((tmp_path / "run" / "config.json").read_text())
    with pytest.raises(CheckpointError, match="no finished checkpoint"):
        evaluate_checkpoint(str(empty))


def test_workdir_with_another_config_is_refused(tmp_path):
    train(micro_config("train.num_steps=1", "train.save_every=1"), str(tmp_path), log=quiet)
    before = (tmp_path / "config.json").read_text()
    with pytest.raises(ValueError, match=r"holds a run with a different config \(train.lr: 0.002 -> 0.001"):
        train(micro_config("train.num_steps=1", "train.save_every=1", "train.lr=1e-3"),
              str(tmp_path), log=quiet)
    assert (tmp_path / "config.json").read_text() == before


@pytest.mark.slow
def test_nan_stops_and_keeps_the_last_good_checkpoint(tmp_path, monkeypatch):
    cfg = micro_config("train.num_steps=8", "train.save_every=2")
    run = str(tmp_path)
    train(cfg, run, stop_after_steps=4, log=quiet)
    real_loss = step_lib.lm_loss

    def poisoned(logits, targets, **kw):
        loss, parts = real_loss(logits, targets, **kw)
        return loss * jnp.nan, parts

    monkeypatch.setattr(step_lib, "lm_loss", poisoned)
    with pytest.raises(TrainingDiverged,
                       match=r"diverged at step 5: non-finite loss.*newest good checkpoint is step 4"):
        train(cfg, run, log=quiet)
    ckpt = Checkpointer(run, create=False)
    assert ckpt.all_steps() == [2, 4]
    ckpt.close()
    monkeypatch.setattr(step_lib, "lm_loss", real_loss)
    assert train(cfg, run, log=quiet).final_step == 8


def test_bad_train_inputs(tmp_path):
    with pytest.raises(ValueError, match=r"model.vocab_size: expected >= the tokenizer's vocabulary \(256"):
        train(micro_config("model.vocab_size=100"), str(tmp_path), log=quiet)


@pytest.mark.slow
def test_two_devices_match_one(tmp_path):
    """Data parallel over 2 CPU devices gives the same losses as 1 device (to fp32 noise)."""
    script = (
        "import sys, json\n"
        "from tests.test_train import micro_config\n"
        "from ls_jax.training.train import train\n"
        "import jax\n"
        "r = train(micro_config('train.num_steps=3', 'train.save_every=3'), sys.argv[1], log=lambda m: None)\n"
        "print(json.dumps({'devices': jax.device_count(), 'losses': [r.losses[s] for s in (1, 2, 3)]}))\n"
    )
    results = {}
    for n in (1, 2):
        env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={n}",
                   JAX_PLATFORMS="cpu")
        out = subprocess.run([sys.executable, "-c", script, str(tmp_path / f"d{n}")], env=env,
                             capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert out.returncode == 0, out.stderr[-3000:]
        results[n] = json.loads(out.stdout.strip().splitlines()[-1])
    assert results[2]["devices"] == 2
    np.testing.assert_allclose(results[1]["losses"], results[2]["losses"], rtol=1e-4)


def test_init_key_is_an_argument_not_a_traced_constant():
    """A seed turned into a key inside the jitted init is a constant, and XLA constant-folds the
    random initialisation of every parameter at compile time (minutes for the 125M model). The
    run's init takes the key as an argument, and gives the seed's parameters."""
    from flax import nnx

    from ls_jax.sharding import make_mesh
    from ls_jax.training.state import create_model_and_optimizer, init_key
    from ls_jax.training.step import compile_train_fns

    cfg = get_config("tiny")
    mesh = make_mesh(cfg.mesh)
    with jax.set_mesh(mesh):
        fns = compile_train_fns(cfg, mesh)
        jaxpr = fns.init.trace(init_key(cfg)).jaxpr  # top level: init has compiler options
        state = fns.init(init_key(cfg))

    def seeds(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "random_seed":
                yield eqn
            for value in eqn.params.values():  # pjit, custom_vjp, ... bodies
                for sub in value if isinstance(value, (tuple, list)) else (value,):
                    if isinstance(sub, jax.extend.core.ClosedJaxpr):
                        yield from seeds(sub.jaxpr)
                    elif isinstance(sub, jax.extend.core.Jaxpr):
                        yield from seeds(sub)

    assert not list(seeds(jaxpr.jaxpr)), "a PRNG key is built inside the jitted init"
    # the same parameters as the int seed gives eagerly (jit fuses the init's scaling: 1 ulp)
    eager = nnx.state(create_model_and_optimizer(cfg))
    for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(state), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=3e-7, atol=0)
