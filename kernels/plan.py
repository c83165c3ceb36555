"""One plan per ``ls_attention`` call: which code runs, decided in one place.

``plan_call`` turns a validated call (shapes, dtype, windows, options), the platforms it is
lowered for and the mesh in context into a frozen ``CallPlan``:

* **routes**: per platform, the backend of the call where nothing differentiates it and the
  backend where something does (``dispatch.py``'s rules, or the one ``implementation=``
  names); the two differ only where a faster forward-only backend exists
  (``directional.py`` runs the pair);
* **partitioning**: how the call lies on the mesh: whole, a ``jax.shard_map`` over a known
  layout (Explicit axes, or the caller's ``partition_spec``), or custom-partitioned ops whose
  split XLA chooses while compiling (Auto axes); ``sharded.py`` executes it;
* **launches**: what each backend launches for one shard (``backends.launch_lines``; the
  Pallas GPU launches are ``pallas_gpu/heuristics.py``'s, the TPU blocks
  ``pallas_tpu/plan.py``'s), computed when the plan is printed.

``ls_attention`` executes the plan; ``ls_jax.kernels.explain`` returns it for printing.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import PartitionSpec

from ls_jax.kernels.backends import IMPLEMENTATIONS, launch_lines
from ls_jax.kernels.band import WindowSizes
from ls_jax.kernels import dispatch
from ls_jax.kernels.dispatch import INTERPRET_IMPLEMENTATIONS
from ls_jax.kernels.sharded import Call, Layout, head_shard_windows, layout_of, mesh_axes

__all__ = ["CallPlan", "Partitioning", "Route", "check_backend_options", "partitioning",
           "plan_call"]

# backends that call JAX's cuDNN attention (kernels/cudnn.py, kernels/split.py), which lowers
# for CUDA alone: a program exported for several platforms runs "pallas_gpu" in their place
JAX_KERNELS = ("cudnn", "split")


class Route(NamedTuple):
    """The backends of one platform: ``primal`` where nothing differentiates the call,
    ``differentiated`` (its forward and backward) where something does."""

    platform: str
    primal: str
    differentiated: str


class Partitioning(NamedTuple):
    """How the call lies on the mesh. path: "whole" (one backend call on the arrays as they
    are), "shard_map" (one call per shard of ``layout``; ``mesh`` the Explicit mesh the inputs
    are resharded to, None: the mesh in context) or "custom_partitioning" (Auto axes: one call
    per shard of the split XLA chooses)."""

    path: str
    reason: str
    layout: Layout | None = None
    mesh: Any = None


@dataclasses.dataclass(frozen=True)
class CallPlan:
    """Everything decided about one ``ls_attention`` call; ``str(plan)`` says it in lines.

    chosen: ``implementation=None`` chose the routes (else the caller named the backend).
    guard: the routes are chosen for the tracing machine's platform, so a lowering for another
    platform is refused. gpu: the ``pallas_gpu.heuristics.Gpu`` the
    GPU launches are shown for (None: this process's GPU).
    """

    batch: int
    seq_len: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    windows: WindowSizes
    scale: float
    logit_stats: bool
    has_segments: bool
    interpret: Any
    routes: tuple[Route, ...]
    chosen: bool
    guard: bool
    partitioning: Partitioning
    gpu: Any = None

    def call(self, route: Route) -> Call:
        """The ``sharded.Call`` that executes ``route``."""
        return Call(primal=route.primal, differentiated=route.differentiated,
                    windows=self.windows, scale=self.scale, logit_stats=self.logit_stats,
                    has_segments=self.has_segments, interpret=self.interpret)

    def shards(self) -> tuple[int, tuple[WindowSizes, ...]]:
        """(batch rows per shard, the distinct window slices of the head shards) of a known
        layout; the whole call otherwise."""
        part = self.partitioning
        if part.layout is None:
            return self.batch, (self.windows,)
        sizes = dict((part.mesh or jax.sharding.get_abstract_mesh()).shape)
        n_batch = math.prod(sizes[a] for a in part.layout.batch)
        n_heads = math.prod(sizes[a] for a in part.layout.heads)
        slices = tuple(dict.fromkeys(head_shard_windows(self.windows, n_heads)))
        return self.batch // n_batch, slices

    def launches(self, route: Route) -> tuple[str, ...]:
        """What ``route``'s backends launch for one shard, a line each."""
        from ls_jax.kernels.pallas_gpu.heuristics import current_gpu
        gpu = self.gpu if self.gpu is not None else current_gpu(bool(self.interpret))
        batch, slices = self.shards()
        lines = []
        for windows in slices:
            kv_heads = self.num_kv_heads * len(windows) // self.num_heads
            case = dict(batch=batch, seq_len=self.seq_len, head_dim=self.head_dim,
                        windows=windows, num_kv_heads=kv_heads, dtype=jax.numpy.dtype(self.dtype),
                        has_segments=self.has_segments, gpu=gpu, interpret=self.interpret)
            head = f"    head shard with windows {_windows(windows)}:" if len(slices) > 1 else ""
            if head:
                lines.append(head)
            pad = "      " if head else "    "
            if route.primal == route.differentiated:
                lines += [f"{pad}{route.primal}: {line}"
                          for line in launch_lines(route.primal, **case)]
                continue
            # the primal backend runs its forward alone
            lines += [f"{pad}not differentiated, {route.primal}: {line}"
                      for line in launch_lines(route.primal, **case)
                      if not line.startswith("backward")]
            lines += [f"{pad}differentiated, {route.differentiated}: {line}"
                      for line in launch_lines(route.differentiated, **case)]
        return tuple(lines)

    def __str__(self) -> str:
        shape = (f"q [B={self.batch}, T={self.seq_len}, H={self.num_heads}, D={self.head_dim}] "
                 f"{self.dtype}, k/v heads {self.num_kv_heads}, windows "
                 f"{_windows(self.windows)}")
        options = [name for name, on in (("logit stats", self.logit_stats),
                                         ("segment ids", self.has_segments),
                                         ("interpret", bool(self.interpret))) if on]
        lines = ["ls_attention call plan", f"  call: {shape}"
                 + (f"; {', '.join(options)}" if options else "")]
        how = "implementation=None's choice" if self.chosen else "named by implementation="
        for route in self.routes:
            if route.primal == route.differentiated:
                lines.append(f"  {route.platform}: {route.primal} forward and backward ({how})")
            else:
                lines.append(f"  {route.platform}: {route.primal} where nothing differentiates "
                             f"the call, {route.differentiated} forward and backward under a "
                             f"gradient ({how})")
        part = self.partitioning
        where = f"  partitioning: {part.path} ({part.reason})"
        if part.layout is not None:
            where += f", q, k, v as {part.layout.qkv}"
        lines.append(where)
        batch, slices = self.shards()
        if part.layout is not None:
            lines.append(f"  per shard: batch {batch}, {len(slices[0])} heads")
        elif part.path == "custom_partitioning":
            lines.append("  per shard: the shard XLA chooses; launches shown for the whole call")
        for route in self.routes:
            lines.append(f"  launches on {route.platform}, per shard:")
            lines += self.launches(route)
        return "\n".join(lines)


def _windows(windows: WindowSizes) -> str:
    """(None, 128 x 15) for (None, 128, ..., 128): runs of one window counted."""
    runs: list[list] = []
    for w in windows:
        if runs and runs[-1][0] == w:
            runs[-1][1] += 1
        else:
            runs.append([w, 1])
    return "(" + ", ".join(f"{w}" if n == 1 else f"{w} x {n}" for w, n in runs) + ")"


def _routes(implementation: str | None, platforms: tuple[str, ...], case: dict,
            hopper: bool | None) -> tuple[Route, ...]:
    if implementation is not None:  # one backend, whatever the platform
        return (Route("+".join(platforms), implementation, implementation),)

    def pick(name):  # cuDNN's calls lower for one platform alone
        return "pallas_gpu" if len(platforms) > 1 and name in JAX_KERNELS else name

    def one(platform):
        return Route(platform,
                     pick(dispatch.choose_primal_implementation(platform, hopper=hopper, **case)),
                     pick(dispatch.choose_implementation(platform, hopper=hopper, **case)))
    return tuple(one(p) for p in platforms)


def _sharding_of(q):
    try:
        return jax.typeof(q).sharding
    except TypeError:  # a jax.ShapeDtypeStruct
        return getattr(q, "sharding", None)


def check_backend_options(implementation: str | None, interpret: Any) -> None:
    """``implementation`` and ``interpret`` as a call (or a layer, when it is built) takes
    them; ValueError naming the argument otherwise."""
    if implementation is not None and implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"implementation: expected None or one of {IMPLEMENTATIONS}, got {implementation!r}")
    if interpret and implementation not in INTERPRET_IMPLEMENTATIONS:
        raise ValueError(
            f"interpret: {interpret!r} runs a Pallas backend in interpret mode and needs "
            f"implementation one of {INTERPRET_IMPLEMENTATIONS}, got "
            f"implementation={implementation!r}")


