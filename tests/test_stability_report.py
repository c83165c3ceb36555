"""docs/stability.md is what experiments.stability_report writes from docs/stability/, and the
generator reads the planned runs (built here as stand-ins from the stored ones, in a temporary
folder) into the page's verdicts; the rules and measures on constructed losses."""

import json
import math
import os
import shutil

import numpy as np
import pytest

from experiments import rules, stability_report as report

PLANNED = ("paper_batch_mhsa_4xH200", "paper_batch_ls_qknorm_4xH200", "lr_sweep_2000_seed0",
           "lr_sweep_2000_seed1")


def test_committed_page_is_what_the_results_give():
    with open(report.PAGE) as f:
        page = f.read()
    assert page == report.render(report.RESULTS), (
        f"docs/stability.md is stale: run `{report.COMMAND}`")
    with open(report.README) as f:
        readme = f.read()
    assert report.with_readme_block(readme, report.readme_block()) == readme, (
        f"README.md's verdict paragraph is stale: run `{report.COMMAND}`")
    assert page.count("\n") <= report.MAX_LINES
    for d in PLANNED:  # the planned runs not in docs/stability/ are listed as not run
        if not os.path.isdir(os.path.join(report.RESULTS, d)):
            assert f"| `{d}` | not run |" in page


# -- stand-ins for the planned runs ------------------------------------------------------------

def _read(path):
    with open(path) as f:
        return json.load(f)


def _write(path, obj):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f)


def _cut(series: dict, n: int) -> dict:
    return {k: (v[:n] if k != "attn_max_abs_logit_tables" else [t for t in v if t[0] <= n])
            for k, v in series.items() if k != "eval"}


def _grow(series: dict, n: int, tail) -> dict:
    """The series to ``n`` steps: steps 4,001-5,000 repeated, the loss then set by ``tail``."""
    out = {}
    for k, v in series.items():
        if k in ("eval", "attn_max_abs_logit_tables"):
            continue
        out[k] = v + [v[4000 + i % 1000] for i in range(n - len(v))]
    loss = np.asarray(out["loss"], np.float64)
    out["loss"] = out["ce"] = tail(loss).tolist()
    out["attn_max_abs_logit_tables"] = []
    return out


def _summary(base: dict, series: dict, evals, device_steps_s: float) -> dict:
    s = dict(base)
    n = len(series["loss"])
    s.update(steps=n, state="finished", train_seconds=round(n * device_steps_s, 1),
             final_eval_loss=evals[-1][1], final_eval_step=evals[-1][0],
             epochs=round(n * 256 / 190_000, 3), lr_at_end=5e-4,
             final_max_abs_logit=series["max_abs_logit"][-1],
             peak_max_abs_logit=max(series["max_abs_logit"]))
    return s


def _evals(series: dict, every: int, offset: float) -> list:
    ce = report.trailing_mean(series.get("ce") or series["loss"])
    n = len(series["loss"])
    return [[s, round(float(ce[s - 1]) + offset, 5)] for s in [*range(every, n + 1, every)]
            + ([n] if n % every else [])]


