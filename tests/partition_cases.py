"""Cases for tests/test_partitioning.py, run in a subprocess with 8 fake CPU devices (XLA_FLAGS
must be set before JAX starts). ``python tests/partition_cases.py CASE ARGS`` prints one JSON
line last; ``CASE ARGS + CASE ARGS ...`` runs the cases in turn in the one process and prints
the list of their results.

Each case compares ``ls_attention`` on sharded inputs with the same call on one device
(output, logit statistics, gradients of q, k, v) and counts the all-gathers of q, k, v (or of
their gradients) in the compiled gradient program."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

# T=24 and D=8: no other array of the programs has a dimension of 24 with a last one of 8
B, T, H, D = 8, 24, 4, 8

# name -> (q/k/v partition spec over a ("rows": 4, "cols": 2) mesh, kv heads, windows)
LAYOUTS = {
    "batch": (P("rows"), 4, (None, 3, 8, 16)),
    "heads": (P(None, None, "cols"), 4, (None, 3, 8, 16)),
    "gqa": (P("rows", None, "cols"), 2, (None, 3, 8, 16)),
    "batch_two_axes": (P(("rows", "cols")), 2, (5, 3, None, 16)),
    "same_windows": (P("rows", None, "cols"), 2, (None, 7, None, 7)),
}


def _inputs(kv_heads: int, segments: bool):
    kq, kk, kv, kd = jax.random.split(jax.random.key(3), 4)
    q = jax.random.normal(kq, (B, T, H, D))
    k = jax.random.normal(kk, (B, T, kv_heads, D))
    v = jax.random.normal(kv, (B, T, kv_heads, D))
    do = jax.random.normal(kd, (B, T, H, D))
    seg = None
    if segments:
        seg = jnp.broadcast_to(jnp.asarray([0] * 15 + [1] * 9, jnp.int32), (B, T))
    return q, k, v, do, seg


def _program(impl: str, windows, seg, partition_spec=None):
    from ls_jax.kernels import ls_attention
    interpret = impl != "reference"

    def loss(q, k, v, do):
        out, stats = ls_attention(q, k, v, windows, segment_ids=seg, return_logit_stats=True,
                                  implementation=impl, interpret=interpret,
                                  partition_spec=partition_spec)
        return jnp.sum(out * do), (out, stats.max_abs_logit)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


def _compare(impl: str, axis_type: str, layout: str, segments: bool):
    from ls_jax.kernels.sharded import qkv_gathers
    spec, kv_heads, windows = LAYOUTS[layout]
    q, k, v, do, seg = _inputs(kv_heads, segments)
    (_, (o0, m0)), g0 = _program(impl, windows, seg)(q, k, v, do)
    # "Spec": Auto axes and the layout passed as ls_attention's partition_spec
    given = axis_type == "Spec"
    axis_type = "Auto" if given else axis_type
    mesh = jax.make_mesh((4, 2), ("rows", "cols"), axis_types=(getattr(AxisType, axis_type),) * 2)
    sharding = NamedSharding(mesh, spec)
    args = [jax.device_put(x, sharding) for x in (q, k, v, do)]
    with jax.set_mesh(mesh):
        seg_s = None if seg is None else jax.device_put(seg, NamedSharding(mesh, P(spec[0])))
        program = _program(impl, windows, seg_s, spec if given else None)
        (_, (o1, m1)), g1 = program(*args)
        lowered = program.lower(*args)
        hlo = lowered.compile().as_text()
    return {
        "out": float(jnp.max(jnp.abs(o0 - o1))),
        "stats": float(jnp.max(jnp.abs(m0 - m1))),
        "grads": max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(g0, g1)),
        "out_spec": str(o1.sharding.spec),
        "grad_specs": [str(g.sharding.spec) for g in g1],
        "gathers": len(qkv_gathers(hlo, T, H, D)),
        "custom_partitioned": lowered.as_text().count("CustomSPMDPartitioning"),
    }


def case_compare(*cases: str):
    """Each case "impl:Auto|Explicit|Spec:layout[:segments]" (layout a key of LAYOUTS; Spec:
    Auto axes with the layout given as ``partition_spec``)."""
    out = {}
    for case in cases:
        impl, axis_type, layout, *seg = case.split(":")
        out[case] = _compare(impl, axis_type, layout, seg == ["segments"])
    return out


def case_planted_gather():
    """The gather check on a program that does gather q: a sharded q constrained to be
    replicated before the attention."""
    from ls_jax.kernels import ls_attention
    from ls_jax.kernels.sharded import qkv_gathers
    q, k, v, do, _ = _inputs(4, False)
    mesh = jax.make_mesh((4, 2), ("rows", "cols"), axis_types=(AxisType.Auto,) * 2)
    args = [jax.device_put(x, NamedSharding(mesh, P("rows", None, "cols"))) for x in (q, k, v)]

    def gathered(q, k, v):
        q = jax.lax.with_sharding_constraint(q, NamedSharding(mesh, P()))
        return ls_attention(q, k, v, (None, 3, 8, 16), implementation="reference")

    hlo = jax.jit(gathered).lower(*args).compile().as_text()
    return {"gathers": len(qkv_gathers(hlo, T, H, D)), "vmap": _vmap()}


def _vmap():
    """jax.vmap over the op on a machine of several devices (the partitioned ops fold the
    mapped axis into the batch): output and gradients against a loop over the mapped axis."""
    from ls_jax.kernels import ls_attention
    q, k, v, do, _ = _inputs(2, False)
    qs, ks, vs, dos = (x.reshape((2, B // 2) + x.shape[1:]) for x in (q, k, v, do))

    def loss(q, k, v, do):
        return jnp.sum(ls_attention(q, k, v, (None, 3, 8, 16), implementation="reference") * do)

    grad = jax.grad(loss, argnums=(0, 1, 2))
    mapped = jax.jit(jax.vmap(grad))(qs, ks, vs, dos)
    one = jax.jit(grad)
    looped = [jnp.stack(g) for g in zip(*(one(qs[i], ks[i], vs[i], dos[i]) for i in range(2)))]
    return max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(mapped, looped))


def case_refused(axis_type: str):
    """A sequence-sharded q, and head shards that do not divide the kv heads (k, v
    replicated): the error (Explicit axes) or the ShardingWarnings (Auto axes: the op takes
    them whole), and the largest difference from the call on one device where it ran."""
    import warnings

    from ls_jax.kernels import ls_attention
    from ls_jax.kernels.sharded import ShardingWarning
    q, k, v, _, _ = _inputs(2, False)
    mesh = jax.make_mesh((2, 4), ("rows", "cols"), axis_types=(getattr(AxisType, axis_type),) * 2)

    def attend(q, k, v):
        return ls_attention(q, k, v, (None, 3, 8, 16), implementation="reference")

    want = attend(q, k, v)
    out = {}
    for name, spec in (("sequence", P(None, "rows")), ("kv_heads", P(None, None, "cols"))):
        args = [jax.device_put(q, NamedSharding(mesh, spec)), k, v]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                with jax.set_mesh(mesh):
                    got = jax.jit(attend)(*args)
                out[name] = {"ran": float(jnp.max(jnp.abs(got - want)))}
            except Exception as e:  # noqa: BLE001 - the message is what the test checks
                out[name] = {"error": str(e)}
        out[name]["warnings"] = [str(w.message) for w in caught
                                 if issubclass(w.category, ShardingWarning)]
    return out


def case_readme():
    """docs/usage.md's mesh example: its output's sharding and the gathers of its program."""
    import pathlib
    import re

    from ls_jax.kernels.sharded import qkv_gathers
    readme = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "usage.md").read_text()
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", readme, re.S)
                if "jax.make_mesh" in b]
    ns: dict = {}
    exec(compile(block, "docs/usage.md", "exec"), ns)
    f = jax.jit(lambda q, k, v: ns["ls_attention"](q, k, v, (None, 64, 64, 64)))
    hlo = f.lower(ns["q"], ns["k"], ns["v"]).compile().as_text()
    return {"out_spec": str(ns["out"].sharding.spec), "gathers": len(qkv_gathers(hlo, 256, 4, 32))}


if __name__ == "__main__":
    from eight_devices import main  # tests/, this script's folder
    main(globals())
