"""The stability experiment: a CPU smoke run of every variant, and its report helpers."""

import json
import math
import os

import pytest

pytest.importorskip("grain", reason="the training loop needs the [train] extra")

from experiments import paper_batch, paper_claims, stability
from experiments.rules import count_spikes
from ls_jax.configs import get_config


# the smoke preset, one layer, one checkpoint and only the final eval: what the report reads
SMALL = ["model.n_layer=1", "train.save_every=6", "train.eval_every=0"]


@pytest.mark.slow
def test_smoke_run_writes_metrics_plot_and_table(tmp_path):
    out = str(tmp_path)
    statuses = stability.run(out, "smoke", overrides=SMALL, log=lambda m: None)
    assert set(statuses) == set(stability.VARIANTS)
    for variant in stability.VARIANTS:
        assert statuses[variant]["state"] == "finished"
        with open(os.path.join(out, variant, "metrics.jsonl")) as f:
            records = [json.loads(line) for line in f]
        assert [r["step"] for r in records if "loss" in r] == list(range(1, 7))
        assert any("eval/loss" in r for r in records)
    assert os.path.getsize(os.path.join(out, "stability.png")) > 10_000
    table = [line for line in open(os.path.join(out, "results.md")) if line.startswith("| ")]
    header = [c.strip() for c in table[0].strip("|\n").split("|")]
    rows = {r.split("|")[1].strip(): [c.strip() for c in r.strip("|\n").split("|")] for r in table[1:]}
    assert set(rows) == set(stability.VARIANTS)
    for cells in rows.values():
        assert len(cells) == len(header)
        assert cells[header.index("steps")] == "6"
        assert float(cells[header.index("final train loss")]) > 0
        assert cells[header.index("diverged")] in ("yes", "no")
    # the variants differ where they should: QK-norm changes the attention logits
    qk = stability.summarize([json.loads(x) for x in open(os.path.join(out, "mhsa_qknorm", "metrics.jsonl"))], {})
    plain = stability.summarize([json.loads(x) for x in open(os.path.join(out, "mhsa", "metrics.jsonl"))], {})
    assert qk["final_max_abs_logit"] != plain["final_max_abs_logit"]
    # a second call resumes nothing: every variant is finished
    again = stability.run(out, "smoke", overrides=SMALL, log=lambda m: None)
    assert all(s["state"] == "finished" and "seconds_this_call" in s for s in again.values())
    # the same out dir with other settings is refused
    with pytest.raises(ValueError, match=r"holds a run with a different config \(train.lr"):
        stability.run(out, "smoke", overrides=SMALL + ["train.lr=1e-3"], log=lambda m: None)


def test_variant_configs_are_the_named_paper_configs_rescaled():
    for variant, name in (("ls", "paper"), ("mhsa", "paper_mhsa"),
                          ("mhsa_qknorm", "paper_qknorm"), ("mhsa_zloss", "paper_zloss")):
        named = get_config(name)
        cfg = stability.variant_config("gpu", variant)
        assert cfg.name == f"stability_gpu_{variant}"
        for key in ("n_layer", "n_head", "head_dim", "d_model", "n_global_heads", "window",
                    "qk_norm", "compute_dtype"):
            assert getattr(cfg.model, key) == getattr(named.model, key), (variant, key)
        assert cfg.train.z_loss == named.train.z_loss
        # the gpu stress setting: bytes on the stdlib corpus, lr 3e-3, T=2048, batch 32
        assert (cfg.data.source, cfg.data.tokenizer, cfg.model.vocab_size) == ("stdlib", "bytes", 256)
        assert (cfg.train.lr, cfg.data.seq_len, cfg.train.batch_size) == (3e-3, 2048, 32)
    assert stability.variant_config("gpu", "ls").model.window_sizes == (None, 51, 51, 51, 51, 51)
    assert stability.variant_config("gpu", "mhsa").model.window_sizes == (None,) * 6
    assert stability.variant_config("gpu", "mhsa_qknorm").model.qk_norm
    assert stability.variant_config("gpu", "mhsa_zloss").train.z_loss == 1e-4
    assert stability.variant_config("gpu_long", "ls").data.seq_len == 8192
    with pytest.raises(ValueError, match=r"variants: expected names from .*got 'flash'"):
        stability.variant_config("gpu", "flash")
    with pytest.raises(ValueError, match=r"preset: expected one of .*got 'huge'"):
        stability.variant_config("huge", "ls")
    with pytest.raises(ValueError, match=r"overrides: expected none of .*model.qk_norm=true"):
        stability.variant_config("smoke", "ls", ["model.qk_norm=true"])


