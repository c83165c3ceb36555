import os, sys, time, dataclasses
import numpy as np, jax, jax.numpy as jnp
sys.path.insert(0, "scratch")
import bwd3
from ls_jax.kernels.pallas_gpu.backend import pallas_gpu_attention
from ls_jax.kernels.pallas_gpu.plan import KernelConfig
from ls_jax.kernels.reference import reference_attention_parts
bwd3.use(bwd3.patched())
for T, windows, bwd in ((448, (None, 50, None), "mosaic"), (320, (None, 7, 130), "mixed")):
    rng = np.random.default_rng(0)
    B, H, D = 1, len(windows), 64
    q, k, v, do = (jnp.asarray(rng.standard_normal((B, T, H, D)), jnp.bfloat16) for _ in range(4))
    f32 = [x.astype(jnp.float32) for x in (q, k, v, do)]
    cfg = KernelConfig(fwd_lowering="mosaic", bwd_lowering=bwd, mosaic_block_k=64, mosaic_bwd_block_q=64, mosaic_bwd_block_k=64,
                       fwd_block_q=16, fwd_block_k=16, dq_block_q=16, dq_block_k=16, dkdv_block_q=16, dkdv_block_k=16)
    def ours(q, k, v):
        return jnp.sum(pallas_gpu_attention(q, k, v, windows, config=cfg, interpret=True)[0].astype(jnp.float32) * f32[3])
    def ref(q, k, v):
        return jnp.sum(reference_attention_parts(q, k, v, windows)[0] * f32[3])
    t = time.time()
    got = jax.grad(ours, (0, 1, 2))(q, k, v)
    want = jax.grad(ref, (0, 1, 2))(*f32[:3])
    rel = [float(jnp.linalg.norm(g.astype(jnp.float32) - w) / jnp.linalg.norm(w)) for g, w in zip(got, want)]
    print(T, windows, bwd, ["%.1e" % r for r in rel], f"{time.time() - t:.0f}s", flush=True)
