"""Run X1: the strip forward with each query block's band at once (strip_whole_band: the band's
QK^T products issued together, one softmax, the PV products chained with the exponentials made
between issues) against run O's online loop; launches alone, interleaved, D=64, B=4."""
import dataclasses, sys, time
import numpy as np, jax, jax.numpy as jnp
from ls_jax.kernels.pallas_gpu.forward import forward_call
from ls_jax.kernels.pallas_gpu.forward_strip import forward_call_strip
from ls_jax.kernels.pallas_gpu.plan import make_plan

gpu = jax.devices()[0].platform == "gpu"
B, H, D = 4, 16, 64
cases = ([(8192, 128, False), (32768, 128, False), (8192, 128, True), (8192, 50, False),
          (32768, 128, True), (16384, 128, False), (4096, 128, False)] if gpu
         else [(256, 128, False), (256, 50, True)])
rounds, inner = (15, 10) if gpu else (1, 1)
print("| n | p | stats | launch | online (run O) | whole band | ratio | max diff |")
for n, p, stats in cases:
    windows = (None,) + (p,) * 15
    plan = make_plan(seq_len=n, head_dim=D, windows=windows, num_kv_heads=H, dtype=jnp.bfloat16,
                     scale=D ** -0.5, config=None, logit_stats=stats, interpret=not gpu)
    if not gpu:
        plan = dataclasses.replace(plan, config=dataclasses.replace(
            plan.config, local_fwd_lowering="strip", fwd_lowering="mixed", strip_blocks=2))
    assert plan.config.local_fwd_lowering == "strip", plan.config
    plans = [plan, dataclasses.replace(plan, config=dataclasses.replace(
        plan.config, strip_whole_band=True))]
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(kk, (B, plan.seq_len_padded, H, D), jnp.bfloat16)
               for kk in keys)
    local = tuple(range(1, H))
    for what in ("15 local heads", "1g15l forward"):
        if what == "15 local heads":
            fns = [jax.jit(lambda q, k, v, p=p: forward_call_strip(p, q, k, v, local))
                   for p in plans]
        else:
            fns = [jax.jit(lambda q, k, v, p=p: forward_call(p, q, k, v, None)) for p in plans]
        outs = [jax.block_until_ready(f(q, k, v)) for f in fns]
        h = slice(1, None) if what == "15 local heads" else slice(None)
        diff = float(jnp.abs(outs[0][0][:, :, h].astype(jnp.float32)
                             - outs[1][0][:, :, h].astype(jnp.float32)).max())
        if stats:
            diff = max(diff, float(jnp.abs(outs[0][2][:, h] - outs[1][2][:, h]).max()))
        times = [[] for _ in fns]
        for _ in range(rounds):
            for t, f in zip(times, fns):
                t0 = time.perf_counter()
                for _ in range(inner):
                    r = f(q, k, v)
                jax.block_until_ready(r)
                t.append((time.perf_counter() - t0) / inner * 1e3)
        a, b = (np.median(t) for t in times)
        print(f"| {n} | {p} | {stats} | {what} | {a:.4f} | {b:.4f} | {b / a:.3f} | {diff:.3g} |",
              flush=True)
