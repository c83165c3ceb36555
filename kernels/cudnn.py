"""GPU baseline: cuDNN flash attention through ``jax.nn.dot_product_attention``.

cuDNN takes one window for all heads of a call, so LS-attention becomes one call per distinct
window (the global heads with ``is_causal=True``; each local group with
``local_window_size=(p - 1, 0)``, the same band as ``kernels.band``: keys i - p < j <= i), and
the outputs are put back in head order. Each call takes its heads as slices of runs of
consecutive heads and its key/value heads as GQA where the group allows (``kernels/heads.py``:
no gather; one call over every head takes the arrays as they are). cuDNN cannot emit logit
statistics, so ``return_logit_stats`` costs one extra blockwise pass over QK^T.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ls_jax.kernels.heads import kv_for_heads, merge_heads, split_heads, take_heads
from ls_jax.kernels.reference import blockwise_max_abs_logit


def head_groups(window_sizes, seq_len: int) -> list[tuple[int | None, tuple[int, ...]]]:
    """[(window, heads)]: every global head under None (first), then each local window."""
    split = split_heads(window_sizes, seq_len)
    glob = [(None, split.global_heads)] if split.global_heads else []
    return glob + list(split.local_groups())


def check_cudnn_inputs(implementation: str, q, segment_ids):
    """One clear error for what cuDNN's attention does not take: segment ids, float32."""
    if segment_ids is not None:
        raise NotImplementedError(
            f"segment_ids: implementation={implementation!r} does not support segment_ids "
            "(cuDNN's attention call takes none); use implementation='pallas_gpu' or "
            "'reference'")
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        raise ValueError(
            f"q: implementation={implementation!r} needs bfloat16 or float16, got {q.dtype}")


def cudnn_backend(q, k, v, *, window_sizes, segment_ids, scale, return_logit_stats,
                  interpret):
    del interpret
    check_cudnn_inputs("cudnn", q, segment_ids)
    B, T, H, D = q.shape
    outs, parts_heads = [], []
    for window, heads in head_groups(window_sizes, T):
        k_part, v_part = kv_for_heads(k, v, heads, H)
        local = None if window is None else (window - 1, 0)
        outs.append(jax.nn.dot_product_attention(
            take_heads(q, heads), k_part, v_part, scale=scale, is_causal=True,
            local_window_size=local, implementation="cudnn"))
        parts_heads.append(heads)
    out = merge_heads(outs, parts_heads)
    stats = None
    if return_logit_stats:
        stats = blockwise_max_abs_logit(q, k, window_sizes, None, scale)
    return out, stats
