"""``ls_attention`` under a device mesh: one kernel call per shard through ``jax.shard_map``.

A Pallas kernel is an opaque custom call to XLA's partitioner: left alone under a sharded
``jit`` its operands are gathered and every device runs the whole batch. Here the call is
placed inside ``jax.shard_map`` instead:

* the batch axis is split over the mesh's batch axes (default ``("data", "fsdp")``, those
  present with size > 1),
* the head axis over the head axis (default ``"tensor"``) when the mesh has it with size > 1;
  query heads and key/value heads are cut into the same number of contiguous chunks, so GQA's
  head h -> kv head h // (Hq // Hkv) stays inside a shard,
* each head shard runs with its own slice of the static per-head window table. The slices can
  differ (with one global head, shard 0 holds it and the others do not); every distinct slice
  becomes one branch of a ``lax.switch`` on the shard's index along the head axis, so each
  shard runs exactly its own static windows (identical slices share one branch; with a single
  distinct slice there is no switch),
* the logit statistic ``max_abs_logit`` [Hq] is reduced with ``pmax`` over the batch axes and
  laid out over the head axis, so the caller sees the same [Hq] vector as without a mesh.

Forward and backward run per shard (the backends' own custom VJPs run inside the map). Without
a mesh (or a mesh of one device) this is exactly ``ls_attention``.
"""

from __future__ import annotations

import functools
import math
import re
from typing import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ls_jax.kernels.api import LogitStats, ls_attention, normalize_window_sizes

BATCH_AXES = ("data", "fsdp")
HEAD_AXIS = "tensor"


def _active(mesh, names: Sequence[str]) -> tuple[str, ...]:
    return tuple(a for a in names if a in mesh.axis_names and mesh.shape[a] > 1)


def _spec_entry(axes: tuple[str, ...]):
    return None if not axes else axes[0] if len(axes) == 1 else axes


def head_shard_windows(window_sizes, num_shards: int) -> list[tuple[int | None, ...]]:
    """The window slice of each of ``num_shards`` contiguous head shards."""
    per = len(window_sizes) // num_shards
    return [tuple(window_sizes[s * per:(s + 1) * per]) for s in range(num_shards)]


def shard_plan(mesh, q_shape, kv_heads: int, batch_axes=BATCH_AXES, head_axis=HEAD_AXIS):
    """(batch mesh axes, head mesh axis or None) this call splits over; ValueError when the
    shapes do not divide."""
    B, _, Hq, _ = q_shape
    batch = _active(mesh, batch_axes)
    n_batch = math.prod(mesh.shape[a] for a in batch)
    if B % n_batch:
        raise ValueError(
            f"q: expected a batch divisible by the {n_batch} devices of mesh axes {batch} "
            f"(batch over {batch_axes}), got batch {B} (shape {tuple(q_shape)})")
    heads = _active(mesh, (head_axis,)) if head_axis else ()
    if heads:
        n_h = mesh.shape[head_axis]
        if Hq % n_h or kv_heads % n_h:
            raise ValueError(
                f"q: expected query heads ({Hq}) and key/value heads ({kv_heads}) divisible by "
                f"mesh axis {head_axis!r} of size {n_h}")
    return batch, (heads[0] if heads else None)


def ls_attention_sharded(q, k, v, window_sizes, *, mesh=None, batch_axes=BATCH_AXES,
                         head_axis: str | None = HEAD_AXIS, segment_ids=None,
                         return_logit_stats: bool = False, implementation=None,
                         interpret=False, **kernel_kwargs):
    """``ls_attention`` run per shard of ``mesh`` (default: the mesh set by ``jax.set_mesh``).

    Arguments as ``kernels.ls_attention`` (extra keywords such as the logit scale are passed
    through); ``batch_axes`` / ``head_axis`` name the mesh axes that split the batch and the
    heads. The result is the same function of the global arrays as ``ls_attention``.
    """
    call = functools.partial(ls_attention, implementation=implementation, interpret=interpret,
                             **kernel_kwargs)
    if mesh is None:
        mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty or mesh.size == 1:
        return call(q, k, v, window_sizes, segment_ids=segment_ids,
                    return_logit_stats=return_logit_stats)
    windows = normalize_window_sizes(window_sizes, q.shape[2])
    batch, head = shard_plan(mesh, q.shape, k.shape[2], batch_axes, head_axis)
    if not batch and head is None:
        return call(q, k, v, windows, segment_ids=segment_ids,
                    return_logit_stats=return_logit_stats)

    slices = head_shard_windows(windows, mesh.shape[head] if head else 1)
    distinct = list(dict.fromkeys(slices))
    branch_of_shard = [distinct.index(s) for s in slices]

    def per_shard(q, k, v, *seg):
        seg = seg[0] if seg else None

        def run(ws):
            if not return_logit_stats:
                return call(q, k, v, ws, segment_ids=seg), jnp.zeros((len(ws),), jnp.float32)
            out, stats = call(q, k, v, ws, segment_ids=seg, return_logit_stats=True)
            return out, stats.max_abs_logit

        if len(distinct) == 1:
            out, max_abs_H = run(distinct[0])
        else:  # each head shard runs its own static windows
            idx = jnp.asarray(branch_of_shard, jnp.int32)[jax.lax.axis_index(head)]
            out, max_abs_H = jax.lax.switch(idx, [functools.partial(run, ws) for ws in distinct])
        if batch and return_logit_stats:
            max_abs_H = jax.lax.pmax(max_abs_H, batch)
        return out, jax.lax.stop_gradient(max_abs_H)

    qkv_spec = P(_spec_entry(batch), None, head, None)
    args, in_specs = (q, k, v), (qkv_spec,) * 3
    if segment_ids is not None:
        args, in_specs = args + (segment_ids,), in_specs + (P(_spec_entry(batch), None),)
    manual = frozenset(batch + ((head,) if head else ()))
    if all(mesh.shape[a] == 1 for a in mesh.axis_names if a not in manual):
        manual = frozenset(mesh.axis_names)  # fully manual: Pallas interpret's callbacks need it
    fn = jax.shard_map(per_shard, mesh=mesh, axis_names=manual, in_specs=in_specs,
                       out_specs=(qkv_spec, P(head)), check_vma=False)
    out, max_abs_H = fn(*args)
    if not return_logit_stats:
        return out
    return out, LogitStats(max_abs_logit=max_abs_H)


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
            continue  # Mosaic GPU custom call's module: it hung bench/scaling.py, run O)
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
