"""The paper's batch size on every visible GPU: LS, MHSA and its stabilisers at 524K tokens
per step.

    python -m experiments.paper_batch --out OUT --variants mhsa_qknorm,mhsa_zloss \
        --max-steps 10430 --time-budget-s 560                           # 4 GPUs, < 10 minutes
    XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu \
        python -m experiments.paper_batch --out OUT --smoke             # CPU, 4 fake devices

Each variant is the paper's config (``ls_jax.configs`` paper / paper_mhsa / paper_qknorm /
paper_zloss) with byte tokens: 256 x 2048 tokens per step, AdamW lr 6e-4, 2000 warmup steps,
then cosine to 6e-5 over the paper's 50k-step horizon, bf16, seed 0. The run is data-parallel
over all visible devices (a mesh with one "data" axis, the batch split over it, parameters
replicated); the model's attention runs per shard (kernels/sharded.py; ``attention_path`` in
the results says which path ran).

The variants of one call train together, in rounds: each round runs every variant
``eval_every`` steps (1000 on GPU) on the same batches in the same order, then measures its
held-out loss. The run ends at ``--max-steps`` (the schedule is the paper's, cut short) or when
the time budget (``--time-budget-s``, from the start of the call to its written report, compile
included) has no room for another round; the last round is cut to the steps that fit at the
pace of the one before, so every variant stops at the same step (state "stopped" when short of
the target). results.json is rewritten after every round, so a call killed from outside still
leaves every finished round, its variants marked "running".

Data: a byte corpus of the machine's text (``experiments.byte_corpus``; the GPU preset reads
source "offline": the standard library's and the installed packages' sources and docs and
/usr/share/doc, each content once; ``--corpus`` picks another source), 1% of the files held
out. The results give the corpus report (files and tokens per split, duplicates dropped) and
each variant's tokens and epochs (passes over the training split); a call that would add
variants trained on another corpus to OUT is refused.

Outputs in OUT: ``results.json`` (settings, corpus, per-variant summary, per-step loss,
cross-entropy and max |logit|, the held-out loss of every round, the [layer][head] max |logit|
table every 10 steps), ``results.md`` and ``paper_batch.png``. A variant already in
OUT/results.json (same settings) is not rerun, unless it is marked "running".
Spikes and divergence follow ``experiments.rules``; ``experiments.stability_report`` writes
docs/stability.md, the verdict on the paper's claims, from the results.json files there.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import numpy as np

from experiments.byte_corpus import SOURCES, WindowSampler, build_corpus, summary_line
from experiments.rules import TAIL_FRACTION, blew_up, count_spikes
from experiments.runner import (Program, RunRecord, data_mesh, run_steps,
                                sharded_attention_available, variant_config)
from experiments import results_dir
from experiments.variants import VARIANTS

TABLE_EVERY = 10
# the end of a call after its last round (results.json, results.md, the plot) takes less
REPORT_RESERVE_S = 15.0
# a round planned at the last round's pace still ends before the deadline if the pace slows 3%
PACE_MARGIN = 0.97

PRESETS = {
    "gpu": {"overrides": [], "corpus": "offline", "max_corpus_mb": None,
            "validation_percent": 1, "eval_batches": 4, "eval_every": 1000,
            "time_budget_s": 560.0, "fetch_every": 10},
    "smoke": {"overrides": ["model.n_layer=1", "model.d_model=48", "model.head_dim=8",
                            "model.window=8", "model.max_seq_len=64",
                            "data.seq_len=64", "model.compute_dtype=float32",
                            "train.batch_size=8", "train.num_steps=6", "train.warmup_steps=2"],
              "corpus": "stdlib", "max_corpus_mb": 2, "validation_percent": 2,
              "eval_batches": 2, "eval_every": 2, "time_budget_s": None, "fetch_every": 2},
}


def settings_of(preset_name: str, variants, max_steps, seed: int, corpus_mb,
                corpus: str) -> dict:
    preset = PRESETS[preset_name]
    cfgs = {v: variant_config(v, [*preset["overrides"], f"train.seed={seed}"]) for v in VARIANTS}
    return {"preset": preset_name, "seed": seed, "max_steps": max_steps,
            "corpus": {"source": corpus, "max_mb": corpus_mb,
                       "validation_percent": preset["validation_percent"]},
            "eval_batches": preset["eval_batches"], "eval_every": preset["eval_every"],
            "configs": {v: c.to_dict() for v, c in cfgs.items()}}


def _r(x, digits=5):
    return float(f"{x:.{digits}g}") if x is not None and math.isfinite(x) else x


def variant_summary(rec, eval_loss, sampler, cfg, compile_s, full: bool = True) -> dict:
    """The summary of one variant's run; ``full=False`` leaves out the spike count and the
    divergence rule (None and the record's state), which scan every step."""
    losses = rec.loss
    n_tail = max(1, int(len(losses) * TAIL_FRACTION))
    finite = [(i + 1, x) for i, x in enumerate(rec.max_abs_logit) if math.isfinite(x)]
    peak_step, peak = max(finite, key=lambda t: t[1]) if finite else (None, None)
    table = rec.attn_max_abs_logit_tables[-1][1] if rec.attn_max_abs_logit_tables else None
    top = None
    if table is not None:
        t = np.asarray(table)
        layer, head = np.unravel_index(int(np.nanargmax(t)), t.shape)
        top = {"layer": int(layer), "head": int(head), "value": _r(float(t[layer, head]))}
    tokens = rec.steps * cfg.train.batch_size * cfg.data.seq_len
    return {
        "state": rec.state, "steps": rec.steps, "tokens": tokens,
        "epochs": round(sampler.epochs(rec.steps), 3),
        "lr_at_end": _r(rec.lr[-1]) if rec.lr else None,
        "final_train_loss": _r(float(np.mean(losses[-n_tail:]))) if losses else None,
        "final_train_ce": _r(float(np.mean(rec.ce[-n_tail:]))) if rec.ce else None,
        "final_eval_loss": _r(eval_loss),
        "final_max_abs_logit": _r(finite[-1][1]) if finite else None,
        "peak_max_abs_logit": _r(peak), "peak_step": peak_step,
        "final_max_abs_logit_per_layer": None if table is None else [_r(max(r)) for r in table],
        "final_top_head": top,
        "final_lm_head_max_abs_logit": _r(rec.lm_head_max_abs_logit[-1]) if rec.lm_head_max_abs_logit else None,
        "spikes": (count_spikes(losses) if losses else 0) if full else None,
        "diverged": bool(rec.state == "diverged" or (full and losses and blew_up(losses))),
        "diverged_at": rec.diverged_at,
        "tokens_per_sec": round(rec.tokens_per_sec), "train_seconds": round(rec.seconds, 1),
        "compile_seconds": round(compile_s, 1),
    }


def next_round(done: int, target: int, eval_every: int, seconds_left: float | None = None,
               seconds_per_step: float | None = None) -> int:
    """Steps every variant runs in the next round: to the next multiple of ``eval_every`` or to
    ``target``, cut to what fits in ``seconds_left`` at ``seconds_per_step`` (the last round's
    wall time per step, all variants and their evaluations together; None before the first
    round). 0: nothing fits."""
    n = min(eval_every - done % eval_every, target - done)
    if seconds_left is not None and seconds_per_step:
        n = min(n, max(0, int(seconds_left * PACE_MARGIN / seconds_per_step)))
    return max(0, n)


CORPUS_IDENTITY = ("source", "train_tokens", "validation_tokens", "train_files")


def check_same_corpus(out: str, results: dict, built: dict) -> None:
    """Refuses to add variants to ``results`` whose kept variants trained on another corpus
    (another machine's packages, or a corpus of an earlier rule)."""
    old = results.get("corpus")
    if not old or not results["variants"]:
        return
    was = {k: old.get(k) for k in CORPUS_IDENTITY}
    now = {k: built.get(k) for k in CORPUS_IDENTITY}
    if was != now:
        raise ValueError(f"out: {out} holds variants trained on another corpus ({was}); this "
                         f"machine builds {now}. Use a new --out")


def variants_to_run(results: dict, variants) -> list[str]:
    """The variants of ``variants`` that ``results`` lacks or holds only as the snapshot of a
    call that did not end (state "running"; there is no state to resume from, so they rerun)."""
    return [v for v in variants if results["variants"].get(v, {}).get("state") in (None, "running")]


def run(out: str, preset_name: str = "smoke", variants=("ls", "mhsa"), *,
        time_budget_s: float | None = None, max_steps: int | None = None, seed: int = 0,
        corpus_mb: int | None = None, corpus: str | None = None, corpus_cache: str | None = None,
        log=print) -> dict:
    """Trains ``variants`` in rounds (each round: every variant ``eval_every`` steps on the same
    batches, then its held-out loss), so that they all stop at the same step; a time budget
    (from this call's start to its written report) cuts the last round to what fits."""
    import jax

    t_start = time.time()
    if preset_name not in PRESETS:
        raise ValueError(f"preset: expected one of {tuple(PRESETS)}, got {preset_name!r}")
    bad = [v for v in variants if v not in VARIANTS]
    if bad or not variants or len(set(variants)) != len(variants):
        raise ValueError(f"variants: expected distinct names from {VARIANTS}, got {list(variants)}")
    if max_steps is not None and (not isinstance(max_steps, int) or max_steps < 1):
        raise ValueError(f"max_steps: expected an int >= 1, got {max_steps!r}")
    preset = PRESETS[preset_name]
    if time_budget_s is None:
        time_budget_s = preset["time_budget_s"]
    if time_budget_s is not None and not time_budget_s > REPORT_RESERVE_S:
        raise ValueError(f"time_budget_s: expected more than the {REPORT_RESERVE_S:g} s the "
                         f"report needs, got {time_budget_s}")
    if corpus_mb is None:
        corpus_mb = preset["max_corpus_mb"]
    source = preset["corpus"] if corpus is None else corpus
    if source not in SOURCES:
        raise ValueError(f"corpus: expected one of {SOURCES}, got {source!r}")
    settings = settings_of(preset_name, variants, max_steps, seed, corpus_mb, source)
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "results.json")
    results = {"settings": settings, "variants": {}, "series": {}}
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
        if old.get("settings") != settings:
            raise ValueError(f"out: {out} holds a run with other settings; use a new --out")
        results = old
    todo = variants_to_run(results, variants)
    deadline = None if time_budget_s is None else t_start + time_budget_s - REPORT_RESERVE_S
    if todo:
        for v in todo:
            results["variants"].pop(v, None)
            results["series"].pop(v, None)
        corpus = build_corpus(source, validation_percent=preset["validation_percent"],
                              max_bytes=None if corpus_mb is None else corpus_mb * 2**20,
                              cache_dir=corpus_cache)
        check_same_corpus(out, results, corpus.describe())
        results["corpus"] = corpus.describe()
        mesh = data_mesh()
        results["device"] = {"kind": jax.devices()[0].device_kind, "count": jax.device_count(),
                             "platform": jax.default_backend()}
        results["attention_path"] = ("per shard (kernels/sharded.py)" if sharded_attention_available()
                                     else "gathered: every device runs the kernel on the whole batch")
        log(f"corpus: {json.dumps(corpus.describe())}")
        log(f"devices: {results['device']}; attention {results['attention_path']}")
        _train_together(results, todo, preset, corpus, mesh, seed, max_steps, deadline, path, log)
    write_report(out, results)
    log(f"done in {time.time() - t_start:.0f}s: {out}/results.md, {out}/paper_batch.png")
    return results


