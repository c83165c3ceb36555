"""Run X3 (under ncu, every kernel): the 1g15l D=64 p=128 n=8192 forward (forward_call, B=4),
inputs made on the host, compiled first, then called twice."""
import numpy as np, jax, jax.numpy as jnp
from ls_jax.kernels.pallas_gpu.forward import forward_call
from ls_jax.kernels.pallas_gpu.plan import make_plan
B, T, H, D = 4, 8192, 16, 64
plan = make_plan(seq_len=T, head_dim=D, windows=(None,) + (128,) * 15, num_kv_heads=H,
                 dtype=jnp.bfloat16, scale=D ** -0.5, config=None, logit_stats=False,
                 interpret=jax.devices()[0].platform != "gpu")
rng = np.random.default_rng(0)
q, k, v = (jax.device_put(rng.standard_normal((B, T, H, D), np.float32).astype(jnp.bfloat16))
           for _ in range(3))
f = jax.jit(lambda q, k, v: forward_call(plan, q, k, v, None)[0]).lower(q, k, v).compile()
for _ in range(2):
    jax.block_until_ready(f(q, k, v))
print("done")
