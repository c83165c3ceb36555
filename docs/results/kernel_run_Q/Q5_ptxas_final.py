import jax, jax.numpy as jnp
from ls_jax.kernels.pallas_gpu.backend import pallas_gpu_attention
T, H, D = 8192, 16, 128
windows = (None,) * H
q = jax.random.normal(jax.random.key(0), (1, T, H, D), jnp.bfloat16)
for stats in (False, True):
    print("=== D=128 all global, default config (three consumers), statistics", stats, flush=True)
    jax.block_until_ready(jax.jit(lambda q: pallas_gpu_attention(q, q, q, windows, return_logit_stats=stats)[0])(q))
