"""Compile the strip forward (online, whole band; with and without statistics) once each, for
ptxas' register and spill report (MOSAIC_GPU_DUMP_PTXAS=1)."""
import dataclasses, sys
import jax, jax.numpy as jnp
from ls_jax.kernels.pallas_gpu.forward_strip import forward_call_strip
from ls_jax.kernels.pallas_gpu.plan import make_plan
for whole in (False, True):
    for stats in (False, True):
        plan = make_plan(seq_len=8192, head_dim=64, windows=(None,) + (128,) * 15,
                         num_kv_heads=16, dtype=jnp.bfloat16, scale=0.125, config=None,
                         logit_stats=stats, interpret=False)
        plan = dataclasses.replace(plan, config=dataclasses.replace(plan.config,
                                                                    strip_whole_band=whole))
        x = jnp.zeros((4, 8192, 16, 64), jnp.bfloat16)
        print(f"=== whole={whole} stats={stats}", file=sys.stderr, flush=True)
        jax.block_until_ready(jax.jit(lambda q, k, v: forward_call_strip(
            plan, q, k, v, tuple(range(1, 16))))(x, x, x))
