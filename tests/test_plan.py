"""The call plan: one function decides the backends, the partitioning and the launches of an
``ls_attention`` call, ``explain`` prints it, and the call runs what the plan says."""

from __future__ import annotations

import pathlib
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractMesh, AxisType, NamedSharding, PartitionSpec as P

from ls_jax.kernels import backends, dispatch, explain, ls_attention
from ls_jax.kernels.plan import Route, partitioning
from ls_jax.kernels.pallas_gpu import heuristics
from stand_in_backends import scaled_get_backend  # tests/, beside this file

HOPPER = next(iter(heuristics.HOPPER_SMS))  # a Hopper model, as device_kind names it
LS = (None,) + (128,) * 15


def sds(shape, dtype=jnp.bfloat16, sharding=None):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


@pytest.mark.parametrize("name, windows, platform, kind, want", [
    ("ls_mix_on_hopper", LS, "cuda", HOPPER, Route("cuda", "pallas_gpu", "pallas_gpu")),
    ("all_global_on_hopper", (None,) * 16, "cuda", HOPPER, Route("cuda", "pallas_gpu", "cudnn")),
    ("all_global_without_hopper", (None,) * 16, "cuda", "some other gpu", Route("cuda", "cudnn", "cudnn")),
    ("ls_mix_on_tpu", LS, "tpu", None, Route("tpu", "pallas_tpu", "pallas_tpu")),
    ("ls_mix_on_cpu", LS, "cpu", None, Route("cpu", "reference", "reference")),
])
def test_the_plan_names_each_platforms_backends(name, windows, platform, kind, want):
    q = sds((4, 8192, 16, 64))
    plan = explain(q, q, q, windows, platform=platform, device_kind=kind)
    assert plan.routes == (want,)
    assert plan.chosen and not plan.guard  # planned for a named platform: no guard
    text = str(plan)
    assert want.differentiated in text and want.primal in text


def test_a_named_implementation_is_one_route_whatever_the_platform():
    q = sds((2, 256, 4, 64))
    plan = explain(q, q, q, (None, 8, 8, 8), implementation="pallas_gpu", interpret=True)
    assert [(r.primal, r.differentiated) for r in plan.routes] == [("pallas_gpu",) * 2]
    assert not plan.chosen
    assert "named by implementation=" in str(plan)


@pytest.mark.parametrize("name, kwargs, message", [
    ("interpret_without_implementation", dict(interpret=True),
     r"interpret: True .* needs implementation one of .*got implementation=None"),
    ("interpret_with_cudnn", dict(interpret=True, implementation="cudnn"),
     r"interpret: True .* needs implementation one of .*got implementation='cudnn'"),
    ("unknown_implementation", dict(implementation="flash"),
     r"implementation: expected None or one of .*got 'flash'"),
    ("partition_spec_not_a_spec", dict(partition_spec=("data",)),
     r"partition_spec: expected None or a jax.sharding.PartitionSpec, got tuple"),
])
def test_explain_refuses_what_the_call_refuses(name, kwargs, message):
    q = jnp.ones((1, 16, 2, 8))
    for fn in (explain, ls_attention):
        with pytest.raises(ValueError, match=message):
            fn(q, q, q, (None, 4), **kwargs)


# -- partitioning ----------------------------------------------------------------------------

EXPLICIT = AbstractMesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
AUTO = AbstractMesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)


@pytest.mark.parametrize("name, mesh, spec, partition_spec, path, batch_heads", [
    ("no_mesh", None, None, None, "whole", None),
    ("explicit_batch_and_heads", EXPLICIT, P("data", None, "model", None), None, "shard_map",
     (("data",), ("model",))),
    ("explicit_unsplit", EXPLICIT, P(), None, "whole", None),
    ("callers_spec", AUTO, None, P("data", None, "model", None), "shard_map",
     (("data",), ("model",))),
    ("callers_spec_splitting_nothing", AUTO, None, P(), "whole", None),
    ("auto_axes", AUTO, None, None, "custom_partitioning", None),
])
def test_the_plan_says_how_the_call_lies_on_the_mesh(name, mesh, spec, partition_spec, path,
                                                       batch_heads):
    def plan_of():
        sharding = None if spec is None else NamedSharding(mesh, spec)
        q = sds((8, 256, 16, 64), sharding=sharding)
        k = sds((8, 256, 4, 64), sharding=sharding)
        return explain(q, k, k, LS, platform="tpu", partition_spec=partition_spec)

    if mesh is None:
        plan = plan_of()
    else:
        with jax.sharding.use_abstract_mesh(mesh):
            plan = plan_of()
            text = str(plan)  # the per-shard launches read the mesh in context
    assert plan.partitioning.path == path
    if batch_heads is not None:
        layout = plan.partitioning.layout
        assert (layout.batch, layout.heads) == batch_heads
        assert "per shard: batch 4, 4 heads" in text
        # four head shards: the first holds the global head, the other three are all local
        assert text.count("head shard with windows") == 2


