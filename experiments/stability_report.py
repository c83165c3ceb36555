"""The stability experiment's report: per-variant summary table (markdown) and plot (PNG)."""

from __future__ import annotations

import math
import os

import numpy as np

from ls_jax.metrics import read_jsonl
from ls_jax.rundir import RunDir

SPIKE_FACTOR = 1.5  # a spike: loss > 1.5x the running median of the preceding losses
SPIKE_WINDOW = 50  # logged steps in that running median


def count_spikes(losses: list[float], factor: float = SPIKE_FACTOR, window: int = SPIKE_WINDOW) -> int:
    """Logged steps whose loss exceeds ``factor`` x the median of the ``window`` before them."""
    spikes = 0
    for i in range(1, len(losses)):
        ref = float(np.median(losses[max(0, i - window):i]))
        if not math.isfinite(losses[i]) or losses[i] > factor * ref:
            spikes += 1
    return spikes


def summarize(records: list[dict], status: dict) -> dict:
    """Final/peak numbers of one variant from its metrics.jsonl records."""
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval/loss" in r]
    if not train:
        return {"steps": 0, "state": status.get("state", "not started")}
    losses = [r["loss"] for r in train]
    logits = [r["max_abs_logit"] for r in train]
    tail = losses[-max(1, len(losses) // 20):]
    best = min(float(np.median(losses[max(0, i - 10):i + 1])) for i in range(len(losses)))
    diverged = status.get("state") == "diverged" or float(np.median(tail)) > 1.5 * best
    out = {
        "steps": train[-1]["step"],
        "state": status.get("state", "?"),
        "final_train_loss": losses[-1],
        "final_max_abs_logit": logits[-1],
        "peak_max_abs_logit": max(logits),
        "peak_step": train[int(np.argmax(logits))]["step"],
        "final_lm_head_max_abs_logit": train[-1]["lm_head_max_abs_logit"],
        "spikes": count_spikes(losses),
        "diverged": bool(diverged),
        "tokens_per_sec": float(np.median([r["tokens_per_sec"] for r in train])),
    }
    if evals:
        out["final_val_loss"] = evals[-1]["eval/loss"]
        out["final_val_ppl"] = evals[-1]["eval/perplexity"]
        out["val_step"] = evals[-1]["step"]
    return out


def results_table(summaries: dict[str, dict]) -> str:
    header = ("| variant | state | steps | final train loss | final val loss (ppl) | "
              "max abs logit: end | peak (step) | lm-head max abs logit | spikes | diverged |")
    lines = [header, "|" + "---|" * 10]
    for name, s in summaries.items():
        if not s.get("steps"):
            lines.append(f"| {name} | {s['state']} | 0 | | | | | | | |")
            continue
        val = (f"{s['final_val_loss']:.4f} ({s['final_val_ppl']:.3f}) @ {s['val_step']}"
               if "final_val_loss" in s else "n/a")
        lines.append(
            f"| {name} | {s['state']} | {s['steps']} | {s['final_train_loss']:.4f} | {val} | "
            f"{s['final_max_abs_logit']:.2f} | {s['peak_max_abs_logit']:.2f} ({s['peak_step']}) | "
            f"{s['final_lm_head_max_abs_logit']:.2f} | {s['spikes']} | "
            f"{'yes' if s['diverged'] else 'no'} |")
    return "\n".join(lines)


def plot(out: str, series: dict[str, list[dict]]) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_logit, ax_loss) = plt.subplots(1, 2, figsize=(13, 4.5))
    for name, records in series.items():
        train = [r for r in records if "loss" in r]
        if not train:
            continue
        steps = [r["step"] for r in train]
        line, = ax_logit.plot(steps, [r["max_abs_logit"] for r in train], label=name)
        ax_loss.plot(steps, [r["loss"] for r in train], color=line.get_color(), alpha=0.8,
                     label=f"{name} train")
        evals = [r for r in records if "eval/loss" in r]
        if evals:
            ax_loss.plot([r["step"] for r in evals], [r["eval/loss"] for r in evals], "o--",
                         color=line.get_color(), label=f"{name} val")
    ax_logit.set(xlabel="step", ylabel="max |pre-softmax logit| (max over layers, heads)",
                 title="attention logit growth", yscale="log")
    ax_loss.set(xlabel="step", ylabel="loss (nats/token)", title="training / validation loss")
    for ax in (ax_logit, ax_loss):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = os.path.join(out, "stability.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(out: str, variants, statuses: dict[str, dict], base_cfg) -> dict[str, dict]:
    os.makedirs(out, exist_ok=True)
    series = {v: read_jsonl(RunDir(os.path.join(out, v)).metrics_path) for v in variants}
    summaries = {v: summarize(series[v], statuses.get(v, {})) for v in variants}
    plot(out, series)
    m, d, t = base_cfg.model, base_cfg.data, base_cfg.train
    text = [
        f"# Stability experiment: {base_cfg.name}",
        "",
        f"Model {m.n_layer}L, {m.n_head} heads x {m.head_dim}, d={m.d_model}, LS = "
        f"{m.n_global_heads} global + {m.n_head - m.n_global_heads} local (p={m.window}); "
        f"T={d.seq_len}, batch {t.batch_size}, lr {t.lr} (warmup {t.warmup_steps}, cosine to "
        f"{t.min_lr} over {t.num_steps} steps), data {d.source} / {d.tokenizer}.",
        f"Spike: loss > {SPIKE_FACTOR}x the median of the previous {SPIKE_WINDOW} logged losses. "
        "Diverged: a non-finite loss stopped training, or the median loss of the last 5% of steps "
        "is > 1.5x the best running median.",
        "",
        results_table(summaries),
        "",
        "![stability](stability.png)",
    ]
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write("\n".join(text) + "\n")
    return summaries
