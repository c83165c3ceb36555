"""Run Y2: which strip backward piece hangs on the GPU. Each case in its own process (the
driver gives it 45 s)."""
import dataclasses, os, subprocess, sys, time
case = sys.argv[1] if len(sys.argv) > 1 and sys.argv[1] != "all" else None
if case is None:
    cases = sys.argv[2].split(",") if len(sys.argv) > 2 else ["dq3", "kv3", "dq3w", "kv3w", "dq2w", "kv2w", "dq3long", "grad_strip", "grad_mixed"]
    for c in cases:
        t0 = time.time()
        try:
            r = subprocess.run([sys.executable, __file__, c], capture_output=True, text=True,
                               timeout=float(os.environ.get("CASE_TIMEOUT", 45)))
            tail = (r.stdout + r.stderr).strip().splitlines()
            tail = [l for l in tail if "ptxas" in l.lower() or "spill" in l.lower() or l.startswith("|") or "Error" in l][-6:]
            print(f"{c}: rc={r.returncode} {time.time() - t0:.0f} s", *tail, sep="\n  ", flush=True)
        except subprocess.TimeoutExpired:
            print(f"{c}: TIMEOUT after {time.time() - t0:.0f} s", flush=True)
    sys.exit()

import numpy as np, jax, jax.numpy as jnp
from ls_jax.kernels.pallas_gpu import backward_strip as bs
from ls_jax.kernels.pallas_gpu.plan import make_plan, default_config
from ls_jax.kernels.pallas_gpu.forward import forward_call
from ls_jax.kernels.pallas_gpu.backward import dq_call, dkdv_call
gpu = jax.devices()[0].platform == "gpu"
if case.startswith("grad"):
    from ls_jax.kernels.pallas_gpu.backend import pallas_gpu_attention
    B, T, windows = (2, 2048, (None, 128, 50, 128, 256, 1, None, 100)) if gpu else (1, 256, (None, 128, 256))
    H, D = len(windows), 64
    keys = jax.random.split(jax.random.key(1), 4)
    q, k, v, do = (jax.random.normal(kk, (B, T, H, D), jnp.bfloat16) for kk in keys)
    extra = dict(local_bwd_lowering="strip")
    if case == "grad_mixed":
        extra["bwd_lowering"] = "mixed"
    cfg = dataclasses.replace(default_config(jnp.bfloat16, D, windows, T, B), **extra)
    g = jax.jit(jax.grad(lambda q, k, v: jnp.sum(pallas_gpu_attention(q, k, v, windows, config=cfg, interpret=not gpu)[0].astype(jnp.float32) * do.astype(jnp.float32)), (0, 1, 2)))
    print("|", case, [float(jnp.linalg.norm(x.astype(jnp.float32))) for x in jax.block_until_ready(g(q, k, v))])
    sys.exit()
bs.STRIP_CONSUMERS = 3 if "3" in case else 2
B, T, windows = (2, 2048, (128, 50, 128, 256, 1, 100)) if "w" in case else (1, 1024, (128, 128))
if "w" in case and not gpu:
    T = 384
H, D = len(windows), 64
plan = make_plan(seq_len=T, head_dim=D, windows=windows, num_kv_heads=H, dtype=jnp.bfloat16,
                 scale=D ** -0.5, config=dataclasses.replace(default_config(jnp.bfloat16, D, windows, T, B),
                 strip_blocks=16 if "long" in case else 0), logit_stats=False, interpret=not gpu)
keys = jax.random.split(jax.random.key(0), 4)
q, k, v, do = (jax.random.normal(kk, (B, T, H, D), jnp.bfloat16) for kk in keys)
out, lse2, _ = forward_call(plan, q, k, v, None)
heads = tuple(range(H))
dq_t, delta = dq_call(plan, q, k, v, None, do, out, lse2)
dk_t, dv_t = dkdv_call(plan, q, k, v, None, do, lse2, delta)
def rel(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))
if case.startswith("dq"):
    dq, d2 = jax.block_until_ready(bs.dq_call_strip(plan, q, k, v, do, lse2, out, heads))
    print("|", case, "dq rel", rel(dq, dq_t), "delta rel", rel(d2, delta))
else:
    dk, dv = jax.block_until_ready(bs.dkdv_call_strip(plan, q, k, v, do, lse2, delta, heads))
    print("|", case, "dk rel", rel(dk, dk_t), "dv rel", rel(dv, dv_t))
