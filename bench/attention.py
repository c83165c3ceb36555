"""Benchmark of LS-attention on one GPU: ours (pallas_gpu) against cuDNN and Pallas Triton mha.

Prints one markdown table: forward ms and forward+backward ms, and effective TF/s that count
only the work inside the band (``kernels.band.band_flops``; full causal for the causal peers).

Rows per (D, n):
  ours[...]     kernels/pallas_gpu/ (pallas_gpu_attention), one call for all heads (per p and head mix; in the
                "causal" rows every head is global: the same work as the two causal peers)
  ours_stats    the same with the logit statistics on (return_logit_stats=True), as training
                logs them (--impl ours_stats)
  cudnn_ls      the cuDNN composition, implementation="cudnn" (per p and head mix)
  split         implementation="split": cuDNN causal for the global heads, ours for the local
                ones (per p and head mix; --check compares it with cudnn_ls like ours)
  cudnn_causal  jax.nn.dot_product_attention(implementation="cudnn", is_causal=True), all heads
  auto          ls_attention(implementation=None): what dispatch picks for the case (the
                forward column: a call nothing differentiates; f+b: a differentiated one),
                per p and head mix and on the all-global rows
  triton_mha    jax.experimental.pallas.ops.gpu.attention.mha(causal=True), all heads

Timing: inputs are fresh normal bf16 arrays (never zeros), rotated among several sets when
one set is small enough to sit in L2; each sample is the mean of ``--batch`` back-to-back calls
(so host dispatch overlaps device work), or of more where those last under ``MIN_SAMPLE_S``,
and the table shows the median of ``--reps`` samples after ``--warmup`` calls. Each row is also
printed as a JSON line when measured, and a sweep ended by SIGTERM (e.g. ``timeout``) or Ctrl-C
prints the table of the rows it has, then exits 1.

Examples:
  python bench/attention.py --d 64 --n 8192 --p 128 --mix 1g15l,global,local
  python bench/attention.py --memory            # peak device memory at n=131072, all local
  # the split dispatch against ours and the cuDNN composition:
  python bench/attention.py --check --d 128 --n 32768,65536 --p 128,512 --mix 2g14l,1g15l
      --impl ours,split,cudnn_ls
  # what going all-Mosaic would cost: every Triton launch of ours replaced by Mosaic GPU ones
  python bench/attention.py --d 64 --n 8192 --p 128 --mix 1g15l --launches default,all-mosaic
  # grouped-query attention, 4 key/value heads for 16 query heads:
  python bench/attention.py --d 128 --n 8192 --p 512 --mix 1g15l --kv-heads 4 --impl ours,cudnn_ls
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import signal
import subprocess
import sys
import time
import warnings

warnings.filterwarnings("ignore", category=DeprecationWarning)
warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*")

import jax
import jax.numpy as jnp
import numpy as np

from ls_jax.kernels import ls_attention
from hardware import peaks  # bench/hardware.py, beside this script
from ls_jax.kernels.band import band_flops
from ls_jax.kernels.pallas_gpu import Launch, Launches, heuristics, pallas_gpu_attention
from ls_jax.kernels.pallas_gpu.plan import padded_head_dim

L2_BYTES = 50 * 2**20
MIXES = ("1g15l", "2g14l", "4g12l", "global", "local")


def head_windows(mix: str, num_heads: int, p: int):
    """The windows of a mix: "<g>g<l>l" is g global heads, then local ones."""
    if mix in ("1g15l", "2g14l", "4g12l"):
        g = int(mix.split("g")[0])
        return (None,) * g + (p,) * (num_heads - g)
    if mix == "global":
        return (None,) * num_heads
    if mix == "local":
        return (p,) * num_heads
    raise ValueError(f"--mix: expected one of {MIXES}, got {mix!r}")


LAUNCHES = ("default", "all-mosaic", "triton-backward", "one-triton-backward")


def all_mosaic(case: heuristics.Case) -> Launches:
    """The heuristics' launches with every Triton launch replaced by Mosaic GPU ones (where
    the Mosaic kernels take the call): the forward's local heads as strips where they fit,
    else every head on the Hopper forward; the backward on the Hopper kernels."""
    launches = heuristics.launches(case)
    if not heuristics.hopper_runs(case):
        return launches
    everything = tuple(range(case.num_heads))
    forward = launches.forward
    if any(launch.lowering == "triton" for launch in forward):
        local = case.local_heads()
        if local and heuristics.strip_fits(case, local):
            forward = tuple(l for l in forward if l.lowering == "hopper") + (
                Launch("strip", local, heuristics.strip_config(case, local)),)
        else:
            forward = (Launch("hopper", everything, heuristics.hopper_forward(case, everything)),)
    backward = (Launch("hopper", everything, heuristics.hopper_backward(case)),)
    return Launches(forward=forward, backward=backward, num_heads=case.num_heads,
                    num_kv_heads=case.num_kv_heads)


def triton_backward(case: heuristics.Case) -> Launches:
    """The heuristics' launches with the local heads' fused strip backward replaced by the
    Triton kernels (one launch for every head when no Hopper launch precedes it)."""
    launches = heuristics.launches(case)
    if all(launch.lowering != "strip" for launch in launches.backward):
        return launches
    triton = heuristics.triton_config(case)
    backward = tuple(Launch("triton", l.heads, triton) if l.lowering == "strip" else l
                     for l in launches.backward)
    return dataclasses.replace(launches, backward=backward)


def one_triton_backward(case: heuristics.Case) -> Launches:
    """The heuristics' launches with the whole backward as one Triton launch over every head
    (what an LS mix below ``SPLIT_MIX_BACKWARD_MIN_SEQ_LEN`` runs)."""
    launches = heuristics.launches(case)
    every = Launch("triton", tuple(range(case.num_heads)), heuristics.triton_config(case))
    return dataclasses.replace(launches, backward=(every,))


def choose_launches(name: str, dtype, head_dim: int, windows, seq_len: int, batch: int,
                    num_kv_heads: int) -> Launches | None:
    """None (the heuristics' launches, chosen inside the call) or the named variant."""
    if name == "default":
        return None
    if name not in LAUNCHES:
        raise ValueError(f"--launches: expected names among {LAUNCHES}, got {name!r}")
    case = heuristics.Case(dtype=dtype, head_dim=padded_head_dim(head_dim),
                           windows=tuple(windows), seq_len=seq_len, batch=batch,
                           num_kv_heads=num_kv_heads, has_segments=False,
                           gpu=heuristics.current_gpu())
    return {"all-mosaic": all_mosaic, "triton-backward": triton_backward,
            "one-triton-backward": one_triton_backward}[name](case)


def make_input_sets(B, n, H, D, dtype, seed, kv_heads=None):
    """Sets of (q, k, v, do): q and do [B, n, H, D], k and v [B, n, kv_heads, D] (None: H)."""
    Hkv = H if kv_heads is None else kv_heads
    set_bytes = 2 * B * n * (H + Hkv) * D * jnp.dtype(dtype).itemsize
    num_sets = 3 if set_bytes < 4 * L2_BYTES else 1
    sets = []
    for s in range(num_sets):
        keys = jax.random.split(jax.random.key(seed + s), 4)
        sets.append(tuple(jax.random.normal(kk, (B, n, heads, D), dtype)
                          for kk, heads in zip(keys, (H, Hkv, Hkv, H))))
    jax.block_until_ready(sets)
    return sets


# A sample lasts at least this long, so that its fixed host cost (the first call's dispatch and
# the final wait) stays small beside the calls it averages.
MIN_SAMPLE_S = 0.02


def time_ms(fn, input_sets, reps: int, warmup: int, batch: int) -> float:
    """Median over ``reps`` samples of ms a call, after ``warmup`` calls. A sample is the mean of
    ``batch`` back-to-back calls, or of more where ``batch`` calls last under ``MIN_SAMPLE_S``."""
    def sample(first: int, calls: int) -> float:
        t0 = time.perf_counter()
        outs = [fn(*input_sets[(first + i) % len(input_sets)]) for i in range(calls)]
        jax.block_until_ready(outs)
        return (time.perf_counter() - t0) / calls

    for i in range(warmup):
        jax.block_until_ready(fn(*input_sets[i % len(input_sets)]))
    calls = max(batch, math.ceil(MIN_SAMPLE_S / sample(0, batch)))
    return 1e3 * float(np.median([sample(r * calls, calls) for r in range(reps)]))


def attention_fns(impl: str, windows, D: int, launches: Launches | None):
    """(forward fn(q,k,v,do) -> out, forward+backward fn(q,k,v,do) -> grads)."""
    scale = 1.0 / float(np.sqrt(D))
    if impl.startswith("ours"):
        stats = impl.startswith("ours_stats")  # the logit statistics on, as training logs them

        def attn(q, k, v):
            return pallas_gpu_attention(q, k, v, windows, scale=scale, launches=launches,
                                        return_logit_stats=stats)[0]
    elif impl == "cudnn_ls":
        def attn(q, k, v):
            return ls_attention(q, k, v, windows, scale=scale, implementation="cudnn")
    elif impl == "split":
        def attn(q, k, v):
            return ls_attention(q, k, v, windows, scale=scale, implementation="split")
    elif impl == "auto":
        def attn(q, k, v):
            return ls_attention(q, k, v, windows, scale=scale)
    elif impl == "cudnn_causal":
        def attn(q, k, v):
            return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True,
                                                implementation="cudnn")
    elif impl == "triton_mha":
        from jax.experimental.pallas.ops.gpu.attention import mha

        def attn(q, k, v):
            return mha(q, k, v, None, sm_scale=scale, causal=True)
    else:
        raise ValueError(f"unknown implementation {impl!r}")

    fwd = jax.jit(lambda q, k, v, do: attn(q, k, v))

    def fwd_bwd(q, k, v, do):
        _, vjp = jax.vjp(attn, q, k, v)
        return vjp(do)

    return fwd, jax.jit(fwd_bwd)