@pytest.fixture(scope="module")
def planned_root(tmp_path_factory):
    """docs/stability/ plus stand-ins for the four planned folders, made from the stored runs:
    a 21,000-step MHSA run whose loss blows up at the end beside LS, LS and QK-norm with
    held-out points every 1,000 steps (LS lower), and a sweep with a second seed at 3 lrs."""
    root = tmp_path_factory.mktemp("stability")
    for d in os.listdir(report.RESULTS):
        if d not in PLANNED and os.path.isdir(os.path.join(report.RESULTS, d)):
            shutil.copytree(os.path.join(report.RESULTS, d), root / d)
    lsm = _read(os.path.join(report.RESULTS, "paper_batch_4xH100", "results.json"))
    base = _read(os.path.join(report.RESULTS, "paper_batch_baselines_4xH100", "results.json"))
    corpus = {**base["corpus"], "source": "offline", "train_tokens": 500_000_000,
              "duplicate_files": 120, "duplicate_bytes": 3_000_000}
    device = {"kind": "NVIDIA H200", "count": 4, "platform": "gpu"}

    def batch_run(variants: dict, settings_max: int) -> dict:
        settings = {**base["settings"], "max_steps": settings_max,
                    "corpus": {**base["settings"]["corpus"], "source": "offline"}}
        out = {"settings": settings, "corpus": corpus, "device": device,
               "attention_path": base["attention_path"], "variants": {}, "series": {}}
        for v, (summary, series, offset) in variants.items():
            series["eval"] = _evals(series, 1000, offset)
            out["series"][v] = series
            out["variants"][v] = _summary(summary, series, series["eval"], 0.02)
        return out

    n = 21_000
    blow = lambda x: np.concatenate([x[:-1500], np.full(1500, 2.5 * x.min())])  # noqa: E731
    flat = lambda x: x  # noqa: E731
    mhsa_long = {"mhsa": (lsm["variants"]["mhsa"], _grow(lsm["series"]["mhsa"], n, blow), 0.08),
                 "ls": (lsm["variants"]["ls"], _grow(lsm["series"]["ls"], n, flat), 0.09)}
    _write(str(root / PLANNED[0] / "results.json"), batch_run(mhsa_long, None))
    qk = {"ls": (lsm["variants"]["ls"], _cut(lsm["series"]["ls"], 8000), 0.04),
          "mhsa_qknorm": (base["variants"]["mhsa_qknorm"],
                          _grow(base["series"]["mhsa_qknorm"], 8000, flat), 0.12)}
    _write(str(root / PLANNED[1] / "results.json"), batch_run(qk, 8000))

    sweep = os.path.join(report.RESULTS, "lr_sweep_T2048")
    settings = _read(os.path.join(sweep, "settings.json"))
    with open(os.path.join(sweep, "points.jsonl")) as f:
        points = [json.loads(line) for line in f]
    for seed, folder in ((0, PLANNED[2]), (1, PLANNED[3])):
        s = json.loads(json.dumps(settings))
        s["steps"], s["seed"] = 2000, seed
        s["corpus"]["source"] = s["corpus_built"]["source"] = "offline"
        for c in s["configs"].values():
            c["train"].update(num_steps=2000, warmup_steps=200, seed=seed)
        _write(str(root / folder / "settings.json"), s)
        lrs = sorted({p["lr"] for p in points})
        keep = lrs if seed == 0 else [lrs[0], lrs[3], lrs[6]]
        with open(root / folder / "points.jsonl", "w") as f:
            for p in points:
                if p["lr"] in keep:
                    q = {**p, "steps": 2000,
                         "final_eval_loss": round(p["final_eval_loss"] + 0.01 * seed, 5)}
                    f.write(json.dumps(q) + "\n")
    return str(root)


def test_planned_runs_slot_into_the_page(planned_root):
    page = report.render(planned_root)
    assert page.count("\n") <= report.MAX_LINES
    assert "not run" not in page
    for d in PLANNED:
        assert f"[`{d}`](stability/{d}/)" in page
    claims = {c.claim.split(" (")[0]: c for c in
              (claim(report.Data(report.load(planned_root))) for claim in report.CLAIMS)}
    div = claims["MHSA diverges after 20-30k steps"]
    assert div.label == "reproduced" and "holds from step 20," in div.detail
    qk = claims["LS reaches about 2/5 of QK-norm's perplexity"]
    assert qk.label == "direction reproduced" and "held-out loss at step 8,000" in qk.detail
    assert "δ = 0.0100" in qk.detail  # the second seed's spread is the margin
    loss = claims["LS has a lower loss than MHSA"]
    assert "held-out loss at step 21,000" in loss.detail
    sens = claims["LS trains well over a wider range of peak lrs than MHSA"]
    assert sens.label in ("yes", "no") and "sweep 2000_seed0 (2,000 steps a point" in sens.evidence
    assert "### Seed to seed" in page and "| 2000_seed0 / 2000_seed1 | ls | 3e-4 |" in page
    assert "ls (mhsa_4xH200)" in page and "mhsa_qknorm (ls_qknorm_4xH200)" in page
    assert "`offline` (500.0M training tokens, 3.90M held out; deduplicated)" in page
    assert "GPU-hours are compared within one kind only" in page  # H100 and H200 runs


