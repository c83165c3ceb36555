"""Run Y5: the strip backward with two consumers in dK/dV (Y4: no spills, 0.183 vs Triton's
0.207 ms) and two or three in dQ: the dQ launch alone (15 local heads, n=8192) and f+b
through the backend (mixed: the global heads on the Hopper kernels), interleaved."""
import dataclasses, sys, time
import numpy as np, jax, jax.numpy as jnp
from ls_jax.kernels.pallas_gpu import backward_strip as bs
from ls_jax.kernels.pallas_gpu.backend import pallas_gpu_attention
from ls_jax.kernels.pallas_gpu.plan import default_config, make_plan
from ls_jax.kernels.pallas_gpu.forward import forward_call
from ls_jax.kernels.pallas_gpu.backward import dq_call
gpu = jax.devices()[0].platform == "gpu"
CONS = {"dq": 3, "kv": 3}
_orig = bs._static
def _static(plan, q, heads, kind):
    bs.STRIP_CONSUMERS = CONS["kv" if kind else "dq"]
    return _orig(plan, q, heads, kind)
bs._static = _static
rounds = 11 if gpu else 1

def interleaved(fns, args):
    times = [[] for _ in fns]
    for _ in range(rounds):
        for t, f in zip(times, fns):
            t0 = time.perf_counter()
            for _ in range(10):
                r = f(*args)
            jax.block_until_ready(r)
            t.append((time.perf_counter() - t0) / 10 * 1e3)
    return [float(np.median(t)) for t in times]

B, H, D, n = (4, 16, 64, 8192) if gpu else (1, 3, 64, 512)
windows = (None,) + (128,) * (H - 1)
local = tuple(range(1, H))
plan = make_plan(seq_len=n, head_dim=D, windows=windows, num_kv_heads=H, dtype=jnp.bfloat16,
                 scale=D ** -0.5, config=None, logit_stats=False, interpret=not gpu, batch=B)
keys = jax.random.split(jax.random.key(0), 4)
q, k, v, do = (jax.random.normal(kk, (B, n, H, D), jnp.bfloat16) for kk in keys)
out, lse2, _ = forward_call(plan, q, k, v, None)
args = (q, k, v, do, lse2, out)
fns = [jax.jit(lambda q, k, v, do, lse2, out: dq_call(plan, q, k, v, None, do, out, lse2, heads=local))]
for c in (3, 2):
    CONS["dq"] = c
    fns.append(jax.jit(lambda *a: bs.dq_call_strip(plan, *a, local)).lower(*args).compile())
m = interleaved(fns, args)
print(f"| Y5 dQ, 15 local heads n=8192 | Triton {m[0]:.4f} | strips 3 consumers {m[1]:.4f} | strips 2 consumers {m[2]:.4f} |", flush=True)

L = lambda p, m: (p,) * m
cases = ([("1g15l n=32768", 4, 32768, (None,) + L(128, 15)), ("2g14l n=16384", 4, 16384, (None, None) + L(128, 14)),
          ("1g15l n=8192", 4, 8192, (None,) + L(128, 15))] if gpu else [("1g2l", 1, 256, (None, 128, 50))])
variants = [("default", None, None), ("mixed+strip dQ3 kv2", 3, 2), ("mixed+strip dQ2 kv2", 2, 2)]
for name, B, n, windows in cases:
    H = len(windows)
    base = default_config(jnp.bfloat16, D, windows, n, B)
    q, k, v, do = (jax.random.normal(kk, (B, n, H, D), jnp.bfloat16) for kk in keys)
    fns = []
    for label, cq, ckv in variants:
        cfg = base if cq is None else dataclasses.replace(base, bwd_lowering="mixed", local_bwd_lowering="strip")
        if cq:
            CONS.update(dq=cq, kv=ckv)
        f = jax.jit(jax.grad(lambda q, k, v, cfg=cfg: jnp.sum(pallas_gpu_attention(
            q, k, v, windows, config=cfg, interpret=not gpu)[0].astype(jnp.float32)
            * do.astype(jnp.float32)), (0, 1, 2))).lower(q, k, v).compile()
        fns.append(f)
    g = [f(q, k, v) for f in fns]
    diffs = [max(float(jnp.linalg.norm((a - b).astype(jnp.float32)) / jnp.linalg.norm(b.astype(jnp.float32))) for a, b in zip(x, g[0])) for x in g[1:]]
    med = interleaved(fns, (q, k, v))
    print(f"| Y5 f+b {name} | " + " | ".join(f"{lab} ({(base.bwd_lowering if cq is None else 'mixed')}) {t:.4f} {med[0] / t:.3f}x"
          for (lab, cq, _), t in zip(variants, med)) + f" | max rel diff to default {max(diffs):.1e} |", flush=True)
