"""Run R: the Mosaic backward with three consumers (KernelConfig.mosaic_bwd_consumers=3,
64-row query blocks) against the default, f+b, interleaved samples in one process."""
import sys, time, dataclasses
import numpy as np, jax, jax.numpy as jnp
from ls_jax.kernels.pallas_gpu.backend import pallas_gpu_attention
from ls_jax.kernels.pallas_gpu.plan import default_config

L15 = (128,) * 15
CASES = {"g16_d64_8k": (4, 8192, 16, 64, (None,) * 16),
         "g16_d64_32k": (1, 32768, 16, 64, (None,) * 16),
         "1g15l_d64_32k": (4, 32768, 16, 64, (None,) + L15),
         "1g15l_d64_8k": (4, 8192, 16, 64, (None,) + L15),
         "1g15l_d64_16k": (4, 16384, 16, 64, (None,) + L15),
         "g16_d128_8k": (4, 8192, 16, 128, (None,) * 16),
         "g16_d64_2k": (4, 2048, 16, 64, (None,) * 16),
         "g16_d64_4k": (4, 4096, 16, 64, (None,) * 16),
         "2g14l_d64_16k": (4, 16384, 16, 64, (None, None) + (128,) * 14),
         "1g15l_d64_32k_b1": (1, 32768, 16, 64, (None,) + L15),
         "2g14l_d128_32k": (4, 32768, 16, 128, (None, None) + (128,) * 14)}
name, labels = sys.argv[1], sys.argv[2].split(",")
samples = int(sys.argv[3]) if len(sys.argv) > 3 else 7
B, n, H, D, windows = CASES[name]
VARIANTS = {"default": {}, "fused": dict(mosaic_fused_dq=True),
            "c2": dict(mosaic_bwd_consumers=2, mosaic_bwd_block_q=128 if D <= 64 else 64), "c3q64": dict(mosaic_bwd_consumers=3, mosaic_bwd_block_q=64),
            "mixc2": dict(bwd_lowering="mixed"),
            "mixc3q64": dict(bwd_lowering="mixed", mosaic_bwd_consumers=3, mosaic_bwd_block_q=64)}
base = default_config(jnp.bfloat16, D, windows, n)
keys = jax.random.split(jax.random.key(0), 4)
q, k, v, do = (jax.random.normal(kk, (B, n, H, D), jnp.bfloat16) for kk in keys)
fns, g = {}, {}
for label in labels:
    cfg = dataclasses.replace(base, **VARIANTS[label])
    def loss(q, k, v, cfg=cfg):
        out, _ = pallas_gpu_attention(q, k, v, windows, config=cfg)
        return jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32))
    fns[label] = jax.jit(jax.grad(loss, (0, 1, 2)))
    g[label] = jax.block_until_ready(fns[label](q, k, v))
ref = labels[0]
for label in labels[1:]:
    diffs = []
    for nm, a, b in zip("qkv", g[ref], g[label]):
        a32, b32 = a.astype(jnp.float32), b.astype(jnp.float32)
        diffs.append(f"d{nm} {float(jnp.linalg.norm(a32 - b32) / jnp.linalg.norm(a32)):.1e}")
    print(name, f"{label} vs {ref} ({base.bwd_lowering}) rel:", "; ".join(diffs), flush=True)
times = {lab: [] for lab in fns}
for _ in range(samples):
    for lab, f in fns.items():
        jax.block_until_ready(f(q, k, v))
        t0 = time.perf_counter()
        for _ in range(3):
            r = f(q, k, v)
        jax.block_until_ready(r)
        times[lab].append((time.perf_counter() - t0) / 3 * 1e3)
med = {lab: float(np.median(t)) for lab, t in times.items()}
spread = {lab: (min(t), max(t)) for lab, t in times.items()}
row = " | ".join(f"{lab} {med[lab]:.3f} ({spread[lab][0]:.3f}-{spread[lab][1]:.3f}) {med[ref] / med[lab]:.3f}x"
                 for lab in labels)
print(f"| R {name} f+b ms | {row} |", flush=True)