def test_count_spikes():
    assert count_spikes([3.0, 2.9, 2.8, 2.7]) == 0
    assert count_spikes([3.0, 2.9, 2.8, 5.0, 2.7]) == 1
    assert count_spikes([3.0, 2.9, float("nan")]) == 1


# -- the paper-batch run's rounds and the verdict on the paper's claims ----------------------

@pytest.mark.parametrize("case, args, expected", [
    ("first round, to the first eval point", (0, 10430, 1000), 1000),
    ("a round ends at the next eval point", (2500, 10430, 1000), 500),
    ("the last round ends at the target", (10000, 10430, 1000), 430),
    ("no pace yet: the round is not cut", (0, 10430, 1000, 5.0, None), 1000),
    ("the time left fits the whole round", (1000, 10430, 1000, 100.0, 0.05), 1000),
    ("cut to what fits, with the margin", (8000, 10430, 1000, 10.0, 0.05),
     int(10.0 * paper_batch.PACE_MARGIN / 0.05)),
    ("nothing fits", (8000, 10430, 1000, 0.01, 0.05), 0),
    ("the deadline has passed", (8000, 10430, 1000, -3.0, 0.05), 0),
])
def test_next_round(case, args, expected):
    assert paper_batch.next_round(*args) == expected, case


def test_variants_to_run_reruns_only_missing_and_unfinished():
    results = {"variants": {"ls": {"state": "stopped"}, "mhsa": {"state": "running"},
                            "mhsa_qknorm": {"state": "diverged"}}}
    assert paper_batch.variants_to_run(results, ("ls", "mhsa", "mhsa_qknorm", "mhsa_zloss")) == [
        "mhsa", "mhsa_zloss"]


def _fake_run(steps, ce, seconds, evals, loss_offset=0.0):
    """A paper_batch results.json holding one variant (the fields paper_claims reads)."""
    summary = {"steps": steps, "state": "finished", "train_seconds": seconds,
               "tokens_per_sec": steps * 524288 / seconds, "final_max_abs_logit": 30.0,
               "peak_max_abs_logit": 40.0, "spikes": 0, "diverged": False,
               "final_eval_loss": evals[-1][1], "final_eval_step": evals[-1][0]}
    series = {"loss": [x + loss_offset for x in ce], "ce": list(ce), "eval": evals}
    return summary, series


def _naive_trailing(xs, step, window):
    part = xs[max(0, step - window):step]
    return sum(part) / len(part)


