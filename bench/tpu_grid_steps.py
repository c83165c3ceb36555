"""Structural cost of the Pallas TPU kernels vs JAX's splash attention: grid steps and DMAs.

No TPU is lent to this project, so the TPU kernels are compared by what their grids execute,
computed from the grid specs and scalar-prefetch tables (no kernel is run):

* grid steps: every step costs a pipeline iteration on TPU (about 0.35 us) even when its
  compute is skipped;
* computed tiles: steps whose body runs the matmuls;
* key-block fetches: DMAs of k (the same for v): a block is fetched only when its index
  changes from one step to the next.

Ours: ``kernels.pallas_tpu.plan.step_counts``; splash: ``bench/splash_cost.py``
(from splash's own mask preprocessing). tests/test_pallas_tpu.py checks both against
interpreted runs of both kernels.

Usage: python bench/tpu_grid_steps.py [--seq-len 8192] [--window 128] [--local 15] [--global 1]
"""

from __future__ import annotations

import argparse

from ls_jax.kernels.pallas_tpu.plan import step_counts
from splash_cost import splash_step_counts  # bench/splash_cost.py, beside this script


def comparison_table(windows, num_kv_heads: int, seq_len: int, blocks) -> str:
    """Markdown table: one row per (block_q, block_k) and metric."""
    lines = ["| blocks (q, k) | metric | ours | splash | ours / splash |",
             "|---|---|---:|---:|---:|"]
    for bq, bk in blocks:
        ours = step_counts(windows, num_kv_heads, seq_len, bq, bk)
        theirs = splash_step_counts(windows, num_kv_heads, seq_len, bq, bk)
        for name in ("fwd_grid_steps", "fwd_computed_tiles", "fwd_k_fetches", "bwd_grid_steps"):
            lines.append(f"| ({bq}, {bk}) | {name} | {ours[name]} | {theirs[name]} | "
                         f"{ours[name] / theirs[name]:.3f} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--local", type=int, default=15, help="number of local heads")
    parser.add_argument("--global", dest="num_global", type=int, default=1,
                        help="number of global heads")
    parser.add_argument("--blocks", default="128x128,512x512,512x128",
                        help="comma-separated block_q x block_k pairs")
    args = parser.parse_args(argv)
    windows = (None,) * args.num_global + (args.window,) * args.local
    blocks = [tuple(int(x) for x in b.split("x")) for b in args.blocks.split(",")]
    print(f"{args.num_global} global + {args.local} local heads (p={args.window}), "
          f"T={args.seq_len}, MHA, per batch element\n")
    print(comparison_table(windows, len(windows), args.seq_len, blocks))


if __name__ == "__main__":
    main()
