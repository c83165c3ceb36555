"""``ls_attention`` on sharded inputs: one kernel call per shard, under any mesh.

A Pallas kernel is an opaque custom call to XLA's partitioner: left alone under a sharded
``jit``, its operands are gathered and every device runs the whole batch. ``ls_attention``
instead runs its backend once per shard, the batch and the heads split over whichever mesh
axes the inputs are sharded along (any names), as ``jax.nn.dot_product_attention``'s cuDNN
call does:

* **Explicit** axis types (``jax.sharding.AxisType.Explicit``): the sharding is in the inputs'
  type (``jax.typeof(q).sharding``); the call is a ``jax.shard_map`` over those axes, and
  autodiff runs the backend's own VJP per shard.
* **Auto** axis types (XLA's propagation decides the sharding while it compiles): the forward
  and the backward are each a ``jax.experimental.custom_partitioning`` op with a sharding rule
  (batch and heads may be split, GQA's kv heads together with their query heads). XLA tells
  each op the sharding it chose and the op runs per shard. The forward keeps the output and
  the backend's row statistic (its logsumexp) for the backward where the backend provides that
  pair (``kernels/backends.py``); for the other backends the backward runs the forward again
  per shard. Where ``implementation=None`` pairs a faster forward-only backend with the
  differentiated one (``kernels/directional.py``), the forward-only op runs the former.
  "cudnn" partitions itself (JAX's cuDNN call has its own custom partitioning) and is called
  as it is.
* a layout the caller gives (``partition_spec``, under ``jax.set_mesh``): a ``jax.shard_map``
  over it, whatever the axis types; no custom partitioning (which a compile for a TPU
  topology from a host without TPUs does not have).
* otherwise (one device, or inside a ``shard_map`` that already made the call per shard) the
  backend is called as it is; so is Pallas' TPU interpreter (``interpret=True`` with
  "pallas_tpu") on Auto axes, since JAX cannot lower its ordered host callbacks inside a
  custom-partitioned op.

Per shard, query heads and kv heads are cut into the same number of contiguous chunks (GQA's
head h -> kv head h // (Hq // Hkv) stays in its shard); each head shard runs its own slice of
the static per-head window table (a ``lax.switch`` on the shard's index where slices differ,
one branch per distinct slice); the logit statistic ``max_abs_logit`` [Hq] is reduced with
``pmax`` over the batch axes and laid out over the head axes, so the caller sees the same [Hq]
vector as without a mesh.

Refused with one line (Explicit axes, ``partition_spec``): a sequence (T) or head-dim (D) axis
split over devices (a split sequence needs a ring schedule, which this op does not have;
reshard q, k, v to ``P(batch, None, heads, None)``), and head shards that do not divide both
the query and the kv heads. On Auto axes XLA chose the split, and an error raised in its
partitioner reaches the caller inside a long compile traceback: the op takes such a dimension
whole instead (XLA gathers it) and says so in one ``ShardingWarning`` line (``auto_layout``).
One kv head (MQA) keeps the query heads whole on Auto axes. Under ``jax.vmap`` the mapped axis
is one more batch dimension of the op, split as XLA splits it.
"""

from __future__ import annotations

import functools
import math
import re
import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import (ArrayMapping, CompoundFactor,
                                                  SdyShardingRule, custom_partitioning)
from jax.sharding import NamedSharding, PartitionSpec as P

from ls_jax.kernels import backends
from ls_jax.kernels.band import WindowSizes
from ls_jax.kernels.directional import directional_backend

__all__ = ["Call", "Layout", "activation_gathers", "attention", "head_shard_windows",
           "layout_of", "mesh_axes", "qkv_gathers"]


class Call(NamedTuple):
    """One validated ``ls_attention`` call, without its arrays (hashable: a static argument).

    primal: the backend of a call that nothing differentiates; differentiated: the backend of a
    differentiated one (its forward and backward); the two differ only where
    ``implementation=None`` pairs them (``kernels/dispatch.py``).
    """

    primal: str
    differentiated: str
    windows: WindowSizes
    scale: float
    logit_stats: bool
    has_segments: bool
    interpret: Any


