"""The stability experiment: a CPU smoke run of every variant, and its report helpers."""

import json
import os

import pytest

from ls_jax.experiments import stability
from ls_jax.experiments.stability_report import count_spikes, summarize


def test_smoke_run_writes_metrics_plot_and_table(tmp_path):
    out = str(tmp_path)
    statuses = stability.run(out, "smoke", log=lambda m: None)
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
    qk = summarize([json.loads(x) for x in open(os.path.join(out, "mhsa_qknorm", "metrics.jsonl"))], {})
    plain = summarize([json.loads(x) for x in open(os.path.join(out, "mhsa", "metrics.jsonl"))], {})
    assert qk["final_max_abs_logit"] != plain["final_max_abs_logit"]
    # a second call resumes nothing: every variant is finished
    again = stability.run(out, "smoke", log=lambda m: None)
    assert all(s["state"] == "finished" and "seconds_this_call" in s for s in again.values())
    # the same out dir with other settings is refused
    with pytest.raises(ValueError, match=r"holds a run with a different config \(train.lr"):
        stability.run(out, "smoke", overrides=["train.lr=1e-3"], log=lambda m: None)


def test_variant_configs():
    base = stability.base_config("gpu")
    assert base.model.window_sizes == (None, 50, 50, 50, 50, 50)
    assert (base.model.n_layer, base.model.n_head, base.model.head_dim, base.model.d_model) == (6, 6, 32, 192)
    assert stability.variant_config(base, "mhsa").model.window_sizes == (None,) * 6
    assert stability.variant_config(base, "mhsa_qknorm").model.qk_norm
    assert stability.variant_config(base, "mhsa_zloss").train.z_loss == 1e-4
    assert stability.base_config("gpu_long").data.seq_len == 8192
    with pytest.raises(ValueError, match=r"variants: expected names from .*got 'flash'"):
        stability.variant_config(base, "flash")
    with pytest.raises(ValueError, match=r"preset: expected one of .*got 'huge'"):
        stability.base_config("huge")


def test_count_spikes():
    assert count_spikes([3.0, 2.9, 2.8, 2.7]) == 0
    assert count_spikes([3.0, 2.9, 2.8, 5.0, 2.7]) == 1
    assert count_spikes([3.0, 2.9, float("nan")]) == 1
