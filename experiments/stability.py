"""The paper's phenomenon, reproduced side by side: does max |attention logit| explode for
plain MHSA and stay bounded for LS-attention?

    python -m experiments.stability --out runs/stability --preset gpu
    python -m experiments.stability --out runs/smoke --preset smoke   # CPU, seconds

(from the repository root). The variants are the named configs ``paper`` (LS), ``paper_mhsa``,
``paper_qknorm`` and ``paper_zloss`` (configs/paper.py); a preset rescales all of them the same
way (size, data, optimisation) and never touches what makes them differ (the attention split,
QK-norm, z-loss). Every variant trains on the same data, seed and token budget, one after
another, each in ``<out>/<variant>/`` (a normal ``train`` workdir: metrics.jsonl, TensorBoard, checkpoints). The
run is resumable: the same command continues each variant from its latest checkpoint, so a
sweep can span several time-boxed calls (``--time-budget-s``). A variant that diverges
(non-finite loss) is recorded as such in ``<out>/<variant>/status.json`` and not retried. At
the end of every call the report is rewritten: ``<out>/stability.png`` and ``<out>/results.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

from ls_jax.config import Config
from ls_jax.configs import get_config
from ls_jax.rundir import RunDir
from ls_jax.train import TrainingDiverged, train

from experiments.stability_report import write_report
from experiments.variants import VARIANTS, config_name

# The paper's model (6L, 6 heads x 32, d=192, 1 global + 5 local, p=51, bf16) and optimizer
# (AdamW betas .9/.95, wd .1, clip 1, warmup + cosine) come from the named configs; the gpu
# presets stress them to show within minutes what the paper saw after 20-30k steps: a 5x higher
# peak lr (3e-3), a short warmup, and byte-level text (the densest short-range dependencies).
_STRESS = ["model.vocab_size=256", "data.source=stdlib", "data.tokenizer=bytes",
           "train.num_steps=3000", "train.lr=3e-3", "train.min_lr=3e-4", "train.warmup_steps=200",
           "train.log_every=10", "train.eval_every=500", "train.eval_batches=4",
           "train.save_every=500", "train.progress=false"]
PRESETS = {
    "smoke": ["model.vocab_size=256", "model.n_layer=2", "model.d_model=48", "model.head_dim=8",
              "model.window=8", "model.max_seq_len=64", "model.compute_dtype=float32",
              "data.source=stdlib", "data.tokenizer=bytes", "data.seq_len=64",
              "data.shuffle_window=64", "train.batch_size=4", "train.num_steps=6",
              "train.lr=3e-3", "train.min_lr=3e-4", "train.warmup_steps=2", "train.log_every=1",
              "train.eval_every=3", "train.eval_batches=1", "train.save_every=3",
              "train.progress=false", "train.async_checkpoints=false"],
    "gpu": _STRESS + ["model.max_seq_len=2048", "data.seq_len=2048", "data.shuffle_window=512",
                      "train.batch_size=32"],
    "gpu_long": _STRESS + ["model.max_seq_len=8192", "data.seq_len=8192",
                           "data.shuffle_window=512", "train.batch_size=8"],
}


def variant_config(preset: str, variant: str, overrides=()) -> Config:
    """The named config of ``variant``, rescaled by ``preset`` and ``overrides``."""
    if preset not in PRESETS:
        raise ValueError(f"preset: expected one of {tuple(PRESETS)}, got {preset!r}")
    cfg = get_config(config_name(variant, overrides), PRESETS[preset] + list(overrides))
    return dataclasses.replace(cfg, name=f"stability_{preset}_{variant}")


def run(out: str, preset: str, variants=VARIANTS, overrides=(), time_budget_s: float | None = None,
        time_per_variant_s: float | None = None, report_only: bool = False,
        log=print) -> dict[str, dict]:
    """Trains each variant (resuming), then writes the report. Returns {variant: status}.

    time_budget_s caps this call; time_per_variant_s caps each variant's share of it, so that a
    slow variant cannot starve the ones after it.
    """
    configs = {v: variant_config(preset, v, overrides) for v in variants}
    deadline = None if time_budget_s is None else time.time() + time_budget_s
    statuses = {}
    for variant, cfg in configs.items():
        run_dir = RunDir(os.path.join(out, variant))
        # an out dir that holds these variants with other settings is refused, not mixed
        run_dir.write_or_check_config(cfg)
        status = run_dir.read_status() or {"state": "not started"}
        if report_only or status["state"] in ("finished", "diverged"):
            statuses[variant] = status
            continue
        if deadline is not None and time.time() >= deadline:
            statuses[variant] = status
            continue
        log(f"== {variant}: {cfg.model.window_sizes} qk_norm={cfg.model.qk_norm} "
            f"z_loss={cfg.train.z_loss}")
        t0 = time.time()
        stop_at = deadline
        if time_per_variant_s is not None:
            stop_at = min(stop_at or float("inf"), t0 + time_per_variant_s)
        try:
            result = train(cfg, run_dir.path, stop_at_time=stop_at, log=log)
            status = {"state": "interrupted" if result.interrupted else "finished",
                      "step": result.final_step}
        except TrainingDiverged as e:
            status = {"state": "diverged", "reason": str(e)}
        status["seconds_this_call"] = round(time.time() - t0, 1)
        run_dir.write_status(status)
        statuses[variant] = status
        log(f"== {variant}: {status}")
    write_report(out, variants, statuses, variant_config(preset, "ls", overrides))
    return statuses


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="output directory (resumable)")
    parser.add_argument("--preset", default="smoke", choices=tuple(PRESETS))
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma-separated subset of {','.join(VARIANTS)}")
    parser.add_argument("--time-budget-s", type=float, default=None,
                        help="stop (checkpointed) after this many seconds; rerun to continue")
    parser.add_argument("--time-per-variant-s", type=float, default=None,
                        help="cap on each variant's training time in this call")
    parser.add_argument("--report-only", action="store_true",
                        help="only rewrite results.md and stability.png from the out dir")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value",
                        help="applied to every variant, e.g. train.num_steps=2000 train.lr=6e-4")
    args = parser.parse_args(argv)
    variants = tuple(v.strip() for v in args.variants.split(",") if v.strip())
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        parser.error(f"--variants: expected names from {VARIANTS}, got {bad}")
    try:
        statuses = run(args.out, args.preset, variants, args.overrides, args.time_budget_s,
                       args.time_per_variant_s, args.report_only)
    except ValueError as e:
        parser.error(str(e))
    print(json.dumps(statuses, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
