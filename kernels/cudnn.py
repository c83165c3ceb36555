"""GPU baseline: cuDNN flash attention through ``jax.nn.dot_product_attention``.

cuDNN takes one window for all heads of a call, so LS-attention becomes one call per distinct
window (the global heads with ``is_causal=True``; each local group with
``local_window_size=(p - 1, 0)``, the same band as ``kernels.band``: keys i - p < j <= i), and
the outputs are put back in head order. GQA key/value heads are expanded to the query heads
first. cuDNN cannot emit logit statistics, so ``return_logit_stats`` costs one extra blockwise
pass over QK^T.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ls_jax.kernels.band import is_global
from ls_jax.kernels.reference import blockwise_max_abs_logit, repeat_kv


def head_groups(window_sizes, seq_len: int) -> list[tuple[int | None, list[int]]]:
    """[(window, [heads])] in order of first appearance; every global head under None."""
    groups: dict[int | None, list[int]] = {}
    for h, p in enumerate(window_sizes):
        groups.setdefault(None if is_global(p, seq_len) else p, []).append(h)
    return list(groups.items())


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
    k_BxTxHxD, v_BxTxHxD = repeat_kv(k, H), repeat_kv(v, H)
    outs, order = [], []
    for window, heads in head_groups(window_sizes, T):
        idx = np.asarray(heads)
        local = None if window is None else (window - 1, 0)
        outs.append(jax.nn.dot_product_attention(
            q[:, :, idx], k_BxTxHxD[:, :, idx], v_BxTxHxD[:, :, idx], scale=scale,
            is_causal=True, local_window_size=local, implementation="cudnn"))
        order.extend(heads)
    out = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=2)
    if order != sorted(order):
        out = out[:, :, np.argsort(order)]
    stats = None
    if return_logit_stats:
        stats = blockwise_max_abs_logit(q, k, window_sizes, None, scale)
    return out, stats
