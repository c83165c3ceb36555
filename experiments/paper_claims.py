"""The verdict on the paper's two claims against its stabilisers, from paper-batch results.

    python -m experiments.paper_claims docs/stability/paper_batch_4xH100/results.json \\
        OUT/results.json [--out verdict.md]

Reads the ``results.json`` of ``experiments.paper_batch`` calls (each variant in exactly one
file) and writes a markdown table per variant and one row per claim:

- **QK-norm:** "LS reaches about 2/5 of QK-norm's perplexity". Compared at QK-norm's last
  held-out step N: the held-out perplexity per byte of both (LS's estimated when it has no
  held-out loss at N, see below) and the training cross-entropy over the steps up to N, which
  both runs measured on the same batches.
- **z-loss:** "LS reaches z-loss's perplexity with 1/20 of the GPU-hours". The target is z-loss's
  last held-out loss; LS's GPU-hours to reach it are its steps to reach it times its seconds per
  step times its GPUs.

Where LS has no held-out loss at the step needed (a run that measured it only at its end), it
is **estimated** from LS's training cross-entropy (the mean over the ``TRAIL`` steps up to the
step) times LS's own held-out / training ratio at its end. The held-out gap grows as the
corpus repeats, so the end ratio overstates the held-out loss earlier: the estimate is late,
i.e. against LS. The same estimate with the end's gap added instead of multiplied (early, i.e.
for LS) bounds it from the other side; both are printed. Every baseline with held-out losses
during training checks the ratio method on itself ("method check").
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import numpy as np

TRAIL = 100  # training steps averaged into one cross-entropy value: steps' noise out, trend in
PAPER = {"qknorm": 2 / 5, "zloss": 1 / 20}  # LS/QK-norm perplexity; LS/z-loss GPU-hours


def load_runs(paths) -> tuple[dict, list[str]]:
    """variant -> {"summary", "series", "device", "corpus", "file"}, and notes on what differs
    between the files (corpus, shared settings). ValueError when a variant is in two files."""
    runs, notes, files = {}, [], []
    for path in paths:
        with open(path) as f:
            res = json.load(f)
        files.append((path, res))
        for v, summary in res["variants"].items():
            if v in runs:
                raise ValueError(f"results: expected each variant in one file, got {v!r} in "
                                 f"{runs[v]['file']} and {path}")
            runs[v] = {"summary": summary, "series": res["series"][v],
                       "device": res.get("device", {}), "corpus": res.get("corpus", {}),
                       "file": path}
    (p0, r0), rest = files[0], files[1:]
    for p, r in rest:
        for key in ("train_tokens", "validation_tokens", "train_files", "validation_files"):
            a, b = r0.get("corpus", {}).get(key), r.get("corpus", {}).get(key)
            if a != b:
                notes.append(f"corpus {key} differs: {a} ({p0}) vs {b} ({p})")
        for key in ("seed", "eval_batches"):
            if r0["settings"].get(key) != r["settings"].get(key):
                notes.append(f"settings {key} differs: {r0['settings'].get(key)} ({p0}) vs "
                             f"{r['settings'].get(key)} ({p})")
        diff = _config_diff(r0["settings"]["configs"]["ls"], r["settings"]["configs"]["ls"])
        if diff:
            notes.append(f"shared config differs ({p0} vs {p}): {', '.join(diff)}")
        d0, d = r0.get("device", {}), r.get("device", {})
        if (d0.get("kind"), d0.get("count")) != (d.get("kind"), d.get("count")):
            notes.append(f"devices differ: {d0.get('count')} x {d0.get('kind')} ({p0}) vs "
                         f"{d.get('count')} x {d.get('kind')} ({p})")
    return runs, notes


def _config_diff(a: dict, b: dict, prefix: str = "") -> list[str]:
    out = []
    for key in sorted(set(a) | set(b)):
        x, y = a.get(key), b.get(key)
        if isinstance(x, dict) and isinstance(y, dict):
            out += _config_diff(x, y, f"{prefix}{key}.")
        elif x != y:
            out.append(f"{prefix}{key} {x!r} vs {y!r}")
    return out


def trailing_mean(xs, window: int = TRAIL) -> np.ndarray:
    """m[i] = mean of xs[i - window + 1 .. i] (fewer at the start)."""
    xs = np.asarray(xs, np.float64)
    c = np.concatenate([[0.0], np.cumsum(xs)])
    i = np.arange(1, len(xs) + 1)
    lo = np.maximum(0, i - window)
    return (c[i] - c[lo]) / (i - lo)


def train_ce(run) -> np.ndarray:
    """Per-step training cross-entropy (the loss less any z-loss term), index = step - 1."""
    s = run["series"]
    return np.asarray(s.get("ce") or s["loss"], np.float64)


def held_out_curve(run) -> list[tuple[int, float]]:
    """(step, held-out loss) measured during the run, or at its end only."""
    if run["series"].get("eval"):
        return [(int(a), float(b)) for a, b in run["series"]["eval"]]
    s = run["summary"]
    return [(int(s.get("final_eval_step") or s["steps"]), float(s["final_eval_loss"]))]


def estimated_held_out(run, window: int = TRAIL) -> tuple[np.ndarray, np.ndarray]:
    """Held-out loss at every step (index = step - 1) from the training cross-entropy and the
    run's last held-out point: (times the held-out/train ratio there, plus the gap there)."""
    ce = trailing_mean(train_ce(run), window)
    step, held = held_out_curve(run)[-1]
    return ce * (held / ce[step - 1]), ce + (held - ce[step - 1])


