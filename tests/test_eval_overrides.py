"""eval.py: section.key=value overrides that leave the model alone (a moved data path), model.*
refused in one line, only the parameters restored (the optimizer state stays on disk), values
below 1 refused, one result file per evaluation, a header before the work and progress only on a
terminal."""

import json
import os
import shutil

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

pytest.importorskip("grain", reason="the training loop needs the [train] extra")
from flax import nnx

from ls_jax.configs import get_config
from ls_jax.configs.cli import eval_main
from ls_jax.training.evaluate import evaluate_checkpoint
from ls_jax.layers.transformer import Transformer
from ls_jax.training.train import train

import test_train  # tests/, beside this file

# the training tests' 2-step run: its compiled programs are theirs (the compilation cache)
MICRO = [*test_train.MICRO, "train.num_steps=2", "train.save_every=2"]


pytestmark = pytest.mark.usefixtures("cli_logging")  # conftest.py: undoes the CLI's log routing


@pytest.fixture(scope="module")
def run_on_moved_corpus(tmp_path_factory):
    """A 2-step run trained on text files whose folder is then moved: (workdir, new folder)."""
    tmp = tmp_path_factory.mktemp("eval_overrides")
    corpus = tmp / "corpus"
    corpus.mkdir()
    rng = np.random.default_rng(0)
    for i in range(40):
        words = rng.choice(["alpha", "beta", "gamma", "delta", "eps"], size=200)
        (corpus / f"doc{i:02d}.txt").write_text(" ".join(words))
    workdir = str(tmp / "run")
    train(get_config("tiny", MICRO + [f"data.source=text:{corpus}/*.txt"]), workdir,
          log=lambda m: None)
    moved = tmp / "moved_corpus"
    shutil.move(str(corpus), str(moved))
    return workdir, moved


def test_override_moves_the_data_path(run_on_moved_corpus, capsys):
    workdir, moved = run_on_moved_corpus
    base = ["--checkpoint", workdir, "--split", "train", "--max-batches", "1"]
    # the recorded path is gone: a clear error, exit 2
    assert eval_main(base) == 2
    assert "no files match the glob" in capsys.readouterr().err
    override = f"data.source=text:{moved}/*.txt"
    assert eval_main(base + [override]) == 0
    out = capsys.readouterr().out
    assert "perplexity" in out
    (path,) = [os.path.join(workdir, f) for f in os.listdir(workdir) if f.startswith("eval_step2_")]
    with open(path) as f:
        result = json.load(f)
    assert result["overrides"] == [override] and np.isfinite(result["loss"])
    # config.json, the run's identity, is untouched
    with open(os.path.join(workdir, "config.json")) as f:
        assert json.load(f)["data"]["source"] != f"text:{moved}/*.txt"


