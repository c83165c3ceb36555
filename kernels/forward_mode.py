"""Forward-mode autodiff (``jax.jvp``, ``jax.jacfwd``, Hessian-vector products) through
``ls_attention``, with reverse mode still running the backend's own backward.

The backends' backwards are ``jax.custom_vjp`` rules and the partitioned ops of
``kernels/sharded.py`` are custom calls: JAX can transpose them (reverse mode) but not push
tangents through them (forward mode). ``with_forward_mode`` wraps a call in a
``jax.custom_jvp`` whose rule runs

* the differentiated backend's forward, keeping its residuals (``jax.vjp`` of the call), and
* the tangent as one ``ls_attention_tangent`` primitive: evaluated, it is the pure-JAX
  reference's JVP (dense [B, H, T, S] logits; forward mode only); transposed (reverse mode),
  it is the backend's backward on the kept residuals, so ``jax.grad`` computes what it
  computes without this wrapper.

Second order: the forward and the backward are themselves ``jax.custom_jvp`` functions whose
tangents are the reference's, so ``jax.jvp`` of ``jax.grad`` (a Hessian-vector product) and
``jax.grad`` of ``jax.grad`` run the kernels for the first-order part and the reference for
the second. A call that nothing differentiates runs its primal function alone.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

__all__ = ["with_forward_mode"]

# out_tangent = tangent(prims, (dq, dk, dv)), linear in the second argument; its transpose
# is transpose(prims, residuals, d_out) -> (dq, dk, dv). Operands: the n_prims arrays
# (q, k, v[, segment ids]), the n_res residual arrays, then dq, dk, dv.
_tangent_p = Primitive("ls_attention_tangent")


def _split(args, n_prims, n_res):
    return args[:n_prims], args[n_prims:n_prims + n_res], args[n_prims + n_res:]


def _tangent_impl(*args, tangent, transpose, n_prims, n_res):
    del transpose
    prims, _, lin = _split(args, n_prims, n_res)
    return tangent(prims, lin)


def _tangent_abstract_eval(*args, tangent, transpose, n_prims, n_res):
    del tangent, transpose, n_prims, n_res
    return args[0].update(weak_type=False)  # the output's tangent: q's shape and dtype


def _zeros(x):
    return ad.instantiate_zeros(x) if type(x) is ad.Zero else x


def _tangent_transpose(ct, *args, tangent, transpose, n_prims, n_res):
    del tangent
    prims, res, lin = _split(args, n_prims, n_res)
    ct = _zeros(ct)
    # a tangent that is not linear input here (a zero the caller filled in) gets nothing
    return [None] * (n_prims + n_res) + [g if ad.is_undefined_primal(x) else None
                                          for x, g in zip(lin, transpose(prims, res, ct))]


def _tangent_jvp(primals, tangents, *, tangent, transpose, n_prims, n_res):
    params = dict(tangent=tangent, transpose=transpose, n_prims=n_prims, n_res=n_res)
    out = _tangent_p.bind(*primals, **params)
    prims, res, lin = _split(primals, n_prims, n_res)
    d_prims, _, d_lin = _split(tangents, n_prims, n_res)
    first = None
    if any(type(t) is not ad.Zero for t in d_lin):  # linear in the tangents
        first = _tangent_p.bind(*prims, *res, *map(_zeros, d_lin), **params)
    diff = [i for i in range(3) if type(d_prims[i]) is not ad.Zero]
    if not diff:
        return out, ad.Zero(out.aval.to_tangent_aval()) if first is None else first

    def of_prims(*xs):  # the second-order part: the reference's, dense
        p = list(prims)
        for i, x in zip(diff, xs):
            p[i] = x
        return tangent(tuple(p), lin)

    _, second = jax.jvp(of_prims, tuple(prims[i] for i in diff),
                        tuple(d_prims[i] for i in diff))
    return out, second if first is None else first + second


def _tangent_batch(args, dims, *, tangent, transpose, n_prims, n_res):
    size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
    args = [jnp.broadcast_to(x, (size,) + x.shape) if d is None else jnp.moveaxis(x, d, 0)
            for x, d in zip(args, dims)]
    out = _tangent_p.bind(*args, tangent=jax.vmap(tangent), transpose=jax.vmap(transpose),
                          n_prims=n_prims, n_res=n_res)
    return out, 0


_tangent_p.def_impl(_tangent_impl)
_tangent_p.def_abstract_eval(_tangent_abstract_eval)
ad.primitive_transposes[_tangent_p] = _tangent_transpose
ad.primitive_jvps[_tangent_p] = _tangent_jvp
batching.primitive_batchers[_tangent_p] = _tangent_batch
mlir.register_lowering(_tangent_p, mlir.lower_fun(_tangent_impl, multiple_results=False))


def _zero_tangent(x):
    x = jnp.asarray(x)
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.zeros_like(x)
    return np.zeros(x.shape, jax.dtypes.float0)


def with_forward_mode(primal: Callable, differentiated: Callable, reference: Callable,
                      q, k, v, segment_ids):
    """``primal(q, k, v, segment_ids)`` -> (out, logit statistic or None), differentiable in
    both modes (this module's docstring). ``differentiated``: the same function whose
    ``jax.vjp`` is the backend's forward and backward (what a differentiated call runs);
    ``reference(q, k, v, segment_ids)`` -> out, pure JAX: its derivatives are the tangents
    in forward mode and the second-order terms."""
    prims = (q, k, v) + (() if segment_ids is None else (segment_ids,))
    tree = []  # the treedef of the forward's residuals, set when the forward is traced

    def unpack(p):
        return p[0], p[1], p[2], (p[3] if len(p) > 3 else None)

    def ref_tangent(p, lin):
        q, k, v, seg = unpack(p)
        return jax.jvp(lambda q, k, v: reference(q, k, v, seg), (q, k, v), tuple(lin))[1]

    def ref_vjp(p, ct):
        q, k, v, seg = unpack(p)
        return jax.vjp(lambda q, k, v: reference(q, k, v, seg), q, k, v)[1](ct)

    @jax.custom_jvp
    def forward(*p):
        q, k, v, seg = unpack(p)
        out, pullback, stats = jax.vjp(lambda q, k, v: differentiated(q, k, v, seg), q, k, v,
                                       has_aux=True)
        leaves, treedef = jax.tree.flatten(pullback)
        tree[:] = [treedef]
        return out, stats, tuple(leaves)

    @forward.defjvp
    def forward_jvp(p, dp):
        out, stats, res = forward(*p)
        d_out = ref_tangent(p, dp[:3])
        d_stats = None if stats is None else jnp.zeros_like(stats)
        return (out, stats, res), (d_out, d_stats, tuple(_zero_tangent(x) for x in res))

    def backward_fn(n_prims):
        @jax.custom_jvp
        def backward(*args):
            res, ct = args[n_prims:-1], args[-1]
            return tuple(jax.tree.unflatten(tree[0], res)(ct))

        @backward.defjvp
        def backward_jvp(args, d_args):  # the residuals' tangents follow from q, k, v's
            p, ct = args[:n_prims], args[-1]
            dp, d_ct = d_args[:n_prims], d_args[-1]
            grads = backward(*args)
            _, d_grads = jax.jvp(lambda q, k, v, ct: ref_vjp((q, k, v) + tuple(p[3:]), ct),
                                 tuple(p[:3]) + (ct,), tuple(dp[:3]) + (d_ct,))
            return grads, tuple(d_grads)

        return backward

    backward = backward_fn(len(prims))

    def transpose(p, res, ct):
        return backward(*p, *res, ct)

    @jax.custom_jvp
    def op(*p):
        return primal(*unpack(p))

    @op.defjvp
    def op_jvp(p, dp):
        out, stats, res = forward(*p)
        d_out = _tangent_p.bind(*p, *res, *dp[:3], tangent=ref_tangent, transpose=transpose,
                                n_prims=len(p), n_res=len(res))
        d_stats = None if stats is None else jnp.zeros_like(stats)
        return (out, stats), (d_out, d_stats)

    return op(*prims)
