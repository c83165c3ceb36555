"""Run X3: how fast one strip program runs when fewer run at once. The 15 local heads' strip
launch (D=64, p=128, strips of 64 blocks, n=8192: each program the same work) with 120, 60, 30
and 8 programs (B x heads x 2 strips); if the strips were bound by the GPU's DRAM, fewer
programs would each finish sooner. Online and whole-band strips; launches alone, interleaved."""
import dataclasses, time
import numpy as np, jax, jax.numpy as jnp
from ls_jax.kernels.pallas_gpu.forward_strip import forward_call_strip
from ls_jax.kernels.pallas_gpu.plan import make_plan

gpu = jax.devices()[0].platform == "gpu"
D, n = (64, 8192) if gpu else (64, 256)
rounds, inner = (15, 10) if gpu else (1, 1)
print("| programs (B x heads x strips) | online ms | whole band ms | MB moved | online TB/s |")
for B, H in ((4, 15), (2, 15), (1, 15), (1, 4)):
    windows = (128,) * H
    plan = make_plan(seq_len=n, head_dim=D, windows=windows, num_kv_heads=H, dtype=jnp.bfloat16,
                     scale=D ** -0.5, config=None, logit_stats=False, interpret=not gpu)
    cfg = dataclasses.replace(plan.config, local_fwd_lowering="strip",
                              strip_blocks=(n // 64) // 2)
    plans = [dataclasses.replace(plan, config=dataclasses.replace(cfg, strip_whole_band=w))
             for w in (False, True)]
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(kk, (B, plan.seq_len_padded, H, D), jnp.bfloat16)
               for kk in keys)
    fns = [jax.jit(lambda q, k, v, p=p: forward_call_strip(p, q, k, v, tuple(range(H)))[0])
           for p in plans]
    for f in fns:
        jax.block_until_ready(f(q, k, v))
    times = [[] for _ in fns]
    for _ in range(rounds):
        for t, f in zip(times, fns):
            t0 = time.perf_counter()
            for _ in range(inner):
                r = f(q, k, v)
            jax.block_until_ready(r)
            t.append((time.perf_counter() - t0) / inner * 1e3)
    a, b = (np.median(t) for t in times)
    mb = 4 * B * n * H * D * 2 / 1e6
    print(f"| {B} x {H} x 2 = {2 * B * H} | {a:.4f} | {b:.4f} | {mb:.0f} | {mb / a / 1e3:.2f} |",
          flush=True)