def _train_together(results, todo, preset, corpus, mesh, seed, max_steps, deadline, path, log):
    """Compiles every variant of ``todo``, then trains them round by round (``next_round``)."""
    cfgs, programs, samplers, evals, compile_s = {}, {}, {}, {}, {}
    for v in todo:
        cfg = cfgs[v] = variant_config(v, [*preset["overrides"], f"train.seed={seed}"])
        samplers[v] = WindowSampler(corpus.train_N, seq_len=cfg.data.seq_len,
                                    batch_size=cfg.train.batch_size, seed=seed)
        evals[v] = WindowSampler(corpus.validation_N, seq_len=cfg.data.seq_len,
                                 batch_size=cfg.train.batch_size, seed=seed
                                 ).fixed_batches(preset["eval_batches"])
        programs[v] = Program(cfg, mesh)
        compile_s[v] = programs[v].compile()
        log(f"== {v}: compiled in {compile_s[v]:.1f}s; {cfg.model.window_sizes} "
            f"qk_norm={cfg.model.qk_norm} z_loss={cfg.train.z_loss}; "
            f"{cfg.train.batch_size} x {cfg.data.seq_len} tokens per step")
    num_steps = {cfgs[v].train.num_steps for v in todo}
    if len(num_steps) != 1:
        raise ValueError(f"variants: expected one schedule length, got {sorted(num_steps)}")
    target = num_steps.pop() if max_steps is None else min(max_steps, *num_steps)
    states = {v: programs[v].init() for v in todo}
    records = {v: RunRecord() for v in todo}
    curves = {v: [] for v in todo}  # [step, held-out loss]
    eval_s = {v: 0.0 for v in todo}
    active, done, pace, cut = list(todo), 0, None, False
    while active and done < target and not cut:
        left = None if deadline is None else deadline - time.time()
        n = next_round(done, target, preset["eval_every"], left, pace)
        if n < 1:
            cut = True
            break
        cut = n < min(preset["eval_every"] - done % preset["eval_every"], target - done)
        t_round = time.time()
        for v in list(active):
            def vlog(msg, v=v):
                log(f"{v} {msg}")
            states[v], chunk = run_steps(programs[v], states[v], samplers[v], cfgs[v].train.lr, n,
                                         fetch_every=preset["fetch_every"],
                                         table_every=TABLE_EVERY, stop_at=deadline, log=vlog,
                                         log_every=100)
            records[v].extend(chunk)
            if chunk.state != "finished":  # diverged, or the deadline despite the plan
                active.remove(v)
            if chunk.state != "diverged":
                t_eval = time.time()
                curves[v].append([records[v].steps,
                                  _r(programs[v].evaluate(states[v], evals[v]))])
                eval_s[v] += time.time() - t_eval
        done += n
        pace = (time.time() - t_round) / n
        log(f"== round to step {done}: " + "; ".join(
            f"{v} held-out {curves[v][-1][1] if curves[v] else 'nan'}" for v in todo)
            + f"; {pace:.3f}s per step for all"
            + ("" if deadline is None else f"; {deadline - time.time():.0f}s left"))
        for v in todo:  # a snapshot, in case the call is killed before the next one
            _record(results, v, records[v], curves[v], samplers[v], cfgs[v], compile_s[v],
                    eval_s[v], target, "running", full=False)
        _write_json(path, results)
    for v in todo:
        state = records[v].state
        if state == "finished" and records[v].steps < target:
            state = "stopped"  # the time budget's cut: the same step for every variant
        _record(results, v, records[v], curves[v], samplers[v], cfgs[v], compile_s[v],
                eval_s[v], target, state)
        log(f"== {v}: {json.dumps(results['variants'][v])}")
        del states[v], programs[v]
    _write_json(path, results)


