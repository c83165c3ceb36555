"""The Pallas GPU kernels against the pure-JAX reference twin.

On CPU the kernels run in Pallas interpret mode in float32 (tolerance ~1e-5 relative); the
GPU-only tests (marked ``gpu``) run the compiled Triton kernels in bfloat16 at realistic sizes.
The block-geometry helpers that decide which tiles are loaded are checked against brute force.
"""

import dataclasses
import functools
import warnings
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ls_jax.kernels import ls_attention
from ls_jax.kernels.band import (kv_block_range, kv_full_block_range, q_block_range,
                                 q_full_block_range)
from ls_jax.kernels.pallas_gpu import KernelConfig, pallas_gpu_attention, pallas_gpu_attention_parts
from ls_jax.kernels.pallas_gpu.plan import TilePath, key_plan, query_plan
from ls_jax.kernels.pallas_gpu.tiles import split_kv_loop, split_q_loop
from ls_jax.kernels.reference import reference_attention_parts

warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*")


def rel_err(got, want):
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    assert np.all(np.isfinite(got)), "non-finite values in the result"
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def random_inputs(rng, B, T, Hq, Hkv, D, dtype=jnp.float32):
    """Fresh normal q, k, v, dO (numpy rng seeded per case, so each case has its own data)."""
    shapes = [(B, T, Hq, D), (B, T, Hkv, D), (B, T, Hkv, D), (B, T, Hq, D)]
    return [jnp.asarray(rng.standard_normal(s, np.float32), dtype) for s in shapes]


SMALL = KernelConfig(fwd_block_q=32, fwd_block_k=16, dq_block_q=16, dq_block_k=32,
                     dkdv_block_q=16, dkdv_block_k=32, fwd_loop="cond", bwd_loop="cond")
SQUARE16 = KernelConfig(16, 16, 16, 16, 16, 16, fwd_loop="split", bwd_loop="split")
# two tile paths in one launch: wide (global) heads on longer tiles than the narrow ones
TWO_PATHS = KernelConfig(fwd_block_q=16, fwd_block_k=16, dq_block_q=16, dq_block_k=16,
                         dkdv_block_q=16, dkdv_block_k=16, wide_fwd_block_q=32,
                         wide_dq_block_q=32, wide_dkdv_block_k=32)
# heads with window >= 20 are wide; delta computed by XLA instead of the dQ kernel
WIDE_WINDOW = KernelConfig(fwd_block_q=32, fwd_block_k=16, dq_block_q=16, dq_block_k=32,
                           dkdv_block_q=32, dkdv_block_k=16, wide_fwd_block_q=16,
                           wide_fwd_block_k=32, wide_dq_block_k=16, wide_dkdv_block_q=16,
                           wide_window=20, wide_fwd_loop="split", delta_in_kernel=False)

# (B, T, Hq, Hkv, D, windows, config); T is never a multiple of the largest block.
CASES = [
    (2, 77, 4, 4, 32, (None, 5, 1, 40), SMALL),          # mixed, p = 1
    (1, 100, 6, 2, 16, (3, None, 100, 17, 1, 250), SMALL),  # GQA, p = T and p > T
    (2, 45, 2, 1, 32, (None, None), SQUARE16),           # all global, MQA
    (1, 130, 4, 2, 64, (16, 33, 2, 64), SQUARE16),        # all local, windows at block edges
    (1, 40, 3, 3, 24, (7, None, 1), SMALL),              # head size that is not a power of 2
    (1, 150, 4, 2, 16, (None, 5, 1, 40), TWO_PATHS),      # GQA group of a global + a local head
    (2, 70, 3, 3, 32, (7, None, 30), WIDE_WINDOW),
]


def case_id(case):
    B, T, Hq, Hkv, D, windows, config = case
    return (f"B{B}-T{T}-H{Hq}/{Hkv}-D{D}-w{'_'.join(str(w) for w in windows)}"
            f"-blk{config.fwd_block_q}-{config.fwd_loop}-w{config.wide_fwd_block_q}")


class TestInterpretFloat32:
    """Compiled-kernel semantics in Pallas interpret mode on CPU, float32."""

    @pytest.mark.parametrize("case", CASES, ids=case_id)
    def test_forward_matches_reference(self, case):
        B, T, Hq, Hkv, D, windows, config = case
        rng = np.random.default_rng(zlib.crc32(case_id(case).encode()))
        q, k, v, _ = random_inputs(rng, B, T, Hq, Hkv, D)
        out, lse, max_abs = pallas_gpu_attention_parts(q, k, v, windows, config=config,
                                                       interpret=True)
        want_out, want_lse, want_max = reference_attention_parts(q, k, v, windows)
        assert out.shape == (B, T, Hq, D) and lse.shape == (B, Hq, T)
        assert rel_err(out, want_out) < 1e-5
        assert rel_err(lse, want_lse) < 1e-5
        np.testing.assert_allclose(max_abs, want_max, rtol=1e-5)

    @pytest.mark.parametrize("case", CASES[:4] + CASES[5:], ids=case_id)
    def test_gradients_match_reference(self, case):
        B, T, Hq, Hkv, D, windows, config = case
        rng = np.random.default_rng(zlib.crc32(case_id(case).encode()) + 1)
        q, k, v, do = random_inputs(rng, B, T, Hq, Hkv, D)

        def ours(q, k, v):
            return jnp.sum(pallas_gpu_attention(q, k, v, windows, config=config,
                                                interpret=True)[0] * do)

        def ref(q, k, v):
            return jnp.sum(reference_attention_parts(q, k, v, windows)[0] * do)

        got = jax.grad(ours, argnums=(0, 1, 2))(q, k, v)
        want = jax.grad(ref, argnums=(0, 1, 2))(q, k, v)
        for name, g, w in zip(("dq", "dk", "dv"), got, want):
            assert g.shape == w.shape
            assert rel_err(g, w) < 1e-5, name

    @pytest.mark.parametrize("config", [SMALL, TWO_PATHS], ids=["small", "two-paths"])
    def test_segment_ids_forward_and_gradients(self, config):
        B, T, Hq, Hkv, D = 2, 70, 4, 2, 32
        windows = (None, 6, 1, 3)
        rng = np.random.default_rng(7 + config.wide_fwd_block_q)
        q, k, v, do = random_inputs(rng, B, T, Hq, Hkv, D)
        seg = jnp.asarray(np.sort(rng.integers(0, 4, (B, T)), axis=1), jnp.int32)
        out, lse, max_abs = pallas_gpu_attention_parts(q, k, v, windows, segment_ids=seg,
                                                       config=config, interpret=True)
        want_out, want_lse, want_max = reference_attention_parts(q, k, v, windows, seg)
        assert rel_err(out, want_out) < 1e-5
        assert rel_err(lse, want_lse) < 1e-5
        np.testing.assert_allclose(max_abs, want_max, rtol=1e-5)

        def ours(q, k, v):
            return jnp.sum(pallas_gpu_attention(q, k, v, windows, segment_ids=seg,
                                                config=config, interpret=True)[0] * do)

        def ref(q, k, v):
            return jnp.sum(reference_attention_parts(q, k, v, windows, seg)[0] * do)

        for name, g, w in zip(("dq", "dk", "dv"), jax.grad(ours, (0, 1, 2))(q, k, v),
                              jax.grad(ref, (0, 1, 2))(q, k, v)):
            assert rel_err(g, w) < 1e-5, name

    def test_public_entry_point_dispatches_here(self):
        B, T, Hq, Hkv, D = 1, 50, 2, 1, 16
        windows = (None, 9)
        q, k, v, _ = random_inputs(np.random.default_rng(3), B, T, Hq, Hkv, D)
        out, stats = ls_attention(q, k, v, windows, implementation="pallas_gpu",
                                  interpret=True, return_logit_stats=True, scale=0.3)
        want_out, _, want_max = reference_attention_parts(q, k, v, windows, scale=0.3)
        assert rel_err(out, want_out) < 1e-5
        np.testing.assert_allclose(stats.max_abs_logit, want_max, rtol=1e-5)

    def test_compiled_mode_on_cpu_is_a_clear_error(self):
        if jax.default_backend() == "gpu":
            pytest.skip("a GPU is present")
        q = jnp.zeros((1, 8, 1, 16))
        with pytest.raises(ValueError, match="pallas_gpu.*needs a CUDA GPU"):
            ls_attention(q, q, q, (None,), implementation="pallas_gpu")

    def test_bad_config_is_a_clear_error(self):
        q = jnp.zeros((1, 8, 1, 16))
        with pytest.raises(ValueError, match="config.fwd_block_k: expected a power of two"):
            pallas_gpu_attention(q, q, q, (None,), config=KernelConfig(fwd_block_k=24),
                                 interpret=True)