def rel_err(got, want) -> float:
    got, want = jnp.asarray(got, jnp.float32), jnp.asarray(want, jnp.float32)
    return float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))


def check_against_cudnn(fwd, fwd_bwd, windows, D, inputs, no_bwd: bool) -> str:
    """Relative errors of out (and dq, dk, dv) against the cuDNN composition on one input set;
    the error text of the row if any is >= 1e-2 or not finite."""
    ref_fwd, ref_fwd_bwd = attention_fns("cudnn_ls", windows, D, None)
    errs = {"out": rel_err(fwd(*inputs), ref_fwd(*inputs))}
    if not no_bwd:
        for name, g, w in zip(("dq", "dk", "dv"), fwd_bwd(*inputs), ref_fwd_bwd(*inputs)):
            errs[name] = rel_err(g, w)
    text = " ".join(f"{k} {v:.1e}" for k, v in errs.items())
    bad = [k for k, v in errs.items() if not v < 1e-2]
    return f"WRONG ({', '.join(bad)}): {text}" if bad else text


def measure(impl, windows, B, n, H, D, input_sets, args, launches=None, flops_windows=None):
    Hkv = input_sets[0][1].shape[2]
    fwd, fwd_bwd = attention_fns(impl, windows, D, launches)
    flops_windows = windows if flops_windows is None else flops_windows
    row = {"impl": impl, "fwd_ms": None, "fb_ms": None}
    try:
        if args.check and (impl.startswith("ours") or impl in ("split", "auto")):
            row["check"] = check_against_cudnn(fwd, fwd_bwd, windows, D, input_sets[0],
                                               args.no_bwd)
        row["fwd_ms"] = time_ms(fwd, input_sets, args.reps, args.warmup, args.batch)
        row["fwd_tfs"] = band_flops(B, n, flops_windows, D) / row["fwd_ms"] / 1e9
        row["fwd_floor_pct"] = floor_pct(row["fwd_ms"], B, n, H, D, flops_windows, False,
                                         Hkv)
        if not args.no_bwd:
            row["fb_ms"] = time_ms(fwd_bwd, input_sets, args.reps, args.warmup, args.batch)
            row["fb_tfs"] = band_flops(B, n, flops_windows, D, backward=True) / row["fb_ms"] / 1e9
            row["fb_floor_pct"] = floor_pct(row["fb_ms"], B, n, H, D, flops_windows, True,
                                            Hkv)
    except Exception as e:  # a peer that fails at a size is reported, not fatal
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
    return row