def test_the_cli_writes_checks_and_refuses_a_folder_it_cannot_read(planned_root, tmp_path, capsys):
    page, readme = tmp_path / "stability.md", tmp_path / "README.md"
    readme.write_text("# x\n\n" + "\n".join(report.README_MARKERS) + "\n\nmore\n")
    args = ["--results", planned_root, "--page", str(page), "--readme", str(readme)]
    assert report.main([*args, "--write"]) == 0
    assert report.main([*args, "--check"]) == 0
    assert report.readme_block(planned_root) in readme.read_text()
    assert readme.read_text().endswith("\n\nmore\n")
    page.write_text(page.read_text().replace("reproduced", "confirmed", 1))
    assert report.main([*args, "--check"]) == 1
    assert "differs from what" in capsys.readouterr().err
    bad = tmp_path / "results"
    shutil.copytree(planned_root, bad)
    (bad / "stray").mkdir()
    (bad / "stray" / "notes.txt").write_text("x")
    with pytest.raises(SystemExit) as e:
        report.main(["--results", str(bad)])
    assert e.value.code == 2
    assert "stray to hold a paper_batch results.json" in capsys.readouterr().err


# -- the rules and measures --------------------------------------------------------------------

@pytest.mark.parametrize("case, losses, held, end_ratio", [
    ("smooth descent", [5.0, 4.0, 3.0] + [2.5] * 37, [], 1.0),
    ("a surge it recovers from", [3.0] * 20 + [6.0] * 10 + [3.0] * 30, [[21, 30]], 1.0),
    ("a blow-up at the end", [3.0] * 20 + [6.0] * 10, [[21, 30]], 2.0),
    ("a non-finite loss", [3.0] * 20 + [math.nan, 3.0], [[21, 22]], math.inf),
])
def test_divergence_rule_over_every_prefix(case, losses, held, end_ratio):
    d = rules.divergence(losses)
    assert d["held"] == held, case
    assert d["end_ratio"] == pytest.approx(end_ratio), case
    assert rules.blew_up(losses) == (d["end_ratio"] > rules.BLOWUP_FACTOR), case


def test_spike_ratios_and_count():
    losses = [3.0, 2.9, 2.8, 5.0, 2.7, math.nan]
    r = rules.spike_ratios(losses)
    assert r[2] == pytest.approx(5.0 / 2.9) and r[-1] == math.inf
    assert rules.count_spikes(losses) == 2


def test_sensitivity_is_wortsmans_expectation_over_lrs():
    pts = {("ls", lr): {"variant": "ls", "lr": lr, "diverged": d, "final_eval_loss": x,
                        "loss": [5.5, 5.0]}
           for lr, x, d in [(1e-3, 2.0, False), (3e-3, 1.5, False), (1e-2, 6.0, False),
                            (3e-2, None, True)]}
    s = report.Sweep("x", {"steps": 10, "configs": {"ls": {"model": {"vocab_size": 256}}}}, pts)
    S, best, best_lr = s.sensitivity("ls")
    # min(loss, L0 = 5.5): 2.0, 1.5, 5.5 (capped), 5.5 (diverged); best 1.5
    assert S == pytest.approx((2.0 + 1.5 + 5.5 + 5.5) / 4 - 1.5)
    assert (best, best_lr) == (1.5, 3e-3)


@pytest.mark.parametrize("x, text", [(45.196, "45.2"), (515.36, "515"),
                                     (13571.8, "1.36 x 10^4"), (2950800.0, "2.95 x 10^6")])
def test_logit_format(x, text):
    assert report.f_logit(x) == text


@pytest.mark.parametrize("lr, text", [(6e-4, "6e-4"), (0.000646, "6.46e-4"), (0.0139, "1.39e-2"),
                                      (0.03, "3e-2")])
def test_lr_format(lr, text):
    assert report.f_lr(lr) == text


def test_seed_spread_leaves_out_points_that_diverged_under_one_seed():
    settings = {"steps": 10, "seed": 0, "configs": {"ls": {"model": {"vocab_size": 256}}}}

    def sweep(seed, losses):
        pts = {("ls", lr): {"variant": "ls", "lr": lr, "diverged": d, "final_eval_loss": x,
                            "loss": [5.5, 5.0]} for lr, (x, d) in losses.items()}
        return report.Sweep(f"s{seed}", {**settings, "seed": seed}, pts)

    a = sweep(0, {1e-3: (2.0, False), 1e-2: (4.0, True)})
    b = sweep(1, {1e-3: (2.1, False), 1e-2: (2.5, False)})
    data = report.Data([a, b])
    spread = data.seed_spread()
    assert spread["delta"] == pytest.approx(0.1) and spread["n"] == 1
    assert [d[0] for d in spread["excluded"]] == [("ls", 1e-2)]
