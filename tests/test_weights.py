"""ls_jax.interop.weights: a run's parameters to safetensors and back, by stable names; and
ls_jax.inference.sample.load_model, which it reads the run with."""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

pytest.importorskip("grain", reason="the training loop needs the [train] extra")
from safetensors.numpy import load_file, save_file

from ls_jax.inference.sample import load_model
from ls_jax.training.train import train
from ls_jax.interop.weights import load_weights, parameters, save_weights

# the training tests' 2-step run: its compiled programs are theirs (the compilation cache)
from test_train import micro_config  # tests/, beside this file


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("weights_run"))
    train(micro_config("train.num_steps=2", "train.save_every=2"), workdir, log=lambda _m: None)
    return workdir


def test_round_trip_gives_the_same_model(run_dir, tmp_path):
    path = str(tmp_path / "w.safetensors")
    assert save_weights(run_dir, path) == 2
    model, cfg, step = load_model(run_dir)
    loaded, loaded_cfg, loaded_step = load_weights(path)
    assert (loaded_cfg.model, loaded_step) == (cfg.model, step)
    tokens = jnp.arange(24, dtype=jnp.int32).reshape(2, 12) % cfg.model.vocab_size
    forward = nnx.jit(lambda model, tokens: model(tokens))  # one compile serves both models
    np.testing.assert_array_equal(forward(loaded, tokens), forward(model, tokens))
    tensors = load_file(path)  # any safetensors reader
    assert {k: v.shape for k, v in tensors.items()} == {
        k: v.shape for k, v in parameters(model).items()}


def test_names_are_the_model_attribute_paths(run_dir, tmp_path):
    path = str(tmp_path / "w.safetensors")
    save_weights(run_dir, path)
    names = set(load_file(path))
    d, h = 64, 2 * 32
    want = {"embed.embedding", "ln_f.scale", "blocks.0.attn.q_proj.kernel",
            "blocks.1.attn.o_proj.kernel", "blocks.0.ln1.scale", "blocks.1.mlp.fc.kernel"}
    assert want <= names, sorted(names)
    assert load_file(path)["blocks.0.attn.q_proj.kernel"].shape == (d, h)


def test_a_file_that_does_not_fit_is_refused_with_one_line(run_dir, tmp_path):
    good = str(tmp_path / "w.safetensors")
    save_weights(run_dir, good)
    from safetensors import safe_open
    with safe_open(good, framework="numpy") as f:
        metadata = f.metadata()
    tensors = load_file(good)
    tensors["blocks.0.ln1.scale"] = np.zeros(5, np.float32)
    bad = str(tmp_path / "bad.safetensors")
    save_file(tensors, bad, metadata=metadata)
    with pytest.raises(ValueError, match=r"weights: blocks\.0\.ln1\.scale: expected float32\[64\]"):
        load_weights(bad)
    save_file(tensors, bad)  # no metadata: not ours
    with pytest.raises(ValueError, match="weights: expected a file written by"):
        load_weights(bad)


def test_a_failed_save_leaves_no_file(run_dir, tmp_path):
    with pytest.raises(FileNotFoundError):
        save_weights(run_dir, str(tmp_path / "missing_dir" / "w.safetensors"))
    with pytest.raises(FileNotFoundError, match="expected a run directory with config.json"):
        save_weights(str(tmp_path / "not_a_run"), str(tmp_path / "w.safetensors"))
    assert os.listdir(tmp_path) == ["not_a_run"] or os.listdir(tmp_path) == []
