import dataclasses, jax, jax.numpy as jnp
from ls_jax.kernels.pallas_gpu.backend import pallas_gpu_attention
from ls_jax.kernels.pallas_gpu.plan import default_config
T, H, D = 2048, 4, 128
windows = (None,) * H
q = jax.random.normal(jax.random.key(0), (1, T, H, D), jnp.bfloat16)
for c, bk in ((2, 128), (3, 64), (3, 128)):
    cfg = dataclasses.replace(default_config(jnp.bfloat16, D, windows, T), mosaic_consumers=c, mosaic_block_k=bk)
    print("=== consumers", c, "block_k", bk, flush=True)
    o, s = jax.jit(lambda q: pallas_gpu_attention(q, q, q, windows, config=cfg, return_logit_stats=True))(q)
    jax.block_until_ready(o)