def floor_pct(ms, B, n, H, D, windows, backward: bool, kv_heads=None) -> float | None:
    """100 x the floor's time over the measured time. The floor is the larger of the band's
    FLOPs at the card's dense bf16 peak and the bytes that must move at its HBM bandwidth
    (bf16 q, k, v read and o written once; the backward also reads q, k, v, o, do and writes
    dq, dk, dv; k, v, dk and dv have ``kv_heads`` heads, None: H). None on a card not in
    bench/hardware.py."""
    found = peaks(jax.devices()[0].device_kind)
    if found is None:
        return None
    flops_s, bytes_s = found
    Hkv = H if kv_heads is None else kv_heads
    # forward: q, o and k, v; the backward adds q, o, do, dq and k, v, dk, dv
    moved = B * n * (H + Hkv) * D * 2 * (6 if backward else 2)
    floor_s = max(band_flops(B, n, windows, D, backward=backward) / flops_s, moved / bytes_s)
    return 100.0 * floor_s / (ms / 1e3)


def fmt(x, digits=3):
    return "-" if x is None else f"{x:.{digits}f}"


class PrintedRows(list):
    """The measured rows; each is printed (JSON) as it is appended."""

    def append(self, row):
        super().append(row)
        print(json.dumps(row), flush=True)


