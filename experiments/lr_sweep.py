"""Learning-rate sensitivity: final loss against peak lr, one curve per attention variant.

    python -m experiments.lr_sweep --out OUT                    # GPU preset (one H100/H200)
    python -m experiments.lr_sweep --out OUT --preset smoke     # CPU, seconds
    python -m experiments.lr_sweep --out OUT --report-only      # redraw from OUT/points.jsonl

Every point trains the paper's model shape (``ls_jax.configs`` paper / paper_mhsa /
paper_qknorm / paper_zloss, byte tokens) from the same initialisation (seed), on the same
batches in the same order, for the same number of steps; only the peak lr differs (linear
warmup over 10% of the steps, cosine to peak / 10). One compiled step per variant serves every
lr (``experiments.runner``: the library's train step, the peak lr a value of its state). The
data is a byte corpus (``experiments.byte_corpus``; the GPU presets read ``offline``, the
machine's deduplicated text, and ``--corpus`` picks another source); the results give its
report and the epochs each point sees. A point is *diverged* when its loss or gradient norm
became non-finite (training stops there) or its loss blew up: the median of its last 5% of
step losses is > 1.5x its best 11-step running median. Its final loss is the cross-entropy on
held-out files.

Resumable: each finished point is one line of ``OUT/points.jsonl``; the same command skips the
points it holds and refuses an OUT made with other settings. Points run lr by lr (all variants
of one lr, then the next, in an order that spreads the lrs) so that a call stopped by
``--time-budget-s`` leaves curves that span the range. Each call rewrites ``results.json``,
``results.md`` and ``lr_sweep.png``.

On a machine with several GPUs, one process per variant can share one OUT (each with its own
``CUDA_VISIBLE_DEVICES`` and ``--variants``); their points append without interleaving, and a
final ``--report-only`` draws all of them.
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
from experiments.runner import Program, data_mesh, run_steps, variant_config
from experiments import results_dir
from experiments.variants import VARIANTS
from experiments.rules import BLOWUP_FACTOR, TAIL_FRACTION, blew_up, count_spikes

MARGIN_NATS = 0.05  # an lr is "within the margin" when its loss <= best loss + this


def log_spaced(lo: float, hi: float, n: int) -> list[float]:
    return [float(f"{x:.3g}") for x in np.geomspace(lo, hi, n)]


PRESETS = {
    # The paper's model at T=2048, 400 steps of 32 x 2048 tokens (26M tokens) per point, 7 lrs
    # x 4 variants = 28 points: about 4M tokens/s on an H200 (stability run 1) -> ~7 s a point,
    # ~4 compiles of ~30 s; ~6-7 minutes on one H100 in all.
    "gpu": {"overrides": ["model.max_seq_len=2048", "data.seq_len=2048"],
            "seq_len": 2048, "batch_size": 32, "steps": 400, "lrs": log_spaced(3e-4, 3e-2, 7),
            "corpus": "offline", "max_corpus_mb": None, "validation_percent": 1,
            "eval_batches": 8},
    # The issue's repeat at T=8192 (the same tokens per step and point); MHSA runs at about
    # 2.4M tokens/s there on an H200 (stability run 3): ~8-9 minutes. Not in this budget.
    "gpu_t8192": {"overrides": ["model.max_seq_len=8192", "data.seq_len=8192"],
                  "seq_len": 8192, "batch_size": 8, "steps": 400,
                  "lrs": log_spaced(3e-4, 3e-2, 7), "corpus": "offline", "max_corpus_mb": None,
                  "validation_percent": 1, "eval_batches": 8},
    "smoke": {"overrides": ["model.n_layer=1", "model.d_model=48", "model.head_dim=8",
                            "model.window=8", "model.max_seq_len=64",
                            "data.seq_len=64", "model.compute_dtype=float32"],
              "seq_len": 64, "batch_size": 4, "steps": 8, "lrs": [1e-3, 1e-2],
              "corpus": "stdlib", "max_corpus_mb": 2, "validation_percent": 2,
              "eval_batches": 2},
}


# -- settings and points ----------------------------------------------------------------------

def point_key(variant: str, lr: float) -> str:
    return f"{variant}@{lr:.6g}"


def sweep_configs(preset: dict, variants, steps: int, seed: int) -> dict:
    warmup = max(1, steps // 10)
    train = [f"train.batch_size={preset['batch_size']}", f"train.num_steps={steps}",
             f"train.warmup_steps={warmup}", "train.lr=1.0", "train.min_lr=0.1",
             f"train.seed={seed}"]
    return {v: variant_config(v, [*preset["overrides"], *train]) for v in variants}


def settings_of(preset_name: str, preset: dict, steps: int, seed: int, corpus: str) -> dict:
    """Everything a point's result depends on, besides its variant and lr."""
    cfgs = sweep_configs(preset, VARIANTS, steps, seed)
    return {"preset": preset_name, "steps": steps, "seed": seed,
            "seq_len": preset["seq_len"], "batch_size": preset["batch_size"],
            "corpus": {"source": corpus, "max_mb": preset["max_corpus_mb"],
                       "validation_percent": preset["validation_percent"]},
            "eval_batches": preset["eval_batches"],
            "peak_lr": "per point (train.lr=1.0 / min_lr=0.1 below is the unit schedule)",
            "configs": {v: c.to_dict() for v, c in cfgs.items()}}


