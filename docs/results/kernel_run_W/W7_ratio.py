"""Run W7: issue 13's D=64 1 global + 15 local (p=128, B=4) rows, ours against the cuDNN
composition, the forward and the f+b, alternated in 12 rounds of 10 calls (n=8192) / 3 calls
(n=32768): the ratio's median and spread over rounds, not one benchmark sample."""
import sys
sys.path.insert(0, "bench")
import time
import numpy as np, jax
from attention import attention_fns, head_windows, make_input_sets  # bench/attention.py

gpu = jax.devices()[0].platform == "gpu"
B, H, D = (4, 16, 64) if gpu else (1, 4, 64)
cases = ((8192, 10), (32768, 3)) if gpu else ((256, 1),)
rounds = 12 if gpu else 1
impls = ("ours", "cudnn_ls") if gpu else ("cudnn_ls",)
print("| n | pass | ours ms (median, min-max of rounds) | composition ms | ratio: median (min-max) |")
for n, inner in cases:
    windows = head_windows("1g15l", H, 128)
    sets = make_input_sets(B, n, H, D, jax.numpy.bfloat16, 0)
    fns = {impl: attention_fns(impl, windows, D, None) for impl in impls}
    if not gpu:
        print("cpu: built", list(fns), len(sets), "input sets")
        break
    for which, name in ((0, "fwd"), (1, "f+b")):
        ts = {impl: [] for impl in impls}
        for impl in impls:
            jax.block_until_ready(fns[impl][which](*sets[0]))
        for r in range(rounds):
            for impl in impls:
                f = fns[impl][which]
                t0 = time.perf_counter()
                outs = [f(*sets[(r * inner + i) % len(sets)]) for i in range(inner)]
                jax.block_until_ready(outs)
                ts[impl].append((time.perf_counter() - t0) / inner * 1e3)
        if not gpu:
            print(f"| {n} | {name} | cpu smoke | {np.median(ts['cudnn_ls']):.3f} | - |")
            continue
        o, c = np.array(ts["ours"]), np.array(ts["cudnn_ls"])
        ratio = c / o
        print(f"| {n} | {name} | {np.median(o):.4f} ({o.min():.4f}-{o.max():.4f}) | "
              f"{np.median(c):.4f} ({c.min():.4f}-{c.max():.4f}) | {np.median(ratio):.3f}x "
              f"({ratio.min():.3f}-{ratio.max():.3f}) |", flush=True)
