"""Cases for tests/test_library_use.py on 8 fake CPU devices (XLA_FLAGS must be set before JAX
starts): ``python tests/library_cases.py CASE [+ CASE ...]`` prints the list of the cases'
results as one JSON line last. Each compares the op on Auto axes (XLA's propagation decides
the sharding) with the same call on one device."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

# T=24, D=8: no other array of the programs has a dimension of 24 with a last one of 8
B, T, H, D = 8, 24, 8, 8
WINDOWS = (None, 3, 8, 16, None, 5, 5, 24)


def _mesh():
    return jax.make_mesh((4, 2), ("rows", "cols"), axis_types=(AxisType.Auto,) * 2)


def _inputs(kv_heads: int):
    kq, kk, kv, kd = jax.random.split(jax.random.key(4), 4)
    return (jax.random.normal(kq, (B, T, H, D)), jax.random.normal(kk, (B, T, kv_heads, D)),
            jax.random.normal(kv, (B, T, kv_heads, D)), jax.random.normal(kd, (B, T, H, D)))


def _diff(a, b) -> float:
    return max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(jax.tree.leaves(a),
                                                               jax.tree.leaves(b)))


def _attend(impl: str):
    from ls_jax.kernels import ls_attention
    return lambda q, k, v: ls_attention(q, k, v, WINDOWS, implementation=impl,
                                        interpret=impl != "reference")


def case_kv_heads(impl: str):
    """Every kv head count that divides the query heads (MQA to MHA), the batch split and
    (where the head shards divide the kv heads) the heads too: output and gradients against
    one device, and the gathers of q, k, v in the compiled gradient program."""
    from ls_jax.kernels.sharded import qkv_gathers
    attend = _attend(impl)
    out = {}
    for G in (1, 2, 4, 8):
        q, k, v, do = _inputs(G)

        def loss(q, k, v, do):
            y = attend(q, k, v)
            return jnp.sum(y * do), y

        program = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
        (_, y0), g0 = program(q, k, v, do)
        for name, spec in (("batch", P("rows")), ("batch_heads", P("rows", None, "cols"))):
            if G % 2 and name == "batch_heads":  # one kv head cannot be split in two
                continue
            mesh = _mesh()
            args = [jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, k, v, do)]
            with jax.set_mesh(mesh):
                (_, y1), g1 = program(*args)
                hlo = program.lower(*args).compile().as_text()
            out[f"G{G}:{name}"] = {"diff": _diff((y0, g0), (y1, g1)),
                                   "gathers": len(qkv_gathers(hlo, T, H, D))}
    return out


def case_layer_mqa():
    """``LSAttention(n_kv_head=1)`` jitted on a batch split over Auto axes, against one
    device."""
    from flax import nnx

    from ls_jax import LSAttention
    layer = LSAttention(32, H, D, n_kv_head=1, window_sizes=WINDOWS, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (B, T, 32))
    want = nnx.jit(lambda m, x: m(x))(layer, x)
    mesh = _mesh()
    with jax.set_mesh(mesh):
        got = nnx.jit(lambda m, x: m(x))(layer, jax.device_put(x, NamedSharding(mesh, P("rows"))))
    return {"diff": _diff(want, got)}


def case_forward_mode(impl: str):
    """jax.jvp, a Hessian-vector product (jvp of grad) and grad of grad through the op, q, k,
    v split over batch and heads, against the pure-JAX reference on one device (relative
    differences)."""
    from ls_jax.kernels.reference import reference_backend
    q, k, v, _ = _inputs(4)
    tangents = tuple(0.5 * x for x in (q, k, v))

    def reference(q, k, v):
        return reference_backend(q, k, v, window_sizes=WINDOWS, segment_ids=None,
                                 scale=D ** -0.5, return_logit_stats=False, interpret=False)[0]

    def programs(attend):
        def f(q, k, v):
            return jnp.sum(jnp.sin(attend(q, k, v)))
        grad = jax.grad(f, argnums=(0, 1, 2))
        return {
            "jvp": jax.jit(lambda p, t: jax.jvp(f, p, t)),
            "hvp": jax.jit(lambda p, t: jax.jvp(grad, p, t)[1]),
            "grad_of_grad": jax.jit(jax.grad(lambda q, k, v: jnp.vdot(grad(q, k, v)[0], q),
                                             argnums=(0, 1, 2))),
        }

    want = programs(reference)
    got = programs(_attend(impl))
    mesh = _mesh()
    sharded = [jax.device_put(x, NamedSharding(mesh, P("rows", None, "cols"))) for x in
               (q, k, v, *tangents)]
    out = {}
    with jax.set_mesh(mesh):
        for name in want:
            args = (((q, k, v), tangents), (tuple(sharded[:3]), tuple(sharded[3:])))
            if name == "grad_of_grad":
                args = ((q, k, v), tuple(sharded[:3]))
            expected = want[name](*args[0])
            out[name] = _relative(expected, got[name](*args[1]))
    return out


def _relative(want, got) -> float:
    """The largest difference over the largest magnitude, leaf by leaf (the jvp's primal is a
    sum over every output)."""
    return max(float(jnp.max(jnp.abs(x - y)) / jnp.max(jnp.abs(x)))
               for x, y in zip(jax.tree.leaves(want), jax.tree.leaves(got)))


def case_vmap():
    """``jax.vmap`` over calls whose batch (or the mapped axis) is split over Auto axes: the
    all-gathers of q, k, v in the compiled gradient program, the output's sharding, and the
    values against a loop."""
    from ls_jax.kernels.sharded import qkv_gathers
    attend = _attend("reference")
    q, k, v, do = (x.reshape((2, B // 2) + x.shape[1:]) for x in _inputs(4))

    def loss(q, k, v, do):
        return jnp.sum(attend(q, k, v) * do)

    program = jax.jit(jax.vmap(jax.value_and_grad(loss, argnums=(0, 1, 2))))
    looped = [program(*(x[i:i + 1] for x in (q, k, v, do))) for i in range(2)]
    want = jax.tree.map(lambda *xs: jnp.concatenate(xs), *looped)
    out = {}
    for name, spec in (("batch", P(None, "rows")), ("mapped", P("cols", "rows"))):
        mesh = _mesh()
        args = [jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, k, v, do)]
        with jax.set_mesh(mesh):
            got = program(*args)
            hlo = program.lower(*args).compile().as_text()
            y = jax.jit(jax.vmap(attend))(*args[:3])
        out[name] = {"diff": _diff(want, got), "gathers": len(qkv_gathers(hlo, T, H, D)),
                     "out_spec": str(y.sharding.spec)}
    return out


if __name__ == "__main__":
    from eight_devices import main  # tests/, this script's folder
    main(globals())
