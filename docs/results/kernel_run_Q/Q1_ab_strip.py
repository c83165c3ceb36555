"""Strip backward A/B: usage ab_strip.py kern|fb CASES REPS VARIANTS"""
import sys, time, dataclasses, re
import numpy as np, jax, jax.numpy as jnp
from ls_jax.kernels.pallas_gpu.backend import pallas_gpu_attention, _prepare
from ls_jax.kernels.pallas_gpu.plan import default_config
from ls_jax.kernels.pallas_gpu.forward import forward_call
from ls_jax.kernels.pallas_gpu.backward import dq_call, dkdv_call
from ls_jax.kernels.pallas_gpu.backward_strip import backward_call_strip

CASES = {
    "16l_8k": (4, 8192, 16, 64, (128,) * 16),
    "16l_32k": (4, 32768, 16, 64, (128,) * 16),
    "16l50_8k": (4, 8192, 16, 64, (50,) * 16),
    "16l256_8k": (4, 8192, 16, 64, (256,) * 16),
    "1g15l_8k": (4, 8192, 16, 64, (None,) + (128,) * 15),
    "1g15l_32k": (4, 32768, 16, 64, (None,) + (128,) * 15),
    "2g14l_16k": (4, 16384, 16, 64, (None,) * 2 + (256,) * 14),
    "1g15l_2k": (4, 2048, 16, 64, (None,) + (128,) * 15),
    "1g15l_4k": (4, 4096, 16, 64, (None,) + (128,) * 15),
}
mode = sys.argv[1]
names = sys.argv[2].split(",")
reps = int(sys.argv[3])
variants = sys.argv[4].split(",")

def timeit(fns, args, reps):
    times = {lab: [] for lab in fns}
    for _ in range(reps):
        for lab, f in fns.items():
            jax.block_until_ready(f(*args))
            t0 = time.perf_counter()
            for _ in range(5):
                r = f(*args)
            jax.block_until_ready(r)
            times[lab].append((time.perf_counter() - t0) / 5 * 1e3)
    return {lab: float(np.median(t)) for lab, t in times.items()}

def rel(a, b):
    a32, b32 = a.astype(jnp.float32), b.astype(jnp.float32)
    return float(jnp.linalg.norm(a32 - b32) / jnp.linalg.norm(a32))

for name in names:
    B, n, H, D, windows = CASES[name]
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, do = (jax.random.normal(kk, (B, n, H, D), jnp.bfloat16) for kk in keys)
    base = default_config(jnp.bfloat16, D, windows, n)
    fns, outs = {}, {}
    if mode == "kern":
        cfg = dataclasses.replace(base, local_bwd_lowering="strip")
        plan, qp, kp, vp, _ = _prepare(q, k, v, windows, None, None, cfg, False, False)
        out, lse2, _ = jax.jit(lambda q, k, v: forward_call(plan, q, k, v, None))(qp, kp, vp)
        local = plan.local_heads()
        for lab in variants:
            if lab == "tri":
                def f(q, k, v, do, out, lse2):
                    dq, delta = dq_call(plan, q, k, v, None, do, out, lse2, heads=local)
                    dk, dv = dkdv_call(plan, q, k, v, None, do, lse2, delta, kv_heads=local)
                    return dq, dk, dv
            else:
                S, W, St = map(int, re.fullmatch(r"s(\d+)w(\d+)s(\d+)", lab).groups())
                def f(q, k, v, do, out, lse2, S=S, W=W, St=St):
                    return backward_call_strip(plan, q, k, v, do, out, lse2, local, strip=S, num_warps=W, num_stages=St)
            fns[lab] = jax.jit(f)
            try:
                outs[lab] = [x[:, :, list(local)] for x in jax.block_until_ready(fns[lab](qp, kp, vp, do, out, lse2))]
            except Exception as e:
                print(name, lab, "FAILED", repr(e)[:600], flush=True); fns.pop(lab)
        args = (qp, kp, vp, do, out, lse2)
    else:
        for lab in variants:
            cfg = base
            for kv in lab.split("+"):
                if kv == "default": continue
                key, val = kv.split("=")
                val = int(val) if val.isdigit() else {"true": True, "false": False}.get(val, val)
                cfg = dataclasses.replace(cfg, **{key: val})
            def loss(q, k, v, cfg=cfg):
                o, _ = pallas_gpu_attention(q, k, v, windows, config=cfg)
                return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32))
            fns[lab] = jax.jit(jax.grad(loss, (0, 1, 2)))
            try:
                outs[lab] = jax.block_until_ready(fns[lab](q, k, v))
            except Exception as e:
                print(name, lab, "FAILED", repr(e)[:600], flush=True); fns.pop(lab)
        args = (q, k, v)
    ref = next(iter(outs))
    for lab in outs:
        if lab != ref:
            print(name, lab, "vs", ref, "|", "; ".join(f"d{c} rel {rel(a, b):.1e}" for c, a, b in zip("qkv", outs[ref], outs[lab])), flush=True)
    med = timeit(fns, args, reps)
    print(f"| {mode} {name} | " + " | ".join(f"{lab} {m:.4f}" for lab, m in med.items()) + " | " + " ".join(f"{lab} {med[ref]/m:.3f}x" for lab, m in med.items() if lab != ref) + " |", flush=True)