class Layout(NamedTuple):
    """The mesh axes a call splits its batch over and its heads over (each possibly ()).

    ``lead``: where the arrays have several leading batch dimensions (the op under
    ``jax.vmap``: [*L, T, H, D]), the axes of each; None: one batch dimension split over
    ``batch``."""

    batch: tuple[str, ...]
    heads: tuple[str, ...]
    lead: tuple[tuple[str, ...], ...] | None = None

    def entry(self, axes):
        return None if not axes else axes[0] if len(axes) == 1 else axes

    @property
    def leading(self) -> tuple:
        lead = (self.batch,) if self.lead is None else self.lead
        return tuple(self.entry(a) for a in lead)

    @property
    def qkv(self) -> P:
        """[B, T, H, D] arrays: q, k, v, the output and their gradients."""
        return P(*self.leading, None, self.entry(self.heads), None)

    @property
    def segments(self) -> P:
        return P(*self.leading, None)

    @property
    def rows(self) -> P:
        """[B, H, T]: the backend's row statistic."""
        return P(*self.leading, self.entry(self.heads), None)

    @property
    def stats(self) -> P:
        """[H]: the logit statistic, reduced over the batch."""
        return P(self.entry(self.heads))


def head_shard_windows(window_sizes, num_shards: int) -> list[tuple[int | None, ...]]:
    """The window slice of each of ``num_shards`` contiguous head shards."""
    per = len(window_sizes) // num_shards
    return [tuple(window_sizes[s * per:(s + 1) * per]) for s in range(num_shards)]


def mesh_axes(entry) -> tuple[str, ...]:
    """The mesh axes of one ``PartitionSpec`` entry (None, a name or a tuple of names)."""
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def layout_of(axis_sizes: dict, spec, q_shape, kv_heads: int) -> Layout:
    """The ``Layout`` of a call whose q is sharded as ``spec`` over a mesh with
    ``axis_sizes``; ValueError (one line) for what is not split per shard."""
    B, T, H, D = q_shape
    spec = tuple(spec) + (None,) * (4 - len(tuple(spec)))
    batch, seq, heads, dim = (mesh_axes(e) for e in spec)
    if seq:
        raise ValueError(
            f"q: sharded along the sequence axis (T={T}) over mesh axes {seq}; ls_attention "
            "splits only the batch and the heads (a split sequence needs ring attention): "
            "reshard q, k, v as P(batch_axes, None, head_axes, None)")
    if dim:
        raise ValueError(
            f"q: sharded along the head dimension (D={D}) over mesh axes {dim}; ls_attention "
            "splits only the batch and the heads: reshard q, k, v as P(batch_axes, None, "
            "head_axes, None)")
    n_batch = math.prod(axis_sizes[a] for a in batch)
    if B % n_batch:
        raise ValueError(
            f"q: expected a batch divisible by the {n_batch} shards of mesh axes {batch}, got "
            f"batch {B}")
    n_heads = math.prod(axis_sizes[a] for a in heads)
    if H % n_heads or kv_heads % n_heads:
        raise ValueError(
            f"q: expected query heads ({H}) and key/value heads ({kv_heads}) divisible by the "
            f"{n_heads} shards of mesh axes {heads}")
    return Layout(batch, heads)


# -- one backend call, per shard or whole -------------------------------------------------

def _get_backend(implementation: str):
    return backends.get_backend(implementation)  # read per call: tests replace it


def run_backend(call: Call, q, k, v, segment_ids):
    """(out, max_abs_logit [H] or None) of the call's backend(s) on these (whole) arrays."""
    backend = _get_backend(call.differentiated)
    if call.primal != call.differentiated:  # a faster forward where nothing differentiates
        backend = directional_backend(_get_backend(call.primal), backend)
    return backend(q, k, v, window_sizes=call.windows, segment_ids=segment_ids,
                   scale=call.scale, return_logit_stats=call.logit_stats,
                   interpret=call.interpret)


