"""Run X8: what bounds a strip program? The strip launch alone (15 local heads, D=64, p=128,
n=8192), interleaved: run O's strips; the same with the consumers computing nothing (zeros
stored); nothing computed and no query loads; nothing computed, no query loads, no stores (the
key/value stream alone); at B=4 (120 programs) and B=1 heads 4 (8 programs, strips of 64)."""
import dataclasses, time
import numpy as np, jax, jax.numpy as jnp
from ls_jax.kernels.pallas_gpu import forward_strip as fs
from ls_jax.kernels.pallas_gpu.plan import make_plan

gpu = jax.devices()[0].platform == "gpu"
D, n = (64, 8192) if gpu else (64, 256)
variants = [("strips", False, True, True), ("no compute", True, True, True),
            ("no compute, no q", True, False, True), ("k/v stream only", True, False, False)]
rounds, inner = (15, 10) if gpu else (1, 1)
print("| programs | " + " | ".join(v[0] for v in variants) + " |")
for B, H in ((4, 15), (1, 4)):
    plan = make_plan(seq_len=n, head_dim=D, windows=(128,) * H, num_kv_heads=H,
                     dtype=jnp.bfloat16, scale=D ** -0.5, config=None, logit_stats=False,
                     interpret=not gpu)
    cfg = dataclasses.replace(plan.config, local_fwd_lowering="strip",
                              strip_blocks=(n // 64) // 2)
    plan = dataclasses.replace(plan, config=cfg)
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(kk, (B, plan.seq_len_padded, H, D), jnp.bfloat16)
               for kk in keys)
    fns = []
    for name, none, qload, ostore in variants:
        fs.NO_COMPUTE, fs.Q_LOADS, fs.O_STORES = none, qload, ostore
        f = jax.jit(lambda q, k, v: fs.forward_call_strip(plan, q, k, v, tuple(range(H)))[0])
        f = f.lower(q, k, v).compile()
        jax.block_until_ready(f(q, k, v))
        fns.append(f)
    fs.NO_COMPUTE, fs.Q_LOADS, fs.O_STORES = False, True, True
    times = [[] for _ in fns]
    for _ in range(rounds):
        for t, f in zip(times, fns):
            t0 = time.perf_counter()
            for _ in range(inner):
                r = f(q, k, v)
            jax.block_until_ready(r)
            t.append((time.perf_counter() - t0) / inner * 1e3)
    print(f"| {B * H * 2} | " + " | ".join(f"{np.median(t):.4f}" for t in times) + " |",
          flush=True)
