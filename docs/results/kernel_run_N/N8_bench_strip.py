"""Run N, calls N8-N9: the strip prototype against the Triton forward for local heads (H100)."""
import sys, time
sys.path.insert(0, "scratch")
import numpy as np, jax, jax.numpy as jnp
from forward_strip import strip_forward
from ls_jax.kernels.api import ls_attention
B, H, D = 4, 16, 64
for n in (8192, 32768):
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(kk, (B, n, H, D), jnp.bfloat16) for kk in keys)
    windows = (128,) * H
    fns = {"triton": jax.jit(lambda q, k, v: ls_attention(q, k, v, windows, implementation="pallas_gpu"))}
    for strip, cons in ((32, 2), (32, 3), (32, 4), (64, 4), (64, 2)):
        fns[f"strip{strip}c{cons}"] = jax.jit(lambda q, k, v, strip=strip, cons=cons: strip_forward(
            q, k, v, tuple(range(H)), windows, scale=D ** -0.5, strip=strip, consumers=cons)[0])
    ref = np.asarray(jax.block_until_ready(fns["triton"](q, k, v)).astype(jnp.float32))
    for name, f in fns.items():
        out = np.asarray(jax.block_until_ready(f(q, k, v)).astype(jnp.float32))
        print(n, name, "max |diff| vs triton", float(np.abs(out - ref).max()), flush=True)
    times = {name: [] for name in fns}
    for _ in range(10 if n == 8192 else 5):
        for name, f in fns.items():
            jax.block_until_ready(f(q, k, v))
            t0 = time.perf_counter()
            for _ in range(10):
                r = f(q, k, v)
            jax.block_until_ready(r)
            times[name].append((time.perf_counter() - t0) / 10 * 1e3)
    print(f"| {n} | " + " | ".join(f"{name} {np.median(t):.3f}" for name, t in times.items()) + " |", flush=True)
