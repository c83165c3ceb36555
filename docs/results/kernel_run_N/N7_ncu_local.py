"""The 1g15l D=64 n=8192 forward (B=4, H=16, p=128), inputs made on the host; run twice."""
import numpy as np, jax, jax.numpy as jnp
from ls_jax.kernels.api import ls_attention
B, T, H, D = 4, 8192, 16, 64
rng = np.random.default_rng(0)
q, k, v = (jax.device_put(rng.standard_normal((B, T, H, D), np.float32).astype(jnp.bfloat16))
           for _ in range(3))
f = jax.jit(lambda q, k, v: ls_attention(q, k, v, (None,) + (128,) * 15,
                                         implementation="pallas_gpu"))
for _ in range(2):
    jax.block_until_ready(f(q, k, v))
print("done")
