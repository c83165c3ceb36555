# Run P, calls P2-P3 (with the switch of P2_modes.diff): where the fused kernel's time goes; usage: P2_ab_modes.py D [BWD_BLOCK_Q]
"""Run P2: where the fused backward's time goes: full / no TMA reduction / no dQ store (kernels in one process, modes by env var at trace time)."""
import os, sys, time, dataclasses
import numpy as np, jax, jax.numpy as jnp
from ls_jax.kernels.pallas_gpu.backend import pallas_gpu_attention
from ls_jax.kernels.pallas_gpu.plan import default_config
B, n, H, D = 4, 8192, 16, int(sys.argv[1]) if len(sys.argv) > 1 else 64
windows = (None,) * H
base = default_config(jnp.bfloat16, D, windows, n)
keys = jax.random.split(jax.random.key(0), 4)
q, k, v, do = (jax.random.normal(kk, (B, n, H, D), jnp.bfloat16) for kk in keys)
fns = {}
BQ = int(sys.argv[2]) if len(sys.argv) > 2 else 0
for label in ("sep", "sep_q64", "full", "nostore"):
    cfg = dataclasses.replace(base, mosaic_fused_dq=not label.startswith("sep"))
    if BQ and label != "sep":
        cfg = dataclasses.replace(cfg, mosaic_bwd_block_q=BQ)
    os.environ["LSJ_FUSED_MODE"] = label
    def loss(q, k, v, cfg=cfg):
        out, _ = pallas_gpu_attention(q, k, v, windows, config=cfg)
        return jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32))
    f = jax.jit(jax.grad(loss, (0, 1, 2)))
    jax.block_until_ready(f(q, k, v))  # trace + compile now, under this mode
    fns[label] = f
times = {lab: [] for lab in fns}
for _ in range(6):
    for lab, f in fns.items():
        jax.block_until_ready(f(q, k, v))
        t0 = time.perf_counter()
        for _ in range(5):
            r = f(q, k, v)
        jax.block_until_ready(r)
        times[lab].append((time.perf_counter() - t0) / 5 * 1e3)
print(f"| all global D={D} n={n} f+b, variants other than sep with bwd block_q={BQ} | " + " | ".join(f"{lab} {np.median(t):.3f}" for lab, t in times.items()) + " |", flush=True)
