"""Run W8: the LS forward (D=64, p=128, B=4): two launches (the default) against one launch
with the global tiles first (W6) and one launch with the strips spread among the global tiles
(forward_joint.INTERLEAVE), the launches alone, interleaved repeats."""
import dataclasses, time
import numpy as np, jax, jax.numpy as jnp
from ls_jax.kernels.pallas_gpu import forward_joint
from ls_jax.kernels.pallas_gpu.forward import forward_call
from ls_jax.kernels.pallas_gpu.plan import make_plan

gpu = jax.devices()[0].platform == "gpu"
B, H, D = (4, 16, 64) if gpu else (1, 4, 64)
cases = [(8192, 1, False), (8192, 2, False), (32768, 1, False), (32768, 2, False),
         (32768, 1, True)] if gpu else [(256, 1, True)]
rounds, inner = (15, 10) if gpu else (1, 1)
print("| n | global heads | stats | two launches | one, global first | one, interleaved | "
      "max diff |")
for n, g, stats in cases:
    windows = (None,) * g + (128,) * (H - g)
    plan = make_plan(seq_len=n, head_dim=D, windows=windows, num_kv_heads=H, dtype=jnp.bfloat16,
                     scale=D ** -0.5, config=None, logit_stats=stats, interpret=not gpu, batch=B)
    if not gpu:
        plan = dataclasses.replace(plan, config=dataclasses.replace(
            plan.config, local_fwd_lowering="strip", fwd_lowering="mixed"))
    assert plan.config.local_fwd_lowering == "strip" and plan.config.fwd_lowering == "mixed"
    joint = dataclasses.replace(plan, config=dataclasses.replace(
        plan.config, local_fwd_lowering="joint"))
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(kk, (B, plan.seq_len_padded, H, D), jnp.bfloat16)
               for kk in keys)
    fns, outs = [], []
    for p, interleave in ((plan, None), (joint, False), (joint, True)):
        if interleave is not None:
            forward_joint.INTERLEAVE = interleave  # read when the call is traced (now)
        f = jax.jit(lambda q, k, v, p=p: forward_call(p, q, k, v, None))
        outs.append(jax.block_until_ready(f(q, k, v)))
        fns.append(f)
    diff = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
               for o in outs[1:] for a, b in zip(outs[0], o) if a is not None)
    times = [[] for _ in fns]
    for _ in range(rounds):
        for t, f in zip(times, fns):
            t0 = time.perf_counter()
            for _ in range(inner):
                r = f(q, k, v)
            jax.block_until_ready(r)
            t.append((time.perf_counter() - t0) / inner * 1e3)
    med = [float(np.median(t)) for t in times]
    print(f"| {n} | {g} | {stats} | {med[0]:.4f} | {med[1]:.4f} ({med[1] / med[0]:.3f}) | "
          f"{med[2]:.4f} ({med[2] / med[0]:.3f}) | {diff:.2e} |", flush=True)