def test_inside_a_shard_map_the_call_is_whole():
    mesh = jax.make_mesh((1,), ("x",), axis_types=(AxisType.Auto,))
    paths = []

    def body(q):
        paths.append(partitioning(q, q.shape[2], None, False).path)
        return q

    jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"))(jnp.ones((2, 8, 2, 4)))
    assert paths == ["whole"]


def test_a_sequence_split_is_refused_at_planning():
    with jax.sharding.use_abstract_mesh(EXPLICIT):
        q = sds((8, 256, 16, 64), sharding=NamedSharding(EXPLICIT, P(None, "data", None, None)))
        with pytest.raises(ValueError, match=r"q: sharded along the sequence axis"):
            explain(q, q, q, LS, platform="tpu")


# -- launches --------------------------------------------------------------------------------

def test_the_gpu_launches_shown_are_the_heuristics_launches():
    q = sds((4, 8192, 16, 64))
    plan = explain(q, q, q, LS, platform="cuda", device_kind=HOPPER)
    case = heuristics.Case(dtype=jnp.bfloat16, head_dim=64, windows=LS, seq_len=8192, batch=4,
                           num_kv_heads=16, has_segments=False,
                           gpu=heuristics.gpu_of_kind(HOPPER), interpret=False)
    launches = heuristics.launches(case)
    text = str(plan)
    for launch in launches.forward + launches.backward:
        assert f"{launch.lowering} over heads" in text
    assert len(re.findall(r"pallas_gpu: (forward|backward):", text)) == len(
        launches.forward) + len(launches.backward)


def test_a_forward_only_backend_shows_its_forward_alone():
    q = sds((4, 8192, 16, 64))
    text = str(explain(q, q, q, (None,) * 16, platform="cuda", device_kind=HOPPER))
    assert re.search(r"not differentiated, pallas_gpu: forward:", text)
    assert not re.search(r"not differentiated, pallas_gpu: backward:", text)
    assert re.search(r"differentiated, cudnn: .*over heads 0-15, causal", text)


def test_a_split_call_shows_cudnn_for_the_global_heads_and_ours_for_the_local_ones():
    """Without the Hopper kernels, a long wide-head mix runs "split" (``dispatch.split_fits``):
    the plan names cuDNN's call over the global heads and our launches over the rest."""
    q, kv = sds((1, 32768, 8, 128)), sds((1, 32768, 4, 128))
    plan = explain(q, kv, kv, (None, None, 128, 128, 128, 128, 128, 128), platform="cuda",
                   device_kind="some other gpu")
    assert plan.routes == (Route("cuda", "split", "split"),)
    text = str(plan)
    assert re.search(r"split: jax.nn.dot_product_attention\(implementation='cudnn'\), causal, "
                     r"over the global heads 0-1", text)
    assert re.search(r"split: local heads 2-7: forward: triton over heads 0-5", text)
    assert re.search(r"split: local heads 2-7: backward: triton over heads 0-5", text)


# -- the call runs its plan --------------------------------------------------------------------

def test_the_call_runs_the_planned_routes(monkeypatch):
    """Stand-in backends scale the reference's output (primal x2, differentiated x3), so the
    numbers show which backend ran; the plan names the same ones."""
    traced = []
    monkeypatch.setattr(backends, "get_backend",
                        scaled_get_backend({"pallas_gpu": 2.0, "cudnn": 3.0}, traced))
    monkeypatch.setattr(dispatch, "current_platform", lambda: "cuda")
    monkeypatch.setattr(heuristics, "current_gpu",
                        lambda interpret=False: heuristics.gpu_of_kind(HOPPER))
    B, T, H, D = 1, dispatch.HOPPER_FORWARD_MIN_SEQ_LEN, 2, 64
    q = jax.random.normal(jax.random.key(0), (B, T, H, D), jnp.bfloat16)
    windows = (None, None)
    plan = explain(q, q, q, windows)
    assert plan.routes == (Route("cuda", "pallas_gpu", "cudnn"),)
    out = ls_attention(q, q, q, windows)
    grad_out = jax.grad(lambda q: ls_attention(q, q, q, windows).astype(jnp.float32).sum())(q)
    assert traced[:1] == ["pallas_gpu"] and "cudnn" in traced
    assert out.shape == grad_out.shape == q.shape


# -- the docs ----------------------------------------------------------------------------------

def test_the_plans_shown_in_the_docs_are_explains_output(capsys):
    """docs/library.md shows three plans: each ```python block that prints ``explain`` is
    followed by a ```text block with what it prints."""
    text = (pathlib.Path(__file__).resolve().parent.parent / "docs" / "library.md").read_text()
    pairs = re.findall(r"```python\n(.*?)```\s*```text\n(.*?)```", text, re.S)
    pairs = [(code, shown) for code, shown in pairs if "explain(" in code]
    assert len(pairs) == 3
    for code, shown in pairs:
        exec(compile(code, "docs/library.md", "exec"), {})
        assert capsys.readouterr().out == shown
