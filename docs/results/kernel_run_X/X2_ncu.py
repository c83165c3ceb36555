"""Run X2 (under ncu): the 1g15l D=64 p=128 forward at n=8192, B=4 (the global head's Hopper
launch, then the 15 local heads' strips), run O's online strips, then the whole-band strips;
inputs made on the host; one call each after compiling both."""
import dataclasses
import numpy as np, jax, jax.numpy as jnp
from ls_jax.kernels.pallas_gpu.forward import forward_call
from ls_jax.kernels.pallas_gpu.plan import make_plan
B, T, H, D = 4, 8192, 16, 64
gpu = jax.devices()[0].platform == "gpu"
plan = make_plan(seq_len=T, head_dim=D, windows=(None,) + (128,) * 15, num_kv_heads=H,
                 dtype=jnp.bfloat16, scale=D ** -0.5, config=None, logit_stats=False,
                 interpret=not gpu)
plans = [plan, dataclasses.replace(plan, config=dataclasses.replace(plan.config,
                                                                    strip_whole_band=True))]
rng = np.random.default_rng(0)
q, k, v = (jax.device_put(rng.standard_normal((B, T, H, D), np.float32).astype(jnp.bfloat16))
           for _ in range(3))
fns = [jax.jit(lambda q, k, v, p=p: forward_call(p, q, k, v, None)[0]) for p in plans]
compiled = [f.lower(q, k, v).compile() for f in fns]
for f in compiled:
    jax.block_until_ready(f(q, k, v))
print("done")