def check_settings(out: str, settings: dict) -> None:
    path = os.path.join(out, "settings.json")
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
        old_core = {k: v for k, v in old.items() if k != "corpus_built"}
        if old_core != settings:
            diff = sorted(k for k in set(old_core) | set(settings) if old_core.get(k) != settings.get(k))
            raise ValueError(f"out: {out} holds a sweep with other settings (differs in {diff}); "
                             f"use a new --out or the same settings to resume")


def write_settings(out: str, settings: dict, corpus_desc: dict) -> None:
    path = os.path.join(out, "settings.json")
    old_built = None
    if os.path.exists(path):
        with open(path) as f:
            old_built = json.load(f).get("corpus_built")
    if old_built is not None:
        same = {k: old_built.get(k) for k in ("train_tokens", "validation_tokens", "train_files")}
        now = {k: corpus_desc.get(k) for k in same}
        if same != now:
            raise ValueError(f"out: {out} was swept on another corpus ({same}); this machine "
                             f"builds {now}. Use a new --out")
    _write_atomic(path, json.dumps({**settings, "corpus_built": old_built or corpus_desc}, indent=2))


def _write_atomic(path: str, text: str) -> None:
    """Whole-file replace (several sweep processes may share one OUT, see the docs)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def read_points(out: str) -> dict[str, dict]:
    path = os.path.join(out, "points.jsonl")
    points = {}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                if line.strip():
                    p = json.loads(line)
                    points[point_key(p["variant"], p["lr"])] = p
    return points


def append_point(out: str, point: dict) -> None:
    """One line, one O_APPEND write: processes sweeping other variants into the same OUT
    (one per GPU) do not interleave their lines."""
    data = (json.dumps(point, allow_nan=True) + "\n").encode()
    fd = os.open(os.path.join(out, "points.jsonl"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        written = os.write(fd, data)
        if written != len(data):
            raise OSError(f"points.jsonl: wrote {written} of {len(data)} bytes")
        os.fsync(fd)
    finally:
        os.close(fd)


# -- judging a run (the rules: experiments.rules) ---------------------------------------------

def spread_order(n: int) -> list[int]:
    """Indices 0..n-1 ordered so that every prefix spans the range: ends, middle, then halves."""
    if n <= 2:
        return list(range(n))
    order, seen = [0, n - 1], {0, n - 1}
    intervals = [(0, n - 1)]
    while len(order) < n:
        nxt = []
        for a, b in intervals:
            m = (a + b) // 2
            if m not in seen:
                order.append(m)
                seen.add(m)
            nxt += [(a, m), (m, b)]
        intervals = [(a, b) for a, b in nxt if b - a > 1]
        if not intervals:
            order += [i for i in range(n) if i not in seen]
            break
    return order


def _r(x: float, digits: int = 5):
    return float(f"{x:.{digits}g}") if math.isfinite(x) else x


def point_result(variant: str, lr: float, rec, eval_loss: float, compile_s: float | None) -> dict:
    losses = rec.loss
    n_tail = max(1, int(len(losses) * TAIL_FRACTION))
    finite_logits = [x for x in rec.max_abs_logit if math.isfinite(x)]
    diverged = rec.state == "diverged" or blew_up(losses)
    return {
        "variant": variant, "lr": lr, "state": rec.state, "steps": rec.steps,
        "diverged": bool(diverged), "diverged_at": rec.diverged_at,
        "final_eval_loss": None if rec.state == "diverged" else _r(eval_loss),
        "final_train_loss": _r(float(np.mean(losses[-n_tail:]))) if losses else None,
        "final_max_abs_logit": _r(finite_logits[-1]) if finite_logits else None,
        "peak_max_abs_logit": _r(max(finite_logits)) if finite_logits else None,
        "final_lm_head_max_abs_logit": _r(rec.lm_head_max_abs_logit[-1]) if rec.lm_head_max_abs_logit else None,
        "final_attn_max_abs_logit": rec.attn_max_abs_logit_tables[-1][1] if rec.attn_max_abs_logit_tables else None,
        "spikes": count_spikes(losses) if losses else 0,
        "tokens_per_sec": round(rec.tokens_per_sec), "seconds": round(rec.seconds, 2),
        "compile_seconds": None if compile_s is None else round(compile_s, 1),
        "loss": [_r(x, 4) for x in losses],
        "max_abs_logit": [_r(x, 4) for x in rec.max_abs_logit],
        "grad_norm": [_r(x, 3) for x in rec.grad_norm],
    }


# -- the sweep --------------------------------------------------------------------------------

def run(out: str, preset_name: str = "smoke", variants=VARIANTS, lrs=None, steps=None, seed=0,
        time_budget_s: float | None = None, report_only: bool = False, log=print,
        corpus: str | None = None, corpus_cache: str | None = None) -> dict:
    """Runs the missing points (within the time budget) and writes the report. Returns the
    summary (see ``summarize``). ``corpus``: the byte corpus source (default: the preset's)."""
    t_start = time.time()
    if preset_name not in PRESETS:
        raise ValueError(f"preset: expected one of {tuple(PRESETS)}, got {preset_name!r}")
    preset = PRESETS[preset_name]
    lrs = list(preset["lrs"] if lrs is None else lrs)
    steps = preset["steps"] if steps is None else steps
    if not lrs or any(not (x > 0 and math.isfinite(x)) for x in lrs):
        raise ValueError(f"lrs: expected positive learning rates, got {lrs}")
    if not isinstance(steps, int) or steps < 2:
        raise ValueError(f"steps: expected an int >= 2, got {steps!r}")
    bad = [v for v in variants if v not in VARIANTS]
    if bad or not variants:
        raise ValueError(f"variants: expected names from {VARIANTS}, got {list(variants)}")
    corpus = preset["corpus"] if corpus is None else corpus
    if corpus not in SOURCES:
        raise ValueError(f"corpus: expected one of {SOURCES}, got {corpus!r}")
    settings = settings_of(preset_name, preset, steps, seed, corpus)
    os.makedirs(out, exist_ok=True)
    check_settings(out, settings)
    points = read_points(out)
    todo = [(lr, v) for i in spread_order(len(lrs)) for lr in [sorted(lrs)[i]] for v in variants
            if point_key(v, lr) not in points]
    if todo and not report_only:
        import jax
        cap = preset["max_corpus_mb"]
        corpus = build_corpus(corpus, max_bytes=None if cap is None else cap * 2**20,
                              validation_percent=preset["validation_percent"],
                              cache_dir=corpus_cache)
        write_settings(out, settings, corpus.describe())
        log(f"corpus: {json.dumps(corpus.describe())}")
        log(f"device: {jax.devices()[0].device_kind} x {jax.device_count()}; "
            f"{len(todo)} points to run")
        sampler = WindowSampler(corpus.train_N, seq_len=preset["seq_len"],
                                batch_size=preset["batch_size"], seed=seed)
        eval_batches = WindowSampler(corpus.validation_N, seq_len=preset["seq_len"],
                                     batch_size=preset["batch_size"], seed=seed
                                     ).fixed_batches(preset["eval_batches"])
        cfgs = sweep_configs(preset, variants, steps, seed)
        mesh = data_mesh(jax.devices()[:1])
        programs: dict[str, Program] = {}
        point_s = []
        deadline = None if time_budget_s is None else t_start + time_budget_s
        for lr, v in todo:
            compile_s = None
            if deadline is not None:
                need = (np.median(point_s) if point_s else 0) + (0 if v in programs else 45)
                if time.time() + need > deadline:
                    log(f"time budget: {v} at lr {lr:g} not run (rerun to continue)")
                    continue
            if v not in programs:
                programs[v] = Program(cfgs[v], mesh)
                compile_s = programs[v].compile()
                log(f"{v}: compiled in {compile_s:.1f}s")
            program = programs[v]
            t0 = time.time()
            state = program.init()
            state, rec = run_steps(program, state, sampler, lr, steps)
            eval_loss = program.evaluate(state, eval_batches) if rec.state != "diverged" else float("nan")
            del state
            point = point_result(v, lr, rec, eval_loss, compile_s)
            point["epochs"] = round(sampler.epochs(rec.steps), 3)
            append_point(out, point)
            points = read_points(out)  # with the points of other processes sharing OUT
            point_s.append(time.time() - t0)
            log(f"{v} lr {lr:g}: {rec.state}, eval {eval_loss:.4f}, train {point['final_train_loss']}, "
                f"max|logit| {point['final_max_abs_logit']}, diverged {point['diverged']}, "
                f"{rec.tokens_per_sec / 1e6:.2f}M tok/s, {time.time() - t0:.1f}s")
            write_results(out, points, variants, lrs, settings)
    points = read_points(out)
    lrs = sorted(set(lrs) | {p["lr"] for p in points.values() if p["variant"] in variants})
    summary = write_results(out, points, variants, lrs, settings)
    plot(out, points, variants, lrs)
    log(f"done in {time.time() - t_start:.0f}s: {out}/results.md, {out}/lr_sweep.png")
    return summary


# -- the report -------------------------------------------------------------------------------

def lr_range(points: list[dict], margin: float = MARGIN_NATS) -> dict:
    """Best loss and the lrs within ``margin`` of it (over the non-diverged points)."""
    ok = sorted((p for p in points if not p["diverged"] and p["final_eval_loss"] is not None),
                key=lambda p: p["lr"])
    all_lrs = sorted(p["lr"] for p in points)
    if not ok:
        return {"best_lr": None, "best_loss": None, "within": [], "lo": None, "hi": None,
                "ratio": None, "contiguous": None, "at_edge": None}
    best = min(ok, key=lambda p: p["final_eval_loss"])
    within = [p["lr"] for p in ok if p["final_eval_loss"] <= best["final_eval_loss"] + margin]
    idx = [all_lrs.index(x) for x in within]
    return {"best_lr": best["lr"], "best_loss": best["final_eval_loss"], "within": within,
            "lo": within[0], "hi": within[-1], "ratio": within[-1] / within[0],
            "contiguous": idx == list(range(idx[0], idx[-1] + 1)),
            "at_edge": [e for e, hit in (("low", within[0] == all_lrs[0]),
                                         ("high", within[-1] == all_lrs[-1])) if hit]}


def summarize(points: dict[str, dict], variants, lrs) -> dict:
    per = {}
    for v in variants:
        pts = [points[k] for k in (point_key(v, lr) for lr in sorted(lrs)) if k in points]
        per[v] = {"points_run": len(pts), "points_planned": len(lrs),
                  "diverged": sum(p["diverged"] for p in pts),
                  "diverged_lrs": [p["lr"] for p in pts if p["diverged"]],
                  "spikes": sum(p["spikes"] for p in pts), **lr_range(pts)}
    return per


def _fmt(x, spec=".4f"):
    return "—" if x is None else format(x, spec)


def _fmt_logit(x):
    return "—" if x is None else f"{x:,.1f}" if abs(x) < 1e6 else f"{x:.2e}"


def results_table(points, variants, lrs) -> list[str]:
    lrs = sorted(lrs)
    head = "| variant | " + " | ".join(f"{lr:.3g}" for lr in lrs) + " |"
    sep = "|---|" + "---|" * len(lrs)
    loss_rows, logit_rows = [head, sep], [head, sep]
    for v in variants:
        cells_l, cells_g = [], []
        best = lr_range([points[k] for k in (point_key(v, lr) for lr in lrs) if k in points])
        for lr in lrs:
            p = points.get(point_key(v, lr))
            if p is None:
                cells_l.append("not run")
                cells_g.append("not run")
                continue
            loss = p["final_eval_loss"]
            txt = ("diverged" + (f" @{p['diverged_at']}" if p["diverged_at"] else "")
                   if loss is None else f"{loss:.4f}" + (" (blow-up)" if p["diverged"] else ""))
            if best["best_lr"] == lr:
                txt = f"**{txt}**"
            cells_l.append(txt)
            cells_g.append(_fmt_logit(p["final_max_abs_logit"]))
        loss_rows.append(f"| {v} | " + " | ".join(cells_l) + " |")
        logit_rows.append(f"| {v} | " + " | ".join(cells_g) + " |")
    return loss_rows, logit_rows


def epochs_line(settings: dict, built: dict) -> str:
    """How many passes over the training split a point makes (``WindowSampler.epochs``)."""
    steps, batch, seq_len = settings["steps"], settings["batch_size"], settings["seq_len"]
    windows = built.get("train_tokens", 0) // (seq_len + 1)
    if not windows:
        return "Epochs: the corpus is not built yet."
    return (f"Each point sees {steps * batch / windows:.3g} epochs of the training split "
            f"({steps:,} x {batch} of its {windows:,} windows of {seq_len + 1} tokens).")


def write_results(out, points, variants, lrs, settings) -> dict:
    summary = summarize(points, variants, lrs)
    loss_rows, logit_rows = results_table(points, variants, lrs)
    cfg = settings["configs"]["ls"]
    m = cfg["model"]
    done = [p for p in points.values() if p["variant"] in variants]
    tok = [p["tokens_per_sec"] for p in done]
    built = {}
    sp = os.path.join(out, "settings.json")
    if os.path.exists(sp):
        with open(sp) as f:
            built = json.load(f).get("corpus_built") or {}
    lines = [
        "# Learning-rate sensitivity",
        "",
        f"Model {m['n_layer']}L, {m['n_head']} heads x {m['head_dim']}, d={m['d_model']}, "
        f"LS = {m['n_global_heads']} global + {m['n_head'] - m['n_global_heads']} local "
        f"(p={m['window']}), {m['compute_dtype']}; T={settings['seq_len']}, batch "
        f"{settings['batch_size']}, {settings['steps']} steps "
        f"({settings['steps'] * settings['batch_size'] * settings['seq_len'] / 1e6:.1f}M tokens) "
        f"per point, warmup {cfg['train']['warmup_steps']} steps then cosine to lr/10, seed "
        f"{settings['seed']}, the same batches in the same order for every point.",
        summary_line(built)[:-1] + ("" if settings["corpus"]["max_mb"] is None else
                                    f" (cap {settings['corpus']['max_mb']} MB)")
        + f"; {settings['eval_batches']} held-out batches give the final loss.",
        epochs_line(settings, built),
        f"Diverged: non-finite loss or gradient norm (training stops), or the median of the last "
        f"{TAIL_FRACTION:.0%} of step losses > {BLOWUP_FACTOR}x the best 11-step running median. "
        f"Margin: {MARGIN_NATS} nats of the best loss.",
        f"Throughput: median {np.median(tok) / 1e6:.2f}M tokens/s over {len(done)} points."
        if tok else "No point run yet.",
        "",
        "## Final held-out loss (nats/byte) by peak lr (best in bold)",
        "", *loss_rows, "",
        "## Max |attention logit| at the last step",
        "", *logit_rows, "",
        "## Per variant",
        "",
        "| variant | points | best lr | best loss | lrs within 0.05 nats | width (hi/lo) | diverged | spikes |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for v, s in summary.items():
        rng = ("—" if s["lo"] is None else
               f"{s['lo']:.3g} – {s['hi']:.3g}" + ("" if s["contiguous"] else " (with gaps)")
               + (f" (at the {' and '.join(s['at_edge'])} edge)" if s["at_edge"] else ""))
        lines.append(f"| {v} | {s['points_run']}/{s['points_planned']} | "
                     f"{_fmt(s['best_lr'], '.3g')} | {_fmt(s['best_loss'])} | {rng} | "
                     f"{_fmt(s['ratio'], '.2f')}x | {s['diverged']} | {s['spikes']} |")
    lines += ["", "![lr sweep](lr_sweep.png)", ""]
    _write_atomic(os.path.join(out, "results.md"), "\n".join(lines))
    result = {"settings": {k: v for k, v in settings.items() if k != "configs"},
              "corpus": built, "summary": summary,
              "points": [{k: v for k, v in p.items() if k not in ("loss", "max_abs_logit", "grad_norm")}
                         for p in done]}
    _write_atomic(os.path.join(out, "results.json"), json.dumps(result, indent=2, allow_nan=True))
    return summary


def plot(out, points, variants, lrs) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(14, 8.5))
    ax_loss = fig.add_subplot(2, 2, 1)
    ax_logit = fig.add_subplot(2, 2, 2)
    curve_axes = [fig.add_subplot(2, len(variants), len(variants) + i + 1)
                  for i in range(len(variants))]
    ok_losses = [p["final_eval_loss"] for p in points.values()
                 if p["variant"] in variants and not p["diverged"] and p["final_eval_loss"] is not None]
    top = (max(ok_losses) + 0.15 * (max(ok_losses) - min(ok_losses) + 0.1)) if ok_losses else 1.0
    cmap = plt.get_cmap("viridis")
    for i, v in enumerate(variants):
        pts = sorted((p for p in points.values() if p["variant"] == v), key=lambda p: p["lr"])
        color = f"C{i}"
        good = [p for p in pts if not p["diverged"]]
        bad = [p for p in pts if p["diverged"]]
        ax_loss.plot([p["lr"] for p in good], [p["final_eval_loss"] for p in good], "o-",
                     color=color, label=v)
        if bad:
            ax_loss.plot([p["lr"] for p in bad], [top] * len(bad), "x", color=color, ms=10, mew=2,
                         label=f"{v}: diverged ({len(bad)})")
        ax_logit.plot([p["lr"] for p in good if p["final_max_abs_logit"]],
                      [p["final_max_abs_logit"] for p in good if p["final_max_abs_logit"]], "o-",
                      color=color, label=v)
        if bad:
            ax_logit.plot([p["lr"] for p in bad if p["final_max_abs_logit"]],
                          [p["final_max_abs_logit"] for p in bad if p["final_max_abs_logit"]],
                          "x", color=color, ms=10, mew=2)
        ax = curve_axes[i]
        sorted_lrs = sorted(lrs)
        for p in pts:
            c = cmap(sorted_lrs.index(p["lr"]) / max(1, len(sorted_lrs) - 1)
                     if p["lr"] in sorted_lrs else 0.0)
            ax.plot(range(1, len(p["loss"]) + 1), p["loss"], color=c, lw=1,
                    ls="--" if p["diverged"] else "-", label=f"{p['lr']:.2g}")
        ax.set(title=f"{v}: training loss", xlabel="step", yscale="log")
        firsts = [p["loss"][0] for p in pts if p["loss"] and math.isfinite(p["loss"][0])]
        if firsts:
            ax.set_ylim(top=1.5 * max(firsts))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, title="peak lr", title_fontsize=6)
    ax_loss.set(xscale="log", xlabel="peak learning rate", ylabel="final held-out loss (nats/byte)",
                title="loss vs peak lr (x: diverged, drawn at the top)")
    if ok_losses:
        ax_loss.set_ylim(min(ok_losses) - 0.05, top + 0.05)
    ax_logit.set(xscale="log", yscale="log", xlabel="peak learning rate",
                 ylabel="max |attention logit| at the last step", title="logit growth vs peak lr")
    for ax in (ax_loss, ax_logit):
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = os.path.join(out, "lr_sweep.png")
    tmp = f"{path}.{os.getpid()}.tmp.png"
    fig.savefig(tmp, dpi=100)
    os.replace(tmp, path)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=results_dir,
                        help="output directory (resumable)")
    parser.add_argument("--preset", default="gpu", choices=tuple(PRESETS))
    parser.add_argument("--smoke", action="store_true", help="same as --preset smoke (CPU)")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma-separated subset of {','.join(VARIANTS)}")
    parser.add_argument("--lrs", default=None,
                        help="comma-separated peak lrs (default: the preset's)")
    parser.add_argument("--steps", type=int, default=None, help="steps per point (default: preset's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--corpus", default=None, choices=SOURCES,
                        help="the byte corpus (experiments.byte_corpus; default: the preset's)")
    parser.add_argument("--corpus-cache", default=None, metavar="DIR",
                        help="load the corpus from DIR if it holds it, else build it and save it there")
    parser.add_argument("--time-budget-s", type=float, default=None,
                        help="start no point that would end after this many seconds; rerun to continue")
    parser.add_argument("--report-only", action="store_true",
                        help="only rewrite results.* and lr_sweep.png from OUT/points.jsonl")
    args = parser.parse_args(argv)
    variants = tuple(v.strip() for v in args.variants.split(",") if v.strip())
    try:
        lrs = None if args.lrs is None else [float(x) for x in args.lrs.split(",") if x.strip()]
    except ValueError:
        parser.error(f"--lrs: expected comma-separated numbers, got {args.lrs!r}")
    try:
        run(args.out, "smoke" if args.smoke else args.preset, variants, lrs, args.steps,
            args.seed, args.time_budget_s, args.report_only, corpus=args.corpus,
            corpus_cache=args.corpus_cache)
    except ValueError as e:
        parser.error(str(e))
    return 0


if __name__ == "__main__":
    sys.exit(main())
