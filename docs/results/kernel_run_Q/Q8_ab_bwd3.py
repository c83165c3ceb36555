"""Run Q (call Q8): the Mosaic backward with three consumers (64-row blocks) vs the default
(two consumers, 128-row query blocks at D=64), f+b, interleaved."""
import sys, time, dataclasses
import numpy as np, jax, jax.numpy as jnp
sys.path.insert(0, "scratch")
import bwd3
import ls_jax.kernels.pallas_gpu.backward_mosaic as bm
from ls_jax.kernels.pallas_gpu.backend import pallas_gpu_attention
from ls_jax.kernels.pallas_gpu.plan import default_config

CASES = {"g16_d64_8k": (4, 8192, 16, 64, (None,) * 16),
         "1g15l_d64_32k": (4, 32768, 16, 64, (None,) + (128,) * 15),
         "g16_d128_8k": (4, 8192, 16, 128, (None,) * 16)}
c3 = bwd3.patched()
for name in sys.argv[1].split(","):
    B, n, H, D, windows = CASES[name]
    base = default_config(jnp.bfloat16, D, windows, n)
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, do = (jax.random.normal(kk, (B, n, H, D), jnp.bfloat16) for kk in keys)
    fns, g = {}, {}
    for label, mod, cfg in (("c2", bm, base), ("c3q64", c3, dataclasses.replace(base, mosaic_bwd_block_q=64))):
        bwd3.use(mod)
        def loss(q, k, v, cfg=cfg):
            out, _ = pallas_gpu_attention(q, k, v, windows, config=cfg)
            return jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32))
        fns[label] = jax.jit(jax.grad(loss, (0, 1, 2)))
        g[label] = jax.block_until_ready(fns[label](q, k, v))
    bwd3.use(bm)
    diffs = []
    for nm, a, b in zip("qkv", g["c2"], g["c3q64"]):
        a32, b32 = a.astype(jnp.float32), b.astype(jnp.float32)
        diffs.append(f"d{nm} rel {float(jnp.linalg.norm(a32 - b32) / jnp.linalg.norm(a32)):.1e}")
    print(name, base.bwd_lowering, "c3q64 vs c2 |", "; ".join(diffs), flush=True)
    times = {lab: [] for lab in fns}
    for _ in range(5):
        for lab, f in fns.items():
            jax.block_until_ready(f(q, k, v))
            t0 = time.perf_counter()
            for _ in range(3):
                r = f(q, k, v)
            jax.block_until_ready(r)
            times[lab].append((time.perf_counter() - t0) / 3 * 1e3)
    med = {lab: float(np.median(t)) for lab, t in times.items()}
    print(f"| {name} f+b | c2 {med['c2']:.3f} | c3q64 {med['c3q64']:.3f} | {med['c2'] / med['c3q64']:.3f}x |", flush=True)