def _head_shard_index(heads: tuple[str, ...], axis_sizes: dict):
    index = 0
    for a in heads:  # row-major over the head axes, as a PartitionSpec entry splits
        index = index * axis_sizes[a] + jax.lax.axis_index(a)
    return index


def _per_shard(fn, call: Call, layout: Layout, axis_sizes: dict, stats_at: int | None):
    """``fn(call, *arrays) -> tuple`` run with the shard's own window slice; the output at
    ``stats_at`` (the logit statistic) reduced over the batch axes."""
    slices = head_shard_windows(call.windows, math.prod(axis_sizes[a] for a in layout.heads))
    distinct = list(dict.fromkeys(slices))

    def body(*arrays):
        if len(distinct) == 1:
            outs = fn(call._replace(windows=distinct[0]), *arrays)
        else:
            branch_of_shard = jnp.asarray([distinct.index(s) for s in slices], jnp.int32)
            branch = branch_of_shard[_head_shard_index(layout.heads, axis_sizes)]
            outs = jax.lax.switch(
                branch, [functools.partial(fn, call._replace(windows=s)) for s in distinct],
                *arrays)
        outs = tuple(outs)
        if stats_at is not None and layout.batch:
            outs = (outs[:stats_at] + (jax.lax.pmax(outs[stats_at], layout.batch),)
                    + outs[stats_at + 1:])
        return outs

    return body


# -- a known layout (Explicit axes, or the caller's spec): shard_map ---------------------------

def _shard_mapped(call: Call, mesh, layout: Layout, q, k, v, segment_ids):
    """The call as a ``jax.shard_map`` over ``layout`` on ``mesh`` (None: the mesh in
    context); inputs of Explicit axes are resharded to it, Auto ones constrained by it."""
    def run(call, q, k, v, *seg):
        out, stats = run_backend(call, q, k, v, seg[0] if seg else None)
        return (out, stats) if call.logit_stats else (out,)

    args, in_specs = [q, k, v], [layout.qkv] * 3
    if segment_ids is not None:
        args, in_specs = args + [segment_ids], in_specs + [layout.segments]
    if mesh is not None:
        args = [jax.sharding.reshard(x, NamedSharding(mesh, s)) for x, s in zip(args, in_specs)]
    sizes = dict((mesh or jax.sharding.get_abstract_mesh()).shape)
    out_specs = (layout.qkv, layout.stats) if call.logit_stats else (layout.qkv,)
    body = _per_shard(run, call, layout, sizes, 1 if call.logit_stats else None)
    outs = jax.shard_map(body, mesh=mesh, in_specs=tuple(in_specs), out_specs=out_specs,
                         check_vma=False)(*args)
    return outs[0], (outs[1] if call.logit_stats else None)


# -- Auto axes: custom-partitioned forward and backward ------------------------------------

class _Op(NamedTuple):
    """A custom-partitioned op: role "primal" (the forward-only backend: out, [stats]),
    "forward" (the differentiated backend: out, [stats], [row statistic]) or "backward"
    (q, k, v, [seg], [out, row statistic], dO -> dq, dk, dv)."""

    call: Call
    role: str

    @property
    def saves_rows(self) -> bool:
        return backends.residual_pair(self.call.differentiated) is not None

    @property
    def stats_at(self) -> int | None:
        return 1 if self.role != "backward" and self.call.logit_stats else None


