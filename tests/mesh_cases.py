"""Multi-device cases for tests/test_sharding.py, run in a subprocess whose XLA_FLAGS give it
fake CPU devices (they must be set before JAX starts). ``python tests/mesh_cases.py CASE ARGS``
prints one JSON line last."""

from __future__ import annotations

import hashlib
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P


def micro(*overrides):
    from ls_jax.config import Config, DataConfig, ModelConfig, TrainConfig
    cfg = Config(
        name="micro",
        # T=48: no weight has a dimension of 48, so an all-gather with one is an activation's
        model=ModelConfig(vocab_size=256, n_layer=1, d_model=40, n_head=4, head_dim=8,
                          n_global_heads=1, window=8, max_seq_len=64),
        data=DataConfig(seq_len=48, shuffle_window=8, worker_threads=0, prefetch=0),
        train=TrainConfig(batch_size=8, num_steps=3, lr=3e-3, warmup_steps=1, log_every=1,
                          save_every=100, eval_batches=1, async_checkpoints=False,
                          progress=False))
    return cfg.override(list(overrides))


def case_directional():
    """ls_attention with implementation=None on a (pretended) Hopper GPU, inputs split over a
    data x tensor mesh, every head global: the forward alone runs the primal backend per shard, jax.grad the
    differentiated one (its own forward and backward). Stand-ins scale the reference's output
    (primal x2, differentiated x3) so the numbers tell which ran."""
    from ls_jax.config import MeshConfig
    from ls_jax.kernels import backends, dispatch
    from ls_jax.kernels import ls_attention
    from ls_jax.kernels.pallas_gpu import heuristics
    from ls_jax.kernels.reference import reference_backend
    from ls_jax.sharding import make_mesh
    from stand_in_backends import scaled_get_backend  # tests/, beside this script
    traced = []
    backends.get_backend = scaled_get_backend({"pallas_gpu": 2.0, "cudnn": 3.0}, traced)
    dispatch.current_platform = lambda: "cuda"
    heuristics.current_gpu = lambda interpret=False: heuristics.Gpu(hopper=True, sms=132)
    B, T, H, D = 4, dispatch.HOPPER_FORWARD_MIN_SEQ_LEN, 2, 64
    kq, kk, kv, kd = jax.random.split(jax.random.key(2), 4)
    q, k, v, do = (jax.random.normal(key, (B, T, H, D), jnp.bfloat16) for key in (kq, kk, kv, kd))
    windows = (None, None)

    def ref(q, k, v):
        return reference_backend(q, k, v, window_sizes=windows, segment_ids=None,
                                 scale=D ** -0.5, return_logit_stats=False,
                                 interpret=False)[0].astype(jnp.float32)

    def loss(attend, q, k, v):
        return jnp.sum(attend(q, k, v).astype(jnp.float32) * do.astype(jnp.float32))

    def sharded(q, k, v):
        return ls_attention(q, k, v, windows)

    mesh = make_mesh(MeshConfig(data=4, tensor=2))
    with jax.set_mesh(mesh):
        q, k, v = (jax.device_put(x, P("data", None, "tensor")) for x in (q, k, v))
        out = jax.jit(sharded)(q, k, v)
        forward_traced = list(traced)
        traced.clear()
        grads = jax.jit(jax.grad(lambda *qkv: loss(sharded, *qkv), argnums=(0, 1, 2)))(q, k, v)
        grad_traced = list(traced)
    want_grads = jax.grad(lambda *qkv: loss(ref, *qkv), argnums=(0, 1, 2))(q, k, v)

    def rel(a, b):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        return float(np.linalg.norm(a - b) / np.linalg.norm(b))

    return {"forward_traced": sorted(set(forward_traced)),
            "grad_traced": sorted(set(grad_traced)),
            "out_vs_2ref": rel(out, 2 * ref(q, k, v)),
            "grads_vs_3ref": max(rel(g, 3 * w) for g, w in zip(grads, want_grads)),
            "out_spec": str(out.sharding.spec)}


def _spec(x):
    return tuple(x.sharding.spec) + (None,) * (x.ndim - len(x.sharding.spec))


def _batches(n_steps: int, batch: int, seq_len: int):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, size=(n_steps, batch, seq_len + 1), dtype=np.int32)
    return [{"inputs": t[:, :-1], "targets": t[:, 1:]} for t in tokens]