@pytest.mark.parametrize("ls_evals", ["at_end_only", "during_training"])
def test_paper_claims_on_constructed_runs(tmp_path, ls_evals):
    window = 10
    ls_ce = [3.0 - 0.01 * s for s in range(1, 201)]
    ls_curve = ([[200, 1.2337]] if ls_evals == "at_end_only" else
                [[50, 2.6], [100, 2.1], [150, 1.7], [200, 1.2337]])
    base_ce = [3.2 - 0.01 * s for s in range(1, 101)]
    runs = {"ls": _fake_run(200, ls_ce, 20.0, ls_curve),
            "mhsa_qknorm": _fake_run(100, base_ce, 20.0, [[50, 2.5], [100, 2.0]]),
            "mhsa_zloss": _fake_run(100, base_ce, 20.0, [[100, 1.8]], loss_offset=0.05),
            "mhsa": _fake_run(100, base_ce, 30.0, [[100, 2.2]])}
    config = {"model": {"d_model": 192}, "train": {"lr": 6e-4}}
    paths = []
    for name, group in (("a", ["ls", "mhsa"]), ("b", ["mhsa_qknorm", "mhsa_zloss"])):
        res = {"settings": {"seed": 0, "eval_batches": 4, "configs": {"ls": config}},
               "corpus": {"train_tokens": 1000}, "device": {"kind": "gpu", "count": 4},
               "variants": {v: runs[v][0] for v in group}, "series": {v: runs[v][1] for v in group}}
        paths.append(str(tmp_path / f"{name}.json"))
        json.dump(res, open(paths[-1], "w"))
    loaded, notes = paper_claims.load_runs(paths)
    assert notes == []

    # QK-norm at its last held-out step, 100
    end_ratio = 1.2337 / _naive_trailing(ls_ce, 200, window)
    ls_at_100 = 2.1 if ls_evals == "during_training" else end_ratio * _naive_trailing(ls_ce, 100, window)
    c = paper_claims.qknorm_claim(loaded["ls"], loaded["mhsa_qknorm"], window)
    assert c["step"] == 100 and c["ls_how"] == ("measured" if ls_evals == "during_training" else "estimated")
    assert c["ls_held_out"] == pytest.approx(ls_at_100)
    assert c["ppl_ratio"] == pytest.approx(math.exp(ls_at_100) / math.exp(2.0))
    assert c["ls_train_ce"] == pytest.approx(_naive_trailing(ls_ce, 100, window))

    # z-loss: the target is its held-out 1.8; GPU-hours at 0.1 s (LS) and 0.2 s (z-loss) a step
    z = paper_claims.zloss_claim(loaded["ls"], loaded["mhsa_zloss"], window, loaded["mhsa"])
    if ls_evals == "during_training":
        ls_step = 150  # the first held-out point at or below 1.8
    else:
        ls_step = next(s for s in range(1, 201)
                       if end_ratio * _naive_trailing(ls_ce, s, window) <= 1.8)
    assert z["ls_step"] == ls_step
    assert z["fraction"] == pytest.approx((ls_step * 0.1) / (100 * 0.2))
    assert z["zl_gpu_hours"] == pytest.approx(4 * 100 * 0.2 / 3600)
    # z-loss's 100 steps at the pace of MHSA in LS's call, 0.3 s a step
    assert z["fraction_same_call"] == pytest.approx((ls_step * 0.1) / (100 * 0.3))
    # on training cross-entropy, not z-loss's loss (which adds its z term)
    zl_ce = _naive_trailing(base_ce, 100, window)
    assert z["ls_step_train_ce"] == next(s for s in range(1, 201)
                                         if _naive_trailing(ls_ce, s, window) <= zl_ce)
    # the ratio method checked on QK-norm's own step-50 point
    qk_ratio = 2.0 / _naive_trailing(base_ce, 100, window)
    assert paper_claims.method_check(loaded["mhsa_qknorm"], window) == pytest.approx(
        abs(qk_ratio * _naive_trailing(base_ce, 50, window) - 2.5))

    out = tmp_path / "verdict.md"
    assert paper_claims.main([*paths, "--out", str(out)]) == 0
    rows = [line for line in out.read_text().splitlines() if line.startswith("| LS reaches")]
    assert len(rows) == 2 and "at MHSA's pace in LS's call" in rows[1]


def test_paper_claims_notes_differences_and_refuses_a_variant_twice(tmp_path, capsys):
    def write(name, variants, train_tokens):
        res = {"settings": {"seed": 0, "eval_batches": 4, "configs": {"ls": {"train": {"lr": 1}}}},
               "corpus": {"train_tokens": train_tokens}, "device": {"kind": "gpu", "count": 4},
               "variants": {}, "series": {}}
        for v in variants:
            res["variants"][v], res["series"][v] = _fake_run(10, [2.0] * 10, 1.0, [[10, 2.0]])
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(res))
        return str(path)

    a, b = write("a", ["ls"], 1000), write("b", ["mhsa_zloss"], 999)
    _, notes = paper_claims.load_runs([a, b])
    assert notes == [f"corpus train_tokens differs: 1000 ({a}) vs 999 ({b})"]
    with pytest.raises(SystemExit) as e:
        paper_claims.main([a, write("c", ["ls"], 1000)])
    assert e.value.code != 0
    assert "expected each variant in one file, got 'ls'" in capsys.readouterr().err
