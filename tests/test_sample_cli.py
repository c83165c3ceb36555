"""`python -m ls_jax.inference.sample`: a briefly trained micro run samples text; bad input -> one line,
exit 2. Also the inference benchmark's --smoke mode on CPU."""

import json
import os
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("grain", reason="the training loop needs the [train] extra")

from ls_jax.inference.sample import main as sample_main
from ls_jax.training.train import train

# the training tests' 2-step run (64 learned positions): its compiled programs are theirs (the
# compilation cache)
from test_train import micro_config  # tests/, beside this file


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("micro_run"))
    train(micro_config("train.num_steps=2", "train.save_every=2"), workdir, log=lambda _m: None)
    return workdir


def test_cli_samples_text(run_dir, capsys):
    rc = sample_main(["--checkpoint", run_dir, "--prompt", "def f(x):", "--max-new-tokens", "12",
                      "--temperature", "0.8", "--top-k", "20", "--no-stop"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert out.startswith("def f(x):") and len(out.encode()) > len("def f(x):")
    assert "step 2: 9 prompt + 12 new tokens" in err and "tokens/s" in err


def test_the_default_length_fits_the_model(run_dir, capsys):
    """Without --max-new-tokens: as many new tokens as the 64 learned positions leave."""
    prompt = "x" * 60
    rc = sample_main(["--checkpoint", run_dir, "--prompt", prompt, "--no-stop"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "60 prompt + 4 new tokens" in err


@pytest.mark.parametrize("case", ["no_run", "no_tokenizer", "empty_prompt", "past_table",
                                  "prompt_fills_table"])
def test_cli_bad_input_one_line_exit_2(run_dir, tmp_path, capsys, case):
    ckpt, args = run_dir, ["--prompt", "abc", "--max-new-tokens", "4"]
    expect = {"no_run": "config.json", "no_tokenizer": "SentencePiece model file not found",
              "empty_prompt": "--prompt: expected a non-empty text",
              "past_table": "exceeds model.max_seq_len=64, the learned position table; expected "
                            "max_new_tokens <= 61",
              "prompt_fills_table": "prompt: 70 tokens leave no room for a new one in "
                                    "model.max_seq_len=64"}[case]
    if case == "no_run":
        ckpt = str(tmp_path / "nothing")
    elif case == "no_tokenizer":  # a run whose tokenizer file is gone
        ckpt = str(tmp_path / "run")
        shutil.copytree(run_dir, ckpt)
        with open(os.path.join(ckpt, "config.json")) as f:
            cfg = json.load(f)
        cfg["data"]["tokenizer"] = f"sentencepiece:{tmp_path}/missing.model"
        with open(os.path.join(ckpt, "config.json"), "w") as f:
            json.dump(cfg, f)
    elif case == "empty_prompt":
        args = ["--prompt", "", "--max-new-tokens", "4"]
    elif case == "prompt_fills_table":  # with the default length: no negative suggestion
        args = ["--prompt", "y" * 70]
    else:
        args = ["--prompt", "abc", "--max-new-tokens", "62"]
    rc = sample_main(["--checkpoint", ckpt] + args)
    out, err = capsys.readouterr()
    assert rc == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: ") and expect in err, err


@pytest.mark.slow
def test_inference_bench_smoke(tmp_path):
    """bench/inference.py --smoke, run as the script it is (tests import no bench module)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "inf.json"
    proc = subprocess.run([sys.executable, os.path.join(root, "bench", "inference.py"),
                           "--smoke", "--out", str(out)], cwd=root, capture_output=True,
                          text=True, timeout=600, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads(out.read_text())
    rows = [r for r in data["results"] if "skipped" not in r]
    assert {r["variant"] for r in rows} == {"LS p=4", "MHSA"}
    assert {r["kind"] for r in rows} == {"prefill", "decode"}
    assert all(r["tokens_per_s"] > 0 for r in rows)
    assert any("cache bytes" in t and t.endswith("PASS") for t in data["targets"])
    assert not any("cache bytes" in t and t.endswith("MISS") for t in data["targets"])
    assert "| shape | variant |" in proc.stdout


@pytest.mark.parametrize("flag", ["--steps", "--loop-tokens", "--reps"])
def test_inference_bench_refuses_a_count_below_one(tmp_path, flag):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "inf.json"
    proc = subprocess.run([sys.executable, os.path.join(root, "bench", "inference.py"),
                           "--out", str(out), flag, "0"], cwd=root,
                          capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == \
        f"error: {flag}: expected an integer >= 1, got 0"
    assert not out.exists()
