"""Run O7: the 1g15l D=64 p=128 forward's launches timed alone and together (strip vs Triton)."""
import sys, time, dataclasses
import numpy as np, jax, jax.numpy as jnp
from ls_jax.kernels.pallas_gpu.forward import forward_call
from ls_jax.kernels.pallas_gpu.forward_mosaic import forward_call_mosaic
from ls_jax.kernels.pallas_gpu.forward_strip import forward_call_strip
from ls_jax.kernels.pallas_gpu.plan import make_plan
B, H, D = 4, 16, 64
windows = (None,) + (128,) * 15
for n in (2048, 4096, 8192):
    plan = make_plan(seq_len=n, head_dim=D, windows=windows, num_kv_heads=H, dtype=jnp.bfloat16,
                     scale=D ** -0.5, config=None, logit_stats=False, interpret=False)
    tplan = dataclasses.replace(plan, config=dataclasses.replace(plan.config, local_fwd_lowering="triton"))
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(kk, (B, plan.seq_len_padded, H, D), jnp.bfloat16) for kk in keys)
    local = tuple(range(1, H))
    fns = {
        "mix_strip": jax.jit(lambda q, k, v: forward_call(plan, q, k, v, None)[0]),
        "mix_triton": jax.jit(lambda q, k, v: forward_call(tplan, q, k, v, None)[0]),
        "global_alone": jax.jit(lambda q, k, v: forward_call_mosaic(plan, q, k, v, heads=(0,))[0]),
        "strip_alone": jax.jit(lambda q, k, v: forward_call_strip(plan, q, k, v, local)[0]),
    }
    times = {name: [] for name in fns}
    for f in fns.values():
        jax.block_until_ready(f(q, k, v))
    for _ in range(15):
        for name, f in fns.items():
            t0 = time.perf_counter()
            for _ in range(10):
                r = f(q, k, v)
            jax.block_until_ready(r)
            times[name].append((time.perf_counter() - t0) / 10 * 1e3)
    print(f"| {n} | " + " | ".join(f"{name} {np.median(t):.4f}" for name, t in times.items()) + " |", flush=True)
