"""Three consumers at D=128: the statistics' row minimum before the exponentials (the 3-consumer
default) vs after them (the 2-consumer placement); forward kernel alone, interleaved."""
import sys, time, types, dataclasses
import numpy as np, jax, jax.numpy as jnp
import ls_jax.kernels.pallas_gpu.forward_mosaic as fm
from ls_jax.kernels.pallas_gpu.backend import _prepare
from ls_jax.kernels.pallas_gpu.plan import default_config

src = open(fm.__file__).read()
assert "early_min = consumers > 2" in src
late = types.ModuleType("fm_late")
late.__file__ = fm.__file__
exec(compile(src.replace("early_min = consumers > 2", "early_min = False"), "fm_late", "exec"), late.__dict__)

D, H, B = 128, 16, 4
for n in (8192, 32768):
    windows = (None,) * H
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(kk, (B, n, H, D), jnp.bfloat16) for kk in keys)
    fns, outs = {}, {}
    for label, consumers, mod in (("c2", 2, fm), ("c3_early", 3, fm), ("c3_late", 3, late)):
        cfg = dataclasses.replace(default_config(jnp.bfloat16, D, windows, n), mosaic_consumers=consumers)
        plan, qp, kp, vp, _ = _prepare(q, k, v, windows, None, None, cfg, True, False)
        fns[label] = jax.jit(lambda q, k, v, plan=plan, mod=mod: mod.forward_call_mosaic(plan, q, k, v))
        outs[label] = jax.block_until_ready(fns[label](qp, kp, vp))
    for label in ("c3_early", "c3_late"):
        d = [float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))) for a, b in zip(outs["c2"], outs[label])]
        print(n, label, "vs c2 max |diff| out, lse2, stat:", ["%.1e" % x for x in d], flush=True)
    times = {lab: [] for lab in fns}
    for _ in range(8 if n == 8192 else 4):
        for lab, f in fns.items():
            jax.block_until_ready(f(qp, kp, vp))
            t0 = time.perf_counter()
            for _ in range(5):
                r = f(qp, kp, vp)
            jax.block_until_ready(r)
            times[lab].append((time.perf_counter() - t0) / 5 * 1e3)
    print(f"| D=128 all global stats n={n} | " + " | ".join(f"{lab} {np.median(t):.3f}" for lab, t in times.items()) + " |", flush=True)
