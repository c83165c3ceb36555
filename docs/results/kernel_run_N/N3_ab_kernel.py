"""Run N, calls N3/N4 (H100): run with commit 751b93b (the persistent forward) checked out and
scratch/old_forward_mosaic.py = `git show b8ab6dd:kernels/pallas_gpu/forward_mosaic.py`.

Same-call A/B of the Hopper forward kernels alone: the previous commit's grid kernel (old),
this one's grid kernel (new: the producer loads Q), and the persistent launch (132 programs)."""
import dataclasses, sys, time
import numpy as np
import jax, jax.numpy as jnp
sys.path.insert(0, "scratch")
import old_forward_mosaic as old
from ls_jax.kernels.pallas_gpu.forward_mosaic import forward_call_mosaic as new
from ls_jax.kernels.pallas_gpu.plan import default_config, make_plan

B, H = 4, 16
CASES = [  # D, n, windows, heads computed
    (64, 8192, (None,) * H, None),
    (128, 8192, (None,) * H, None),
    (64, 8192, (None,) + (128,) * 15, (0,)),
    (64, 32768, (None,) + (128,) * 15, (0,)),
    (128, 32768, (None,) * H, None),
    (64, 32768, (None,) * H, None),
]
for D, n, windows, heads in CASES:
    cfg = default_config(jnp.bfloat16, D, windows, n)
    plans = {}
    for name, programs in (("old", 0), ("new", 0), ("persistent", 132)):
        plans[name] = make_plan(seq_len=n, head_dim=D, windows=windows, num_kv_heads=H,
                                dtype=jnp.bfloat16, scale=D ** -0.5,
                                config=dataclasses.replace(cfg, mosaic_programs=programs),
                                logit_stats=True, interpret=False)
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(kk, (B, n, H, D), jnp.bfloat16) for kk in keys)
    fns = {"old": jax.jit(lambda q, k, v: old.forward_call_mosaic(plans["old"], q, k, v, heads)),
           "new": jax.jit(lambda q, k, v: new(plans["new"], q, k, v, heads)),
           "persistent": jax.jit(lambda q, k, v: new(plans["persistent"], q, k, v, heads))}
    outs = {name: jax.block_until_ready(f(q, k, v)) for name, f in fns.items()}
    hs = list(range(H)) if heads is None else list(heads)
    for name in ("new", "persistent"):
        for a, b in zip(outs["old"], outs[name]):
            a = np.asarray(a.astype(jnp.float32)); b = np.asarray(b.astype(jnp.float32))
            a = a[:, :, hs] if a.ndim == 4 else a[:, hs]
            b = b[:, :, hs] if b.ndim == 4 else b[:, hs]
            if not np.array_equal(a, b):
                print("MISMATCH", name, D, n, float(np.abs(a - b).max()), flush=True)
    times = {name: [] for name in fns}
    reps = 6 if n > 8192 else 12
    for _ in range(reps):
        for name, f in fns.items():
            jax.block_until_ready(f(q, k, v))
            t0 = time.perf_counter()
            for _ in range(5):
                r = f(q, k, v)
            jax.block_until_ready(r)
            times[name].append((time.perf_counter() - t0) / 5 * 1e3)
    med = {name: float(np.median(t)) for name, t in times.items()}
    print(f"| {D} | {n} | {'all global' if heads is None else 'global head of 1g15l'} | "
          f"{cfg.mosaic_consumers} | {med['old']:.3f} | {med['new']:.3f} | "
          f"{med['persistent']:.3f} |", flush=True)
