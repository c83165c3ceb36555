"""CPU: whole-band strips against the online strips and the reference (interpret), and lowering."""
import dataclasses, sys
import numpy as np, jax, jax.numpy as jnp
from ls_jax.kernels.pallas_gpu.forward_strip import forward_call_strip
from ls_jax.kernels.pallas_gpu.plan import make_plan, KernelConfig
from ls_jax.kernels.reference import reference_attention_parts
cases = [(1, 256, 3, 1, (128, 50, 1)), (2, 320, 2, 2, (129, 64)), (1, 192, 2, 1, (100, 128))]
for B, T, H, G, windows in cases:
    for stats in (False, True):
        outs = []
        for whole in (False, True):
            cfg = KernelConfig(fwd_lowering="mosaic", local_fwd_lowering="strip", strip_blocks=2,
                               strip_whole_band=whole)
            plan = make_plan(seq_len=T, head_dim=64, windows=windows, num_kv_heads=G,
                             dtype=jnp.bfloat16, scale=0.125, config=cfg, logit_stats=stats,
                             interpret=True)
            rng = np.random.default_rng(0)
            q, k, v = (jnp.asarray(rng.standard_normal((B, plan.seq_len_padded, h, 64)) * 2,
                                   jnp.bfloat16) for h in (H, G, G))
            outs.append(forward_call_strip(plan, q, k, v, tuple(range(H))))
        ref = reference_attention_parts(*(x.astype(jnp.float32)[:, :T] for x in (q, k, v)), windows)
        for name, a, b in zip(("out", "lse", "stat"), *outs):
            if a is None: continue
            d = float(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)).max())
            print(B, T, windows, stats, name, "whole vs online max diff", d, flush=True)
        e = float(jnp.abs(outs[1][0][:, :T].astype(jnp.float32) - ref[0]).max())
        print("  whole vs reference out", e, flush=True)
# lowering for the GPU
cfg = KernelConfig(fwd_lowering="mosaic", local_fwd_lowering="strip", strip_whole_band=True)
for stats in (False, True):
    plan = make_plan(seq_len=512, head_dim=64, windows=(128,) * 2 + (50,), num_kv_heads=3,
                     dtype=jnp.bfloat16, scale=0.125, config=cfg, logit_stats=stats, interpret=False)
    x = jax.ShapeDtypeStruct((1, 512, 3, 64), jnp.bfloat16)
    txt = jax.jit(lambda q, k, v: forward_call_strip(plan, q, k, v, (0, 1, 2))).trace(x, x, x).lower(
        lowering_platforms=("cuda",)).as_text()
    print("lowered", stats, "mosaic_gpu" in txt)
