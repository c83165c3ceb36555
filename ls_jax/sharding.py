"""The device mesh and how arrays lie on it: mesh axes from the config, logical-axis rules for
the parameters, batch sharding, and the process-local -> global batch step.

Mesh axes (``MeshConfig``; -1 = every device left over):

* ``data``: pure data parallelism (parameters replicated along it),
* ``fsdp``: data parallelism with parameters and optimizer state split along it (ZeRO-3 style;
  XLA gathers each weight where it is used and reduce-scatters its gradient),
* ``tensor``: attention heads and MLP hidden units split along it (Megatron style).

The batch is split over ``("data", "fsdp")``. Parameters carry logical axis names
(``nnx.with_partitioning`` in layers/transformer.py and layers/attention.py);
``LOGICAL_RULES`` maps them to mesh axes. A dimension that a mesh axis does not divide stays whole (replicated) along that axis.
"""

from __future__ import annotations

import math
import os
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from ls_jax.config import MeshConfig

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")

# logical parameter axis -> mesh axis (None: not split)
LOGICAL_RULES: dict[str, str | None] = {
    "vocab": "tensor",
    "embed": "fsdp",
    "heads": "tensor",  # q/k/v projection outputs and o_proj inputs, in whole heads
    "mlp": "tensor",
    "positions": None,
}


def mesh_shape(mcfg: MeshConfig, n_devices: int) -> tuple[int, int, int]:
    """(data, fsdp, tensor) sizes with the -1 entry resolved; ValueError if they do not
    multiply to ``n_devices``."""
    sizes = {"data": mcfg.data, "fsdp": mcfg.fsdp, "tensor": mcfg.tensor}
    fixed = math.prod(v for v in sizes.values() if v != -1)
    rest = [k for k, v in sizes.items() if v == -1]
    if rest:
        if n_devices % fixed:
            raise ValueError(
                f"mesh.{rest[0]}: -1 needs the device count {n_devices} divisible by the other "
                f"axes' product {fixed} ({sizes})")
        sizes[rest[0]] = n_devices // fixed
    if math.prod(sizes.values()) != n_devices:
        raise ValueError(
            f"mesh: expected data x fsdp x tensor = {n_devices} devices, got "
            f"{sizes['data']} x {sizes['fsdp']} x {sizes['tensor']}")
    return sizes["data"], sizes["fsdp"], sizes["tensor"]


def make_mesh(mcfg: MeshConfig | None = None, devices=None) -> jax.sharding.Mesh:
    """A (data, fsdp, tensor) mesh over ``devices`` (default: every device of every process).

    Axes are Auto: XLA propagates shardings and inserts the collectives; the attention kernel
    partitions itself along the batch and head shardings it is given (kernels/sharded.py).
    """
    mcfg = mcfg or MeshConfig()
    devices = jax.devices() if devices is None else list(devices)
    shape = mesh_shape(mcfg, len(devices))
    auto = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
    if len(devices) == jax.device_count():
        return jax.make_mesh(shape, MESH_AXES, axis_types=auto, devices=devices)
    return jax.sharding.Mesh(np.asarray(devices).reshape(shape), MESH_AXES, axis_types=auto)


def batch_spec(mesh: jax.sharding.Mesh) -> P:
    return P(BATCH_AXES)


def batch_sharding(mesh: jax.sharding.Mesh) -> NamedSharding:
    """Leading (batch) axis split over the data axes."""
    return NamedSharding(mesh, batch_spec(mesh))


