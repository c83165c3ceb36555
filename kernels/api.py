"""The one public attention entry point, its input validation and backend dispatch.

Every backend (pure-JAX reference, cuDNN composition, Pallas GPU, Pallas TPU, and "split":
cuDNN for the global heads, Pallas GPU for the local ones, ``kernels/split.py``) computes the
same function: causal attention where each query head has its own window (the band, defined
once in ``kernels/band.py``). For head h with window p (an int >= 1), query i sees the p keys
i - p < j <= i; with window None it sees every j <= i. With ``segment_ids`` a query only sees
keys of its own segment as well.

Shape letters (array names carry them as suffixes, e.g. ``q_BxTxHxD``; one legend for the
whole project, kernels/, ls_jax/ and experiments/ alike):

  B     batch
  T     sequence positions (queries); S the same positions as keys, in [T, S] score matrices
  H     query heads (Hq in prose)
  G     key/value heads (Hkv in prose); G divides H, query head h reads kv head h // (H // G)
  D     head dimension
  M     model width (d_model); V vocabulary; L layers; R RoPE frequency pairs (D / 2)
  Q, K  rows of one query block / one key block of a kernel tile, e.g. ``s_QxK``
  C, E  chunks / work-list entries per chunk of a TPU work list (``kernels/pallas_tpu/plan.py``)
  N     a generic length (a 1-D token array, a row count); digits are literal sizes
        (``m_Qx128``: 128 lanes)

A backend is a function

    fn(q, k, v, *, window_sizes, segment_ids, scale, return_logit_stats, interpret)
        -> (out_BxTxHxD, max_abs_logit_H or None)

that gets validated inputs: ``window_sizes`` as returned by ``normalize_window_sizes`` (a
tuple of int >= 1 or None, one per query head) and ``scale`` a float. ``get_backend`` imports
it on first use, so that importing ``kernels`` never pulls in Triton or Mosaic. Which backend
``implementation=None`` picks is ``kernels/dispatch.py``.

On inputs sharded over a device mesh (any axis names, Auto or Explicit axis types) the backend
runs once per shard, the batch and the heads split: ``kernels/sharded.py``.
"""

from __future__ import annotations

import functools
from typing import Any, Literal, NamedTuple, Sequence, overload

import jax
import jax.numpy as jnp
import numpy as np

from ls_jax.kernels.band import WindowSizes
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from ls_jax.kernels.dispatch import (
    DEFAULT_IMPLEMENTATION,
    IMPLEMENTATIONS,
    INTERPRET_IMPLEMENTATIONS,
    choose_implementation,
    choose_primal_implementation,
    current_platform,
)
from ls_jax.kernels.forward_mode import with_forward_mode
from ls_jax.kernels.heads import kv_group_size
from ls_jax.kernels.platform_call import export_platforms
from ls_jax.kernels.reference import default_scale
from ls_jax.kernels.sharded import Call, attention, register_backend_lookup

SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
# float64 (under jax_enable_x64): the reference alone computes in it; the kernels do not
REFERENCE_DTYPES = SUPPORTED_DTYPES + (jnp.float64,)

__all__ = ["DEFAULT_IMPLEMENTATION", "IMPLEMENTATIONS", "LogitStats", "default_implementation",
           "get_backend", "ls_attention", "normalize_window_sizes", "validate_inputs"]


class LogitStats(NamedTuple):
    """Statistics of the pre-softmax logits ``scale * q_i . k_j`` over allowed pairs.

    max_abs_logit: float32 [H], max over batch and allowed (i, j) of the absolute logit.
    """

    max_abs_logit: jax.Array


def normalize_window_sizes(window_sizes: Any, num_heads: int) -> WindowSizes:
    """Checks ``window_sizes`` against ``num_heads`` and returns it as a hashable tuple."""
    if isinstance(window_sizes, (str, bytes)) or not isinstance(window_sizes, Sequence):
        raise ValueError(
            f"window_sizes: expected a tuple of {num_heads} entries (int >= 1 for a local "
            f"head, None for a global head), got {window_sizes!r}")
    if len(window_sizes) != num_heads:
        raise ValueError(
            f"window_sizes: expected one entry per query head ({num_heads}), got "
            f"{len(window_sizes)} entries: {tuple(window_sizes)!r}")
    out = []
    for h, p in enumerate(window_sizes):
        if p is None:
            out.append(None)
            continue
        if isinstance(p, bool) or not isinstance(p, (int, np.integer)):
            raise ValueError(
                f"window_sizes[{h}]: expected an int >= 1 or None, got {p!r} "
                f"({type(p).__name__})")
        if p < 1:
            raise ValueError(f"window_sizes[{h}]: expected an int >= 1 or None, got {int(p)}")
        out.append(int(p))
    return tuple(out)