def _record(results, v, rec, curve, sampler, cfg, compile_s, eval_s, target, state,
            full: bool = True):
    """Puts variant ``v``'s summary (in ``state``) and series into ``results``."""
    eval_loss = curve[-1][1] if curve and rec.state != "diverged" else float("nan")
    summary = variant_summary(rec, eval_loss, sampler, cfg, compile_s, full)
    summary.update(state=state, target_steps=target,
                   final_eval_step=curve[-1][0] if curve else None, eval_seconds=round(eval_s, 1))
    results["variants"][v] = summary
    results["series"][v] = {
        "loss": [_r(x, 4) for x in rec.loss],
        "ce": [_r(x, 4) for x in rec.ce],
        "eval": curve,
        "max_abs_logit": [_r(x, 4) for x in rec.max_abs_logit],
        "lm_head_max_abs_logit": [_r(x, 4) for x in rec.lm_head_max_abs_logit],
        "grad_norm": [_r(x, 3) for x in rec.grad_norm],
        "lr": [_r(x, 4) for x in rec.lr],
        "attn_max_abs_logit_tables": [[s, [[_r(x, 4) for x in row] for row in t]]
                                      for s, t in rec.attn_max_abs_logit_tables],
    }


def _write_json(path, results):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(results, f, allow_nan=True)
    os.replace(tmp, path)


