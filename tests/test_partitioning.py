"""``ls_attention`` on sharded inputs (kernels/sharded.py): one kernel call per shard over mesh
axes of any names, Auto and Explicit axis types, forward and backward, without all-gathers of
q, k, v, the output or their gradients.

The multi-device cases run on 8 fake CPU devices in subprocesses (tests/partition_cases.py;
XLA_FLAGS must be set before JAX starts), started together once per session; each test below
checks its own entry."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ls_jax.kernels.reference import default_scale
from ls_jax.kernels.backends import residual_pair
from ls_jax.kernels.sharded import Layout, layout_of
from eight_devices import result, start  # tests/, beside this file


# the mesh is ("rows": 4, "cols": 2); layouts in tests/partition_cases.py
COMPARED = [
    "reference:Auto:batch", "reference:Auto:heads", "reference:Auto:gqa:segments",
    "reference:Auto:batch_two_axes", "reference:Auto:same_windows",
    "pallas_gpu:Auto:gqa:segments",
    "reference:Explicit:gqa:segments", "pallas_gpu:Explicit:heads", "pallas_tpu:Explicit:gqa",
    "reference:Spec:gqa:segments", "reference:Spec:batch_two_axes",
]
# one subprocess per group (they run at once); the slow interpreters get their own
GROUPS = [[c for c in COMPARED if c.startswith("reference")],
          [c for c in COMPARED if c.startswith("pallas_gpu")],
          [c for c in COMPARED if c.startswith("pallas_tpu")]]


@pytest.fixture(scope="module")
def cases():
    procs = [start("partition_cases.py", "compare", *group) for group in GROUPS]
    # the short cases in one process: one start-up of JAX for the four
    procs.append(start("partition_cases.py", "planted_gather", "+", "refused", "Auto", "+", "refused", "Explicit",
                        "+", "readme"))
    *groups, (planted, refused_auto, refused_explicit, readme) = [result(p, 600) for p in procs]
    compared = {k: v for (r,) in groups for k, v in r.items()}
    return dict(compared=compared, planted=planted, refused_auto=refused_auto,
                refused_explicit=refused_explicit, readme=readme)


@pytest.mark.parametrize("case", COMPARED)
def test_sharded_call_matches_one_device_without_gathers(cases, case):
    r = cases["compared"][case]
    assert r["out"] < 1e-5 and r["grads"] < 1e-5 and r["stats"] < 1e-5, r
    assert r["gathers"] == 0, r
    # Auto axes: custom-partitioned ops; a given layout or Explicit axes: a shard_map
    assert (r["custom_partitioned"] > 0) == (case.split(":")[1] == "Auto"), r
    layout = case.split(":")[2]
    want = {"batch": ["rows"], "heads": [None, None, "cols"], "batch_two_axes":
            [["rows", "cols"]]}.get(layout, ["rows", None, "cols"])
    for spec in [r["out_spec"], *r["grad_specs"]]:
        got = list(eval(spec, {"P": lambda *e: [list(x) if isinstance(x, tuple) else x
                                                   for x in e]}))
        got += [None] * (4 - len(got))
        assert got == want + [None] * (4 - len(want)), (spec, want)


def test_a_planted_gather_is_counted(cases):
    assert cases["planted"]["gathers"] >= 1


def test_vmap_over_the_partitioned_op_matches_a_loop(cases):
    assert cases["planted"]["vmap"] < 1e-5


def test_readme_mesh_example_runs_per_shard(cases):
    assert cases["readme"] == {"out_spec": "P('batch', None, 'model', None)", "gathers": 0}


def test_sequence_sharding_and_uneven_head_shards_are_refused_on_explicit_axes(cases):
    r = cases["refused_explicit"]
    assert r["sequence"]["error"] == (
        "q: sharded along the sequence axis (T=24) over mesh axes ('rows',); ls_attention "
        "splits only the batch and the heads (a split sequence needs ring attention): reshard "
        "q, k, v as P(batch_axes, None, head_axes, None)")
    assert r["kv_heads"]["error"] == (
        "q: expected query heads (4) and key/value heads (2) divisible by the 4 shards of "
        "mesh axes ('cols',)")


def test_sequence_sharding_and_uneven_head_shards_are_taken_whole_on_auto_axes(cases):
    """Auto axes: XLA chose the split, and an error raised inside its partitioner reaches the
    caller as a long compile traceback; the op takes the dimension whole (XLA gathers it),
    computes the same values, and says so in one warning line."""
    r = cases["refused_auto"]
    for name, note in (("sequence", "q: sharded along the sequence axis (T=24) over mesh "
                                    "axes ('rows',)"),
                       ("kv_heads", "q: query heads (4) and key/value heads (2) not divisible "
                                    "by the 4 shards of mesh axes ('cols',)")):
        assert r[name]["ran"] < 1e-5, r
        (message,) = set(r[name]["warnings"])
        assert message.startswith(note) and "\n" not in message, message
        assert message.endswith("shard q, k, v as P(batch_axes, None, head_axes, None)")


# -- one device: the layout arithmetic and the residual pairs ------------------------------

def test_layout_names_the_axes_of_batch_and_heads():
    sizes = {"a": 2, "b": 4, "c": 1}
    assert layout_of(sizes, (("a", "c"), None, "b"), (4, 8, 8, 16), 4) == Layout(("a", "c"),
                                                                                  ("b",))
    assert layout_of(sizes, (), (3, 8, 8, 16), 1) == Layout((), ())
    assert Layout(("a", "c"), ("b",)).qkv == jax.sharding.PartitionSpec(("a", "c"), None, "b",
                                                                        None)
    with pytest.raises(ValueError, match=r"q: expected a batch divisible by the 2 shards"):
        layout_of(sizes, ("a",), (3, 8, 8, 16), 8)
    with pytest.raises(ValueError, match=r"q: sharded along the head dimension \(D=16\)"):
        layout_of(sizes, (None, None, None, "a"), (4, 8, 8, 16), 8)


@pytest.mark.parametrize("impl", ["pallas_gpu", "pallas_tpu"])
def test_residual_pair_gives_the_backends_gradients(impl):
    """The forward/backward pair that the partitioned ops run (out and a row statistic saved,
    padding redone) against the backend's own VJP, with GQA, segments and padded T."""
    from ls_jax.kernels.backends import get_backend
    B, T, H, G, D = 2, 40, 4, 2, 16
    windows = (None, 3, 9, None)
    kq, kk, kv, kd = jax.random.split(jax.random.key(5), 4)
    q = jax.random.normal(kq, (B, T, H, D))
    k, v = (jax.random.normal(x, (B, T, G, D)) for x in (kk, kv))
    do = jax.random.normal(kd, (B, T, H, D))
    seg = jnp.broadcast_to(jnp.asarray([0] * 25 + [1] * 15, jnp.int32), (B, T))
    opts = dict(window_sizes=windows, segment_ids=seg, scale=default_scale(D), interpret=True)
    pair = residual_pair(impl)

    @jax.jit  # one program each, not one per operation
    def backend_vjp(q, k, v, do):
        out, pullback = jax.vjp(lambda q, k, v: get_backend(impl)(
            q, k, v, return_logit_stats=False, **opts)[0], q, k, v)
        return out, pullback(do)

    @jax.jit
    def pair_forward_backward(q, k, v, do):
        out, rows, stats = pair.forward(q, k, v, return_logit_stats=True, **opts)
        return out, rows, stats, pair.backward(q, k, v, out, rows, do, **opts)

    out, want_grads = backend_vjp(q, k, v, do)
    out2, rows, stats, grads = pair_forward_backward(q, k, v, do)
    np.testing.assert_array_equal(out2, out)
    assert rows.shape == (B, H, T) and rows.dtype == jnp.float32 and stats.shape == (H,)
    for got, want in zip(grads, want_grads):
        np.testing.assert_allclose(got, want, atol=1e-6, rtol=1e-6)
