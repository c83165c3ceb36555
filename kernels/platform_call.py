"""A kernel launch lowered for its own platform alone, inside a program exported for several.

``ls_jax.interop.export.export(..., platforms=("cpu", "cuda", "tpu"))`` with
``implementation=None`` gives each platform its backend through ``jax.lax.platform_dependent``
(``kernels/api.py``). JAX lowers every branch of it for every platform of the export (the
branch that runs is chosen when the program runs), and a Pallas kernel lowers for its own
platform only. ``on_platform`` wraps one launch in a primitive whose lowering lowers it for
that platform alone: on another, its branch never runs. Outside a multi-platform export it
calls the launch as it is.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import jax
from jax.extend.core import Primitive, jaxpr_as_fun
from jax.interpreters import batching, mlir

__all__ = ["export_platforms", "exporting_for", "on_platform"]

# The platforms a program is being exported for (ls_jax.interop.export.export sets them while it
# traces): implementation=None then chooses per platform, with lax.platform_dependent.
_EXPORT_PLATFORMS: contextvars.ContextVar[tuple[str, ...] | None] = contextvars.ContextVar(
    "ls_attention_export_platforms", default=None)


@contextlib.contextmanager
def exporting_for(platforms: tuple[str, ...]):
    """While tracing under it, ``ls_attention(..., implementation=None)`` chooses a backend
    for each of ``platforms`` (one ``jax.lax.platform_dependent`` branch each) rather than
    for the tracing machine's."""
    token = _EXPORT_PLATFORMS.set(tuple(platforms))
    try:
        yield
    finally:
        _EXPORT_PLATFORMS.reset(token)


def export_platforms() -> tuple[str, ...] | None:
    """The platforms set by ``exporting_for``, or None outside it."""
    return _EXPORT_PLATFORMS.get()


_on_platform_p = Primitive("ls_attention_on_platform")
_on_platform_p.multiple_results = True


def _impl(*args, jaxpr, platform):
    del platform
    return jaxpr_as_fun(jaxpr)(*args)


def _abstract_eval(*args, jaxpr, platform):
    del args, platform
    return jaxpr.out_avals, jaxpr.effects


def _lowering(ctx, *args, jaxpr, platform):
    return mlir.lower_fun(jaxpr_as_fun(jaxpr), multiple_results=True)(
        ctx.replace(platforms=(platform,)), *args)


def _batch(args, dims, *, jaxpr, platform):
    fn = jax.vmap(jaxpr_as_fun(jaxpr), in_axes=tuple(dims))  # None: not mapped
    outs = _bind(platform, fn, args)
    return outs, [0] * len(outs)


def _bind(platform: str, fn, args):
    closed = jax.make_jaxpr(fn)(*args)
    return _on_platform_p.bind(*args, jaxpr=closed, platform=platform)


_on_platform_p.def_impl(_impl)
_on_platform_p.def_effectful_abstract_eval(_abstract_eval)
batching.primitive_batchers[_on_platform_p] = _batch
mlir.register_lowering(_on_platform_p, _lowering)


def on_platform(platform: str, fn):
    """``fn`` (a kernel launch: arrays in, a pytree of arrays out), lowered for ``platform``
    alone where the program is exported for several platforms."""
    platforms = export_platforms()
    if platforms is None or len(platforms) < 2:
        return fn

    @functools.wraps(fn)
    def call(*args):
        flat, tree = jax.tree.flatten(args)
        out_tree = []

        def flat_fn(*flat):
            out = fn(*jax.tree.unflatten(tree, flat))
            leaves, treedef = jax.tree.flatten(out)
            out_tree[:] = [treedef]
            return leaves

        outs = _bind(platform, flat_fn, flat)
        return jax.tree.unflatten(out_tree[0], outs)

    return call
