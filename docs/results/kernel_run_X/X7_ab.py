"""Run X7: the strip launch alone (15 local heads, D=64, p=128, B=4), interleaved: run O's
online strips; the whole band; the whole band + early release (blocks released before the
output's store); the whole band + early release + 2 more ring slots; online + early release."""
import dataclasses, time
import numpy as np, jax, jax.numpy as jnp
from ls_jax.kernels.pallas_gpu import forward_strip as fs
from ls_jax.kernels.pallas_gpu.plan import make_plan

gpu = jax.devices()[0].platform == "gpu"
D = 64
variants = [("online", False, False, 0), ("whole", True, False, 0),
            ("whole+early", True, True, 0), ("whole+early+2", True, True, 2),
            ("online+early", False, True, 0), ("online+early+2", False, True, 2)]
cases = ([(8192, 4, False), (32768, 4, False), (8192, 4, True), (8192, 1, False)] if gpu
         else [(256, 1, False)])
rounds, inner = (15, 10) if gpu else (1, 1)
print("| n | B | stats | " + " | ".join(v[0] for v in variants) + " |")
for n, B, stats in cases:
    H = 15
    plan = make_plan(seq_len=n, head_dim=D, windows=(128,) * H, num_kv_heads=H,
                     dtype=jnp.bfloat16, scale=D ** -0.5, config=None, logit_stats=stats,
                     interpret=not gpu)
    cfg = dataclasses.replace(plan.config, local_fwd_lowering="strip",
                              strip_blocks=0 if gpu else 2)
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(kk, (B, plan.seq_len_padded, H, D), jnp.bfloat16)
               for kk in keys)
    fns, outs = [], []
    for name, whole, early, extra in variants:
        fs.EARLY_RELEASE, fs.EXTRA_STAGES = early, extra
        p = dataclasses.replace(plan, config=dataclasses.replace(cfg, strip_whole_band=whole))
        f = jax.jit(lambda q, k, v, p=p: fs.forward_call_strip(p, q, k, v, tuple(range(H)))[0])
        f = f.lower(q, k, v).compile()
        fns.append(f)
        outs.append(np.asarray(jax.block_until_ready(f(q, k, v)), np.float32))
    fs.EARLY_RELEASE, fs.EXTRA_STAGES = False, 0
    diff = max(float(np.abs(o - outs[0]).max()) for o in outs[1:])
    times = [[] for _ in fns]
    for _ in range(rounds):
        for t, f in zip(times, fns):
            t0 = time.perf_counter()
            for _ in range(inner):
                r = f(q, k, v)
            jax.block_until_ready(r)
            t.append((time.perf_counter() - t0) / inner * 1e3)
    print(f"| {n} | {B} | {stats} | " + " | ".join(f"{np.median(t):.4f}" for t in times)
          + f" | max diff {diff:.3g} |", flush=True)
