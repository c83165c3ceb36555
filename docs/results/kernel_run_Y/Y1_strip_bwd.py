"""Run Y1: the local heads' backward as strips (backward_strip.py) against the Triton kernels.
(1) gradients against the float32 reference, strips twice bit for bit; (2) the local heads'
launches alone (dQ, dK/dV), interleaved; (3) f+b through the backend, interleaved."""
import dataclasses, sys, time
import numpy as np, jax, jax.numpy as jnp
from ls_jax.kernels.pallas_gpu.backend import pallas_gpu_attention
from ls_jax.kernels.pallas_gpu.plan import default_config, make_plan
from ls_jax.kernels.pallas_gpu.forward import forward_call
from ls_jax.kernels.pallas_gpu.backward import dq_call, dkdv_call
from ls_jax.kernels.pallas_gpu.backward_strip import dq_call_strip, dkdv_call_strip
from ls_jax.kernels.reference import reference_attention_parts

gpu = jax.devices()[0].platform == "gpu"
parts = sys.argv[1].split(",") if len(sys.argv) > 1 else ["check", "kernels", "fb"]
rounds, inner = (11, 10) if gpu else (1, 1)


def rel(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def interleaved(fns, args):
    times = [[] for _ in fns]
    for f in fns:
        jax.block_until_ready(f(*args))
    for _ in range(rounds):
        for t, f in zip(times, fns):
            t0 = time.perf_counter()
            for _ in range(inner):
                r = f(*args)
            jax.block_until_ready(r)
            t.append((time.perf_counter() - t0) / inner * 1e3)
    return [float(np.median(t)) for t in times]


STRIP = dict(local_bwd_lowering="strip")
if "check" in parts:
    print("| check | B T H windows | variant | dq | dk | dv (rel. to f32 reference) | repeat bit-identical |")
    cases = ([(2, 2048, (None, 128, 50, 128, 256, 1, None, 100)), (1, 3000, (128, 50, 1, 200))]
             if gpu else [(1, 300, (None, 128, 50))])
    for B, T, windows in cases:
        H, D = len(windows), 64
        keys = jax.random.split(jax.random.key(1), 4)
        q, k, v, do = (jax.random.normal(kk, (B, T, H, D), jnp.bfloat16) for kk in keys)
        f32 = [x.astype(jnp.float32) for x in (q, k, v, do)]
        want = jax.grad(lambda q, k, v: jnp.sum(reference_attention_parts(q, k, v, windows)[0]
                                                * f32[3]), (0, 1, 2))(*f32[:3])
        base = default_config(jnp.bfloat16, D, windows, T, B)
        if not gpu:
            base = dataclasses.replace(base, fwd_lowering="mixed", strip_blocks=2)
        variants = [("default", {}), ("strip", STRIP),
                    ("mixed+strip", dict(bwd_lowering="mixed", **STRIP))]
        for label, extra in variants[:2 if None not in windows else 3]:
            cfg = dataclasses.replace(base, **extra)
            g = jax.jit(jax.grad(lambda q, k, v: jnp.sum(pallas_gpu_attention(
                q, k, v, windows, config=cfg, interpret=not gpu)[0].astype(jnp.float32)
                * f32[3]), (0, 1, 2)))
            a, b = g(q, k, v), g(q, k, v)
            same = all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(a, b))
            print(f"| check | {B} {T} {H} {windows} | {label} ({cfg.bwd_lowering}) | "
                  + " | ".join(f"{rel(x, w):.2e}" for x, w in zip(a, want)) + f" | {same} |",
                  flush=True)