def held_out_at(run, step: int, window: int = TRAIL) -> tuple[float, float, str]:
    """(value, other bound, how) of the held-out loss at ``step``: measured if the run has it
    (both the same), else the ratio and gap estimates."""
    for s, loss in held_out_curve(run):
        if s == step:
            return loss, loss, "measured"
    ratio, gap = estimated_held_out(run, window)
    if step > len(ratio):
        raise ValueError(f"step: expected at most the run's {len(ratio)} steps, got {step}")
    return float(ratio[step - 1]), float(gap[step - 1]), "estimated"


def first_step_at_or_below(values, target: float) -> int | None:
    """The first step (index + 1) whose value is <= target, or None."""
    hit = np.nonzero(np.asarray(values) <= target)[0]
    return int(hit[0]) + 1 if hit.size else None


def seconds_per_step(run) -> float:
    s = run["summary"]
    return s["train_seconds"] / s["steps"]


def gpu_hours(run, steps: int | None = None) -> float:
    """GPU-hours of the run's first ``steps`` steps (all of them by default) at its pace."""
    steps = run["summary"]["steps"] if steps is None else steps
    return run["device"].get("count", 1) * steps * seconds_per_step(run) / 3600


def qknorm_claim(ls, qk, window: int = TRAIL) -> dict:
    """LS against QK-norm at QK-norm's last held-out step."""
    n, qk_held = held_out_curve(qk)[-1]
    ls_held, ls_other, how = held_out_at(ls, n, window)
    ls_ce, qk_ce = trailing_mean(train_ce(ls), window), trailing_mean(train_ce(qk), window)
    ratio = math.exp(ls_held - qk_held)
    return {"step": n, "qk_held_out": qk_held, "ls_held_out": ls_held,
            "ls_held_out_other": ls_other, "ls_how": how,
            "ppl_ratio": ratio, "ppl_ratio_other": math.exp(ls_other - qk_held),
            "ls_train_ce": float(ls_ce[n - 1]), "qk_train_ce": float(qk_ce[n - 1]),
            # the bytes per token at which this per-byte ratio is the paper's per-token one
            "bytes_per_token_for_paper": (math.log(PAPER["qknorm"]) / math.log(ratio)
                                          if 0 < ratio < 1 else None)}


