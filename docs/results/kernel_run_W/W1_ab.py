"""Run W1: the strip forward's launches alone, spans (one per SM over the rows laid end to end)
against run O's row-aligned strips, interleaved; and the whole 1g15l forward (D=64, p=128)."""
import dataclasses, time
import numpy as np, jax, jax.numpy as jnp
from ls_jax.kernels.pallas_gpu.forward import forward_call
from ls_jax.kernels.pallas_gpu.forward_strip import forward_call_strip
from ls_jax.kernels.pallas_gpu.plan import make_plan

gpu = jax.devices()[0].platform == "gpu"
B, H, D = 4, 16, 64
windows = (None,) + (128,) * 15
cases = ((8192, (64,)), (32768, (128, 117))) if gpu else ((256, (1,)),)
rounds, inner = (15, 10) if gpu else (1, 1)
print("| n | launch | " + " | ".join(["spans (default)", "row-aligned", "other"]) + " |")
for n, others in cases:
    plan = make_plan(seq_len=n, head_dim=D, windows=windows, num_kv_heads=H, dtype=jnp.bfloat16,
                     scale=D ** -0.5, config=None, logit_stats=False, interpret=not gpu)
    assert plan.config.local_fwd_lowering == "strip" or not gpu, plan.config
    if not gpu:
        plan = dataclasses.replace(plan, config=dataclasses.replace(
            plan.config, local_fwd_lowering="strip", fwd_lowering="mixed"))
    plans = [plan] + [dataclasses.replace(plan, config=dataclasses.replace(
        plan.config, strip_blocks=s)) for s in others]
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(kk, (B, plan.seq_len_padded, H, D), jnp.bfloat16)
               for kk in keys)
    local = tuple(range(1, H))
    for what in ("local heads", "1g15l forward"):
        if what == "local heads":
            fns = [jax.jit(lambda q, k, v, p=p: forward_call_strip(p, q, k, v, local)[0])
                   for p in plans]
        else:
            fns = [jax.jit(lambda q, k, v, p=p: forward_call(p, q, k, v, None)[0])
                   for p in plans]
        outs = [np.asarray(jax.block_until_ready(f(q, k, v)), np.float32) for f in fns]
        sl = (slice(None), slice(None), slice(1, None)) if what == "local heads" else ...
        same = all(np.array_equal(o[sl], outs[0][sl]) for o in outs[1:])
        times = [[] for _ in fns]
        for _ in range(rounds):
            for t, f in zip(times, fns):
                t0 = time.perf_counter()
                for _ in range(inner):
                    r = f(q, k, v)
                jax.block_until_ready(r)
                t.append((time.perf_counter() - t0) / inner * 1e3)
        cells = [f"{np.median(t):.4f}" + ("" if i == 0 else f" (strip_blocks={([0] + list(others))[i]})")
                 for i, t in enumerate(times)]
        print(f"| {n} | {what} | " + " | ".join(cells) + f" | bit-identical: {same} |", flush=True)
