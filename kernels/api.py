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

``ls_attention`` validates its inputs once (``validate_inputs``: ``window_sizes`` becomes a
tuple of int >= 1 or None, one per query head, and ``scale`` a float), plans the call once
(``kernels/plan.py``: the backends, from ``kernels/dispatch.py``'s rules; the partitioning over
the mesh; the launches) and executes the plan: the backends (``kernels/backends.py``) run once
per shard on sharded inputs (``kernels/sharded.py``), forward-mode autodiff through
``kernels/forward_mode.py``. ``explain`` returns the plan of a call without running it.
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

from ls_jax.kernels.backends import IMPLEMENTATIONS, get_backend
from ls_jax.kernels.dispatch import DEFAULT_IMPLEMENTATION, choose_implementation, current_platform
from ls_jax.kernels.forward_mode import with_forward_mode
from ls_jax.kernels.heads import kv_group_size
from ls_jax.kernels.plan import CallPlan, plan_call
from ls_jax.kernels.platform_call import export_platforms
from ls_jax.kernels.reference import default_scale
from ls_jax.kernels.sharded import attention

SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
# float64 (under jax_enable_x64): the reference alone computes in it; the kernels do not
REFERENCE_DTYPES = SUPPORTED_DTYPES + (jnp.float64,)

__all__ = ["DEFAULT_IMPLEMENTATION", "IMPLEMENTATIONS", "CallPlan", "LogitStats",
           "default_implementation", "explain", "get_backend", "ls_attention",
           "ls_attention_validated", "normalize_window_sizes", "validate_inputs"]


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
    return ls_attention_validated(q, k, v, windows, scale, segment_ids=segment_ids,
                                  return_logit_stats=return_logit_stats,
                                  implementation=implementation, interpret=interpret,
                                  partition_spec=partition_spec)


def ls_attention_validated(q, k, v, windows: WindowSizes, scale: float, *, segment_ids=None,
                           return_logit_stats: bool = False, implementation: str | None = None,
                           interpret: Any = False, partition_spec=None):
    """``ls_attention`` for a caller that has validated q, k, v and segment_ids as
    ``validate_inputs`` does and passes its normalised ``windows`` and float ``scale`` (the
    library's layers, which check their inputs when called and their windows when built)."""
    plan = plan_call(q, k, windows, scale=scale, has_segments=segment_ids is not None,
                     logit_stats=bool(return_logit_stats), implementation=implementation,
                     interpret=interpret, partition_spec=partition_spec,
                     platforms=export_platforms())
    if plan.guard:  # a lowering for another platform than the tracing machine's is refused
        q = _platform_guard_p.bind(q, traced_on=current_platform(),
                                   chosen=plan.routes[0].differentiated)
    branches = {route.platform: functools.partial(_run, plan, route, segment_ids=segment_ids)
                for route in plan.routes}
    out, max_abs_logit = (branches[plan.routes[0].platform](q, k, v) if len(branches) == 1
                          else jax.lax.platform_dependent(q, k, v, **branches))
    if not return_logit_stats:
        return out
    return out, LogitStats(max_abs_logit=jax.lax.stop_gradient(max_abs_logit.astype(jnp.float32)))


def explain(q: ArrayIn | jax.ShapeDtypeStruct, k: ArrayIn | jax.ShapeDtypeStruct,
            v: ArrayIn | jax.ShapeDtypeStruct, window_sizes: Sequence[int | None], *,
            segment_ids: ArrayIn | jax.ShapeDtypeStruct | None = None,
            scale: float | None = None, return_logit_stats: bool = False,
            implementation: Implementation | None = None, interpret: Any = False,
            partition_spec: jax.sharding.PartitionSpec | None = None,
            platform: str | None = None, device_kind: str | None = None) -> CallPlan:
    """The plan ``ls_attention`` would run for these arguments, without running it:
    ``print(explain(q, k, v, windows))`` says which backends run forward and backward, how
    the call is split over the mesh in context and what each backend launches per shard.

    q, k, v (and segment_ids) may be arrays or ``jax.ShapeDtypeStruct``s (with a
    ``sharding`` to plan for a mesh). ``platform``: plan for this platform ("cpu", "cuda",
    "tpu") rather than this machine's; ``device_kind``: the GPU to plan the launches for, as
    JAX's ``device.device_kind`` names it (``pallas_gpu.heuristics.gpu_of_kind``; default:
    this process's GPU). Raises ValueError as ``ls_attention`` would.
    """
    windows, scale = validate_inputs(q, k, v, window_sizes, segment_ids, scale)
    gpu = None
    if device_kind is not None:
        from ls_jax.kernels.pallas_gpu.heuristics import gpu_of_kind
        gpu = gpu_of_kind(device_kind)
    return plan_call(q, k, windows, scale=scale, has_segments=segment_ids is not None,
                     logit_stats=bool(return_logit_stats), implementation=implementation,
                     interpret=interpret, partition_spec=partition_spec,
                     platforms=None if platform is None else (platform,), gpu=gpu)


def _run(plan: CallPlan, route, q, k, v, *, segment_ids):
    """(out, max_abs_logit or None) of validated inputs by ``route`` of ``plan``: its primal
    backend where nothing differentiates the call and its differentiated one where something
    does (forward or reverse mode: ``kernels/forward_mode.py``)."""
    if q.dtype not in SUPPORTED_DTYPES and (route.primal, route.differentiated) != (
            "reference",) * 2:
        raise ValueError(
            f"q: float64 is computed by implementation='reference' alone, got implementation="
            f"{route.differentiated!r}; cast q, k, v to float32 or pass "
            "implementation='reference'")
    call = plan.call(route)
    as_differentiated = call._replace(primal=route.differentiated)

    def reference(q, k, v, segment_ids):
        from ls_jax.kernels.reference import reference_backend
        return reference_backend(q, k, v, window_sizes=plan.windows, segment_ids=segment_ids,
                                 scale=plan.scale, return_logit_stats=False,
                                 interpret=False)[0]

    part = plan.partitioning
    return with_forward_mode(
        lambda *a: attention(call, part, *a), lambda *a: attention(as_differentiated, part, *a),
        reference, q, k, v, segment_ids)