def _run_op(op: _Op, *arrays):
    """The op's computation on whole arrays (per shard: the shard's arrays and windows);
    arrays with several leading batch dimensions (``jax.vmap``) run as one batch."""
    lead = arrays[0].shape[:-3]
    if len(lead) != 1:
        n = len(lead)
        outs = _run_op(op, *(x.reshape((-1,) + x.shape[n:]) for x in arrays))
        return tuple(y if i == op.stats_at else y.reshape(lead + y.shape[1:])
                     for i, y in enumerate(outs))
    call = op.call
    n_in = 4 if call.has_segments else 3
    q, k, v = arrays[:3]
    seg = arrays[3] if call.has_segments else None
    opts = dict(window_sizes=call.windows, segment_ids=seg, scale=call.scale,
                interpret=call.interpret)
    if op.role == "primal":
        out, stats = run_backend(call._replace(differentiated=call.primal), q, k, v, seg)
        return (out, stats) if call.logit_stats else (out,)
    pair = backends.residual_pair(call.differentiated)
    if op.role == "forward":
        if pair is None:
            out, stats = run_backend(call._replace(primal=call.differentiated), q, k, v, seg)
            return (out, stats) if call.logit_stats else (out,)
        out, rows, stats = pair.forward(q, k, v, return_logit_stats=call.logit_stats, **opts)
        return (out, stats, rows) if call.logit_stats else (out, rows)
    do = arrays[-1]
    if pair is not None:
        out, rows = arrays[n_in:n_in + 2]
        return tuple(pair.backward(q, k, v, out, rows, do, **opts))
    backend = _get_backend(call.differentiated)
    _, pullback = jax.vjp(lambda q, k, v: backend(q, k, v, return_logit_stats=False,
                                                  **opts)[0], q, k, v)
    return tuple(pullback(do))


def _op_impl(op: _Op, *arrays):
    # jit: custom_partitioning takes a function whose jaxpr has no constants
    return jax.jit(_run_op, static_argnums=0)(op, *arrays)


