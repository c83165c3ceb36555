"""The pure-JAX reference attention as the tests call it: jitted, so a case compiles it as one
program instead of one program per operation, as an eager call does (XLA's CPU compile of a
program, however small, is most of such a call's time). Windows and scale are static."""

from __future__ import annotations

import jax

from ls_jax.kernels import reference

reference_attention_parts = jax.jit(reference.reference_attention_parts,
                                    static_argnames=("window_sizes", "scale"))


def reference_vjp(q, k, v, do, window_sizes, segment_ids=None, scale=None):
    """(out, max |logit|, (dq, dk, dv)) of the reference in float32, for the cotangent ``do``
    of its output; one compiled program."""
    return _reference_vjp(q, k, v, do, tuple(window_sizes), segment_ids, scale)


@jax.jit(static_argnums=(4, 6))
def _reference_vjp(q, k, v, do, window_sizes, segment_ids, scale):
    f32 = [x.astype("float32") for x in (q, k, v, do)]

    def out_and_stats(q, k, v):
        out, _, stats = reference.reference_attention_parts(q, k, v, window_sizes, segment_ids,
                                                            scale)
        return out, stats

    out, pullback, stats = jax.vjp(out_and_stats, *f32[:3], has_aux=True)
    return out, stats, pullback(f32[3])