def case_train(impl: str, meshes: str):
    """Losses of 3 steps of the run's jitted step (ls_jax.training.step.compile_train_fns) on each mesh
    ("DxFxT", over the first D x F x T devices); on the last mesh also the shardings of params,
    optimizer state and batch, and the all-gathers of activations in the compiled step."""
    from flax import nnx

    from ls_jax import sharding as sharding_lib
    from ls_jax.kernels.sharded import qkv_gathers
    from ls_jax.training.state import init_key
    from ls_jax.training.step import compile_train_fns
    extra = [f"model.attn_implementation={impl}"]
    if impl.startswith("pallas"):  # the model's kernel calls in Pallas interpret mode (CPU)
        from ls_jax.layers import attention
        from ls_jax.kernels.api import ls_attention_validated
        attention.ls_attention_validated = lambda *a, **kw: ls_attention_validated(
            *a, **{**kw, "interpret": True})
    out = {"devices": jax.device_count(), "losses": {}}
    mesh_specs = meshes.split(",")
    for mesh_spec in mesh_specs:
        d, f, t = mesh_spec.split("x")
        cfg = micro(f"mesh.data={d}", f"mesh.fsdp={f}", f"mesh.tensor={t}", *extra)
        mesh = sharding_lib.make_mesh(cfg.mesh, jax.devices()[:int(d) * int(f) * int(t)])
        with jax.set_mesh(mesh):
            fns = compile_train_fns(cfg, mesh)
            state = fns.init(init_key(cfg))
            losses = []
            for batch_np in _batches(3, cfg.train.batch_size, cfg.data.seq_len):
                batch = sharding_lib.global_batch(batch_np, sharding_lib.batch_sharding(mesh))
                state, metrics = fns.steps[True](state, batch)
                losses.append(float(metrics["loss"]))
            if mesh_spec == mesh_specs[-1]:
                hlo = fns.steps[True].lower(state, batch).compile().as_text()
        out["losses"][mesh_spec] = losses
    model_state, opt_state = state[0], state[1]
    blk = model_state["blocks"][0]
    mu = [v for p, v in nnx.to_flat_state(opt_state)
          if {"mu", "q_proj", "kernel"} <= set(map(str, p))]
    out["specs"] = {
        "q_proj": _spec(blk["attn"]["q_proj"]["kernel"].get_value()),
        "o_proj": _spec(blk["attn"]["o_proj"]["kernel"].get_value()),
        "fc": _spec(blk["mlp"]["fc"]["kernel"].get_value()),
        "embed": _spec(model_state["embed"]["embedding"].get_value()),
        "ln": _spec(blk["ln1"]["scale"].get_value()),
        "mu_q_proj": _spec(mu[0].get_value()) if mu else None,
        "batch": _spec(batch["inputs"]),
    }
    out["gathers"] = qkv_gathers(hlo, cfg.data.seq_len, cfg.model.n_head, cfg.model.head_dim)
    return out


def _digest(state) -> str:
    h = hashlib.sha256()
    for leaf in jax.tree.leaves(state):
        h.update(np.asarray(jax.device_get(leaf)).tobytes())
    return h.hexdigest()


def case_restore(workdir: str, stop_after: str):
    """Trains micro in ``workdir`` (resuming if it holds a checkpoint), stopping after
    ``stop_after`` steps (0: run to the end); reports the losses and a digest of the state
    restored from the checkpoint it resumed from."""
    from ls_jax import sharding as sharding_lib
    from ls_jax.training.checkpoint import Checkpointer
    from ls_jax.training.step import compile_train_fns
    from ls_jax.training.train import train
    cfg = micro("train.num_steps=4")
    ckpt = Checkpointer(workdir)
    start = ckpt.latest_step()
    digest = None
    if start:
        mesh = sharding_lib.make_mesh(cfg.mesh)
        with jax.set_mesh(mesh):
            fns = compile_train_fns(cfg, mesh)
            _, state = ckpt.restore(start, sharding_lib.with_shardings(fns.abstract,
                                                                       fns.state_sharding))
        digest = _digest(state)
    ckpt.close()
    r = train(cfg, workdir, stop_after_steps=int(stop_after) or None, log=lambda m: None)
    return {"devices": jax.device_count(), "start": r.start_step, "final": r.final_step,
            "losses": {str(k): v for k, v in r.losses.items()}, "digest": digest}


def case_multiprocess(workdir: str, process_id: str, port: str, stop_after: str):
    """One of two processes on localhost (jax.distributed); trains until stopped (or for
    ``stop_after`` steps when not 0)."""
    jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=2,
                               process_id=int(process_id))
    from ls_jax.training.train import train
    cfg = micro("train.num_steps=400", "train.save_every=1000")

    def log(msg):
        print(msg, flush=True)

    r = train(cfg, workdir, log=log, stop_after_steps=int(stop_after) or None)
    return {"process": jax.process_index(), "start": r.start_step, "final": r.final_step,
            "interrupted": r.interrupted, "devices": jax.device_count()}


def case_alone(workdir: str):
    """case_multiprocess's run resumed by one process (one device) for one step; reports the
    warning lines."""
    from ls_jax.training.train import train
    cfg = micro("train.num_steps=400", "train.save_every=1000")
    messages = []
    r = train(cfg, workdir, log=messages.append, stop_after_steps=1)
    return {"process_count": jax.process_count(), "start": r.start_step, "final": r.final_step,
            "warnings": [m for m in messages if m.startswith("warning:")]}


if __name__ == "__main__":
    result = globals()[f"case_{sys.argv[1]}"](*sys.argv[2:])
    print(json.dumps(result), flush=True)
