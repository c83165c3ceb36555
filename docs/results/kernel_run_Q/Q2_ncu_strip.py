import numpy as np, jax, jax.numpy as jnp, dataclasses
from ls_jax.kernels.pallas_gpu.backend import _prepare
from ls_jax.kernels.pallas_gpu.plan import default_config
from ls_jax.kernels.pallas_gpu.forward import forward_call
from ls_jax.kernels.pallas_gpu.backward import dq_call, dkdv_call
from ls_jax.kernels.pallas_gpu.backward_strip import backward_call_strip
B, n, H, D = 4, 8192, 16, 64
windows = (128,) * 16
rng = np.random.default_rng(0)
q, k, v, do = (jax.device_put(rng.standard_normal((B, n, H, D), np.float32).astype(jnp.bfloat16)) for _ in range(4))
cfg = dataclasses.replace(default_config(jnp.bfloat16, D, windows, n), local_bwd_lowering="strip")
plan, qp, kp, vp, _ = _prepare(q, k, v, windows, None, None, cfg, False, False)
out, lse2, _ = jax.jit(lambda q, k, v: forward_call(plan, q, k, v, None))(qp, kp, vp)
local = plan.local_heads()
def tri(q, k, v, do, out, lse2):
    dq, delta = dq_call(plan, q, k, v, None, do, out, lse2, heads=local)
    return (dq,) + tuple(dkdv_call(plan, q, k, v, None, do, lse2, delta, kv_heads=local))
def strip(q, k, v, do, out, lse2):
    return backward_call_strip(plan, q, k, v, do, out, lse2, local, strip=16, num_warps=4, num_stages=2)
for f in (jax.jit(tri), jax.jit(strip)):
    for _ in range(2):
        jax.block_until_ready(f(qp, kp, vp, do, out, lse2))
print("done")