class TestPlans:
    """Which program computes which block: every block of every head exactly once."""

    @staticmethod
    def counts(plan, kernel, num_heads, seq_len):
        schedule, classes, paths, num_slots = (plan.schedule, plan.head_class, plan.paths,
                                               plan.num_slots)
        covered = np.zeros((num_heads, seq_len), int)
        for item in schedule.tolist():
            head, block = divmod(item, num_slots)
            path = paths.wide if classes[head] == 0 else paths.narrow
            size = path.block_k if kernel == "dkdv" else path.block_q
            covered[head, block * size:(block + 1) * size] += 1
        return covered

    # windows (256, 3, 64, 256, 1, 17) on T = 256: expected classes (0 wide, 1 narrow)
    @pytest.mark.parametrize("config,want_classes", [
        (TWO_PATHS, [0, 1, 1, 0, 1, 1]),
        (WIDE_WINDOW, [0, 1, 0, 0, 1, 1]),  # wide_window=20
        (SMALL, [0] * 6),  # no wide tiles: one path for every head
    ], ids=["two-paths", "wide-window", "small"])
    def test_every_block_once(self, config, want_classes):
        windows, Tp = (256, 3, 64, 256, 1, 17), 256
        threshold = config.wide_window or Tp
        for kernel in ("fwd", "dq"):
            narrow, wide = config.paths(kernel)
            plan = query_plan(windows, Tp, narrow, wide, threshold)
            assert np.all(self.counts(plan, kernel, len(windows), Tp) == 1), kernel
            assert plan.head_class.tolist() == want_classes
        narrow, wide = config.paths("dkdv")
        plan = key_plan(windows, 3, Tp, narrow, wide, threshold)
        assert np.all(self.counts(plan, "dkdv", 3, Tp) == 1)
        # kv head g serves query heads 2g, 2g+1: wide only if both are
        assert plan.head_class.tolist() == [max(want_classes[2 * g:2 * g + 2]) for g in range(3)]


