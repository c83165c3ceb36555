# Run P, calls P4-P5 and P8 (and P1 in its first version): f+b A/B of dQ fused into the Mosaic dK/dV kernel against the default; usage: P_ab_fused.py CASES REPS VARIANTS
"""Run P: dQ fused into the Mosaic dK/dV kernel (TMA reduce-add), vs the separate dQ kernel (the default), f+b, interleaved."""
import sys, time, dataclasses
import numpy as np, jax, jax.numpy as jnp
import ls_jax.kernels.pallas_gpu.backward_mosaic as bm
from ls_jax.kernels.pallas_gpu.backend import pallas_gpu_attention
from ls_jax.kernels.pallas_gpu.plan import default_config

CASES = {  # name: (B, n, H, D, windows)
    "g16_d64_8k": (4, 8192, 16, 64, (None,) * 16),
    "1g15l_d64_8k": (4, 8192, 16, 64, (None,) + (128,) * 15),
    "1g15l_d64_32k": (4, 32768, 16, 64, (None,) + (128,) * 15),
    "2g14l_d64_16k": (4, 16384, 16, 64, (None,) * 2 + (256,) * 14),
    "g16_d64_32k": (4, 32768, 16, 64, (None,) * 16),
    "g16_d128_8k": (4, 8192, 16, 128, (None,) * 16),
    "1g15l_d64_2k": (4, 2048, 16, 64, (None,) + (128,) * 15),
}
names = sys.argv[1].split(",")
reps = int(sys.argv[2]) if len(sys.argv) > 2 else 8
variants = sys.argv[3].split(",") if len(sys.argv) > 3 else ["sep", "fused", "fused1slot"]
orig_slots = bm.dq_slots
for name in names:
    B, n, H, D, windows = CASES[name]
    base = default_config(jnp.bfloat16, D, windows, n)
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, do = (jax.random.normal(kk, (B, n, H, D), jnp.bfloat16) for kk in keys)
    fns, g = {}, {}
    for label in variants:
        cfg = base
        if label.startswith("fused"):
            cfg = dataclasses.replace(base, mosaic_fused_dq=True, mosaic_bwd_block_q=64)
            if base.bwd_lowering == "triton":
                cfg = dataclasses.replace(cfg, bwd_lowering="mixed")
        if label == "sepmixed":
            cfg = dataclasses.replace(base, bwd_lowering="mixed")
        bm.dq_slots = (lambda d: 1) if label.endswith("1slot") else orig_slots
        def loss(q, k, v, cfg=cfg):
            out, _ = pallas_gpu_attention(q, k, v, windows, config=cfg)
            return jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32))
        fns[label] = jax.jit(jax.grad(loss, (0, 1, 2)))
        g[label] = jax.block_until_ready(fns[label](q, k, v))  # compiled under this patch
    bm.dq_slots = orig_slots
    for label in variants[1:]:
        diffs = []
        for nm, a, b in zip("qkv", g[variants[0]], g[label]):
            a32, b32 = a.astype(jnp.float32), b.astype(jnp.float32)
            diffs.append(f"d{nm} rel {float(jnp.linalg.norm(a32 - b32) / jnp.linalg.norm(a32)):.1e}")
        print(name, base.bwd_lowering, label, "vs", variants[0], "|", "; ".join(diffs), flush=True)
    times = {lab: [] for lab in fns}
    for _ in range(reps):
        for lab, f in fns.items():
            jax.block_until_ready(f(q, k, v))
            t0 = time.perf_counter()
            for _ in range(5):
                r = f(q, k, v)
            jax.block_until_ready(r)
            times[lab].append((time.perf_counter() - t0) / 5 * 1e3)
    med = {lab: np.median(t) for lab, t in times.items()}
    print(f"| {name} | " + " | ".join(f"{lab} {m:.3f}" for lab, m in med.items()) + " | " + " ".join(f"{lab} {med[variants[0]]/m:.3f}x" for lab, m in med.items() if lab != variants[0]) + " |", flush=True)