def validate_inputs(q, k, v, window_sizes, segment_ids, scale) -> tuple[WindowSizes, float]:
    """Raises ValueError naming the argument, the expectation and the given value; returns
    the window list in its one representation and the scale as a float."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise ValueError(f"{name}: expected an array of shape [B, T, H, D], got {type(x).__name__}")
        if x.ndim != 4:
            raise ValueError(
                f"{name}: expected rank 4 [B, T, H, D], got rank {x.ndim} with shape {tuple(x.shape)}")
        if x.dtype not in REFERENCE_DTYPES:
            raise ValueError(
                f"{name}: expected dtype float32, bfloat16, float16 (or float64 with "
                f"implementation='reference'), got {x.dtype}")
    B, T, H, D = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v: expected the same shape, got k {tuple(k.shape)} and v {tuple(v.shape)}")
    Bk, Tk, G, Dk = k.shape
    if (Bk, Tk, Dk) != (B, T, D):
        raise ValueError(
            f"k: expected shape [B={B}, T={T}, Hkv, D={D}] to match q {tuple(q.shape)}, "
            f"got {tuple(k.shape)}")
    if not (k.dtype == v.dtype == q.dtype):
        raise ValueError(f"q, k, v: expected one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    kv_group_size(H, G, arg="k heads (Hkv)", heads_arg="the query heads Hq")
    if T < 1 or D < 1 or B < 1:
        raise ValueError(f"q: expected non-empty B, T, D, got shape {tuple(q.shape)}")
    if segment_ids is not None:
        if not hasattr(segment_ids, "shape") or tuple(segment_ids.shape) != (B, T):
            raise ValueError(
                f"segment_ids: expected shape [B={B}, T={T}], got "
                f"{getattr(segment_ids, 'shape', type(segment_ids).__name__)}")
        if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
            raise ValueError(f"segment_ids: expected an integer dtype, got {segment_ids.dtype}")
    windows = normalize_window_sizes(window_sizes, H)
    if scale is None:
        scale = default_scale(D)
    elif isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating)) \
            or not np.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale: expected a finite float > 0 or None, got {scale!r}")
    return windows, float(scale)


# backends that call JAX's cuDNN attention (kernels/cudnn.py, kernels/split.py), which lowers
# for CUDA alone: a program exported for several platforms runs "pallas_gpu" in their place
JAX_KERNELS = ("cudnn", "split")


# implementation=None chooses for the platform of the machine that traces the call; a program
# lowered for another platform (jax.export(..., platforms=...)) would run that choice there (the
# dense reference on a GPU, say). An identity on q whose lowering checks the platforms refuses
# that with one line.
_platform_guard_p = Primitive("ls_attention_platform_guard")
_platform_guard_p.def_impl(lambda x, **_: x)
_platform_guard_p.def_abstract_eval(lambda x, **_: x)
ad.deflinear2(_platform_guard_p, lambda ct, x, **params: [_platform_guard_p.bind(ct, **params)])
batching.primitive_batchers[_platform_guard_p] = (
    lambda args, dims, **params: (_platform_guard_p.bind(args[0], **params), dims[0]))


def _platform_guard_lowering(ctx, x, *, traced_on: str, chosen: str):
    others = [p for p in ctx.module_context.platforms if p != traced_on]
    if others:
        raise ValueError(
            f"implementation: None chose {chosen!r} for {traced_on!r}, the platform of the "
            f"machine that traced the call, but the program is lowered for {tuple(others)!r}; "
            "export with ls_jax.interop.export.export (it chooses per platform) or pass "
            "implementation= explicitly (e.g. 'pallas_gpu' for cuda, 'pallas_tpu' for tpu)")
    return [x]


mlir.register_lowering(_platform_guard_p, _platform_guard_lowering)


def default_implementation(platform: str | None = None) -> str:
    """The backend ``implementation=None`` picks on ``platform`` (default: JAX's default
    platform) when the case does not change it; per call, see ``kernels/dispatch.py``."""
    return choose_implementation(platform)


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


register_backend_lookup(lambda name: get_backend(name))  # read per call: tests replace it


# the argument types of ls_attention (its overloads differ in return_logit_stats alone)
ArrayIn = jax.Array | np.ndarray
Implementation = Literal["reference", "cudnn", "pallas_gpu", "pallas_tpu", "split"]


@overload
def ls_attention(q: ArrayIn, k: ArrayIn, v: ArrayIn, window_sizes: Sequence[int | None], *,
                 segment_ids: ArrayIn | None = None, scale: float | None = None,
                 return_logit_stats: Literal[False] = False,
                 implementation: Implementation | None = None, interpret: Any = False,
                 partition_spec: jax.sharding.PartitionSpec | None = None) -> jax.Array: ...


@overload
def ls_attention(q: ArrayIn, k: ArrayIn, v: ArrayIn, window_sizes: Sequence[int | None], *,
                 segment_ids: ArrayIn | None = None, scale: float | None = None,
                 return_logit_stats: Literal[True],
                 implementation: Implementation | None = None, interpret: Any = False,
                 partition_spec: jax.sharding.PartitionSpec | None = None
                 ) -> tuple[jax.Array, LogitStats]: ...


@overload
def ls_attention(q: ArrayIn, k: ArrayIn, v: ArrayIn, window_sizes: Sequence[int | None], *,
                 segment_ids: ArrayIn | None = None, scale: float | None = None,
                 return_logit_stats: bool = False,
                 implementation: Implementation | None = None, interpret: Any = False,
                 partition_spec: jax.sharding.PartitionSpec | None = None
                 ) -> jax.Array | tuple[jax.Array, LogitStats]: ...


def ls_attention(q: ArrayIn, k: ArrayIn, v: ArrayIn, window_sizes: Sequence[int | None], *,
                 segment_ids: ArrayIn | None = None, scale: float | None = None,
                 return_logit_stats: bool = False, implementation: str | None = None,
                 interpret: Any = False, partition_spec: jax.sharding.PartitionSpec | None = None
                 ) -> jax.Array | tuple[jax.Array, LogitStats]:
    """Causal attention with a window per query head (LS-attention), in one call for all heads.

    Window semantics, side by side (p an int >= 1):

    | here | ``jax.nn.dot_product_attention`` | flash-attention |
    |---|---|---|
    | ``p``: query i sees the p keys i - p < j <= i (itself included) | ``is_causal=True, local_window_size=(p - 1, 0)`` | ``causal=True, window_size=(p - 1, 0)`` |
    | ``None`` (global): every key j <= i | ``is_causal=True`` | ``causal=True, window_size=(-1, -1)`` |

    So flash-attention's ``window_size=(span, 0)`` is ``p = span + 1`` here.

    Sharded inputs: under ``jax.jit`` with q, k, v split over mesh axes (of any names) along
    the batch and/or the heads, the backend runs once per shard, forward and backward, with
    no gather of q, k, v, the output or their gradients, and each head shard with its own
    windows (``kernels/sharded.py``); a split sequence (T) or head dimension (D) is refused
    (on Auto axes: taken whole, with a one-line warning).

    Forward-mode autodiff (``jax.jvp``, ``jax.jacfwd``, Hessian-vector products) computes its
    tangents with the reference (dense logits); reverse mode runs the backend's backward
    (``kernels/forward_mode.py``).

    Args:
      q: [B, T, Hq, D] queries (float32, bfloat16 or float16; float64 with
        implementation="reference", under ``jax_enable_x64``).
      k, v: [B, T, Hkv, D] keys and values, Hkv divides Hq (GQA: query head h reads kv head
        h // (Hq // Hkv)).
      window_sizes: length-Hq tuple; an int p >= 1 makes head h local, None makes it global
        (see the table). Must be static (Python values).
      segment_ids: optional int [B, T]; queries only see keys with the same segment id.
      scale: logit scale, default 1 / sqrt(D) (as in ``jax.nn.dot_product_attention``).
      return_logit_stats: also return ``LogitStats`` (no gradient flows through them).
      implementation: None (the fastest backend for the platform and the case,
        ``kernels/dispatch.py``; where the fastest forward alone is another backend, a call
        that nothing differentiates runs that one, ``kernels/directional.py``; the platform is
        the tracing machine's, and lowering the call for another, as
        ``jax.export(..., platforms=...)`` can, is refused; ``ls_jax.interop.export.export`` chooses
        for each platform it exports for), "reference",
        "cudnn", "pallas_gpu", "pallas_tpu" or "split" (cuDNN for the global heads,
        "pallas_gpu" for the local ones).
      interpret: run a Pallas backend in Pallas interpret mode (on CPU); for "split" its local
        heads' kernel (its global heads still need cuDNN). For "pallas_tpu" this may also be a
        ``pltpu.InterpretParams``.
      partition_spec: for a caller that knows how q, k, v lie on the mesh in context
        (``jax.set_mesh``), their ``PartitionSpec(batch_axes, None, head_axes, None)``: the call
        is then a ``jax.shard_map`` over that layout rather than custom-partitioned ops whose
        layout XLA chooses (which compiles with less work, and also where custom partitioning
        is not available: a compile for a TPU topology from a host without TPUs). Ignored
        without a mesh in context.

    Returns:
      [B, T, Hq, D] in q's dtype, or ``(out, LogitStats)`` with ``return_logit_stats=True``.
    """
    windows, scale = validate_inputs(q, k, v, window_sizes, segment_ids, scale)
    if partition_spec is not None and not isinstance(partition_spec, jax.sharding.PartitionSpec):
        raise ValueError(
            "partition_spec: expected None or a jax.sharding.PartitionSpec, got "
            f"{type(partition_spec).__name__}")
    run = functools.partial(_run, windows=windows, scale=scale, segment_ids=segment_ids,
                            logit_stats=bool(return_logit_stats), interpret=interpret,
                            partition_spec=partition_spec)
    if implementation is None:
        if interpret:
            raise ValueError(
                "interpret: True needs an explicit implementation, one of "
                f"{INTERPRET_IMPLEMENTATIONS}; got implementation=None")
        B, T, H, D = q.shape
        case = dict(window_sizes=windows, seq_len=T, head_dim=D, dtype=q.dtype,
                    has_segments=segment_ids is not None, return_logit_stats=return_logit_stats)
        platforms = export_platforms()
        if platforms is None:  # the tracing machine's platform
            implementation = choose_implementation(**case)
            q = _platform_guard_p.bind(q, traced_on=current_platform(), chosen=implementation)
            out, max_abs_logit = run(choose_primal_implementation(**case), implementation,
                                     q, k, v)
        else:  # one branch per platform of the export, each lowered for its own
            def pallas_where_several(name):  # cuDNN's calls lower for one platform alone
                return "pallas_gpu" if len(platforms) > 1 and name in JAX_KERNELS else name

            branches = {p: functools.partial(
                run, pallas_where_several(choose_primal_implementation(p, **case)),
                pallas_where_several(choose_implementation(p, **case))) for p in platforms}
            out, max_abs_logit = (branches[platforms[0]](q, k, v) if len(platforms) == 1
                                  else jax.lax.platform_dependent(q, k, v, **branches))
    else:
        if interpret and implementation not in INTERPRET_IMPLEMENTATIONS:
            raise ValueError(
                "interpret: only the Pallas backends and 'split' (its local heads), "
                f"{INTERPRET_IMPLEMENTATIONS}, have an interpret mode; got "
                f"interpret={interpret!r} with implementation={implementation!r}")
        if implementation not in IMPLEMENTATIONS:
            raise ValueError(f"implementation: expected None or one of {IMPLEMENTATIONS}, "
                             f"got {implementation!r}")
        out, max_abs_logit = run(implementation, implementation, q, k, v)
    if not return_logit_stats:
        return out
    return out, LogitStats(max_abs_logit=jax.lax.stop_gradient(max_abs_logit.astype(jnp.float32)))


def _run(primal: str, differentiated: str, q, k, v, *, windows: WindowSizes, scale: float,
         segment_ids, logit_stats: bool, interpret, partition_spec):
    """(out, max_abs_logit or None) of validated inputs with the ``primal`` backend where
    nothing differentiates the call and ``differentiated`` where something does (forward or
    reverse mode: ``kernels/forward_mode.py``)."""
    if q.dtype not in SUPPORTED_DTYPES and (primal, differentiated) != ("reference",) * 2:
        raise ValueError(
            f"q: float64 is computed by implementation='reference' alone, got implementation="
            f"{differentiated!r}; cast q, k, v to float32 or pass implementation='reference'")
    call = Call(primal=primal, differentiated=differentiated, windows=windows, scale=scale,
                logit_stats=logit_stats, has_segments=segment_ids is not None,
                interpret=interpret)
    as_differentiated = call._replace(primal=differentiated)

    def reference(q, k, v, segment_ids):
        from ls_jax.kernels.reference import reference_backend
        return reference_backend(q, k, v, window_sizes=windows, segment_ids=segment_ids,
                                 scale=scale, return_logit_stats=False, interpret=False)[0]

    return with_forward_mode(
        lambda *a: attention(call, *a, partition_spec),
        lambda *a: attention(as_differentiated, *a, partition_spec), reference,
        q, k, v, segment_ids)