class TestBlockGeometry:
    """Which tiles the kernels visit, against brute force over every (i, j) of every tile."""

    @staticmethod
    def tile_state(q_block, k_block, bq, bk, window):
        allowed = [(j <= i) and (window is None or i - j < window)
                   for i in range(q_block * bq, (q_block + 1) * bq)
                   for j in range(k_block * bk, (k_block + 1) * bk)]
        return any(allowed), all(allowed)

    @pytest.mark.parametrize("bq,bk", [(16, 16), (32, 16), (16, 32)])
    def test_loop_splits_cover_exactly_the_band(self, bq, bk):
        T = 128
        for window in (None, 1, 5, 16, 17, 40, 127, 300):
            for i in range(T // bq):
                first, lo, hi, end = (int(x) for x in split_kv_loop(i, bq, bk, window, T))
                visited = set(range(first, end))
                for j in range(T // bk):
                    touches, full = self.tile_state(i, j, bq, bk, window)
                    assert (j in visited) == touches, (window, i, j)
                    if lo <= j < hi:
                        assert full, ("unmasked tile not fully inside the band", window, i, j)
                assert first <= lo <= hi <= end
            for j in range(T // bk):
                first, lo, hi, end = (int(x) for x in split_q_loop(j, bq, bk, window, T))
                for i in range(T // bq):
                    touches, full = self.tile_state(i, j, bq, bk, window)
                    assert (first <= i < end) == touches, (window, i, j)
                    if lo <= i < hi:
                        assert full, ("unmasked tile not fully inside the band", window, i, j)

    def test_full_ranges_are_exact(self):
        T, bq, bk = 96, 16, 32
        for window in (None, 1, 20, 48, 49, 96):
            for i in range(T // bq):
                f, e = kv_full_block_range(i, bq, bk, window, T)
                want = [j for j in range(T // bk) if self.tile_state(i, j, bq, bk, window)[1]]
                assert list(range(f, min(e, T // bk))) == want
            for j in range(T // bk):
                f, e = q_full_block_range(j, bq, bk, window, T)
                want = [i for i in range(T // bq) if self.tile_state(i, j, bq, bk, window)[1]]
                assert list(range(f, min(e, T // bq))) == want

    def test_schedules_cover_every_program_once_longest_first(self):
        windows, T, bq, bk = (256, 3, 64, 256, 1, 64), 256, 32, 16
        path = TilePath(bq, bk, "cond")  # one tile path for every head
        sched = query_plan(windows, T, path, path, T).schedule
        n_q = T // bq
        assert sorted(sched.tolist()) == list(range(len(windows) * n_q))
        costs = [np.subtract(*kv_block_range(int(x) % n_q, bq, bk, windows[int(x) // n_q], T))
                 for x in sched]
        assert costs == sorted(costs)  # (first - end) ascending = visits descending
        assert sched[0] // n_q in (0, 3) and sched[0] % n_q == n_q - 1  # a global head's last block

        sched = key_plan(windows, 3, T, path, path, T).schedule
        n_k = T // bk
        assert sorted(sched.tolist()) == list(range(3 * n_k))
        costs = [sum(np.subtract(*q_block_range(int(x) % n_k, bq, bk, windows[h], T))
                     for h in (2 * (int(x) // n_k), 2 * (int(x) // n_k) + 1)) for x in sched]
        assert costs == sorted(costs)


# ------------------------------------------------------------------------------------------
# GPU only: the compiled Triton kernels in bf16 at realistic sizes.

GPU_CASES = [
    # (B, T, Hq, Hkv, D, windows)
    (2, 2048, 8, 8, 64, (None,) + (128,) * 7),
    (1, 3000, 8, 2, 128, (None, 50, 512, 1, None, 128, 3000, 7)),
    (2, 1536, 6, 3, 32, (50,) * 6),
    (1, 1024, 4, 4, 64, (None,) * 4),
    (1, 1024, 2, 2, 128, (None,) * 2),   # D=128 all global: dQ on 128-key blocks
    (2, 1000, 4, 4, 128, (50, 512, 1, 128)),  # D=128 every head local: the Mosaic backward
    # D=128, GQA, local windows >= 256: every head on the Hopper forward with three consumers
    # (8 x 16 heads x 9 tiles of 192 rows: 1152 programs) and on the Hopper backward
    (8, 1550, 16, 4, 128, (None, 256, 512, 300, None, 1549, 700) + (256,) * 9),
    # D=64 all global, groups of 4 query heads: each kv head's sum in the Hopper dK/dV kernel
    (2, 1024, 8, 2, 64, (None,) * 8),
]


def _poison_device_memory(nbytes: int):
    """Fills freed device memory with NaN, so an output element the kernel does not write
    would read NaN (XLA's allocator hands freed chunks back out)."""
    junk = [jnp.full((nbytes // 2,), jnp.nan, jnp.bfloat16) for _ in range(4)]
    jax.block_until_ready(junk)
    del junk


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: f"T{c[1]}-H{c[2]}/{c[3]}-D{c[4]}")
def test_gpu_bf16_matches_reference(case):
    B, T, Hq, Hkv, D, windows = case
    rng = np.random.default_rng(T * 31 + D)
    q, k, v, do = random_inputs(rng, B, T, Hq, Hkv, D, jnp.bfloat16)
    f32 = [x.astype(jnp.float32) for x in (q, k, v, do)]
    _poison_device_memory(q.size * 2)

    fwd = jax.jit(lambda q, k, v: ls_attention(q, k, v, windows, implementation="pallas_gpu",
                                               return_logit_stats=True))
    out, stats = fwd(q, k, v)
    want_out, _, want_max = reference_attention_parts(*f32[:3], windows)
    assert rel_err(out, want_out) < 1e-2
    assert rel_err(stats.max_abs_logit, want_max) < 1e-2

    def ours(q, k, v):
        o = ls_attention(q, k, v, windows, implementation="pallas_gpu")
        return jnp.sum(o.astype(jnp.float32) * f32[3])

    def ref(q, k, v):
        return jnp.sum(reference_attention_parts(q, k, v, windows)[0] * f32[3])

    _poison_device_memory(q.size * 2)
    got = jax.jit(jax.grad(ours, (0, 1, 2)))(q, k, v)
    want = jax.grad(ref, (0, 1, 2))(*f32[:3])
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert rel_err(g, w) < 1e-2, name


@pytest.mark.gpu
def test_gpu_segment_ids_and_fp16():
    B, T, Hq, Hkv, D = 2, 1000, 4, 2, 64
    windows = (None, 64, 1, 300)
    rng = np.random.default_rng(11)
    q, k, v, do = random_inputs(rng, B, T, Hq, Hkv, D, jnp.float16)
    seg = jnp.asarray(np.sort(rng.integers(0, 5, (B, T)), axis=1), jnp.int32)
    f32 = [x.astype(jnp.float32) for x in (q, k, v, do)]
    out = jax.jit(lambda q, k, v: ls_attention(q, k, v, windows, segment_ids=seg,
                                               implementation="pallas_gpu"))(q, k, v)
    assert rel_err(out, reference_attention_parts(*f32[:3], windows, seg)[0]) < 1e-2
    got = jax.grad(lambda q, k, v: jnp.sum(ls_attention(
        q, k, v, windows, segment_ids=seg, implementation="pallas_gpu").astype(jnp.float32)
        * f32[3]), (0, 1, 2))(q, k, v)
    want = jax.grad(lambda q, k, v: jnp.sum(reference_attention_parts(
        q, k, v, windows, seg)[0] * f32[3]), (0, 1, 2))(*f32[:3])
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert rel_err(g, w) < 1e-2, name


@pytest.mark.gpu
def test_gpu_float32_matches_reference():
    B, T, Hq, Hkv, D = 1, 600, 2, 1, 64
    windows = (None, 100)
    q, k, v, _ = random_inputs(np.random.default_rng(5), B, T, Hq, Hkv, D)
    out = ls_attention(q, k, v, windows, implementation="pallas_gpu")
    # fp32 dots run on the matrix units (seen on an H200: 3.6e-4, the tf32 signature)
    assert rel_err(out, reference_attention_parts(q, k, v, windows)[0]) < 2e-3


# ---------------------------------------------------------------------------------------------
# The Hopper forward (``forward_mosaic.py``): the Mosaic GPU kernel, with the Triton backward.

def mosaic_config(block_q=64, block_k=64, stages=2, lowering="mosaic", bwd="triton",
                  bwd_block_q=64, consumers=2, strip=None, fused_dq=False, bwd_consumers=2):
    """strip: None keeps the local heads' forward on Triton; else strips of that many query
    blocks (0: the kernel's choice). fused_dq: dQ in the Mosaic dK/dV kernel."""
    return KernelConfig(fwd_lowering=lowering, bwd_lowering=bwd, mosaic_block_q=block_q,
                        mosaic_fused_dq=fused_dq, mosaic_bwd_consumers=bwd_consumers,
                        mosaic_block_k=block_k, mosaic_stages=stages,
                        mosaic_bwd_block_q=bwd_block_q, mosaic_consumers=consumers,
                        local_fwd_lowering="triton" if strip is None else "strip",
                        strip_blocks=strip or 0,
                        fwd_block_q=16, fwd_block_k=16,
                        dq_block_q=16, dq_block_k=16, dkdv_block_q=16, dkdv_block_k=16)


# (B, T, Hq, Hkv, D, windows, mosaic tiles); bfloat16, as the kernel takes
MOSAIC_CASES = [
    (1, 200, 4, 2, 64, (None, 1, 64, 130), (64, 64, 2)),   # padded T, GQA, p = 1, p = a block
    (2, 256, 2, 2, 64, (None, None), (64, 64, 3)),         # all global, 3 stages > a row's blocks
    (1, 384, 3, 1, 128, (7, None, 300), (64, 128, 2)),     # D = 128, 128-key blocks, MQA
    # global heads on the Mosaic kernel, local ones on the Triton kernel, one output
    (2, 160, 4, 2, 64, (5, None, 64, None), (64, 64, 2, "mixed")),
    # three consumers: 4 query blocks, so the last tile's extra consumers redo block 3
    (1, 256, 2, 1, 64, (None, 50), (64, 64, 2, "mosaic", "triton", 64, 3)),
    # the same at D = 128 (there the statistics' row minimum is taken after the exponentials)
    (1, 320, 2, 1, 128, (None, 50), (64, 128, 2, "mosaic", "triton", 64, 3)),
    # the local heads as strips (forward_strip.py) into the global heads' buffers: padded T
    # (8 query blocks: strips of 3, 3, 2), GQA, p = 1, p = a block, p = 4 blocks - 1
    (1, 400, 5, 1, 64, (None, 1, 64, 255, 100), (64, 64, 2, "mixed", "triton", 64, 2, 3)),
    # every head local (no earlier launch), strips of 2 of 4 blocks, two batch elements
    (2, 256, 2, 2, 64, (50, 128), (64, 64, 2, "triton", "triton", 64, 2, 2)),
]


def mosaic_id(case):
    B, T, Hq, Hkv, D, windows, tiles = case
    tiles = "x".join(map(str, tiles))
    return f"B{B}-T{T}-H{Hq}/{Hkv}-D{D}-w{'_'.join(map(str, windows))}-t{tiles}"


@pytest.mark.parametrize("dtype,D,windows,T,want", [
    (jnp.bfloat16, 64, (None,) * 4, 8192, ("mosaic", "mosaic")),
    # D=128 (runs T-U): the local heads' backward on Mosaic too, their forward from p=256
    (jnp.bfloat16, 128, (None,) + (128,) * 15, 8192, ("mixed", "mosaic")),
    (jnp.bfloat16, 128, (None, None) + (512,) * 14, 65536, ("mosaic", "mosaic")),
    (jnp.bfloat16, 128, (None,) + (256,) * 15, 8192, ("mosaic", "mosaic")),
    (jnp.bfloat16, 128, (None, 512, 255, 512), 4096, ("mixed", "mosaic")),  # one narrower
    (jnp.bfloat16, 128, (128,) * 16, 8192, ("triton", "mosaic")),      # no global head
    (jnp.bfloat16, 128, (512,) * 16, 8192, ("mosaic", "mosaic")),
    (jnp.bfloat16, 128, (None,) * 4, 8192, ("mosaic", "mosaic")),
    (jnp.float32, 128, (None,) + (512,) * 15, 8192, ("triton", "triton")),
    (jnp.bfloat16, 64, (None,) + (128,) * 15, 8192, ("mixed", "triton")),  # short mix
    (jnp.bfloat16, 64, (None,) + (128,) * 15, 32768, ("mixed", "mixed")),
    (jnp.bfloat16, 64, (128,) * 16, 32768, ("triton", "triton")),      # no global head
    (jnp.float32, 64, (None,) * 4, 8192, ("triton", "triton")),
])
def test_default_lowerings(dtype, D, windows, T, want):
    """Which kernels the defaults pick (the measured choices of runs J, T, U and V,
    kernel-notes.md)."""
    from ls_jax.kernels.pallas_gpu import default_config
    config = default_config(dtype, D, windows, T)
    assert (config.fwd_lowering, config.bwd_lowering) == want


def test_gqa_mixes_at_d128_take_the_hopper_backward():
    """Run V: with each GQA group summed in the Hopper dK/dV kernel, GQA mixes with narrow
    windows are faster on the Hopper backward (run U had sent them to Triton): the plan of a
    call with 4 kv heads for 16 query heads picks it, as it does without GQA."""
    from ls_jax.kernels.pallas_gpu.plan import make_plan
    for kv_heads in (4, 16):
        plan = make_plan(seq_len=8192, head_dim=128, windows=(None,) + (128,) * 15,
                         num_kv_heads=kv_heads, dtype=jnp.bfloat16, scale=0.1, config=None,
                         logit_stats=False, interpret=False, batch=4)
        assert plan.config.bwd_lowering == "mosaic", kv_heads


@pytest.mark.parametrize("dtype,D,windows,T,want", [
    (jnp.bfloat16, 64, (None,) + (128,) * 15, 8192, "strip"),   # run O: forward 3-7% faster
    (jnp.bfloat16, 64, (50,) * 16, 4096, "strip"),               # no global head
    (jnp.bfloat16, 64, (None,) + (128,) * 15, 2048, "triton"),  # short: measured slower
    (jnp.bfloat16, 64, (None,) * 4, 8192, "triton"),             # no local head
    (jnp.bfloat16, 128, (None,) + (128,) * 15, 8192, "triton"),  # D=128: strips take D=64
    (jnp.float32, 64, (None,) + (128,) * 15, 8192, "triton"),
])
def test_default_local_forward(dtype, D, windows, T, want):
    """Where the defaults run the local heads' forward as strips (run O)."""
    from ls_jax.kernels.pallas_gpu import default_config
    assert default_config(dtype, D, windows, T).local_fwd_lowering == want


@pytest.mark.parametrize("windows,D,want", [
    ((128, 50), 64, True), ((256,), 64, True),   # p=256 ran on the H100 (run O: O4-O6)
    ((257,), 64, False), ((512, 50), 64, False), ((128,), 128, False), ((), 64, False),
])
def test_strip_fits(windows, D, want):
    """The strip kernel takes D=64 and windows up to 256: a ring of 10 slots for p=257 would
    need 239,104 bytes of the H100's 232,448."""
    from ls_jax.kernels.pallas_gpu.forward_strip import strip_fits
    assert strip_fits(D, windows) == want


@pytest.mark.parametrize("blocks,rows,sms,want", [
    (128, 64, 132, 64),    # n=8192, B=4, 16 heads: 2 strips a head (run O's fastest)
    (512, 64, 132, 128),   # n=32768: capped at 128 blocks (4 strips a head, run O)
    (64, 64, 132, 32),     # n=4096
    (128, 15, 132, 16),    # B=1, 15 heads: 8 strips a head, 120 programs
    (128, 256, 132, 128),  # more (head, batch) pairs than SMs: one strip a head
    (3, 1, 132, 1),
])
def test_strip_length(blocks, rows, sms, want):
    from ls_jax.kernels.pallas_gpu.forward_strip import strip_length
    assert strip_length(blocks, rows, sms) == want


@pytest.mark.parametrize("D,windows,T,B,want", [
    # three consumers on 64-row blocks from 512 dQ programs (batch x global heads x tiles of
    # 192 rows), run R
    (64, (None,) * 4, 32768, 1, (3, 64, 0)),          # 4 x 171
    (64, (None,) + (128,) * 15, 32768, 4, (3, 64, 0)),  # 4 x 171 (measured faster)
    (64, (None,) + (128,) * 15, 32768, 1, (2, 128, 0)),  # 171 (measured slower)
    (64, (None,) + (128,) * 15, 16384, 4, (2, 128, 0)),  # 4 x 86 (measured slower)
    (64, (None,) * 2, 12288, 4, (3, 64, 0)),          # 4 x 2 x 64
    (64, (None,) * 2, 12096, 4, (2, 128, 0)),         # 4 x 2 x 63
    (128, (None,) * 4, 32768, 4, (2, 64, 128)),  # dQ on 128-key blocks: all global at D=128
    (128, (None, 128, 128, 128), 32768, 4, (2, 64, 0)),  # D=128: three spill (run R)
])
def test_default_hopper_backward_blocks(D, windows, T, B, want):
    """The Hopper backward's consumers, query blocks and dQ key blocks by default (runs J-K,
    R)."""
    from ls_jax.kernels.pallas_gpu import default_config
    config = default_config(jnp.bfloat16, D, windows, T, batch=B)
    got = (config.mosaic_bwd_consumers, config.mosaic_bwd_block_q, config.mosaic_dq_block_k)
    assert got == want


def test_default_consumers_follow_the_batch():
    """The call's batch reaches ``default_config`` (one global head at n=32768: B=4 gives 684
    programs and three consumers, forward and backward; B=1 171 programs and two)."""
    from ls_jax.kernels.pallas_gpu.backend import _prepare
    windows = (None,) + (128,) * 15

    def consumers(B):
        x = jax.ShapeDtypeStruct((B, 32768, 16, 64), jnp.bfloat16)
        out = []
        jax.eval_shape(lambda q: out.append(_prepare(q, q, q, windows, None, None, None, False,
                                                     True)[0].config), x)
        return out[0].mosaic_consumers, out[0].mosaic_bwd_consumers

    assert (consumers(4), consumers(1)) == ((3, 3), (2, 2))


@pytest.mark.parametrize("D,windows,T,B,want", [
    # three from 256 programs (batch x global heads x tiles of 192 rows)
    (64, (None,) * 16, 8192, 1, 3),           # all global: 16 x 43 tiles
    (64, (None,) * 4, 1024, 4, 2),            # 4 x 4 x 6: too few programs
    (64, (None,) + (128,) * 15, 8192, 4, 2),  # one global head, 4 x 43 (measured slower)
    (64, (None,) + (128,) * 15, 16384, 4, 3),  # 4 x 86 (measured faster, run L)
    (64, (None,) + (128,) * 15, 16384, 1, 2),  # 86 (measured slower, run R)
    (64, (None,) + (128,) * 15, 32768, 1, 2),  # 171 (measured slower, run R)
    (64, (None,) * 2 + (128,) * 14, 32768, 1, 3),  # 2 x 171 (measured faster, run R)
    (128, (None,) * 16, 8192, 4, 3),          # D=128 too, although its tiles spill (run Q)
    (128, (None,) * 2 + (128,) * 14, 4096, 4, 2),  # 4 x 2 x 22 (measured slower, run Q)
    (128, (None,) * 2 + (128,) * 14, 32768, 4, 3),  # 4 x 2 x 171 (measured faster)
    (128, (None,) * 2 + (128,) * 14, 16384, 1, 2),  # 2 x 86 (measured slower, run R)
    # D=128 local windows >= 256 share the launch: every head's tiles count (run U)
    (128, (None,) + (512,) * 15, 8192, 4, 3),  # 4 x 16 x 43 (measured faster; 4 x 43 global)
    (128, (None,) * 2 + (256,) * 14, 4096, 4, 3),  # 4 x 16 x 22 (4 x 2 x 22 global)
    (128, (512,) * 16, 8192, 4, 3),           # no global head
    (128, (None,) + (512,) * 15, 4096, 1, 2),  # 16 x 22 (measured a tie to slower)
    (128, (None,) + (512,) * 15, 6144, 1, 2),  # 16 x 32 = 512 < 1024
    (256, (None,) * 16, 8192, 4, 2),          # not measured: a 128-register accumulator
])
def test_default_forward_consumers(D, windows, T, B, want):
    """The Hopper forward's consumer warpgroups by default (runs L, Q and R)."""
    from ls_jax.kernels.pallas_gpu import default_config
    assert default_config(jnp.bfloat16, D, windows, T, batch=B).mosaic_consumers == want


def test_register_budgets_fit_what_the_program_launches_with():
    """setmaxnreg moves registers between a program's warpgroups; it cannot add any. Every
    budget the kernels use fits; run N's four consumers at 120 (a GPU hang, most likely this)
    do not."""
    from ls_jax.kernels.pallas_gpu.mosaic_ring import REGISTERS, launch_registers

    def fits(consumers, consumer, producer):
        return consumers * consumer + producer <= (consumers + 1) * launch_registers(consumers + 1)

    assert [launch_registers(w) for w in (3, 4, 5)] == [168, 128, 96]  # ptxas, run N (N9)
    for consumers, (consumer, producer) in REGISTERS.items():
        assert fits(consumers, consumer, producer), consumers
        assert consumer % 8 == 0 and producer % 8 == 0 and 24 <= producer <= consumer <= 256
    assert not fits(4, 120, 24) and fits(4, 112, 24)


def test_interpreter_falls_back_to_two_consumers_on_few_processors(monkeypatch):
    """Four warpgroups hung Pallas' GPU interpreter on 2 processors (run L)."""
    from ls_jax.kernels.pallas_gpu.mosaic_ring import interpreter_fits
    monkeypatch.setenv("PJRT_NPROC", "2")
    assert interpreter_fits(2) and not interpreter_fits(3)
    monkeypatch.setenv("PJRT_NPROC", "8")
    assert interpreter_fits(3)


class TestMosaicInterpret:
    """The Mosaic GPU forward in Pallas' GPU interpreter on CPU (threads, barriers, TMA
    simulated; a barrier phase no thread observed is an error there), bfloat16."""

    @pytest.mark.parametrize("case", MOSAIC_CASES, ids=mosaic_id)
    def test_forward_matches_reference(self, case):
        B, T, Hq, Hkv, D, windows, tiles = case
        rng = np.random.default_rng(zlib.crc32(mosaic_id(case).encode()))
        q, k, v, _ = random_inputs(rng, B, T, Hq, Hkv, D, jnp.bfloat16)
        out, lse, max_abs = pallas_gpu_attention_parts(q, k, v, windows,
                                                       config=mosaic_config(*tiles),
                                                       interpret=True)
        f32 = [x.astype(jnp.float32) for x in (q, k, v)]
        want_out, want_lse, want_max = reference_attention_parts(*f32, windows)
        assert out.dtype == jnp.bfloat16 and out.shape == (B, T, Hq, D)
        assert rel_err(out, want_out) < 1e-2
        assert rel_err(lse, want_lse) < 1e-5
        np.testing.assert_allclose(max_abs, want_max, rtol=1e-5)

    @pytest.mark.parametrize("bwd,Hkv,windows", [
        ("triton", 1, (None, 20, None)),        # the Mosaic forward, the Triton backward
        ("mosaic", 3, (None, 20, 64)),          # every head on the Mosaic backward
        ("mosaic", 1, (None, None, 130)),       # GQA: dK/dV per query head, summed
        ("mosaic", 3, (20, 130, 1)),            # every head local (the D=128 default, run T)
        ("mosaic-q128dq128", 3, (None, 7, 100)),  # 128-row query, 128-key dQ blocks
        ("mixed", 3, (None, 20, None)),         # global heads Mosaic, local heads Triton
        # the same with every head's delta from one XLA pass (by default the Triton dQ
        # kernel computes the local heads' delta and the pass only the global heads')
        ("mixed-xladelta", 3, (20, None, 5)),
        # dQ in the dK/dV kernel (in the interpreter each key block's share in its own slice)
        ("mosaic-fused", 1, (None, 20, 130)),   # GQA too
        ("mixed-fused", 3, (None, 7, None)),
        # three consumers in the backward (4 blocks of 64: the last tile's extra consumers
        # redo the last block)
        ("mosaic-c3", 1, (None, 20, 130)),
        ("mixed-c3", 3, (None, 7, None)),
    ], ids=["bwd-triton", "bwd-mosaic", "bwd-mosaic-mqa", "bwd-mosaic-local",
            "bwd-mosaic-q128dq128", "bwd-mixed",
            "bwd-mixed-xladelta", "bwd-mosaic-fused-mqa", "bwd-mixed-fused", "bwd-mosaic-c3-mqa",
            "bwd-mixed-c3"])
    def test_gradients_match_reference(self, bwd, Hkv, windows):
        B, T, Hq, D = 1, 200, 3, 64
        q, k, v, do = random_inputs(np.random.default_rng(3), B, T, Hq, Hkv, D, jnp.bfloat16)
        f32 = [x.astype(jnp.float32) for x in (q, k, v, do)]

        config = mosaic_config(lowering="mixed", bwd=bwd.split("-")[0])
        if bwd.endswith("dq128"):
            config = dataclasses.replace(config, mosaic_dq_block_k=128, mosaic_bwd_block_q=128)
        if bwd.endswith("xladelta"):
            config = dataclasses.replace(config, delta_in_kernel=False)
        if bwd.endswith("fused"):
            config = dataclasses.replace(config, mosaic_fused_dq=True)
        if bwd.endswith("c3"):
            config = dataclasses.replace(config, mosaic_bwd_consumers=3)

        def ours(q, k, v):
            out, _ = pallas_gpu_attention(q, k, v, windows, config=config, interpret=True)
            return jnp.sum(out.astype(jnp.float32) * f32[3])

        def ref(q, k, v):
            return jnp.sum(reference_attention_parts(q, k, v, windows)[0] * f32[3])

        got = jax.grad(ours, (0, 1, 2))(q, k, v)
        want = jax.grad(ref, (0, 1, 2))(*f32[:3])
        for name, g, w in zip(("dq", "dk", "dv"), got, want):
            assert rel_err(g, w) < 2e-2, name

    def test_calls_it_cannot_run_take_the_triton_forward(self):
        # D = 32 is not a multiple of 64: the same config runs the Triton forward, same result
        q, k, v, _ = random_inputs(np.random.default_rng(4), 1, 64, 2, 2, 32, jnp.bfloat16)
        out, _, _ = pallas_gpu_attention_parts(q, k, v, (None, 9), config=mosaic_config(),
                                               interpret=True)
        want = reference_attention_parts(*(x.astype(jnp.float32) for x in (q, k, v)),
                                         (None, 9))[0]
        assert rel_err(out, want) < 1e-2

    def test_bad_mosaic_config_is_a_clear_error(self):
        q = jnp.zeros((1, 64, 1, 64), jnp.bfloat16)
        for bad, field in [(dict(mosaic_block_q=32), "mosaic_block_q"),
                           (dict(mosaic_stages=1), "mosaic_stages"),
                           (dict(mosaic_dq_block_k=96), "mosaic_dq_block_k"),
                           (dict(mosaic_consumers=4), "mosaic_consumers"),
                           (dict(mosaic_bwd_consumers=1), "mosaic_bwd_consumers"),
                           (dict(mosaic_fused_dq=1), "mosaic_fused_dq"),
                           (dict(local_fwd_lowering="mosaic"), "local_fwd_lowering"),
                           (dict(strip_blocks=-1), "strip_blocks"),
                           (dict(fwd_lowering="cuda"), "fwd_lowering")]:
            with pytest.raises(ValueError, match=field):
                pallas_gpu_attention(q, q, q, (None,), config=dataclasses.replace(
                    mosaic_config(), **bad), interpret=True)


def test_row_delta_of_some_heads():
    from ls_jax.kernels.pallas_gpu.backward import row_delta

    rng = np.random.default_rng(7)
    out, do = (rng.standard_normal((2, 5, 4, 8)).astype(np.float32) for _ in range(2))
    want = np.zeros((2, 4, 5), np.float32)
    for h in (0, 2):
        want[:, h] = (out[:, :, h] * do[:, :, h]).sum(-1)
    np.testing.assert_allclose(row_delta(out, do, heads=(0, 2)), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(row_delta(out, do)[:, 1], (out[:, :, 1] * do[:, :, 1]).sum(-1),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("D,windows,config", [
    (64, (None, 1, 128, None), dict(mosaic_bwd_block_q=128)),   # masks, 128-row bwd blocks
    (64, (None,) * 2, dict(mosaic_consumers=3, mosaic_bwd_block_q=128)),  # constant window
    (128, (None, 50), dict(mosaic_consumers=3, mosaic_block_k=128)),  # D=128, three consumers
    (128, (None, 50), dict(mosaic_block_k=128, mosaic_dq_block_k=128)),
    # (the fused kernel takes 64-row query blocks whatever the config: 128 would not fit)
    (64, (None, 1, 128, None), dict(mosaic_bwd_block_q=128, mosaic_fused_dq=True)),
    (128, (None, 50), dict(mosaic_fused_dq=True)),
    (64, (None, 1, 128, None), dict(mosaic_bwd_consumers=3)),
], ids=["d64-mixed", "d64-global-3consumers", "d128-3consumers", "d128", "d64-fused-dq",
        "d128-fused-dq", "d64-bwd-3consumers"])
def test_mosaic_kernels_lower_for_the_gpu_on_cpu(D, windows, config):
    """The GPU code paths that interpret mode does not run (register-operand and overlapped
    wgmma in the backward, ``mosaic_ring.mma`` on the GPU) lowered to Mosaic GPU's module on
    the CPU: a kernel that would not compile for an H100 fails here, without one."""
    from ls_jax.kernels.pallas_gpu.backward_mosaic import (delta_fits, dkdv_call_mosaic,
                                                           dq_call_mosaic)
    from ls_jax.kernels.pallas_gpu.forward_mosaic import forward_call_mosaic
    from ls_jax.kernels.pallas_gpu.plan import make_plan

    T, H = 512, len(windows)
    plan = make_plan(seq_len=T, head_dim=D, windows=windows, num_kv_heads=H,
                     dtype=jnp.bfloat16, scale=D ** -0.5,
                     config=dataclasses.replace(mosaic_config(lowering="mosaic", bwd="mosaic"),
                                                **config),
                     logit_stats=True, interpret=False)
    x = jax.ShapeDtypeStruct((1, plan.seq_len_padded, H, D), jnp.bfloat16)
    rows = jax.ShapeDtypeStruct((1, H, plan.seq_len_padded), jnp.float32)
    fused = plan.config.mosaic_fused_dq

    def lower(kernel, *args):
        return jax.jit(lambda *a: kernel(plan, *a)).trace(*args).lower(
            lowering_platforms=("cuda",))

    # delta from the dQ kernel's own O and dO tiles where ``delta_fits`` says its shared
    # memory holds O's tile too; where it says not, the kernel would not compile
    def dq_own_delta(plan, *a):
        return dq_call_mosaic(plan, *a[:5], out=a[5])

    if delta_fits(plan, jnp.bfloat16):
        assert "mosaic_gpu" in lower(dq_own_delta, x, x, x, x, rows, x).as_text()
    else:
        with pytest.raises(ValueError, match="exceeds available shared memory"):
            lower(dq_own_delta, x, x, x, x, rows, x)
    for kernel, args in [(forward_call_mosaic, (x, x, x)),
                         (dq_call_mosaic, (x, x, x, x, rows, rows)),
                         (functools.partial(dkdv_call_mosaic, fused_dq=fused),
                          (x, x, x, x, rows, rows))]:
        text = lower(kernel, *args).as_text()
        assert "mosaic_gpu" in text, kernel
        if fused and getattr(kernel, "func", None) is dkdv_call_mosaic:  # dk, dv, dQ acc.
            assert text.count("output_operand_alias<") == 3


@pytest.mark.parametrize("D", [64, 128])
def test_mosaic_dkdv_sums_gqa_groups_in_the_kernel(D):
    """With GQA the Hopper dK/dV kernel walks each kv head's query heads in one program (run
    V): the same gradients as one program per query head summed by XLA afterwards (run U's
    way), in Pallas' GPU interpreter, for a group that mixes global and local heads; and the
    kernel lowers for an H100 on the CPU."""
    from ls_jax.kernels.pallas_gpu.backward_mosaic import dkdv_call_mosaic
    from ls_jax.kernels.pallas_gpu.plan import make_plan

    B, T, Hq, Hkv, windows = 1, 256, 4, 2, (None, 20, 130, 7)
    q, k, v, do = random_inputs(np.random.default_rng(11), B, T, Hq, Hkv, D, jnp.bfloat16)
    rng = np.random.default_rng(12)
    lse2 = jnp.asarray(rng.uniform(4.0, 6.0, (B, Hq, T)), jnp.float32)
    delta = jnp.asarray(rng.standard_normal((B, Hq, T)) * 0.1, jnp.float32)

    def plan(interpret):
        return make_plan(seq_len=T, head_dim=D, windows=windows, num_kv_heads=Hkv,
                         dtype=jnp.bfloat16, scale=D ** -0.5,
                         config=mosaic_config(lowering="mosaic", bwd="mosaic"),
                         logit_stats=False, interpret=interpret)

    args = (q, k, v, do, lse2, delta)
    summed = dkdv_call_mosaic(plan(True), *args)
    per_head = dkdv_call_mosaic(plan(True), *args, sum_groups=False)
    for name, got, want in zip(("dk", "dv"), summed, per_head):
        assert got.shape == (B, T, Hkv, D), name
        assert rel_err(got, want) < 1e-2, name
        assert float(jnp.abs(want.astype(jnp.float32)).max()) > 0, name
    lowered = jax.jit(lambda *a: dkdv_call_mosaic(plan(False), *a)).trace(*args).lower(
        lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()
    with pytest.raises(ValueError, match="one kv head per query head"):
        dkdv_call_mosaic(plan(True), *args, heads=(0,))


def test_mosaic_dq_without_delta_or_out_is_a_clear_error():
    from ls_jax.kernels.pallas_gpu.backward_mosaic import dq_call_mosaic
    from ls_jax.kernels.pallas_gpu.plan import make_plan

    plan = make_plan(seq_len=128, head_dim=64, windows=(None,), num_kv_heads=1,
                     dtype=jnp.bfloat16, scale=0.125, config=mosaic_config(bwd="mosaic"),
                     logit_stats=False, interpret=True)
    x = jnp.zeros((1, 128, 1, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="expected out .* when delta is None"):
        dq_call_mosaic(plan, x, x, x, x, jnp.zeros((1, 1, 128), jnp.float32))


def test_strip_forward_lowers_for_the_gpu_on_cpu():
    """The strip forward (three consumers, statistics) lowered for an H100 on the CPU, alone
    and writing into an earlier launch's buffers: those come back as aliased operands of the
    kernel's custom call, not copies."""
    from ls_jax.kernels.pallas_gpu.forward_strip import forward_call_strip
    from ls_jax.kernels.pallas_gpu.plan import make_plan

    T, windows = 1024, (None, 128, 50, 256)
    plan = make_plan(seq_len=T, head_dim=64, windows=windows, num_kv_heads=2,
                     dtype=jnp.bfloat16, scale=0.125,
                     config=KernelConfig(fwd_lowering="mixed", local_fwd_lowering="strip"),
                     logit_stats=True, interpret=False)
    x = jax.ShapeDtypeStruct((2, T, 4, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, T, 2, 64), jnp.bfloat16)
    rows = jax.ShapeDtypeStruct((2, 4, T), jnp.float32)
    alone = jax.jit(lambda q, k, v: forward_call_strip(plan, q, k, v, (1, 2, 3)))
    assert "mosaic_gpu" in alone.trace(x, kv, kv).lower(lowering_platforms=("cuda",)).as_text()
    into = jax.jit(lambda q, k, v, *outs: forward_call_strip(plan, q, k, v, (1, 2, 3), outs))
    text = into.trace(x, kv, kv, x, rows, rows).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("output_operand_alias<") == 3, "out, lse and statistics aliased"


MOSAIC_GPU_CASES = [
    # (B, T, Hq, Hkv, D, windows, mosaic tiles)
    (2, 2048, 8, 8, 64, (None,) + (128,) * 7, (64, 64, 2)),
    (1, 3000, 8, 2, 128, (None, 50, 512, 1, None, 128, 3000, 7), (64, 128, 2)),
    (1, 4096, 4, 4, 64, (None,) * 4, (64, 128, 3)),
    (2, 1000, 4, 2, 128, (None, 64, 1, 300), (64, 64, 4)),
    (2, 2048, 8, 4, 64, (None, 128, None, 50, 128, 128, 1, 2048), (64, 128, 2, "mixed")),
    # the Mosaic backward: every head (GQA: per query head, summed), and mixed
    (1, 4096, 4, 4, 64, (None,) * 4, (64, 128, 3, "mosaic", "mosaic")),
    (1, 3000, 8, 2, 128, (None, 50, 512, 1, None, 128, 3000, 7), (64, 128, 2, "mosaic", "mosaic")),
    # 128-row query blocks in the backward (the default at D <= 64): padded T, GQA
    (1, 3000, 8, 2, 64, (None, 50, 512, 1, None, 128, 3000, 7),
     (64, 128, 2, "mosaic", "mosaic", 128)),
    (2, 2048, 8, 8, 128, (None, 128, None, 50, 128, 128, 1, 2048), (64, 128, 2, "mixed", "mixed")),
    # three consumers in the forward (64 and 32 query blocks: the last tile is cut short)
    (1, 4000, 8, 2, 64, (None, 50, 512, 1, None, 128, 4000, 7),
     (64, 128, 2, "mosaic", "mosaic", 128, 3)),
    (2, 2048, 4, 4, 64, (None,) * 4, (64, 128, 2, "mosaic", "mosaic", 128, 3)),
    (1, 4000, 8, 2, 128, (None, 50, 512, 1, None, 128, 4000, 7),
     (64, 128, 2, "mixed", "mixed", 64, 3)),
    (2, 2048, 4, 4, 128, (None,) * 4, (64, 128, 2, "mosaic", "mosaic", 64, 3)),
    # the local heads as strips (forward_strip.py): into the global heads' buffers (strip
    # length from the SM count), and every head local on strips of 5 blocks, padded T
    (2, 2048, 8, 4, 64, (None, 128, None, 50, 128, 256, 1, 2048),
     (64, 128, 2, "mixed", "triton", 128, 3, 0)),
    (1, 3000, 4, 2, 64, (128, 50, 1, 200), (64, 128, 2, "mixed", "mixed", 128, 2, 5)),
    # dQ fused into the dK/dV kernel (TMA reductions): every head on Mosaic with GQA and
    # padded T, mixed, and D=128 (one outgoing tile per consumer)
    (1, 3000, 8, 2, 64, (None, 50, 512, 1, None, 128, 3000, 7),
     (64, 128, 2, "mosaic", "mosaic", 64, 2, None, True)),
    (2, 2048, 8, 8, 64, (None, 128, None, 50, 128, 256, 1, 2048),
     (64, 128, 2, "mixed", "mixed", 64, 3, None, True)),
    (1, 2048, 4, 4, 128, (None, None, 300, None), (64, 128, 2, "mosaic", "mosaic", 64, 2, None,
                                                   True)),
    # three consumers in the backward: every head with GQA and padded T (46 blocks: a last
    # tile of one block), and mixed
    (1, 2900, 8, 2, 64, (None, 50, 512, 1, None, 128, 2900, 7),
     (64, 128, 2, "mosaic", "mosaic", 64, 2, None, False, 3)),
    (2, 2048, 8, 8, 64, (None, 128, None, 50, 128, 256, 1, 2048),
     (64, 128, 2, "mixed", "mixed", 64, 3, None, False, 3)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", MOSAIC_GPU_CASES, ids=mosaic_id)
def test_gpu_mosaic_forward_matches_reference(case):
    B, T, Hq, Hkv, D, windows, tiles = case
    rng = np.random.default_rng(T * 17 + D)
    q, k, v, do = random_inputs(rng, B, T, Hq, Hkv, D, jnp.bfloat16)
    f32 = [x.astype(jnp.float32) for x in (q, k, v, do)]
    config = dataclasses.replace(mosaic_config(*tiles), fwd_block_q=64, fwd_block_k=64,
                                 dq_block_q=64, dq_block_k=32, dkdv_block_q=32, dkdv_block_k=64)
    _poison_device_memory(q.size * 2)
    out, lse, max_abs = jax.jit(lambda q, k, v: pallas_gpu_attention_parts(
        q, k, v, windows, config=config))(q, k, v)
    want_out, want_lse, want_max = reference_attention_parts(*f32[:3], windows)
    assert rel_err(out, want_out) < 1e-2
    assert rel_err(lse, want_lse) < 1e-3
    assert rel_err(max_abs, want_max) < 1e-2

    def ours(q, k, v):
        o = pallas_gpu_attention(q, k, v, windows, config=config)[0]
        return jnp.sum(o.astype(jnp.float32) * f32[3])

    def ref(q, k, v):
        return jnp.sum(reference_attention_parts(q, k, v, windows)[0] * f32[3])

    got = jax.jit(jax.grad(ours, (0, 1, 2)))(q, k, v)
    want = jax.grad(ref, (0, 1, 2))(*f32[:3])
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert rel_err(g, w) < 1e-2, name


def _load_attention_benchmark(monkeypatch):
    """bench/attention.py as a module."""
    import importlib.util
    import pathlib

    folder = pathlib.Path(__file__).resolve().parents[1] / "bench"
    monkeypatch.syspath_prepend(str(folder))  # the script imports its neighbour hardware.py
    spec = importlib.util.spec_from_file_location("bench_attention", folder / "attention.py")
    bench = importlib.util.module_from_spec(spec)
    with warnings.catch_warnings():  # (it sets warning filters as it loads)
        spec.loader.exec_module(bench)
    return bench


def test_benchmark_cfg_overrides_take_ints_strings_and_flags(monkeypatch):
    """bench/attention.py --cfg: digits become ints, true/false bools, the rest strings."""
    bench = _load_attention_benchmark(monkeypatch)
    config = bench.parse_config("mosaic_fused_dq=true,mosaic_bwd_block_q=64,"
                                "local_fwd_lowering=triton", jnp.bfloat16, 64, (None,) * 4, 8192)
    assert config.mosaic_fused_dq is True and config.mosaic_bwd_block_q == 64
    assert config.local_fwd_lowering == "triton"
    assert bench.parse_config("mosaic_fused_dq=False", jnp.bfloat16, 64, (None,) * 4,
                              8192).mosaic_fused_dq is False


def test_benchmark_cut_short_by_sigterm_prints_its_rows(monkeypatch, capsys):
    """A sweep that ``timeout`` ends (SIGTERM) prints the table of the rows it measured and
    exits non-zero (run T lost two commands' rows to their timeouts); the handler is put back."""
    import signal
    import sys

    bench = _load_attention_benchmark(monkeypatch)
    row = {"D": 128, "n": 4096, "p": 512, "mix": "1g15l", "impl": "ours", "fwd_ms": 0.25,
           "fb_ms": 0.75}

    def sweep(args, rows):
        rows.append(row)
        signal.raise_signal(signal.SIGTERM)  # as `timeout` does
        rows.append(dict(row, impl="never measured"))

    monkeypatch.setattr(bench, "run_sweep", sweep)
    monkeypatch.setattr(sys, "argv", ["attention.py"])
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as exit_info:
        bench.main()
    assert exit_info.value.code == 1
    assert signal.getsignal(signal.SIGTERM) is before
    out = capsys.readouterr().out
    assert "| 128 | 4096 | 512 | 1g15l | ours | 0.250 |" in out
    assert "never measured" not in out
    assert "stopped by SIGTERM after 1 rows" in out


def test_benchmark_gqa_inputs_and_floor_bytes(monkeypatch, capsys):
    """bench/attention.py --kv-heads: k and v get the kv heads, the floor counts their bytes
    (by hand: B=1, n=64, D=16 bf16, a q-sized tensor 16 KiB at 8 heads, a kv-sized 4 KiB at 2;
    forward q, o, k, v; the backward adds q, o, do, dq, k, v, dk, dv), and a count that does
    not divide --heads, or GQA with triton_mha, is refused with one line."""
    import sys

    bench = _load_attention_benchmark(monkeypatch)
    sets = bench.make_input_sets(1, 64, 8, 16, jnp.bfloat16, seed=0, kv_heads=2)
    assert [x.shape for x in sets[0]] == [(1, 64, 8, 16), (1, 64, 2, 16), (1, 64, 2, 16),
                                          (1, 64, 8, 16)]
    monkeypatch.setattr(bench, "peaks", lambda kind: (1e30, 1e9))  # memory bound: bytes / 1e9
    ms = 1e3 * 40960 / 1e9  # the forward's bytes: 2 x 16384 + 2 x 4096
    assert bench.floor_pct(ms, 1, 64, 8, 16, (None,) * 8, False, 2) == pytest.approx(100)
    assert bench.floor_pct(ms, 1, 64, 8, 16, (None,) * 8, True, 2) == pytest.approx(300)
    # one kv head per query head: 4 q-sized tensors forward, 12 with the backward
    assert bench.floor_pct(ms, 1, 64, 8, 16, (None,) * 8, True) == pytest.approx(
        100 * 12 * 16384 / 40960)
    refusals = [
        (["--kv-heads", "5"], "--kv-heads: expected 0 or a divisor of --heads (16), got 5"),
        (["--kv-heads", "-4"], "--kv-heads: expected 0 or a divisor of --heads (16), got -4"),
        # the default --impl holds triton_mha, which takes no GQA
        (["--kv-heads", "4"], "--kv-heads: triton_mha takes one kv head per query head"),
    ]
    for flags, message in refusals:
        monkeypatch.setattr(sys, "argv", ["attention.py", "--heads", "16", *flags])
        with pytest.raises(SystemExit) as exit_info:
            bench.main()
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err
