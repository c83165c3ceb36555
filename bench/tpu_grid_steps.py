"""Structural cost of the Pallas TPU kernels vs JAX's splash attention: grid steps and DMAs.

No TPU is lent to this project, so the TPU kernels are compared by what their grids execute,
computed from the grid specs and scalar-prefetch tables (no kernel is run):

* grid steps: every step costs a pipeline iteration on TPU (about 0.35 us) even when its
  compute is skipped;
* computed tiles: steps whose body runs the matmuls;
* key-block fetches: DMAs of k (the same for v): a block is fetched only when its index
  changes from one step to the next.

For splash the numbers come from its own mask preprocessing
(``splash_attention_mask_info.process_mask``/``process_mask_dkv``, which hold the scalar
prefetch tables and set the grid width) for a MultiHeadMask of LocalMask((T, T),
window_size=(p - 1, 0), offset=0) (local heads) and CausalMask((T, T)) (global heads).
tests/test_pallas_tpu.py checks these counts against interpreted runs of both kernels.

Usage: python bench/tpu_grid_steps.py [--seq-len 8192] [--window 128] [--local 15] [--global 1]
"""

from __future__ import annotations

import argparse

import numpy as np


from ls_jax.kernels.pallas_tpu_plan import column_worklist, row_worklist


def ours_counts(windows, num_kv_heads: int, seq_len: int, block_q: int, block_k: int,
                num_chunks: int = 1) -> dict[str, int]:
    """Per batch element. ``seq_len`` is padded to a multiple of both blocks first."""
    lcm = int(np.lcm(block_q, block_k))
    seq_len = -(-seq_len // lcm) * lcm
    windows = tuple(windows)
    group = len(windows) // num_kv_heads
    rows = row_worklist(windows, seq_len, block_q, block_k, num_chunks)
    cols = column_worklist(windows, num_kv_heads, seq_len, block_q, block_k, num_chunks)
    return {
        "fwd_grid_steps": rows.grid_steps,
        "fwd_computed_tiles": rows.active_steps,
        "fwd_k_fetches": rows.block_fetches("k", group),
        "dq_grid_steps": rows.grid_steps,
        "dkv_grid_steps": cols.grid_steps,
        "bwd_grid_steps": rows.grid_steps + cols.grid_steps,
    }


def splash_mask(windows, seq_len: int):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm
    shape = (seq_len, seq_len)
    return sm.MultiHeadMask([sm.CausalMask(shape) if p is None
                             else sm.LocalMask(shape, window_size=(p - 1, 0), offset=0)
                             for p in windows])


def splash_counts(windows, num_kv_heads: int, seq_len: int, block_q: int,
                  block_k: int) -> dict[str, int]:
    """Per batch element, for splash's default separate dQ and dK/dV kernels with the same
    blocks in every pass (its ``BlockSizes`` default is 128 everywhere)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_mask_info as mask_info_lib,
    )
    if seq_len % block_q or seq_len % block_k:
        raise ValueError(f"seq_len: splash needs a multiple of the blocks, got {seq_len}")
    mask = splash_mask(tuple(windows), seq_len)
    heads = len(windows)
    group = heads // num_kv_heads
    fwd, _ = mask_info_lib.process_mask(mask, (block_q, block_k), head_shards=1,
                                        q_seq_shards=1)
    dkv, _ = mask_info_lib.process_mask_dkv(mask, (block_q, block_k), head_shards=1,
                                            q_seq_shards=1)
    nq, nk = seq_len // block_q, seq_len // block_k
    fwd_width = fwd.data_next.shape[-1]  # key steps per query block (nk unless shrunk)
    dkv_width = dkv.data_next.shape[-2]  # query steps per key block
    # forward grid (head, q block, key step); the k index map reads data_next[h, i, j]
    data_next = np.asarray(fwd.data_next).astype(np.int64)
    data_next_HxQxW = np.broadcast_to(
        data_next if data_next.shape[0] == heads else data_next[:1], (heads, nq, fwd_width))
    block_mask = np.asarray(fwd.block_mask)
    block_mask_HxQxW = np.broadcast_to(
        block_mask if block_mask.shape[0] == heads else block_mask[:1], (heads, nq, fwd_width))
    kv_head = np.broadcast_to((np.arange(heads) // group)[:, None, None], data_next_HxQxW.shape)
    key_S = (kv_head.reshape(-1) * (nk + 1) + data_next_HxQxW.reshape(-1))
    fetches = 1 + int(np.count_nonzero(key_S[1:] != key_S[:-1]))
    fwd_steps = heads * nq * fwd_width
    dkv_steps = nk * heads * dkv_width
    return {
        "fwd_grid_steps": fwd_steps,
        "fwd_computed_tiles": int(np.count_nonzero(block_mask_HxQxW)),
        "fwd_k_fetches": fetches,
        "dq_grid_steps": fwd_steps,
        "dkv_grid_steps": dkv_steps,
        "bwd_grid_steps": fwd_steps + dkv_steps,
    }


def comparison_table(windows, num_kv_heads: int, seq_len: int, blocks) -> str:
    """Markdown table: one row per (block_q, block_k) and metric."""
    lines = ["| blocks (q, k) | metric | ours | splash | ours / splash |",
             "|---|---|---:|---:|---:|"]
    for bq, bk in blocks:
        ours = ours_counts(windows, num_kv_heads, seq_len, bq, bk)
        theirs = splash_counts(windows, num_kv_heads, seq_len, bq, bk)
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