def check_symbolic_length(seq_len, implementation: str | None,
                          platforms: tuple[str, ...]) -> None:
    """A symbolic T (``jax.export.symbolic_shape``): the reference computes it, the kernels
    cannot (their launch grids and band tables are static); ValueError (one line) unless the
    call runs the reference on every platform it is lowered for."""
    if implementation is not None:
        kernels = () if implementation == "reference" else platforms
    else:
        kernels = tuple(p for p in platforms
                        if dispatch.choose_implementation(p) != "reference")
    if not kernels:
        return
    runs = (f"implementation={implementation!r}" if implementation is not None
            else f"implementation=None, which runs a kernel on {kernels!r}")
    raise ValueError(
        f"q: a symbolic sequence length T={seq_len} runs on implementation='reference' alone "
        f"(a kernel's launch grid is static), got {runs}; export a program per length for "
        "the kernels, or the reference: implementation='reference', or "
        "ls_jax.interop.export.export(..., platforms=('cpu',))")


def partitioning(q, num_kv_heads: int, partition_spec: PartitionSpec | None,
                 tpu_interpreter: bool) -> Partitioning:
    """How a call on ``q`` lies on the mesh in context (``sharded.py``'s docstring);
    ValueError (one line) for a layout that is not split per shard."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.manual_axes:
        return Partitioning("whole", "inside a shard_map: the program is already per shard")
    if partition_spec is not None and not mesh.empty:
        layout = layout_of(dict(mesh.shape), partition_spec, q.shape, num_kv_heads)
        if not (layout.batch or layout.heads):
            return Partitioning("whole", "partition_spec splits neither the batch nor the heads")
        return Partitioning("shard_map", "the caller's partition_spec", layout,
                            mesh if mesh.explicit_axes else None)
    sharding = _sharding_of(q)
    q_mesh = getattr(sharding, "mesh", None)
    if q_mesh is not None and not q_mesh.empty and q_mesh.explicit_axes:
        spec = tuple(sharding.spec)
        if any(mesh_axes(e) for e in spec):
            layout = layout_of(dict(q_mesh.shape), spec, q.shape, num_kv_heads)
            return Partitioning("shard_map", "q's sharding on Explicit axes", layout, q_mesh)
        if not q_mesh.auto_axes:
            return Partitioning("whole", "q is not split on its Explicit axes")
    # the devices of the mesh in context (a compile for another topology names its own), else
    # of this process
    devices = mesh.size if not mesh.empty else jax.device_count()
    if devices == 1:
        return Partitioning("whole", "one device")
    if tpu_interpreter:  # JAX cannot lower its ordered host callbacks in a partitioned op
        return Partitioning("whole", "Pallas' TPU interpreter runs unpartitioned")
    return Partitioning("custom_partitioning",
                        f"Auto axes over {devices} devices: XLA chooses the split")


def plan_call(q, k, windows: WindowSizes, *, scale: float, has_segments: bool,
              logit_stats: bool, implementation: str | None, interpret: Any,
              partition_spec: PartitionSpec | None, platforms: tuple[str, ...] | None = None,
              gpu=None) -> CallPlan:
    """The plan of a call on validated inputs (``api.validate_inputs``): q, k arrays, tracers
    or ``jax.ShapeDtypeStruct``s; ``platforms``: those the call is lowered for (None: the
    tracing machine's); ``gpu``: a ``pallas_gpu.heuristics.Gpu`` to plan for (None: this
    process's). Raises ValueError (one line) for an option the call cannot take."""
    if partition_spec is not None and not isinstance(partition_spec, PartitionSpec):
        raise ValueError(
            "partition_spec: expected None or a jax.sharding.PartitionSpec, got "
            f"{type(partition_spec).__name__}")
    check_backend_options(implementation, interpret)
    B, T, H, D = q.shape
    guard = implementation is None and platforms is None
    platforms = (dispatch.current_platform(),) if platforms is None else tuple(platforms)
    if jax.export.is_symbolic_dim(T):
        check_symbolic_length(T, implementation, platforms)
    case = dict(window_sizes=windows, seq_len=T, head_dim=D, dtype=q.dtype,
                has_segments=has_segments, return_logit_stats=logit_stats)
    routes = _routes(implementation, platforms, case,
                     None if gpu is None else gpu.hopper)
    tpu_interpreter = bool(interpret) and any(
        "pallas_tpu" in (r.primal, r.differentiated) for r in routes)
    return CallPlan(
        batch=B, seq_len=T, num_heads=H, num_kv_heads=k.shape[2], head_dim=D,
        dtype=np.dtype(q.dtype).name, windows=windows, scale=scale, logit_stats=logit_stats,
        has_segments=has_segments, interpret=interpret, routes=routes,
        chosen=implementation is None, guard=guard,
        partitioning=partitioning(q, k.shape[2], partition_spec, tpu_interpreter), gpu=gpu)
