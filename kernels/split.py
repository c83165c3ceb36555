"""The "split" backend (GPU): cuDNN's causal kernel for the global heads, ours for the local ones.

Our kernel runs full-causal work slower than cuDNN at D >= 64 and local heads much faster than
the cuDNN composition (docs/kernel-notes.md, "Split dispatch"), so this backend makes two calls:

* the global heads (``kernels.heads.split_heads``: window None or >= T) in ONE
  ``jax.nn.dot_product_attention(..., is_causal=True, implementation="cudnn")`` call;
* the local heads in ONE ``pallas_gpu_attention`` call with their windows;

and puts the two outputs back in head order. Heads are taken out and put back as runs of
consecutive heads (slices and one concatenate, never a gather): with the global heads first,
as the model lays them out, that is one slice per part and one concatenate. A call with only
global (only local) heads is the single cuDNN (Pallas) call.

GQA/MQA: each part keeps its key/value heads grouped where it can. If every kv head that a
part touches serves the same number of that part's query heads (always so when the
global/local boundary falls between kv groups, and also when e.g. each group holds one global
head), the part gets just those kv heads and runs as GQA. Otherwise (a group shared unevenly)
the part gets one kv head per query head (the ``repeat_kv`` expansion, restricted to its
heads); the gradients of shared kv heads are summed by autodiff either way.

Logit statistics: the local heads' come from our kernel, the global heads' from one extra
blockwise pass over their QK^T (``kernels.reference.blockwise_max_abs_logit``, as the cuDNN
composition does), merged into [H] in head order. Not supported: ``segment_ids`` (cuDNN's
causal call takes none) and float32 (cuDNN takes bfloat16/float16 only).

``interpret=True`` runs the local heads' kernel in Pallas interpret mode; the global heads
still go to cuDNN (``_global_causal_attention``, the one place that calls it, which CPU tests
replace with the reference).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ls_jax.kernels.cudnn import check_cudnn_inputs
from ls_jax.kernels.heads import kv_for_heads, merge_heads, split_heads, take_heads
from ls_jax.kernels.pallas_gpu import pallas_gpu_attention
from ls_jax.kernels.reference import blockwise_max_abs_logit

__all__ = ["split_backend"]


def _global_causal_attention(q, k, v, scale: float):
    """Causal attention of every head of q (k, v: GQA allowed) through cuDNN. The one call
    into cuDNN of this backend; CPU tests replace it with the reference."""
    if not isinstance(q, jax.core.Tracer) and jax.default_backend() != "gpu":
        raise ValueError(
            "implementation='split' runs its global heads through cuDNN and needs a CUDA GPU "
            f"(JAX backend 'gpu'), got backend {jax.default_backend()!r}; use "
            "implementation='pallas_gpu' (interpret=True on CPU) or 'reference'")
    return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True,
                                        implementation="cudnn")


def split_backend(q, k, v, *, window_sizes, segment_ids, scale, return_logit_stats,
                  interpret, launches=None):
    """The "split" backend (``kernels.backends.get_backend``); ``launches`` (a
    ``pallas_gpu.Launches`` over the local heads) replaces the heuristics' choice for them."""
    check_cudnn_inputs("split", q, segment_ids)
    B, T, H, D = q.shape
    heads = split_heads(window_sizes, T)
    glob, local = heads.global_heads, heads.local_heads
    outs, stats, parts_heads = [], [], []
    if glob:
        q_g = take_heads(q, glob)
        k_g, v_g = kv_for_heads(k, v, glob, H)
        outs.append(_global_causal_attention(q_g, k_g, v_g, scale))
        if return_logit_stats:
            stats.append(blockwise_max_abs_logit(q_g, k_g, (None,) * len(glob), None, scale))
        parts_heads.append(glob)
    if local:
        k_l, v_l = kv_for_heads(k, v, local, H)
        out_l, stats_l = pallas_gpu_attention(
            take_heads(q, local), k_l, v_l, tuple(window_sizes[h] for h in local),
            scale=scale, return_logit_stats=return_logit_stats, launches=launches,
            interpret=interpret)
        outs.append(out_l)
        stats.append(stats_l)
        parts_heads.append(local)
    out = merge_heads(outs, parts_heads)
    if not return_logit_stats:
        return out, None
    return out, merge_heads([s.astype(jnp.float32) for s in stats], parts_heads, axis=0)
