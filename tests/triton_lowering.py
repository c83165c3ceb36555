"""A Pallas Triton kernel's lowering without a GPU: a jitted function exported for an abstract
Hopper GPU (jaxpr -> Triton IR, run by JAX in Python), what interpret mode does not exercise."""

from __future__ import annotations

import jax

TRITON_CALL = "__gpu$xla.gpu.triton"


def lower_for_hopper(fn, *args) -> str:
    """The MLIR module of ``jax.jit(fn)(*args)`` exported for an H100; each Triton launch is one
    ``TRITON_CALL`` custom call in it."""
    h100 = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=None,
                                       platform="cuda")
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",),
                                                                  abstract_device=h100)):
        exported = jax.export.export(
            jax.jit(fn), platforms=["cuda"],
            disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON_CALL)],
        )(*args)
    return exported.mlir_module()