def test_model_overrides_are_refused_in_one_line(run_on_moved_corpus, capsys):
    workdir, moved = run_on_moved_corpus
    assert eval_main(["--checkpoint", workdir, f"data.source=text:{moved}/*.txt",
                      "model.n_layer=3"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == ("error: override: expected data.*, train.* or "
                           "model.attn_implementation at evaluation (the checkpoint fixes the "
                           "model), got 'model.n_layer=3'")
    # choosing the attention backend is allowed: it does not change the model
    assert eval_main(["--checkpoint", workdir, "--split", "train", "--max-batches", "1",
                      f"data.source=text:{moved}/*.txt",
                      "model.attn_implementation=reference"]) == 0


def test_only_the_parameters_are_restored(run_on_moved_corpus, monkeypatch):
    workdir, moved = run_on_moved_corpus
    targets = []
    original = ocp.CheckpointManager.restore

    def spy(self, step, *args, **kwargs):
        targets.append(kwargs["args"]["state"].item)
        return original(self, step, *args, **kwargs)

    monkeypatch.setattr(ocp.CheckpointManager, "restore", spy)
    r = evaluate_checkpoint(workdir, split="train", max_batches=1,
                            overrides=[f"data.source=text:{moved}/*.txt"])
    assert np.isfinite(r["loss"])
    (target,) = targets
    # what was read: exactly the model's variables (counted from a model built here), no more
    cfg = get_config("tiny", MICRO)
    model_leaves = jax.tree.leaves(nnx.state(nnx.eval_shape(
        lambda: Transformer(cfg.model, rngs=nnx.Rngs(params=0)))))
    read_leaves = jax.tree.leaves(target)
    assert len(read_leaves) == len(model_leaves)
    assert sorted((l.shape, str(l.dtype)) for l in read_leaves) == \
        sorted((l.shape, str(l.dtype)) for l in model_leaves)
    # while the checkpoint on disk holds more (the optimizer's moments and step count)
    on_disk = ocp.PyTreeCheckpointer().metadata(
        os.path.join(workdir, "checkpoints", "2", "state")).item_metadata.tree
    assert len(jax.tree.leaves(on_disk)) > 2 * len(model_leaves)


@pytest.mark.parametrize("flag,value", [("--seq-len", "0"), ("--batch-size", "0"),
                                        ("--batch-size", "-3"), ("--max-batches", "0"),
                                        ("--seq-len", "ten")])
def test_values_below_one_are_refused_in_one_line(run_on_moved_corpus, capsys, flag, value):
    workdir, _ = run_on_moved_corpus
    before = sorted(os.listdir(workdir))
    with pytest.raises(SystemExit) as exit_:
        eval_main(["--checkpoint", workdir, flag, value])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err == f"error: argument {flag}: expected an int >= 1, got {value!r}\n"
    assert sorted(os.listdir(workdir)) == before  # nothing evaluated or written


@pytest.mark.parametrize("kind", ["a-notes-file", "a-json-file", "a-directory"])
def test_an_output_that_is_not_a_result_is_refused_and_left_alone(run_on_moved_corpus, capsys,
                                                                   tmp_path, kind):
    workdir, moved = run_on_moved_corpus
    target = tmp_path / "target"
    if kind == "a-directory":
        target.mkdir()
        message = f"error: output: {target} is a directory; expected a path for the JSON result\n"
    else:
        target.write_text("my notes" if kind == "a-notes-file" else '{"mine": 1}')
        message = (f"error: output: {target} exists and is not an evaluation result; name a "
                   "new path (or an earlier result to rewrite)\n")
    def results():
        return sorted(n for n in os.listdir(workdir) if n.startswith("eval_"))

    before = results()
    assert eval_main(["--checkpoint", workdir, "--output", str(target)]) == 2
    assert capsys.readouterr().err == message
    assert results() == before  # nothing evaluated or written
    if kind != "a-directory":
        assert target.read_text() in ("my notes", '{"mine": 1}')


def test_an_earlier_result_as_output_is_rewritten(run_on_moved_corpus, capsys, tmp_path):
    workdir, moved = run_on_moved_corpus
    out = str(tmp_path / "result.json")
    args = ["--checkpoint", workdir, "--split", "train", f"data.source=text:{moved}/*.txt",
            "--output", out]
    assert eval_main(args + ["--max-batches", "1"]) == 0
    assert eval_main(args + ["--max-batches", "2"]) == 0
    with open(out) as f:
        assert json.load(f)["batches"] == 2


def test_each_evaluation_keeps_its_own_results(run_on_moved_corpus, capsys):
    """Another batch size, batch count or override: another file; the same evaluation again
    rewrites its own file only."""
    workdir, moved = run_on_moved_corpus
    base = ["--checkpoint", workdir, "--split", "train"]
    source = f"data.source=text:{moved}/*.txt"
    paths = []
    for extra in (["--max-batches", "1", "--batch-size", "2", source],
                  ["--max-batches", "1", "--batch-size", "1", source],
                  ["--max-batches", "2", "--batch-size", "1", source],
                  ["--max-batches", "1", "--batch-size", "2", source,
                   "model.attn_implementation=reference"],
                  ["--max-batches", "1", "--batch-size", "2", source]):
        assert eval_main(base + extra) == 0
        (line,) = [l for l in capsys.readouterr().out.splitlines() if l.startswith("written to")]
        paths.append(line.removeprefix("written to "))
    assert len(set(paths[:4])) == 4 and paths[4] == paths[0]
    results = [json.load(open(p)) for p in paths[:4]]
    assert [(r["batch_size"], r["max_batches"], r["batches"], len(r["overrides"]))
            for r in results] == [(2, 1, 1, 1), (1, 1, 1, 1), (1, 2, 2, 1), (2, 1, 1, 2)]


def test_header_first_and_no_progress_off_a_terminal(run_on_moved_corpus, capsys):
    workdir, moved = run_on_moved_corpus
    assert eval_main(["--checkpoint", workdir, "--split", "train", "--max-batches", "2",
                      f"data.source=text:{moved}/*.txt"]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines()[0] == (f"eval: checkpoint {workdir}, step 2 (the latest), split "
                                   f"train, T=64, batch 8, the first 2 batches")
    assert "perplexity" in out and err == ""  # captured output is no terminal: no bar


def test_on_batch_is_called_once_per_batch(run_on_moved_corpus):
    workdir, moved = run_on_moved_corpus
    calls = []
    result = evaluate_checkpoint(workdir, split="train", max_batches=3,
                                 output=os.path.join(workdir, "on_batch.json"),
                                 overrides=[f"data.source=text:{moved}/*.txt"],
                                 on_batch=lambda: calls.append(1))
    assert len(calls) == result["batches"] == 3