def write_report(out: str, results: dict) -> None:
    _write_json(os.path.join(out, "results.json"), results)
    settings, corpus = results["settings"], results.get("corpus", {})
    cfg = settings["configs"]["ls"]
    m, t = cfg["model"], cfg["train"]
    dev = results.get("device", {})
    lines = [
        "# The paper's batch size: " + ", ".join(results["variants"]),
        "",
        f"Device: {dev.get('count', '?')} x {dev.get('kind', '?')}; attention "
        f"{results.get('attention_path', '?')}.",
        f"Model {m['n_layer']}L, {m['n_head']} heads x {m['head_dim']}, d={m['d_model']}, "
        f"{m['compute_dtype']}; {t['batch_size']} x {cfg['data']['seq_len']} = "
        f"{t['batch_size'] * cfg['data']['seq_len']:,} tokens per step; AdamW lr {t['lr']}, "
        f"warmup {t['warmup_steps']}, cosine to {t['min_lr']} at step {t['num_steps']} "
        f"(cut short by the step cap or the time budget); seed {t['seed']}.",
        summary_line(corpus)[:-1] + f"; {settings['eval_batches']} batches for the held-out loss"
        + (f", measured every {settings['eval_every']} steps and at the end."
           if "eval_every" in settings else ", measured at the end."),
        "State: finished (all target steps), stopped (time: the variants of one call stop at the "
        "same step), diverged (non-finite loss), running (a snapshot of a call that did not end).",
        "",
        "| variant | state | steps (target) | tokens | epochs | lr at end | final train loss "
        "(cross-entropy) | held-out loss, ppl (step) | max abs logit: end | peak (step) | "
        "top head end (layer, head) | lm-head max abs logit | spikes | diverged | tokens/s |",
        "|" + "---|" * 15,
    ]
    for v, s in results["variants"].items():
        top = s["final_top_head"]
        ce = s.get("final_train_ce")
        ce_txt = "" if ce is None or ce == s["final_train_loss"] else f" ({ce})"
        held = s["final_eval_loss"]
        held_txt = (f"{held} ({math.exp(held):.4g}) ({s.get('final_eval_step', s['steps']):,})"
                    if held is not None and math.isfinite(held) else f"{held}")
        lines.append(
            f"| {v} | {s['state']} | {s['steps']:,} ({s.get('target_steps') or '—'}) | "
            f"{s['tokens'] / 1e9:.2f}B | {s['epochs']} | "
            f"{s['lr_at_end']} | {s['final_train_loss']}"
            f"{ce_txt} | {held_txt} | "
            f"{s['final_max_abs_logit']} | {s['peak_max_abs_logit']} ({s['peak_step']}) | "
            f"{'—' if top is None else '{value} ({layer}, {head})'.format(**top)} | "
            f"{s['final_lm_head_max_abs_logit']} | {s['spikes']} | "
            f"{'yes' if s['diverged'] else 'no'} | {s['tokens_per_sec'] / 1e6:.2f}M |")
    lines += ["", "Max |logit| per layer at the end:", ""]
    for v, s in results["variants"].items():
        lines.append(f"- {v}: {s['final_max_abs_logit_per_layer']}")
    curves = {v: s["eval"] for v, s in results["series"].items() if s.get("eval")}
    if curves:
        lines += ["", "Held-out loss (nats/byte) during training:", "",
                  "| step | " + " | ".join(curves) + " |", "|---|" + "---|" * len(curves)]
        by_step = {}
        for v, curve in curves.items():
            for step, loss in curve:
                by_step.setdefault(step, {})[v] = loss
        for step in sorted(by_step):
            lines.append(f"| {step:,} | " + " | ".join(
                str(by_step[step].get(v, "")) for v in curves) + " |")
    lines += ["", "![paper batch](paper_batch.png)", ""]
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write("\n".join(lines))
    plot(out, results)