if "kernels" in parts:
    print("| kernels | n | triton dQ | strip dQ | triton dK/dV | strip dK/dV | triton both | strip both | ratio both | strip vs triton rel (dq dk dv) |")
    for n in ([8192, 32768] if gpu else [512]):
        B, H, D = (4, 16, 64) if gpu else (1, 3, 64)
        windows = (None,) + (128,) * (H - 1)
        local = tuple(range(1, H))
        plan = make_plan(seq_len=n, head_dim=D, windows=windows, num_kv_heads=H,
                         dtype=jnp.bfloat16, scale=D ** -0.5,
                         config=None if gpu else dataclasses.replace(
                             default_config(jnp.bfloat16, D, windows, n, B), strip_blocks=2),
                         logit_stats=False, interpret=not gpu, batch=B)
        keys = jax.random.split(jax.random.key(0), 4)
        q, k, v, do = (jax.random.normal(kk, (B, plan.seq_len_padded, H, D), jnp.bfloat16)
                       for kk in keys)
        out, lse2, _ = jax.jit(lambda q, k, v: forward_call(plan, q, k, v, None))(q, k, v)
        t_dq = jax.jit(lambda *a: dq_call(plan, *a[:3], None, *a[3:], heads=local))
        s_dq = jax.jit(lambda q, k, v, do, out, lse2: dq_call_strip(plan, q, k, v, do, lse2, out, local))
        args = (q, k, v, do, out, lse2)
        _, delta = t_dq(*args)
        t_kv = jax.jit(lambda q, k, v, do, lse2, delta: dkdv_call(plan, q, k, v, None, do, lse2, delta, kv_heads=local))
        s_kv = jax.jit(lambda q, k, v, do, lse2, delta: dkdv_call_strip(plan, q, k, v, do, lse2, delta, local))

        def t_both(q, k, v, do, out, lse2):
            dq, delta = dq_call(plan, q, k, v, None, do, out, lse2, heads=local)
            return (dq, *dkdv_call(plan, q, k, v, None, do, lse2, delta, kv_heads=local))

        def s_both(q, k, v, do, out, lse2):
            dq, delta = dq_call_strip(plan, q, k, v, do, lse2, out, local)
            return (dq, *dkdv_call_strip(plan, q, k, v, do, lse2, delta, local))

        t_both, s_both = jax.jit(t_both), jax.jit(s_both)
        gt, gs = t_both(*args), s_both(*args)
        diffs = " ".join(f"{rel(x[:, :, 1:], y[:, :, 1:]):.1e}" for x, y in zip(gs, gt))
        kv_args = (q, k, v, do, lse2, delta)
        m1 = interleaved([t_dq, s_dq], args)
        m2 = interleaved([t_kv, s_kv], kv_args)
        m3 = interleaved([t_both, s_both], args)
        print(f"| kernels | {n} | {m1[0]:.4f} | {m1[1]:.4f} | {m2[0]:.4f} | {m2[1]:.4f} | "
              f"{m3[0]:.4f} | {m3[1]:.4f} | {m3[0] / m3[1]:.3f}x | {diffs} |", flush=True)

if "fb" in parts:
    print("| f+b | case | variants (ms, median) |")
    L = lambda p, m: (p,) * m
    cases = ([("1g15l n=8192", 4, 8192, (None,) + L(128, 15)),
              ("1g15l n=32768", 4, 32768, (None,) + L(128, 15)),
              ("2g14l n=16384", 4, 16384, (None, None) + L(128, 14)),
              ("16 local n=8192", 4, 8192, L(128, 16)),
              ("1g15l p=256 n=8192", 4, 8192, (None,) + L(256, 15))] if gpu else
             [("1g2l", 1, 256, (None, 128, 50))])
    for name, B, n, windows in cases:
        H, D = len(windows), 64
        base = default_config(jnp.bfloat16, D, windows, n, B)
        variants = [("default", {}), ("strip", STRIP), ("mixed+strip", dict(bwd_lowering="mixed", **STRIP))]
        if not any(w is None for w in windows):
            variants = variants[:2]
        keys = jax.random.split(jax.random.key(0), 4)
        q, k, v, do = (jax.random.normal(kk, (B, n, H, D), jnp.bfloat16) for kk in keys)
        fns = []
        for label, extra in variants:
            cfg = dataclasses.replace(base, **extra)
            fns.append(jax.jit(jax.grad(lambda q, k, v, cfg=cfg: jnp.sum(pallas_gpu_attention(
                q, k, v, windows, config=cfg, interpret=not gpu)[0].astype(jnp.float32)
                * do.astype(jnp.float32)), (0, 1, 2))))
        med = interleaved(fns, (q, k, v))
        print(f"| f+b | {name} | " + " | ".join(
            f"{lab} ({dataclasses.replace(base, **ex).bwd_lowering}) {m:.4f} {med[0] / m:.3f}x"
            for (lab, ex), m in zip(variants, med)) + " |", flush=True)
