"""Run X9: what DRAM rate this H100 reaches on plain XLA streams of the strips' bytes (B=4,
n=8192, 15 heads, D=64: q, k, v read and out written, 252 MB): three arrays read and one written
(q + k + v), one read and one written (a copy, x * 2), and a read-only sum."""
import time
import numpy as np, jax, jax.numpy as jnp
shape = (4, 8192, 15, 64)
keys = jax.random.split(jax.random.key(0), 3)
q, k, v = (jax.random.normal(kk, shape, jnp.bfloat16) for kk in keys)
mb = np.prod(shape) * 2 / 1e6
cases = [("3 read + 1 write (q + k + v)", jax.jit(lambda q, k, v: q + k + v), 4 * mb),
         ("1 read + 1 write (q * 2)", jax.jit(lambda q, k, v: q * 2), 2 * mb),
         ("1 read (sum of q)", jax.jit(lambda q, k, v: jnp.sum(q, dtype=jnp.float32)), mb)]
print("| stream | MB | ms | TB/s |")
for name, f, total in cases:
    jax.block_until_ready(f(q, k, v))
    ts = []
    for _ in range(15):
        t0 = time.perf_counter()
        for _ in range(20):
            r = f(q, k, v)
        jax.block_until_ready(r)
        ts.append((time.perf_counter() - t0) / 20 * 1e3)
    t = float(np.median(ts))
    print(f"| {name} | {total:.0f} | {t:.4f} | {total / t / 1e3:.2f} |", flush=True)
