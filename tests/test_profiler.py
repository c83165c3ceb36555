"""train.profile_steps=a:b: parsing, and a JAX profiler trace of exactly those steps."""

import os

import jax
import jax.numpy as jnp
import pytest

from ls_jax.configs import get_config
from ls_jax.training.profiler import StepProfiler


def trace_files(log_dir):
    return [os.path.join(d, f) for d, _, fs in os.walk(log_dir) for f in fs]


def test_profile_steps_parse_and_errors():
    assert get_config("tiny").train.profile_range is None
    assert get_config("tiny", ["train.profile_steps=3:5"]).train.profile_range == (3, 5)
    assert get_config("tiny", ["train.profile_steps=4:4"]).train.profile_range == (4, 4)
    for bad in ("5:3", "0:2", "3", "a:b"):
        with pytest.raises(ValueError, match=r"train.profile_steps: expected 'a:b' with 1 <= a <= b"):
            get_config("tiny", [f"train.profile_steps={bad}"])


def test_step_profiler_traces_only_its_window(tmp_path):
    step_fn = jax.jit(lambda x: jnp.tanh(x @ x.T))
    x = jnp.ones((16, 16))
    messages = []
    profiler = StepProfiler((2, 3), str(tmp_path / "tb"), log=messages.append)
    started_at = []
    for step in range(1, 6):
        profiler.before_step(step)
        if profiler.active and not started_at:
            started_at.append(step)
        out = step_fn(x)
        profiler.after_step(step, out)
        if step == 3:
            assert not profiler.active  # stopped once step 3 finished
    assert started_at == [2]
    files = trace_files(tmp_path / "tb")
    assert any(f.endswith(".xplane.pb") and os.path.getsize(f) > 0 for f in files), files
    assert all(os.sep + os.path.join("plugins", "profile") + os.sep in f for f in files), files
    assert messages == [f"profiling steps 2..3 into {tmp_path / 'tb'}"]


def test_step_profiler_resumed_past_the_window_traces_nothing(tmp_path):
    profiler = StepProfiler((2, 3), str(tmp_path / "tb"), log=lambda m: None)
    for step in (4, 5):
        profiler.before_step(step)
        profiler.after_step(step, jnp.ones(2))
    assert not profiler.active and not os.path.exists(tmp_path / "tb")


def test_training_writes_a_trace_of_the_profiled_steps(tmp_path):
    from ls_jax.training.train import train
    cfg = get_config("tiny", [
        "model.n_layer=1", "model.d_model=32", "model.n_head=2", "model.head_dim=16",
        "model.window=8", "model.max_seq_len=32", "data.seq_len=32", "data.shuffle_window=16",
        "train.batch_size=2", "train.warmup_steps=1", "train.num_steps=2", "train.save_every=2",
        "train.log_every=1", "train.eval_batches=1", "train.progress=false",
        "train.async_checkpoints=false", "train.profile_steps=2:2"])  # one step function
    messages = []
    train(cfg, str(tmp_path / "run"), log=messages.append)
    profile_dir = tmp_path / "run" / "tensorboard" / "plugins" / "profile"
    files = trace_files(profile_dir)
    assert any(f.endswith(".xplane.pb") and os.path.getsize(f) > 0 for f in files), files
    assert f"profiling steps 2..2 into {tmp_path / 'run' / 'tensorboard'}" in messages
