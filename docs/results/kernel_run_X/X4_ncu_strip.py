"""Run X4 (under ncu): the 15 local heads' strip launch alone (D=64, p=128, n=8192, B=4), run
O's online strips then the whole-band strips; inputs made on the host."""
import dataclasses
import numpy as np, jax, jax.numpy as jnp
from ls_jax.kernels.pallas_gpu.forward_strip import forward_call_strip
from ls_jax.kernels.pallas_gpu.plan import make_plan
B, T, H, D = 4, 8192, 15, 64
plan = make_plan(seq_len=T, head_dim=D, windows=(128,) * H, num_kv_heads=H, dtype=jnp.bfloat16,
                 scale=D ** -0.5, config=None, logit_stats=False,
                 interpret=jax.devices()[0].platform != "gpu")
cfg = dataclasses.replace(plan.config, local_fwd_lowering="strip")
rng = np.random.default_rng(0)
q, k, v = (jax.device_put(rng.standard_normal((B, T, H, D), np.float32).astype(jnp.bfloat16))
           for _ in range(3))
fs = [jax.jit(lambda q, k, v, p=dataclasses.replace(plan, config=dataclasses.replace(
    cfg, strip_whole_band=w)): forward_call_strip(p, q, k, v, tuple(range(H)))[0]).lower(
    q, k, v).compile() for w in (False, True)]
for f in fs:
    jax.block_until_ready(f(q, k, v))
print("done")
