"""Train the same model with two attention implementations and compare the loss curves.

    python bench/train_parity.py --config tiny --steps 50 --impls pallas_gpu,reference

Same config, seed and data for each implementation; prints one row per logged step with each
implementation's loss and the largest difference, and (with --out) writes the curves as JSON.
On a GPU this checks that the Pallas kernel trains the model like the reference path (equal
within bf16 noise for the first steps).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time



def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="tiny")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--impls", default="pallas_gpu,reference")
    parser.add_argument("--out", default=None, help="JSON file for the curves")
    parser.add_argument("overrides", nargs="*", help="section.key=value for every run")
    args = parser.parse_args(argv)

    import jax

    from ls_jax.configs import get_config
    from ls_jax.training.train import train

    impls = args.impls.split(",")
    curves, seconds = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for impl in impls:
            cfg = get_config(args.config, [
                f"train.num_steps={args.steps}", f"train.save_every={args.steps}",
                "train.log_every=1", "train.progress=false", f"model.attn_implementation={impl}",
                *args.overrides])
            t0 = time.perf_counter()
            result = train(cfg, os.path.join(tmp, impl), log=lambda m: None)
            seconds[impl] = time.perf_counter() - t0
            curves[impl] = result.losses
    steps = sorted(curves[impls[0]])
    diffs = [max(curves[i][s] for i in impls) - min(curves[i][s] for i in impls) for s in steps]
    device = jax.devices()[0].device_kind
    print(f"device: {device}; config {args.config} {' '.join(args.overrides)}")
    print("| step | " + " | ".join(impls) + " | max diff |")
    print("|---|" + "---|" * (len(impls) + 1))
    for s, d in zip(steps, diffs):
        if s <= 5 or s % 10 == 0 or s == steps[-1]:
            print(f"| {s} | " + " | ".join(f"{curves[i][s]:.4f}" for i in impls) + f" | {d:.4f} |")
    print("seconds (incl. compile): " + ", ".join(f"{i} {seconds[i]:.1f}" for i in impls))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": device, "config": args.config, "overrides": args.overrides,
                       "curves": {i: {str(s): v for s, v in c.items()} for i, c in curves.items()},
                       "seconds": seconds}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
