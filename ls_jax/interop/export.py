"""``jax.export`` of programs that call our kernels, for a GPU or a TPU, from any machine.

    import jax
    from ls_jax.interop.export import export
    exported = export(jax.jit(fn), platforms=("cuda",), gpu=TARGET_DEVICE_KIND)(*args)
    exported.serialize()  # bytes (needs the flatbuffers package); jax.export.deserialize(...)

What it adds to ``jax.export.export``:

* ``gpu``: for "cuda", the target GPU's ``device_kind`` (the string
  ``jax.devices()[0].device_kind`` gives on that machine), set as the device of an abstract
  mesh (JAX's ``jax.sharding.AbstractDevice``) while the program is traced. Pallas' GPU lowering
  compiles for that GPU's architecture, and our kernels' launches are planned for it
  (``kernels/pallas_gpu/heuristics.current_gpu``: the Mosaic GPU kernels for a Hopper GPU, the
  Triton ones for another), so the export holds what that GPU runs; on a machine with that
  GPU it may be left out, on one without a GPU it may not (one line says so).
* the custom calls of our GPU kernels' Triton lowering are allowed: JAX refuses to serialize
  custom calls whose format it does not promise to keep (its Triton call is one; the TPU
  kernels' ``tpu_custom_call`` and Mosaic GPU's ``mosaic_gpu_v2`` are kept), so such an
  export runs on the same JAX/jaxlib version only.

* ``implementation=None`` chooses the backend of each platform in ``platforms``: one
  ``jax.lax.platform_dependent`` branch each, its kernels lowered for their own platform
  (``kernels/platform_call.py``), so that one export for ``platforms=("cpu", "cuda", "tpu")``
  runs the reference on a CPU and our kernels on a GPU or a TPU ("pallas_gpu" where the GPU's
  choice alone would be cuDNN's, whose call lowers for CUDA only). Under
  ``jax.export.export`` itself, ``implementation=None`` chooses for the machine that traces,
  and lowering that choice for another platform is refused with one line (``kernels/api.py``).
"""

from __future__ import annotations

import contextlib

import jax

from ls_jax.kernels.platform_call import exporting_for

__all__ = ["KERNEL_CUSTOM_CALLS", "export"]

# the custom-call targets our kernels lower to, per platform
KERNEL_CUSTOM_CALLS = {
    "cuda": ("__gpu$xla.gpu.triton", "mosaic_gpu_v2"),
    "tpu": ("tpu_custom_call",),
}
_UNSTABLE = ("__gpu$xla.gpu.triton",)  # not in JAX's list of custom calls it keeps stable


def export(fn, *, platforms, gpu: str | None = None, disabled_checks=()):
    """``jax.export.export(fn, platforms=platforms)`` with this module's additions; returns
    the function of the arguments (or their ``jax.ShapeDtypeStruct``s) that exports."""
    platforms = tuple(platforms)
    if isinstance(platforms, str) or not platforms:
        raise ValueError(f"platforms: expected a tuple of platform names, got {platforms!r}")
    if gpu is not None and (not isinstance(gpu, str) or not gpu):
        raise ValueError(f"gpu: expected a device kind such as jax.devices()[0].device_kind "
                         f"gives on the target, got {gpu!r}")
    checks = tuple(disabled_checks)
    if "cuda" in platforms:
        checks += tuple(jax.export.DisabledSafetyCheck.custom_call(t) for t in _UNSTABLE)
    exporter = jax.export.export(fn, platforms=platforms, disabled_checks=checks)

    def run(*args, **kwargs):
        context = contextlib.nullcontext()
        if gpu is not None:
            device = jax.sharding.AbstractDevice(device_kind=gpu, num_cores=None, platform="gpu")
            mesh = jax.sharding.AbstractMesh((1,), ("_",), (jax.sharding.AxisType.Explicit,),
                                             abstract_device=device)
            context = jax.sharding.use_abstract_mesh(mesh)
        try:
            with context, exporting_for(platforms):
                return exporter(*args, **kwargs)
        except RuntimeError as e:  # Pallas' GPU lowering found no GPU to compile for
            if gpu is None and "AbstractDevice" in str(e):
                raise ValueError(
                    "gpu: exporting the GPU kernels from a machine without a GPU needs the "
                    "target named: gpu=<jax.devices()[0].device_kind on the target>") from e
            raise

    return run
