"""Run O12: the strip kernel with specialised edge masks against the package's, kernels alone."""
import sys, time, dataclasses
sys.path.insert(0, "scratch")
import numpy as np, jax, jax.numpy as jnp
from ls_jax.kernels.pallas_gpu.forward_strip import forward_call_strip as old
from strip_masks import forward_call_strip as new
from ls_jax.kernels.pallas_gpu.plan import make_plan
interpret = jax.devices()[0].platform != "gpu"
B, H, D = (1, 4, 64) if interpret else (4, 16, 64)
for n, p in ((512, 128), (512, 64)) if interpret else ((8192, 128), (32768, 128), (8192, 256)):
    windows = (p,) * H
    plan = make_plan(seq_len=n, head_dim=D, windows=windows, num_kv_heads=H, dtype=jnp.bfloat16,
                     scale=D ** -0.5, config=None, logit_stats=False, interpret=interpret)
    splan = dataclasses.replace(plan, logit_stats=True)
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(kk, (B, plan.seq_len_padded, H, D), jnp.bfloat16) for kk in keys)
    heads = tuple(range(H))
    fns = {"old": jax.jit(lambda q, k, v: old(plan, q, k, v, heads)[:2]),
           "new": jax.jit(lambda q, k, v: new(plan, q, k, v, heads)[:2]),
           "old_stats": jax.jit(lambda q, k, v: old(splan, q, k, v, heads)),
           "new_stats": jax.jit(lambda q, k, v: new(splan, q, k, v, heads))}
    a, b = fns["old_stats"](q, k, v), fns["new_stats"](q, k, v)
    print(n, p, "max diff", [float(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32)).max()) for x, y in zip(a, b)], flush=True)
    if interpret:
        continue
    times = {name: [] for name in fns}
    for _ in range(15 if n <= 8192 else 6):
        for name, f in fns.items():
            jax.block_until_ready(f(q, k, v))
            t0 = time.perf_counter()
            for _ in range(10):
                r = f(q, k, v)
            jax.block_until_ready(r)
            times[name].append((time.perf_counter() - t0) / 10 * 1e3)
    print(f"| {n} | p={p} | " + " | ".join(f"{name} {np.median(t):.4f}" for name, t in times.items()) + " |", flush=True)