class Stopped(BaseException):
    """A signal ended the sweep (e.g. ``timeout``'s SIGTERM); BaseException, so that
    ``measure``'s per-row ``except Exception`` lets it through."""


def _stop(signum, frame):
    raise Stopped(signal.Signals(signum).name)


def run_sweep(args, rows: list) -> None:
    """Measures every requested row into ``rows`` (in place, so that a sweep cut short keeps
    the rows it measured)."""
    dtype = jnp.bfloat16
    B, H, Hkv = args.batch_size, args.heads, args.kv_heads or args.heads
    variants = args.launches.split(",")
    impls = args.impl.split(",")
    for D in (int(x) for x in args.d.split(",")):
        for n in (int(x) for x in args.n.split(",")):
            input_sets = make_input_sets(B, n, H, D, dtype, seed=n + D, kv_heads=Hkv)
            causal = (None,) * H
            base = {"D": D, "n": n}
            for impl in ("cudnn_causal", "triton_mha", "auto"):
                if impl in impls and not (impl == "triton_mha" and n > args.triton_max_n):
                    rows.append({**base, "p": "-", "mix": "causal",
                                 **measure(impl, causal, B, n, H, D, input_sets, args)})
            ours_impls = [i for i in ("ours", "ours_stats") if i in impls]
            for ours in ours_impls if "global" in args.mix.split(",") else ():
                for name in variants:
                    launches = choose_launches(name, dtype, D, causal, n, B, Hkv)
                    rows.append({**base, "p": "-", "mix": "causal", **measure(
                        ours + ("" if name == "default" else f"[{name}]"), causal, B, n, H,
                        D, input_sets, args, launches)})
            for p in (int(x) for x in args.p.split(",")):
                for mix in args.mix.split(","):
                    if mix == "global":
                        continue
                    windows = head_windows(mix, H, p)
                    for peer in ("cudnn_ls", "split", "auto"):
                        if peer in impls:
                            rows.append({**base, "p": p, "mix": mix,
                                         **measure(peer, windows, B, n, H, D, input_sets,
                                                   args)})
                    for ours in ours_impls:
                        for name in variants:
                            launches = choose_launches(name, dtype, D, windows, n, B, Hkv)
                            rows.append({**base, "p": p, "mix": mix, **measure(
                                ours + ("" if name == "default" else f"[{name}]"), windows,
                                B, n, H, D, input_sets, args, launches)})
            del input_sets


