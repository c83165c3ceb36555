"""Issue 14's experiments: the variants, the learning-rate sweep (CPU smoke) and the paper-batch
run on 4 fake devices without the packages the GPU image lacks. The byte corpus is
tests/test_byte_corpus.py's, the runner against the library's step tests/test_step.py's."""

import json
import math
import os
import subprocess
import sys
import textwrap

import pytest

from experiments import lr_sweep, runner
from experiments.variants import VARIANTS

from tests.test_step import BLOCK

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_variant_configs_are_the_paper_configs_with_bytes():
    cfgs = {v: runner.variant_config(v) for v in VARIANTS}
    assert cfgs["ls"].model.window_sizes == (None, 51, 51, 51, 51, 51)
    assert cfgs["mhsa"].model.window_sizes == (None,) * 6
    assert cfgs["mhsa_qknorm"].model.qk_norm and cfgs["mhsa_zloss"].train.z_loss == 1e-4
    assert all(c.model.vocab_size == 256 and c.data.tokenizer == "bytes" for c in cfgs.values())
    assert (cfgs["ls"].train.batch_size, cfgs["ls"].train.lr, cfgs["ls"].train.warmup_steps) == (256, 6e-4, 2000)
    with pytest.raises(ValueError, match=r"overrides: expected none of .*model.n_global_heads"):
        runner.variant_config("ls", ["model.n_global_heads=6"])
    with pytest.raises(ValueError, match=r"variants: expected names from .*got 'flash'"):
        runner.variant_config("flash")


def test_blew_up_spread_order_and_lr_range():
    assert not lr_sweep.blew_up([5.0, 4.0, 3.0, 2.5, 2.4, 2.3])
    assert lr_sweep.blew_up([5.0, 4.0, 3.0] + [2.5] * 20 + [5.5] * 2)
    assert lr_sweep.blew_up([5.0, float("nan")])
    assert lr_sweep.spread_order(7) == [0, 6, 3, 1, 4, 2, 5]
    assert sorted(lr_sweep.spread_order(6)) == list(range(6))
    pts = [{"lr": lr, "diverged": d, "final_eval_loss": loss} for lr, d, loss in
           [(1e-3, False, 1.30), (2e-3, False, 1.22), (4e-3, False, 1.20), (8e-3, False, 1.26),
            (1.6e-2, True, None)]]
    r = lr_sweep.lr_range(pts, margin=0.05)
    assert (r["best_lr"], r["lo"], r["hi"], r["contiguous"], r["at_edge"]) == (4e-3, 2e-3, 4e-3, True, [])
    assert math.isclose(r["ratio"], 2.0)


@pytest.mark.slow
def test_sweep_smoke_counts_divergence_resumes_and_refuses_other_settings(tmp_path):
    out = str(tmp_path / "sweep")
    quiet = dict(log=lambda m: None)
    summary = lr_sweep.run(out, "smoke", variants=("ls", "mhsa"), lrs=[1e-2, 1e3], **quiet)
    points = lr_sweep.read_points(out)
    assert len(points) == 4
    for v in ("ls", "mhsa"):
        good, bad = points[f"{v}@0.01"], points[f"{v}@1000"]
        assert not good["diverged"] and good["steps"] == 8 and len(good["loss"]) == 8
        assert good["final_eval_loss"] < math.log(256)  # it learned something
        assert bad["diverged"]
        assert summary[v]["diverged"] == 1 and summary[v]["best_lr"] == 0.01
    table = open(os.path.join(out, "results.md")).read()
    assert "| ls | **" in table and "diverged" in table
    assert "duplicate files" in table and "epochs of the training split" in table
    assert os.path.getsize(os.path.join(out, "lr_sweep.png")) > 10_000
    saved = json.load(open(os.path.join(out, "results.json")))
    assert saved["summary"]["mhsa"]["points_run"] == 2
    # the same command again runs nothing (no compile), and keeps the points
    before = open(os.path.join(out, "points.jsonl")).read()
    lr_sweep.run(out, "smoke", variants=("ls", "mhsa"), lrs=[1e-2, 1e3], **quiet)
    assert open(os.path.join(out, "points.jsonl")).read() == before
    with pytest.raises(ValueError, match="holds a sweep with other settings"):
        lr_sweep.run(out, "smoke", variants=("ls",), lrs=[1e-2], steps=5, **quiet)


