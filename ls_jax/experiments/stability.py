"""The paper's phenomenon, reproduced side by side: does max |attention logit| explode for
plain MHSA and stay bounded for LS-attention?

    python -m ls_jax.experiments.stability --out runs/stability --preset gpu
    python -m ls_jax.experiments.stability --out runs/smoke --preset smoke   # CPU, seconds

Every variant trains on the same data, seed and token budget, one after another, each in
``<out>/<variant>/`` (a normal ``train`` workdir: metrics.jsonl, TensorBoard, checkpoints). The
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

from ls_jax.config import Config, DataConfig, ModelConfig, TrainConfig

VARIANTS = ("ls", "mhsa", "mhsa_qknorm", "mhsa_zloss")


def base_config(preset: str) -> Config:
    """The shared setting of a preset; variants differ from it only in the attention."""
    if preset == "smoke":
        model = ModelConfig(vocab_size=256, n_layer=2, d_model=32, n_head=2, head_dim=16,
                            n_global_heads=1, window=8, max_seq_len=64)
        data = DataConfig(source="stdlib", tokenizer="bytes", seq_len=64, shuffle_window=64)
        train = TrainConfig(batch_size=4, num_steps=6, lr=3e-3, min_lr=3e-4, warmup_steps=2,
                            log_every=1, eval_every=3, eval_batches=1, save_every=3,
                            progress=False, async_checkpoints=False)
    elif preset in ("gpu", "gpu_long"):
        # The paper's model (6L, 6 heads x 32, d=192, 1 global + 5 local, p=50, bf16) and
        # optimizer (AdamW betas .9/.95, wd .1, clip 1, warmup + cosine), stressed to show
        # within minutes what the paper saw after 20-30k steps: a 5x higher peak lr (3e-3),
        # a short warmup, and byte-level text (the densest short-range dependencies).
        seq_len = 2048 if preset == "gpu" else 8192
        model = ModelConfig(vocab_size=256, n_layer=6, d_model=192, n_head=6, head_dim=32,
                            n_global_heads=1, window=50, max_seq_len=seq_len,
                            compute_dtype="bfloat16")
        data = DataConfig(source="stdlib", tokenizer="bytes", seq_len=seq_len, shuffle_window=512)
        train = TrainConfig(batch_size=32 if preset == "gpu" else 8, num_steps=3000, lr=3e-3,
                            min_lr=3e-4, warmup_steps=200, b1=0.9, b2=0.95, weight_decay=0.1,
                            grad_clip=1.0, log_every=10, eval_every=500, eval_batches=4,
                            save_every=500, progress=False)
    else:
        raise ValueError(f"preset: expected one of ('smoke', 'gpu', 'gpu_long'), got {preset!r}")
    return Config(name=f"stability_{preset}", model=model, data=data, train=train)


def variant_config(base: Config, variant: str) -> Config:
    m, t = base.model, base.train
    if variant == "ls":
        model = m  # base is LS: 1 global head, the rest local
    elif variant == "mhsa":
        model = dataclasses.replace(m, n_global_heads=m.n_head)
    elif variant == "mhsa_qknorm":
        model = dataclasses.replace(m, n_global_heads=m.n_head, qk_norm=True)
    elif variant == "mhsa_zloss":
        model = dataclasses.replace(m, n_global_heads=m.n_head)
        t = dataclasses.replace(t, z_loss=1e-4)
    else:
        raise ValueError(f"variants: expected names from {VARIANTS}, got {variant!r}")
    return dataclasses.replace(base, name=f"{base.name}_{variant}", model=model, train=t)


def _status_path(out: str, variant: str) -> str:
    return os.path.join(out, variant, "status.json")


def read_status(out: str, variant: str) -> dict:
    path = _status_path(out, variant)
    if not os.path.exists(path):
        return {"state": "not started"}
    with open(path) as f:
        return json.load(f)


def _write_status(out: str, variant: str, status: dict) -> None:
    os.makedirs(os.path.join(out, variant), exist_ok=True)
    with open(_status_path(out, variant), "w") as f:
        json.dump(status, f, indent=2)


def run(out: str, preset: str, variants=VARIANTS, overrides=(), time_budget_s: float | None = None,
        time_per_variant_s: float | None = None, report_only: bool = False,
        log=print) -> dict[str, dict]:
    """Trains each variant (resuming), then writes the report. Returns {variant: status}.

    time_budget_s caps this call; time_per_variant_s caps each variant's share of it, so that a
    slow variant cannot starve the ones after it.
    """
    from ls_jax.experiments.stability_report import write_report
    from ls_jax.train import TrainingDiverged, train, write_or_check_config

    base = base_config(preset).override(list(overrides))
    deadline = None if time_budget_s is None else time.time() + time_budget_s
    statuses = {}
    for variant in variants:
        cfg = variant_config(base, variant)
        # an out dir that holds these variants with other settings is refused, not mixed
        write_or_check_config(cfg, os.path.join(out, variant))
        status = read_status(out, variant)
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
            result = train(cfg, os.path.join(out, variant), stop_at_time=stop_at, log=log)
            status = {"state": "interrupted" if result.interrupted else "finished",
                      "step": result.final_step}
        except TrainingDiverged as e:
            status = {"state": "diverged", "reason": str(e)}
        status["seconds_this_call"] = round(time.time() - t0, 1)
        _write_status(out, variant, status)
        statuses[variant] = status
        log(f"== {variant}: {status}")
    write_report(out, variants, statuses, base)
    return statuses


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="output directory (resumable)")
    parser.add_argument("--preset", default="smoke", choices=("smoke", "gpu", "gpu_long"))
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
