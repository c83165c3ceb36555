"""Run Y4: why the dK/dV strips lose (Y3: 0.270 vs Triton's 0.204 ms): ptxas registers and
spills of both strip kernels (MOSAIC_GPU_DUMP_PTXAS=1), and the dK/dV strips with two
consumers (232 registers each) against three and Triton, 15 local heads, B=4, n=8192."""
import time
import numpy as np, jax, jax.numpy as jnp
from ls_jax.kernels.pallas_gpu import backward_strip as bs
from ls_jax.kernels.pallas_gpu.plan import make_plan
from ls_jax.kernels.pallas_gpu.forward import forward_call
from ls_jax.kernels.pallas_gpu.backward import dq_call, dkdv_call
gpu = jax.devices()[0].platform == "gpu"
B, H, D, n = (4, 16, 64, 8192) if gpu else (1, 3, 64, 512)
windows = (None,) + (128,) * (H - 1)
local = tuple(range(1, H))
plan = make_plan(seq_len=n, head_dim=D, windows=windows, num_kv_heads=H, dtype=jnp.bfloat16,
                 scale=D ** -0.5, config=None, logit_stats=False, interpret=not gpu, batch=B)
keys = jax.random.split(jax.random.key(0), 4)
q, k, v, do = (jax.random.normal(kk, (B, n, H, D), jnp.bfloat16) for kk in keys)
out, lse2, _ = forward_call(plan, q, k, v, None)
_, delta = dq_call(plan, q, k, v, None, do, out, lse2, heads=local)
args = (q, k, v, do, lse2, delta)
fns = [jax.jit(lambda *a: dkdv_call(plan, *a[:3], None, *a[3:], kv_heads=local))]
print("=== ptxas: dq strip, 3 consumers", flush=True)
jax.block_until_ready(jax.jit(lambda q, k, v, do, lse2, out: bs.dq_call_strip(plan, q, k, v, do, lse2, out, local))(q, k, v, do, lse2, out))
for c in (3, 2):
    print(f"=== ptxas: dkdv strip, {c} consumers", flush=True)
    bs.STRIP_CONSUMERS = c
    f = jax.jit(lambda *a: bs.dkdv_call_strip(plan, *a, local)).lower(*args).compile()
    jax.block_until_ready(f(*args))
    fns.append(f)
times = [[] for _ in fns]
for _ in range(11 if gpu else 1):
    for t, f in zip(times, fns):
        t0 = time.perf_counter()
        for _ in range(10):
            r = f(*args)
        jax.block_until_ready(r)
        t.append((time.perf_counter() - t0) / 10 * 1e3)
print("| Y4 dK/dV, 15 local heads n=8192 | Triton | strips, 3 consumers | strips, 2 consumers |")
print("| ms | " + " | ".join(f"{np.median(t):.4f}" for t in times) + " |")