def plot(out: str, results: dict) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_logit, ax_layer) = plt.subplots(1, 3, figsize=(17, 4.8))
    for i, (v, s) in enumerate(results["series"].items()):
        color = f"C{i}"
        steps = np.arange(1, len(s["loss"]) + 1)
        loss = np.asarray(s.get("ce") or s["loss"], np.float64)  # without the z-loss term
        ax_loss.plot(steps, loss, color=color, alpha=0.35, lw=0.6)
        k = min(25, len(loss))
        if k > 1:
            smooth = np.convolve(loss, np.ones(k) / k, mode="valid")
            ax_loss.plot(steps[k - 1:], smooth, color=color, label=f"{v} ({k}-step mean)")
        else:
            ax_loss.plot(steps, loss, color=color, label=v)
        if s.get("eval"):
            ax_loss.plot(*zip(*s["eval"]), color=color, marker="o", ls="--", ms=3,
                         label=f"{v} held-out")
        ax_logit.plot(steps, s["max_abs_logit"], color=color, label=f"{v} attention")
        ax_logit.plot(steps, s["lm_head_max_abs_logit"], color=color, ls=":", label=f"{v} lm head")
        tables = s["attn_max_abs_logit_tables"]
        if tables:
            t_steps = [x[0] for x in tables]
            per_layer = np.asarray([[max(row) for row in x[1]] for x in tables])
            for layer in range(per_layer.shape[1]):
                ax_layer.plot(t_steps, per_layer[:, layer], color=color,
                              marker="o" if len(t_steps) < 20 else None,
                              alpha=0.35 + 0.65 * layer / max(1, per_layer.shape[1] - 1),
                              label=f"{v} layer {layer}")
    ax_loss.set(xlabel="step", ylabel="cross-entropy (nats/byte)", title="loss")
    ax_logit.set(xlabel="step", ylabel="max |logit|", yscale="log", title="max |logit|")
    ax_layer.set(xlabel="step", ylabel="max |attention logit| of the layer", yscale="log",
                 title="per layer (lighter: earlier layer)")
    for ax in (ax_loss, ax_logit, ax_layer):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, ncol=2 if ax is ax_layer else 1)
    fig.tight_layout()
    path = os.path.join(out, "paper_batch.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=results_dir, help="output directory")
    parser.add_argument("--preset", default="gpu", choices=tuple(PRESETS))
    parser.add_argument("--smoke", action="store_true", help="same as --preset smoke (CPU)")
    parser.add_argument("--variants", default="ls,mhsa",
                        help=f"comma-separated subset of {','.join(VARIANTS)}")
    parser.add_argument("--time-budget-s", type=float, default=None,
                        help="seconds from the start of the run to its written report; the last "
                             "round is cut so that every variant stops at the same step "
                             "(preset: 560 on GPU, none on CPU)")
    parser.add_argument("--max-steps", type=int, default=None,
                        help="stop every variant after this many steps (the schedule is unchanged)")
    parser.add_argument("--corpus", default=None, choices=SOURCES,
                        help="the byte corpus (experiments.byte_corpus; default: the preset's)")
    parser.add_argument("--corpus-mb", type=int, default=None,
                        help="cap the corpus at this many MB (default: the whole preset corpus)")
    parser.add_argument("--corpus-cache", default=None, metavar="DIR",
                        help="load the corpus from DIR if it holds it, else build it and save it there")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--report-only", action="store_true",
                        help="only redraw results.md and paper_batch.png from OUT/results.json")
    args = parser.parse_args(argv)
    variants = tuple(v.strip() for v in args.variants.split(",") if v.strip())
    try:
        if args.report_only:
            with open(os.path.join(args.out, "results.json")) as f:
                write_report(args.out, json.load(f))
            return 0
        run(args.out, "smoke" if args.smoke else args.preset, variants,
            time_budget_s=args.time_budget_s, max_steps=args.max_steps,
            seed=args.seed, corpus_mb=args.corpus_mb, corpus=args.corpus,
            corpus_cache=args.corpus_cache)
    except (ValueError, FileNotFoundError) as e:
        parser.error(str(e))
    return 0


if __name__ == "__main__":
    sys.exit(main())