def zloss_claim(ls, zl, window: int = TRAIL, pace=None) -> dict:
    """LS's GPU-hours to reach z-loss's last held-out loss, against z-loss's. ``pace``: a run
    from LS's call (MHSA: z-loss's step is MHSA's plus one logsumexp) whose seconds per step
    also stand in for z-loss's ("fraction_same_call"), so that both paces come from one
    machine and one version of the code."""
    nz, target = held_out_curve(zl)[-1]
    zl_hours = gpu_hours(zl, nz)
    curve = held_out_curve(ls)
    out = {"zl_step": nz, "target": target, "zl_gpu_hours": zl_hours,
           "zl_gpu_hours_same_call": None if pace is None else (
               zl["device"].get("count", 1) * nz * seconds_per_step(pace) / 3600)}
    if len(curve) > 1:  # LS measured its held-out loss during training
        step = next((s for s, loss in curve if loss <= target), None)
        out.update(how="measured (first held-out point at or below)", ls_step=step,
                   ls_step_other=step)
    else:
        ratio, gap = estimated_held_out(ls, window)
        out.update(how="estimated", ls_step=first_step_at_or_below(ratio, target),
                   ls_step_other=first_step_at_or_below(gap, target))
    zl_ce = float(trailing_mean(train_ce(zl), window)[nz - 1])
    out["zl_train_ce"] = zl_ce
    out["ls_step_train_ce"] = first_step_at_or_below(trailing_mean(train_ce(ls), window), zl_ce)
    for key in ("ls_step", "ls_step_other", "ls_step_train_ce"):
        step = out[key]
        out[key.replace("step", "gpu_hours")] = None if step is None else gpu_hours(ls, step)
        out[key.replace("ls_step", "fraction")] = (None if step is None
                                                   else gpu_hours(ls, step) / zl_hours)
    out["fraction_same_call"] = (None if out["ls_step"] is None or pace is None
                                 else out["ls_gpu_hours"] / out["zl_gpu_hours_same_call"])
    return out


def method_check(run, window: int = TRAIL) -> float | None:
    """Largest |ratio estimate - measured| over the run's held-out points but the last (the
    one the estimate is pinned to); None without such points."""
    curve = held_out_curve(run)[:-1]
    if not curve:
        return None
    ratio, _ = estimated_held_out(run, window)
    return max(abs(float(ratio[s - 1]) - loss) for s, loss in curve)


def _f(x, fmt=".4f"):
    return "—" if x is None else format(x, fmt)


