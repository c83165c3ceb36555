"""Structural cost of JAX's splash attention on the same band, to compare with our work lists
(``kernels.pallas_tpu.plan.step_counts``): grid steps, computed tiles, DMAs of k.

The numbers come from splash's own mask preprocessing
(``splash_attention_mask_info.process_mask``/``process_mask_dkv``, which hold its scalar
prefetch tables and set its grid width) for a MultiHeadMask of LocalMask((T, T),
window_size=(p - 1, 0), offset=0) (local heads; the band of ``kernels.band``) and
CausalMask((T, T)) (global heads). tests/test_pallas_tpu.py checks both counts against
interpreted runs of both kernels; bench/tpu_grid_steps.py prints them side by side.
"""

from __future__ import annotations

import numpy as np


def splash_mask(windows, seq_len: int):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm
    shape = (seq_len, seq_len)
    return sm.MultiHeadMask([sm.CausalMask(shape) if p is None
                             else sm.LocalMask(shape, window_size=(p - 1, 0), offset=0)
                             for p in windows])


def splash_step_counts(windows, num_kv_heads: int, seq_len: int, block_q: int,
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