def test_a_corpus_is_named_and_an_output_of_another_corpus_refused(tmp_path):
    from experiments import paper_batch

    for run in (lr_sweep.run, paper_batch.run):
        with pytest.raises(ValueError, match=r"corpus: expected one of \('stdlib', 'python', "
                                             r"'offline'\), got 'pg19'"):
            run(str(tmp_path / run.__module__), "smoke", corpus="pg19", log=lambda m: None)
    built = {"source": "offline", "train_tokens": 10, "validation_tokens": 2, "train_files": 3}
    results = {"corpus": built, "variants": {"ls": {"state": "finished"}}}
    paper_batch.check_same_corpus("OUT", results, dict(built))  # the same corpus: no error
    with pytest.raises(ValueError, match=r"out: OUT holds variants trained on another corpus"):
        paper_batch.check_same_corpus("OUT", results, {**built, "train_tokens": 11})
    paper_batch.check_same_corpus("OUT", {**results, "variants": {}}, {**built, "train_files": 4})


@pytest.mark.slow
def test_paper_batch_smoke_on_four_devices_matches_one_device(tmp_path):
    """Two variants trained together in rounds on 4 fake CPU devices, the time budget cutting
    them after step 4 of 5: the same steps for both, the held-out loss at every round, and the
    losses of one uninterrupted single-device run. Grain, TFDS, SentencePiece and tensorboardX
    are blocked, as on the GPU image."""
    script = BLOCK + textwrap.dedent(f"""
        import json, numpy as np, jax
        from experiments import paper_batch, runner
        from experiments.byte_corpus import WindowSampler, build_corpus
        assert jax.device_count() == 4
        plan = paper_batch.next_round  # a deadline with no room after step 4
        paper_batch.next_round = lambda done, *a: 0 if done >= 4 else plan(done, *a)
        res = paper_batch.run({str(tmp_path)!r}, "smoke", ("mhsa_qknorm", "mhsa_zloss"),
                              max_steps=5, time_budget_s=3600, log=lambda m: None)
        for v in ("mhsa_qknorm", "mhsa_zloss"):
            s, series = res["variants"][v], res["series"][v]
            assert res["device"]["count"] == 4 and s["state"] == "stopped", s
            assert (s["steps"], s["target_steps"]) == (4, 5) and not s["diverged"], s
            assert [p[0] for p in series["eval"]] == [2, 4], series["eval"]
            assert s["final_eval_loss"] == series["eval"][-1][1] and s["final_eval_step"] == 4
        zl = res["series"]["mhsa_zloss"]
        assert all(loss > ce for loss, ce in zip(zl["loss"], zl["ce"]))  # the z term
        qk = res["series"]["mhsa_qknorm"]
        assert qk["loss"] == qk["ce"]
        cfg = runner.variant_config("mhsa_zloss", paper_batch.PRESETS["smoke"]["overrides"])
        corpus = build_corpus("stdlib", max_bytes=2 * 2**20, validation_percent=2)
        sampler = WindowSampler(corpus.train_N, seq_len=64, batch_size=8, seed=0)
        one = runner.Program(cfg, runner.data_mesh(jax.devices()[:1]))
        _, rec = runner.run_steps(one, one.init(), sampler, cfg.train.lr, 4)
        np.testing.assert_allclose(zl["loss"], rec.loss, rtol=1e-3)
        print("OK")
    """)
    env = {**os.environ, "XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4",
           "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]
    assert os.path.getsize(tmp_path / "paper_batch.png") > 10_000
    md = open(tmp_path / "results.md").read()
    assert "| mhsa_qknorm | stopped | 4 (5) |" in md and "| mhsa_zloss | stopped | 4 (5) |" in md