def verdict_markdown(runs: dict, notes: list[str], window: int = TRAIL) -> str:
    lines = [
        "| variant | steps | state | held-out loss (ppl per byte) at step | train cross-entropy, "
        f"last {window} steps | GPUs | tokens/s | GPU-hours | max abs logit: end (peak) | "
        "spikes | diverged | file |",
        "|" + "---|" * 12,
    ]
    for v, r in runs.items():
        s = r["summary"]
        step, held = held_out_curve(r)[-1]
        ce = trailing_mean(train_ce(r), window)[-1] if len(train_ce(r)) else None
        lines.append(
            f"| {v} | {s['steps']:,} | {s['state']} | {held:.4f} ({math.exp(held):.4f}) at "
            f"{step:,} | {_f(ce)} | {r['device'].get('count', '?')} x "
            f"{r['device'].get('kind', '?')} | {s['tokens_per_sec'] / 1e6:.1f}M | "
            f"{gpu_hours(r):.3f} | {s['final_max_abs_logit']:,} ({s['peak_max_abs_logit']:,}) | "
            f"{s['spikes']} | {'yes' if s['diverged'] else 'no'} | {r['file']} |")
    lines += ["", "| claim (paper) | measured here | verdict |", "|---|---|---|"]
    if "ls" in runs and "mhsa_qknorm" in runs:
        c = qknorm_claim(runs["ls"], runs["mhsa_qknorm"], window)
        est = ("" if c["ls_how"] == "measured" else
               f" (estimated; {c['ls_held_out_other']:.4f} with the additive gap, ratio "
               f"{c['ppl_ratio_other']:.3f})")
        if c["ppl_ratio"] < 1:
            b = c["bytes_per_token_for_paper"]
            verdict = (f"direction reproduced: LS's perplexity per byte is "
                       f"{c['ppl_ratio']:.3f} of QK-norm's, which is the paper's 2/5 per token "
                       f"at {b:.1f} bytes per token (less than 2/5 with more bytes per token)")
        else:
            verdict = "not reproduced: LS's held-out loss is not below QK-norm's"
        lines.append(
            f"| LS reaches about 2/5 of QK-norm's perplexity | at step {c['step']:,}: LS "
            f"held-out {c['ls_held_out']:.4f}{est}, QK-norm {c['qk_held_out']:.4f}: perplexity "
            f"ratio {c['ppl_ratio']:.3f} per byte (LS lower by "
            f"{c['qk_held_out'] - c['ls_held_out']:.4f} nats/byte); training cross-entropy, "
            f"steps {max(1, c['step'] - window + 1):,}-{c['step']:,} (same batches): LS "
            f"{c['ls_train_ce']:.4f}, QK-norm {c['qk_train_ce']:.4f} | {verdict} |")
    if "ls" in runs and "mhsa_zloss" in runs:
        pace = runs.get("mhsa")
        if pace is not None and pace["file"] != runs["ls"]["file"]:
            pace = None
        c = zloss_claim(runs["ls"], runs["mhsa_zloss"], window, pace)
        if c["ls_step"] is None:
            reach = f"LS does not reach it in its {runs['ls']['summary']['steps']:,} steps"
            verdict = "not reproduced"
        else:
            k = 1 / c["fraction"]
            other = ("" if c["ls_step_other"] in (None, c["ls_step"]) else
                     f" (step {c['ls_step_other']:,} with the additive gap: 1/"
                     f"{1 / c['fraction_other']:.1f})")
            reach = (f"LS reaches it by step {c['ls_step']:,} ({c['how']}){other}: "
                     f"{c['ls_gpu_hours']:.3f} GPU-hours, 1/{k:.1f} of z-loss's")
            if c["fraction_same_call"] is not None:
                reach += (f"; 1/{1 / c['fraction_same_call']:.1f} with z-loss's steps timed at "
                          "MHSA's pace in LS's call (one machine, one code version)")
            verdict = ("reproduced (1/20 or less)" if c["fraction"] <= PAPER["zloss"] else
                       f"LS needs 1/{k:.1f} of the GPU-hours: fewer, not 1/20" if k > 1 else
                       "not reproduced")
        train = ("LS never reaches it" if c["ls_step_train_ce"] is None else
                 f"LS by step {c['ls_step_train_ce']:,}, 1/{1 / c['fraction_train_ce']:.1f} of "
                 "the GPU-hours")
        lines.append(
            f"| LS reaches z-loss's perplexity with 1/20 of the GPU-hours | z-loss: held-out "
            f"{c['target']:.4f} (ppl {math.exp(c['target']):.4f}) at step {c['zl_step']:,} after "
            f"{c['zl_gpu_hours']:.3f} GPU-hours; {reach}. On the training cross-entropy "
            f"(z-loss {c['zl_train_ce']:.4f}, last {window} steps): {train} | {verdict} |")
    checks = {v: method_check(r, window) for v, r in runs.items()}
    checks = {v: x for v, x in checks.items() if x is not None}
    lines += [""]
    if checks:
        lines.append("Method check (the ratio estimate applied to a run with held-out points "
                     "during training, largest error over them): " + ", ".join(
                         f"{v} {x:.4f} nats/byte" for v, x in checks.items()) + ".")
    lines += [f"Note: {n}." for n in notes]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", help="results.json files of experiments.paper_batch")
    parser.add_argument("--out", help="write the markdown here too")
    args = parser.parse_args(argv)
    try:
        runs, notes = load_runs(args.results)
    except (ValueError, FileNotFoundError, KeyError) as e:
        parser.error(f"results: {e}")
    text = verdict_markdown(runs, notes)
    sys.stdout.write(text)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
