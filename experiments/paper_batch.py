"""The paper's batch size on every visible GPU: LS vs MHSA at 524K tokens per step.

    python -m experiments.paper_batch --out OUT                         # 4 GPUs, ~6 minutes
    XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu \\
        python -m experiments.paper_batch --out OUT --smoke             # CPU, 4 fake devices

Each variant is the paper's config (``ls_jax.configs`` paper / paper_mhsa / paper_qknorm /
paper_zloss) with byte tokens: 256 x 2048 tokens per step, AdamW lr 6e-4, 2000 warmup steps,
then cosine to 6e-5 over the paper's 50k-step horizon, bf16, seed 0. The run is data-parallel
over all visible devices (a mesh with one "data" axis, the batch split over it, parameters
replicated); the model's attention runs per shard (kernels/sharded.py; ``attention_path`` in
the results says which path ran). Each variant trains for ``--time-per-variant-s`` seconds after its compile (or
``--max-steps``), on the same batches in the same order; the schedule is the paper's, cut short.

Data: every ``.py`` file of the standard library and the installed packages of the machine
(``experiments.byte_corpus``, source "python"), 1% of the files held out; the results report
the corpus size and how many epochs each variant saw.

Outputs in OUT: ``results.json`` (settings, corpus, per-variant summary, per-step loss and max
|logit|, the [layer][head] max |logit| table every 10 steps), ``results.md`` and
``paper_batch.png``. A variant already in OUT/results.json (same settings) is not rerun.
Spikes and divergence follow docs/stability.md (``experiments.lr_sweep.blew_up``,
``count_spikes``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import numpy as np

from experiments.byte_corpus import WindowSampler, build_corpus
from experiments.lr_sweep import TAIL_FRACTION, blew_up
from experiments.stability_report import count_spikes
from experiments.runner import (VARIANTS, Program, data_mesh, run_steps,
                                sharded_attention_available, variant_config)

TABLE_EVERY = 10

PRESETS = {
    "gpu": {"overrides": [], "corpus": "python", "max_corpus_mb": None,
            "validation_percent": 1, "eval_batches": 4, "time_per_variant_s": 120.0,
            "fetch_every": 10},
    "smoke": {"overrides": ["model.n_layer=1", "model.d_model=48", "model.head_dim=8",
                            "model.window=8", "model.max_seq_len=64",
                            "data.seq_len=64", "model.compute_dtype=float32",
                            "train.batch_size=8", "train.num_steps=6", "train.warmup_steps=2"],
              "corpus": "stdlib", "max_corpus_mb": 2, "validation_percent": 2,
              "eval_batches": 2, "time_per_variant_s": None, "fetch_every": 2},
}


def settings_of(preset_name: str, variants, max_steps, seed: int, corpus_mb) -> dict:
    preset = PRESETS[preset_name]
    cfgs = {v: variant_config(v, [*preset["overrides"], f"train.seed={seed}"]) for v in VARIANTS}
    return {"preset": preset_name, "seed": seed, "max_steps": max_steps,
            "corpus": {"source": preset["corpus"], "max_mb": corpus_mb,
                       "validation_percent": preset["validation_percent"]},
            "eval_batches": preset["eval_batches"],
            "configs": {v: c.to_dict() for v, c in cfgs.items()}}


def _r(x, digits=5):
    return float(f"{x:.{digits}g}") if x is not None and math.isfinite(x) else x


def variant_summary(rec, eval_loss, sampler, cfg, compile_s) -> dict:
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
        "final_eval_loss": _r(eval_loss),
        "final_max_abs_logit": _r(finite[-1][1]) if finite else None,
        "peak_max_abs_logit": _r(peak), "peak_step": peak_step,
        "final_max_abs_logit_per_layer": None if table is None else [_r(max(r)) for r in table],
        "final_top_head": top,
        "final_lm_head_max_abs_logit": _r(rec.lm_head_max_abs_logit[-1]) if rec.lm_head_max_abs_logit else None,
        "spikes": count_spikes(losses) if losses else 0,
        "diverged": bool(rec.state == "diverged" or (losses and blew_up(losses))),
        "diverged_at": rec.diverged_at,
        "tokens_per_sec": round(rec.tokens_per_sec), "train_seconds": round(rec.seconds, 1),
        "compile_seconds": round(compile_s, 1),
    }


def run(out: str, preset_name: str = "smoke", variants=("ls", "mhsa"), *,
        time_per_variant_s: float | None = None, max_steps: int | None = None, seed: int = 0,
        corpus_mb: int | None = None, log=print) -> dict:
    import jax

    if preset_name not in PRESETS:
        raise ValueError(f"preset: expected one of {tuple(PRESETS)}, got {preset_name!r}")
    bad = [v for v in variants if v not in VARIANTS]
    if bad or not variants:
        raise ValueError(f"variants: expected names from {VARIANTS}, got {list(variants)}")
    if max_steps is not None and (not isinstance(max_steps, int) or max_steps < 1):
        raise ValueError(f"max_steps: expected an int >= 1, got {max_steps!r}")
    preset = PRESETS[preset_name]
    if time_per_variant_s is None:
        time_per_variant_s = preset["time_per_variant_s"]
    if corpus_mb is None:
        corpus_mb = preset["max_corpus_mb"]
    settings = settings_of(preset_name, variants, max_steps, seed, corpus_mb)
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "results.json")
    results = {"settings": settings, "variants": {}, "series": {}}
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
        if old.get("settings") != settings:
            raise ValueError(f"out: {out} holds a run with other settings; use a new --out")
        results = old
    todo = [v for v in variants if v not in results["variants"]]
    t_start = time.time()
    if todo:
        corpus = build_corpus(preset["corpus"], validation_percent=preset["validation_percent"],
                              max_bytes=None if corpus_mb is None else corpus_mb * 2**20)
        results["corpus"] = corpus.describe()
        mesh = data_mesh()
        results["device"] = {"kind": jax.devices()[0].device_kind, "count": jax.device_count(),
                             "platform": jax.default_backend()}
        results["attention_path"] = ("per shard (kernels/sharded.py)" if sharded_attention_available()
                                     else "gathered: every device runs the kernel on the whole batch")
        log(f"corpus: {corpus.describe()}")
        log(f"devices: {results['device']}; attention {results['attention_path']}")
        for v in todo:
            cfg = variant_config(v, [*preset["overrides"], f"train.seed={seed}"])
            sampler = WindowSampler(corpus.train_N, seq_len=cfg.data.seq_len,
                                    batch_size=cfg.train.batch_size, seed=seed)
            evals = WindowSampler(corpus.validation_N, seq_len=cfg.data.seq_len,
                                  batch_size=cfg.train.batch_size, seed=seed
                                  ).fixed_batches(preset["eval_batches"])
            program = Program(cfg, mesh)
            compile_s = program.compile()
            log(f"== {v}: compiled in {compile_s:.1f}s; {cfg.model.window_sizes} "
                f"qk_norm={cfg.model.qk_norm} z_loss={cfg.train.z_loss}; "
                f"{cfg.train.batch_size} x {cfg.data.seq_len} tokens per step")
            steps = cfg.train.num_steps if max_steps is None else min(max_steps, cfg.train.num_steps)
            stop_at = None if time_per_variant_s is None else time.time() + time_per_variant_s
            state = program.init()
            state, rec = run_steps(program, state, sampler, cfg.train.lr, steps,
                                   fetch_every=preset["fetch_every"], table_every=TABLE_EVERY,
                                   stop_at=stop_at, log=log, log_every=100)
            eval_loss = (program.evaluate(state, evals) if rec.state != "diverged"
                         else float("nan"))
            del state, program
            summary = variant_summary(rec, eval_loss, sampler, cfg, compile_s)
            results["variants"][v] = summary
            results["series"][v] = {
                "loss": [_r(x, 4) for x in rec.loss],
                "max_abs_logit": [_r(x, 4) for x in rec.max_abs_logit],
                "lm_head_max_abs_logit": [_r(x, 4) for x in rec.lm_head_max_abs_logit],
                "grad_norm": [_r(x, 3) for x in rec.grad_norm],
                "lr": [_r(x, 4) for x in rec.lr],
                "attn_max_abs_logit_tables": [[s, [[_r(x, 4) for x in row] for row in t]]
                                              for s, t in rec.attn_max_abs_logit_tables],
            }
            log(f"== {v}: {json.dumps(summary)}")
            _write_json(path, results)
    write_report(out, results)
    log(f"done in {time.time() - t_start:.0f}s: {out}/results.md, {out}/paper_batch.png")
    return results


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
        "# The paper's batch size: LS vs MHSA",
        "",
        f"Device: {dev.get('count', '?')} x {dev.get('kind', '?')}; attention "
        f"{results.get('attention_path', '?')}.",
        f"Model {m['n_layer']}L, {m['n_head']} heads x {m['head_dim']}, d={m['d_model']}, "
        f"{m['compute_dtype']}; {t['batch_size']} x {cfg['data']['seq_len']} = "
        f"{t['batch_size'] * cfg['data']['seq_len']:,} tokens per step; AdamW lr {t['lr']}, "
        f"warmup {t['warmup_steps']}, cosine to {t['min_lr']} at step {t['num_steps']} "
        f"(cut short by the time budget); seed {t['seed']}.",
        f"Corpus: {corpus.get('train_files', '?')} .py files of "
        f"{'the standard library' if corpus.get('source') == 'stdlib' else 'the standard library and the installed packages'}"
        f", {corpus.get('train_tokens', 0) / 1e6:.1f}M byte tokens; "
        f"held out: {corpus.get('validation_files', '?')} files "
        f"({corpus.get('validation_tokens', 0) / 1e6:.2f}M tokens), "
        f"{settings['eval_batches']} batches for the final loss.",
        "",
        "| variant | state | steps | tokens | epochs | lr at end | final train loss | "
        "final held-out loss | max abs logit: end | peak (step) | top head end (layer, head) | "
        "lm-head max abs logit | spikes | diverged | tokens/s |",
        "|" + "---|" * 15,
    ]
    for v, s in results["variants"].items():
        top = s["final_top_head"]
        lines.append(
            f"| {v} | {s['state']} | {s['steps']:,} | {s['tokens'] / 1e9:.2f}B | {s['epochs']} | "
            f"{s['lr_at_end']} | {s['final_train_loss']} | {s['final_eval_loss']} | "
            f"{s['final_max_abs_logit']} | {s['peak_max_abs_logit']} ({s['peak_step']}) | "
            f"{'—' if top is None else '{value} ({layer}, {head})'.format(**top)} | "
            f"{s['final_lm_head_max_abs_logit']} | {s['spikes']} | "
            f"{'yes' if s['diverged'] else 'no'} | {s['tokens_per_sec'] / 1e6:.2f}M |")
    lines += ["", "Max |logit| per layer at the end:", ""]
    for v, s in results["variants"].items():
        lines.append(f"- {v}: {s['final_max_abs_logit_per_layer']}")
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
        loss = np.asarray(s["loss"], np.float64)
        ax_loss.plot(steps, loss, color=color, alpha=0.35, lw=0.6)
        k = min(25, len(loss))
        if k > 1:
            smooth = np.convolve(loss, np.ones(k) / k, mode="valid")
            ax_loss.plot(steps[k - 1:], smooth, color=color, label=f"{v} ({k}-step mean)")
        else:
            ax_loss.plot(steps, loss, color=color, label=v)
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
    ax_loss.set(xlabel="step", ylabel="training loss (nats/byte)", title="loss")
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
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--preset", default="gpu", choices=tuple(PRESETS))
    parser.add_argument("--smoke", action="store_true", help="same as --preset smoke (CPU)")
    parser.add_argument("--variants", default="ls,mhsa",
                        help=f"comma-separated subset of {','.join(VARIANTS)}")
    parser.add_argument("--time-per-variant-s", type=float, default=None,
                        help="training seconds per variant after its compile (preset: 120 on GPU)")
    parser.add_argument("--max-steps", type=int, default=None,
                        help="stop each variant after this many steps (the schedule is unchanged)")
    parser.add_argument("--corpus-mb", type=int, default=None,
                        help="cap the corpus at this many MB (default: the whole preset corpus)")
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
            time_per_variant_s=args.time_per_variant_s, max_steps=args.max_steps,
            seed=args.seed, corpus_mb=args.corpus_mb)
    except (ValueError, FileNotFoundError) as e:
        parser.error(str(e))
    return 0


if __name__ == "__main__":
    sys.exit(main())