def print_table(rows, args):
    device = jax.devices()[0].device_kind
    print(f"\n## {device}, {datetime.date.today()}, jax {jax.__version__}, bf16, "
          f"B={args.batch_size} Hq={args.heads} Hkv={args.kv_heads or args.heads}, "
          f"median of {args.reps} samples x >= {args.batch} calls")
    print("| D | n | p | heads | impl | fwd ms | fwd TF/s | fwd % floor | f+b ms | f+b TF/s | "
          "f+b % floor | note |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        note = " ".join(x for x in (r.get("error", ""), r.get("check", "")) if x)
        print(f"| {r['D']} | {r['n']} | {r['p']} | {r['mix']} | {r['impl']} | "
              f"{fmt(r.get('fwd_ms'))} | {fmt(r.get('fwd_tfs'), 0)} | "
              f"{fmt(r.get('fwd_floor_pct'), 0)} | {fmt(r.get('fb_ms'))} | "
              f"{fmt(r.get('fb_tfs'), 0)} | {fmt(r.get('fb_floor_pct'), 0)} | {note} |")


def memory_child(impl: str, n: int, args):
    """Runs one forward+backward at size n (all local, p=128) and prints peak bytes."""
    B, H, D = args.batch_size, args.heads, 64
    windows = (128,) * H
    q, k, v, do = make_input_sets(B, n, H, D, jnp.bfloat16, seed=1)[0]
    _, fwd_bwd = attention_fns(impl, windows, D, None)
    jax.block_until_ready(fwd_bwd(q, k, v, do))
    stats = jax.devices()[0].memory_stats() or {}
    print(json.dumps({"impl": impl, "n": n, "peak_bytes": stats.get("peak_bytes_in_use"),
                      "io_bytes": 7 * q.nbytes}))


def run_memory(args):
    print(f"\n## peak device memory, fwd+bwd, B={args.batch_size} Hq={args.heads} D=64, "
          f"all local p=128, n={args.memory_n}")
    print("| impl | peak GiB | inputs + grads (q,k,v,do,dq,dk,dv) GiB |")
    print("|---|---|---|")
    for impl in args.impl.split(","):
        if impl not in ("ours", "cudnn_ls"):
            continue
        res = subprocess.run([sys.executable, __file__, "--memory-child", impl,
                              "--memory-n", str(args.memory_n),
                              "--batch-size", str(args.batch_size), "--heads", str(args.heads)],
                             capture_output=True, text=True)
        lines = [ln for ln in res.stdout.splitlines() if ln.startswith("{")]
        if res.returncode or not lines:
            print(f"| {impl} | failed: {res.stderr.strip().splitlines()[-1][:100]} | - |")
            continue
        d = json.loads(lines[-1])
        print(f"| {impl} | {d['peak_bytes'] / 2**30:.2f} | {d['io_bytes'] / 2**30:.2f} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--d", default="64,32", help="head sizes, comma separated")
    ap.add_argument("--n", default="2048,8192,32768", help="sequence lengths")
    ap.add_argument("--p", default="50,128,512", help="local windows")
    ap.add_argument("--mix", default="1g15l,global,local", help=f"head mixes among {MIXES}")
    ap.add_argument("--impl", default="ours,cudnn_ls,cudnn_causal,triton_mha")
    ap.add_argument("--launches", default="default",
                    help=f"ours' launches, comma separated among {LAUNCHES}: the heuristics' "
                         "choice, every Triton launch replaced by Mosaic GPU ones, the local "
                         "heads' strip backward replaced by the Triton kernels, or the whole "
                         "backward as one Triton launch")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=0,
                    help="key/value heads (GQA; 0: as many as --heads); must divide --heads")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=5, help="back-to-back calls per sample")
    ap.add_argument("--no-bwd", action="store_true", help="forward only")
    ap.add_argument("--check", action="store_true",
                    help="also check each ours, split and auto row against the cuDNN composition "
                         "(rel. error)")
    ap.add_argument("--triton-max-n", type=int, default=32768,
                    help="skip triton_mha above this n (it is slow)")
    ap.add_argument("--memory", action="store_true", help="peak memory at --memory-n instead")
    ap.add_argument("--memory-n", type=int, default=131072)
    ap.add_argument("--memory-child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.kv_heads < 0 or (args.kv_heads and args.heads % args.kv_heads):
        ap.error(f"--kv-heads: expected 0 or a divisor of --heads ({args.heads}), "
                 f"got {args.kv_heads}")
    if args.kv_heads and "triton_mha" in args.impl.split(","):
        ap.error("--kv-heads: triton_mha takes one kv head per query head; leave it out of "
                 "--impl")
    if args.memory_child:
        memory_child(args.memory_child, args.memory_n, args)
        return
    if args.memory:
        run_memory(args)
        return
    # a sweep cut short by SIGTERM (``timeout``) or Ctrl-C still prints the table of the rows
    # it measured, then exits non-zero
    rows, stopped = PrintedRows(), None
    previous = signal.signal(signal.SIGTERM, _stop)
    try:
        run_sweep(args, rows)
    except (Stopped, KeyboardInterrupt) as stop:
        stopped = str(stop) or "SIGINT"
    finally:
        signal.signal(signal.SIGTERM, previous)
    print_table(rows, args)
    if stopped:
        print(f"\nstopped by {stopped} after {len(rows)} rows: the table is partial", flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
