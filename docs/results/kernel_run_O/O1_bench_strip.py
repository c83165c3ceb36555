# Run O, calls O1-O3 (H100): the run-N strip prototype (N8_forward_strip.py, four consumers at 112 registers) against the Triton forward, 16 local heads.
"""usage: bench_one.py N strip:cons[,strip:cons...]  (Triton local forward interleaved)."""
import sys, time
sys.path.insert(0, "scratch")
import numpy as np, jax, jax.numpy as jnp
from forward_strip import strip_forward
from ls_jax.kernels.api import ls_attention
B, H, D = 4, 16, 64
n = int(sys.argv[1])
P = int(sys.argv[3]) if len(sys.argv) > 3 else 128
H = int(sys.argv[4]) if len(sys.argv) > 4 else 16
variants = [tuple(int(x) for x in v.split(":")) for v in sys.argv[2].split(",")]
keys = jax.random.split(jax.random.key(0), 3)
q, k, v = (jax.random.normal(kk, (B, n, H, D), jnp.bfloat16) for kk in keys)
windows = (P,) * H
fns = {"triton": jax.jit(lambda q, k, v: ls_attention(q, k, v, windows, implementation="pallas_gpu"))}
for strip, cons, *st in variants:
    st = st[0] if st else None
    fns[f"strip{strip}c{cons}s{st}"] = jax.jit(lambda q, k, v, strip=strip, cons=cons, st=st: strip_forward(
        q, k, v, tuple(range(H)), windows, scale=D ** -0.5, strip=strip, consumers=cons, stages=st)[0])
ref = np.asarray(jax.block_until_ready(fns["triton"](q, k, v)).astype(jnp.float32))
for name, f in fns.items():
    out = np.asarray(jax.block_until_ready(f(q, k, v)).astype(jnp.float32))
    print(n, name, "max |diff| vs triton", float(np.abs(out - ref).max()), flush=True)
times = {name: [] for name in fns}
for _ in range(10 if n <= 8192 else 5):
    for name, f in fns.items():
        jax.block_until_ready(f(q, k, v))
        t0 = time.perf_counter()
        for _ in range(10):
            r = f(q, k, v)
        jax.block_until_ready(r)
        times[name].append((time.perf_counter() - t0) / 10 * 1e3)
print(f"| {n} | p={P} H={H} | " + " | ".join(f"{name} {np.median(t):.3f}" for name, t in times.items()) + " |", flush=True)
