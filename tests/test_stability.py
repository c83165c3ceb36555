"""The stability experiment: a CPU smoke run of every variant, and its report helpers."""

import json
import os

import pytest

pytest.importorskip("grain", reason="the training loop needs the [train] extra")

from experiments import paper_batch, stability
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


# -- the paper-batch run's rounds ---------------------------------------------------------------

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
