"""Run X11: the strips with query loads two blocks ahead (3 slots) or double-buffered output
tiles, against run O's (one ahead, one tile); the 15 local heads' launch and the 1g15l
forward, D=64, p=128, B=4, interleaved; outputs compared bit for bit."""
import dataclasses, time
import numpy as np, jax, jax.numpy as jnp
from ls_jax.kernels.pallas_gpu import forward_strip as fs
from ls_jax.kernels.pallas_gpu.forward import forward_call
from ls_jax.kernels.pallas_gpu.plan import make_plan

gpu = jax.devices()[0].platform == "gpu"
B, H, D = 4, 16, 64
variants = [("run O (2 q slots, 1 out)", 2, 1), ("3 q slots", 3, 1), ("2 out tiles", 2, 2)]
cases = ([(8192, False), (32768, False), (8192, True), (16384, False)] if gpu
         else [(256, False), (256, True)])
rounds, inner = (15, 10) if gpu else (1, 1)
print("| n | stats | launch | " + " | ".join(v[0] for v in variants) + " | bit-identical |")
for n, stats in cases:
    windows = (None,) + (128,) * 15
    plan = make_plan(seq_len=n, head_dim=D, windows=windows, num_kv_heads=H, dtype=jnp.bfloat16,
                     scale=D ** -0.5, config=None, logit_stats=stats, interpret=not gpu)
    if not gpu:
        plan = dataclasses.replace(plan, config=dataclasses.replace(
            plan.config, local_fwd_lowering="strip", fwd_lowering="mixed", strip_blocks=2))
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(kk, (B, plan.seq_len_padded, H, D), jnp.bfloat16)
               for kk in keys)
    local = tuple(range(1, H))
    for what in ("15 local heads", "1g15l forward"):
        fns, outs = [], []
        for _, qs, os_ in variants:
            fs.Q_SLOTS, fs.OUT_SLOTS = qs, os_
            if what == "15 local heads":
                f = jax.jit(lambda q, k, v: fs.forward_call_strip(plan, q, k, v, local))
            else:
                f = jax.jit(lambda q, k, v: forward_call(plan, q, k, v, None))
            f = f.lower(q, k, v).compile()
            fns.append(f)
            o = jax.block_until_ready(f(q, k, v))
            outs.append([np.asarray(x) for x in o if x is not None])
        fs.Q_SLOTS, fs.OUT_SLOTS = 2, 1
        h = slice(1, None) if what == "15 local heads" else slice(None)
        same = all(np.array_equal(a[0][:, :, h], b[0][:, :, h])
                   and all(np.array_equal(x[:, h], y[:, h]) for x, y in zip(a[1:], b[1:]))
                   for a, b in zip(outs[1:], outs[:1] * 2))
        times = [[] for _ in fns]
        for _ in range(rounds):
            for t, f in zip(times, fns):
                t0 = time.perf_counter()
                for _ in range(inner):
                    r = f(q, k, v)
                jax.block_until_ready(r)
                t.append((time.perf_counter() - t0) / inner * 1e3)
        print(f"| {n} | {stats} | {what} | " + " | ".join(f"{np.median(t):.4f}" for t in times)
              + f" | {same} |", flush=True)
