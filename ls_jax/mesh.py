"""The device mesh: 1-D data parallelism over every device of every process."""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

DATA_AXIS = "data"


def make_mesh() -> jax.sharding.Mesh:
    """Mesh of all devices on one "data" axis (Auto sharding: XLA inserts the gradient
    all-reduce)."""
    return jax.make_mesh((jax.device_count(),), (DATA_AXIS,),
                         axis_types=(jax.sharding.AxisType.Auto,))


def batch_sharding(mesh: jax.sharding.Mesh) -> NamedSharding:
    """Leading (batch) axis split over the data axis."""
    return NamedSharding(mesh, P(DATA_AXIS))


def replicated(mesh: jax.sharding.Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def global_batch(local_batch: dict, sharding: NamedSharding) -> dict:
    """This process's numpy batch -> global jax.Arrays sharded on the batch axis."""
    import numpy as np
    return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v))
            for k, v in local_batch.items()}


def maybe_initialize_distributed(enabled: bool) -> None:
    """``jax.distributed.initialize()`` for multi-process runs (TPU pods, SLURM, GPU clusters);
    it detects the cluster from the environment."""
    if enabled:
        jax.distributed.initialize()