def _sharding_rule(op: _Op, mesh, value_types, result_types):
    del mesh, result_types
    n_lead = len(value_types[0].shape) - 3  # batch dimensions (more than one under jax.vmap)
    b = tuple(f"b{i}" for i in range(n_lead))
    H, G = value_types[0].shape[-2], value_types[1].shape[-2]
    # query head h reads kv head h // r; one kv head (MQA): the query heads stay whole (the
    # head shards must divide the kv heads), and a factor of size 1 cannot be compounded
    heads = "g" if H == G else "r" if G == 1 else CompoundFactor("g", "r")
    q = ArrayMapping(*b, "t", heads, "d")
    kv = ArrayMapping(*b, "s", "g", "d")
    rows = ArrayMapping(*b, heads, "t")
    inputs = [q, kv, kv] + ([ArrayMapping(*b, "t")] if op.call.has_segments else [])
    if op.role == "backward":
        inputs += ([q, rows] if op.saves_rows else []) + [q]
        outputs = [q, kv, kv]
    else:
        outputs = [q] + ([ArrayMapping(heads)] if op.call.logit_stats else [])
        outputs += [rows] if op.role == "forward" and op.saves_rows else []
    sizes = {"r": H // G} if H != G and G != 1 else {}
    replicated = ("r",) if G == 1 and H != G else ()
    return SdyShardingRule(tuple(inputs), tuple(outputs), need_replication_factors=replicated,
                           **sizes)


class ShardingWarning(UserWarning):
    """XLA's sharding propagation (Auto axes) split a dimension that ``ls_attention`` does not
    split per shard; the op takes it whole (XLA gathers it)."""


def auto_layout(axis_sizes: dict, spec, q_shape, kv_heads: int) -> tuple[Layout, list[str]]:
    """The ``Layout`` of a custom-partitioned op whose q XLA sharded as ``spec`` (Auto axes:
    XLA chose it): what ``layout_of`` refuses is taken whole instead, with one line each
    (the sequence or the head dimension split, head shards that do not divide both head
    counts, batch shards that do not divide a batch dimension)."""
    n_lead = len(q_shape) - 3
    spec = tuple(spec) + (None,) * (len(q_shape) - len(tuple(spec)))
    lead = [mesh_axes(e) for e in spec[:n_lead]]
    seq, heads, dim = (mesh_axes(e) for e in spec[n_lead:])
    T, H, D = q_shape[n_lead:]
    notes = []
    for what, axes in ((f"the sequence axis (T={T})", seq), (f"the head dimension (D={D})", dim)):
        if axes:
            notes.append(f"q: sharded along {what} over mesh axes {axes}")
    for i, axes in enumerate(lead):
        n = math.prod(axis_sizes[a] for a in axes)
        if q_shape[i] % n:
            notes.append(f"q: batch {q_shape[i]} not divisible by the {n} shards of mesh axes "
                         f"{axes}")
            lead[i] = ()
    n_heads = math.prod(axis_sizes[a] for a in heads)
    if H % n_heads or kv_heads % n_heads:
        notes.append(f"q: query heads ({H}) and key/value heads ({kv_heads}) not divisible "
                     f"by the {n_heads} shards of mesh axes {heads}")
        heads = ()
    batch = tuple(a for axes in lead for a in axes)
    return Layout(batch, heads, tuple(lead) if n_lead != 1 else None), notes


def _partition(op: _Op, mesh, arg_shapes, result_shape):
    del result_shape
    q, k = arg_shapes[0], arg_shapes[1]
    sharding = q.sharding
    if not isinstance(sharding, NamedSharding):
        raise ValueError(
            "q: ls_attention on several devices needs NamedSharding inputs or a mesh set with "
            f"jax.set_mesh, got {type(sharding).__name__}")
    # An error raised here reaches the caller inside XLA's compile error (a long traceback),
    # so what the op does not split is taken whole, with a warning of one line.
    layout, notes = auto_layout(dict(mesh.shape), sharding.spec, q.shape, k.shape[-2])
    if notes and op.role != "backward":
        warnings.warn(
            "; ".join(notes) + ": ls_attention splits only the batch and the heads and takes "
            "the rest whole (XLA gathers it); shard q, k, v as P(batch_axes, None, head_axes, "
            "None)", ShardingWarning, stacklevel=2)
    call = op.call
    ins = [layout.qkv] * 3 + ([layout.segments] if call.has_segments else [])
    if op.role == "backward":
        ins += ([layout.qkv, layout.rows] if op.saves_rows else []) + [layout.qkv]
        outs = [layout.qkv] * 3
    else:
        outs = [layout.qkv] + ([layout.stats] if call.logit_stats else [])
        outs += [layout.rows] if op.role == "forward" and op.saves_rows else []
    body = _per_shard(lambda c, *a: _run_op(op._replace(call=c), *a), call, layout,
                      dict(mesh.shape), op.stats_at)
    named = lambda specs: tuple(NamedSharding(mesh, s) for s in specs)  # noqa: E731
    return mesh, body, named(outs), named(ins)


_partitioned_op = custom_partitioning(_op_impl, static_argnums=(0,))
_partitioned_op.def_partition(partition=_partition, sharding_rule=_sharding_rule)


def _apply(op: _Op, *arrays):
    """The partitioned op; under ``jax.vmap`` the mapped axis joins the batch axis (the op
    has no batching rule of its own)."""

    @jax.custom_batching.custom_vmap
    def apply(*arrays):
        return tuple(_partitioned_op(op, *arrays))

    @apply.def_vmap
    def apply_vmap(axis_size, in_batched, *arrays):
        if op.stats_at is not None:
            raise NotImplementedError(
                "return_logit_stats: not supported under jax.vmap on several devices (the "
                "statistic is a max over the batch); call ls_attention on the whole batch")
        arrays = [x if b else jnp.broadcast_to(x, (axis_size,) + x.shape)
                  for x, b in zip(arrays, in_batched)]
        # the mapped axis is one more batch dimension of the op (its own sharding factor), so
        # that XLA keeps the sharding of either, whichever is split
        outs = _apply(op, *arrays)
        return tuple(outs), (True,) * len(outs)

    return apply(*arrays)


# Backends that partition themselves: "cudnn" is jax.nn.dot_product_attention's cuDNN call,
# custom-partitioned by JAX (batch and heads), its statistic pass plain JAX.
SELF_PARTITIONING = ("cudnn",)


def _auto(call: Call, q, k, v, segment_ids):
    if call.differentiated in SELF_PARTITIONING:
        if call.primal == call.differentiated:
            return run_backend(call, q, k, v, segment_ids)

        def primal(q, k, v, *, segment_ids, **_):  # our forward, partitioned by the op
            return _auto(call._replace(differentiated=call.primal), q, k, v, segment_ids)

        backend = directional_backend(primal, _get_backend(call.differentiated))
        return backend(q, k, v, window_sizes=call.windows, segment_ids=segment_ids,
                       scale=call.scale, return_logit_stats=call.logit_stats,
                       interpret=call.interpret)
    arrays = (q, k, v) + ((segment_ids,) if segment_ids is not None else ())
    forward = _Op(call, "forward")

    @jax.custom_vjp
    def attend(*arrays):
        return _apply(_Op(call, "primal"), *arrays)

    def attend_fwd(*arrays):
        outs = _apply(forward, *arrays)
        rows = outs[-1:] if forward.saves_rows else ()
        primal_outs = outs[:-1] if forward.saves_rows else outs
        return primal_outs, (arrays, outs[0], rows)

    def attend_bwd(saved, cotangents):
        arrays, out, rows = saved
        do = cotangents[0].astype(arrays[0].dtype)
        saved_out = (out,) + rows if rows else ()
        grads = _apply(_Op(call, "backward"), *arrays, *saved_out, do)
        return tuple(grads) + ((None,) if call.has_segments else ())

    attend.defvjp(attend_fwd, attend_bwd)
    outs = attend(*arrays)
    return outs[0], (outs[1] if call.logit_stats else None)


# -- which path ------------------------------------------------------------------------------

def attention(call: Call, partitioning, q, k, v, segment_ids):
    """(out, max_abs_logit [H] or None) of ``call`` on q, k, v, laid out on the mesh as
    ``partitioning`` (a ``kernels.plan.Partitioning``) says."""
    if partitioning.path == "shard_map":
        return _shard_mapped(call, partitioning.mesh, partitioning.layout, q, k, v, segment_ids)
    if partitioning.path == "custom_partitioning":
        return _auto(call, q, k, v, segment_ids)
    return run_backend(call, q, k, v, segment_ids)


# -- checks on compiled programs --------------------------------------------------------------

_HLO_SHAPE = re.compile(r"[a-z]+[0-9]*\[([0-9,]*)\]")
_HLO_ALL_GATHER = re.compile(r"=\s*(.*?)\s+all-gather(?:-start)?\(")


def activation_gathers(hlo_text: str, seq_len: int, last_dims=None) -> list[str]:
    """The all-gather instructions of compiled HLO text whose result has a dimension of
    ``seq_len`` (and, if ``last_dims`` is given, a last dimension in it): gathers of
    activations rather than of weights (pick a seq_len no weight has).

    ``qkv_gathers`` narrows this to the attention operands."""
    found = []
    for line in hlo_text.splitlines():
        if "all-gather" not in line:  # the regex is slow on a long line with many "=" (a
            continue  # Mosaic GPU custom call's module inline)
        m = _HLO_ALL_GATHER.search(line)
        if m is None:
            continue
        for dims in _HLO_SHAPE.findall(m.group(1)):
            shape = [int(d) for d in dims.split(",")] if dims else []
            if seq_len in shape and (last_dims is None or shape[-1] in last_dims):
                found.append(line.strip())
                break
    return found


def qkv_gathers(hlo_text: str, seq_len: int, n_head: int, head_dim: int) -> list[str]:
    """All-gathers of q, k or v (or their grads) around the attention: results [.., T, .., D]
    with D = head_dim, or [.., T, h * head_dim] (heads flattened). A step whose kernel runs
    per shard has none; one whose kernel runs on the gathered batch has several."""
    return activation_gathers(hlo_text, seq_len,
                              last_dims={head_dim * h for h in range(1, n_head + 1)})