def replicated(mesh: jax.sharding.Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def batch_divisor(mesh: jax.sharding.Mesh) -> int:
    """How many ways the batch is split: a global batch must be a multiple of it."""
    return math.prod(mesh.shape[a] for a in BATCH_AXES)


def logical_to_spec(names, shape, mesh: jax.sharding.Mesh, rules=None) -> P:
    """PartitionSpec of an array with logical axis ``names`` (None entries: not split)."""
    rules = LOGICAL_RULES if rules is None else rules
    if len(names) != len(shape):
        raise ValueError(f"sharding: expected {len(shape)} logical axis names for shape "
                         f"{tuple(shape)}, got {tuple(names)}")
    used, spec = set(), []
    for name, dim in zip(names, shape):
        axis = rules.get(name) if name is not None else None
        if axis is None or axis in used or axis not in mesh.shape or dim % mesh.shape[axis]:
            spec.append(None)
        else:
            spec.append(axis)
            used.add(axis)
    return P(*spec)


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def state_shardings(abstract_state: Any, mesh: jax.sharding.Mesh, rules=None) -> Any:
    """The tree of ``abstract_state`` (an nnx.State of the model and/or optimizer) with each
    variable's value replaced by its NamedSharding, from its ``out_sharding`` logical names
    (no names: replicated). Optimizer moments inherit their parameter's names."""

    def one(x):
        names = x.get_metadata().get("out_sharding") if _is_variable(x) else None
        value = x.get_value() if _is_variable(x) else x
        shape = getattr(value, "shape", ())
        spec = logical_to_spec(names, shape, mesh, rules) if names else P()
        sharding = NamedSharding(mesh, spec)
        return x.replace(sharding) if _is_variable(x) else sharding

    return jax.tree.map(one, abstract_state, is_leaf=_is_variable)


def with_shardings(abstract_state: Any, shardings: Any) -> Any:
    """``abstract_state`` (ShapeDtypeStructs) with the given shardings attached (for restore)."""
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        abstract_state, shardings)


def constrain_batch(x):
    """``x`` [B, ...] split over the batch axes of the mesh set by ``jax.set_mesh`` (and whole
    along the rest): keeps XLA from spreading activations over the fsdp/tensor axes in other
    layouts. Without such a mesh, ``x`` unchanged."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not all(a in mesh.axis_names for a in BATCH_AXES):
        return x
    if x.shape[0] % batch_divisor(mesh):
        return x
    return jax.lax.with_sharding_constraint(x, P(BATCH_AXES))


def attention_spec(batch: int, heads: int, kv_heads: int) -> P | None:
    """How the model's q, k, v [B, T, H, D] lie on the mesh set by ``jax.set_mesh``: the
    batch over the batch axes and the heads over ``tensor``, each where the mesh divides it;
    None without such a mesh (``ls_attention``'s ``partition_spec``)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not all(a in mesh.axis_names for a in MESH_AXES):
        return None
    batch_axes = None if batch % batch_divisor(mesh) else BATCH_AXES
    split_heads = heads % mesh.shape["tensor"] == 0 and kv_heads % mesh.shape["tensor"] == 0
    return P(batch_axes, None, "tensor" if split_heads else None, None)


def global_batch(local_batch: dict, sharding: NamedSharding) -> dict:
    """This process's numpy batch -> global jax.Arrays sharded on the batch axis."""
    return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v))
            for k, v in local_batch.items()}


def any_process(flag: bool) -> bool:
    """True on every process when ``flag`` is True on any (a host collective; free with one
    process). Multi-host runs call it every step so that all hosts stop at the same step."""
    if jax.process_count() == 1:
        return bool(flag)
    from jax.experimental import multihost_utils
    flags = multihost_utils.process_allgather(np.asarray([flag], np.int32))
    return bool(np.any(flags))


def maybe_initialize_distributed(enabled: bool) -> None:
    """``jax.distributed.initialize()`` for multi-process runs. TPU VM slices and SLURM are
    detected from the environment; elsewhere set JAX_COORDINATOR_ADDRESS (host:port of
    process 0), JAX_NUM_PROCESSES and JAX_PROCESS_ID on every process."""
    if not enabled:
        return
    kwargs = {}
    for var, key in (("JAX_NUM_PROCESSES", "num_processes"), ("JAX_PROCESS_ID", "process_id")):
        if os.environ.get(var):
            try:
                kwargs[key] = int(os.environ[var])
            except ValueError:
                raise ValueError(f"{var}: expected an int, got {os.environ[var]!r}") from None
    jax.distributed.initialize(**kwargs)
