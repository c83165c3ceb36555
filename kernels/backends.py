"""The backends by name: their functions, their residual pairs and their launches.

A backend is a function

    fn(q, k, v, *, window_sizes, segment_ids, scale, return_logit_stats, interpret)
        -> (out_BxTxHxD, max_abs_logit_H or None)

that gets validated inputs (``kernels/api.py``). Each is imported on first use, so importing
``kernels`` never pulls in Triton or Mosaic.

**Residual pairs.** ``kernels/sharded.py`` runs the forward and the backward of a call on Auto
axes as two custom-partitioned ops, so what the forward leaves for the backward must have
shapes the partitioner can split like the inputs, whatever windows a shard holds. For a
flash-style kernel that is its output and one float32 statistic per query row:

    forward(q, k, v, *, window_sizes, segment_ids, scale, interpret, return_logit_stats)
        -> (out [B, T, H, D], rows float32 [B, H, T], max_abs_logit [H] or None)
    backward(q, k, v, out, rows, do, *, window_sizes, segment_ids, scale, interpret)
        -> (dq, dk, dv)

``rows`` is the backend's own row logsumexp (its log base is the backend's business). The pair
computes what the backend's ``jax.custom_vjp`` computes. ``residual_pair`` returns None for a
backend without one ("reference", "cudnn", "split"): its partitioned backward runs the forward
again per shard.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

from ls_jax.kernels.heads import head_span, split_heads

IMPLEMENTATIONS = ("reference", "cudnn", "pallas_gpu", "pallas_tpu", "split")

__all__ = ["IMPLEMENTATIONS", "ResidualPair", "get_backend", "launch_lines", "residual_pair"]


def get_backend(implementation: str):
    """The backend function of ``implementation``, imported on first use."""
    if implementation == "reference":
        from ls_jax.kernels.reference import reference_backend
        return reference_backend
    if implementation == "cudnn":
        from ls_jax.kernels.cudnn import cudnn_backend
        return cudnn_backend
    if implementation == "pallas_gpu":
        from ls_jax.kernels.pallas_gpu import pallas_gpu_backend
        return pallas_gpu_backend
    if implementation == "pallas_tpu":
        from ls_jax.kernels.pallas_tpu import pallas_tpu_backend
        return pallas_tpu_backend
    if implementation == "split":
        from ls_jax.kernels.split import split_backend
        return split_backend
    raise ValueError(
        f"implementation: expected None or one of {IMPLEMENTATIONS}, got {implementation!r}")


class ResidualPair(NamedTuple):
    forward: Callable
    backward: Callable


def residual_pair(implementation: str) -> ResidualPair | None:
    """The backend's (forward, backward) with output and row-statistic residuals, or None."""
    if implementation == "pallas_gpu":
        from ls_jax.kernels.pallas_gpu import backend
    elif implementation == "pallas_tpu":
        from ls_jax.kernels.pallas_tpu import backend
    else:
        return None
    return ResidualPair(backend.forward_with_rows, backend.backward_with_rows)


def launch_lines(implementation: str, *, batch: int, seq_len: int, head_dim: int,
                 windows: tuple[int | None, ...], num_kv_heads: int, dtype, has_segments: bool,
                 gpu, interpret=False) -> tuple[str, ...]:
    """What ``implementation`` launches for one call (one shard) of this case, a line each.
    ``gpu``: the ``pallas_gpu.heuristics.Gpu`` the GPU kernels plan for."""
    case = dict(batch=batch, seq_len=seq_len, head_dim=head_dim, num_kv_heads=num_kv_heads,
                dtype=dtype, has_segments=has_segments, gpu=gpu, interpret=interpret)
    if implementation == "reference":
        return ("one XLA computation: dense [B, H, T, T] float32 logits under the band mask",)
    if implementation == "cudnn":
        from ls_jax.kernels.cudnn import head_groups
        return tuple(
            f"jax.nn.dot_product_attention(implementation='cudnn') over heads {head_span(heads)}, "
            + ("causal" if w is None else f"local_window_size=({w - 1}, 0)")
            for w, heads in head_groups(windows, seq_len))
    if implementation == "pallas_gpu":
        from ls_jax.kernels.pallas_gpu import backend
        return backend.describe_launches(windows=windows, **case)
    if implementation == "pallas_tpu":
        from ls_jax.kernels.pallas_tpu import backend
        return backend.describe_launches(windows=windows, **case)
    if implementation == "split":
        split = split_heads(windows, seq_len)
        local = tuple(h for h in range(len(windows)) if h not in split.global_heads)
        group = len(windows) // num_kv_heads  # query heads per kv head
        lines = (f"jax.nn.dot_product_attention(implementation='cudnn'), causal, over the "
                 f"global heads {head_span(split.global_heads)}",)
        if local:
            lines += tuple(f"local heads {head_span(local)}: {line}" for line in launch_lines(
                "pallas_gpu", **dict(case, num_kv_heads=len({h // group for h in local})),
                windows=tuple(windows[h] for h in local)))
        return lines
    raise ValueError(
        f"implementation: expected one of {IMPLEMENTATIONS}, got {implementation!r}")
