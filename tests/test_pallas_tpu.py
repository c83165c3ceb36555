"""The "pallas_tpu" backend in Pallas interpret mode on CPU (no TPU is lent to this project):
``interpret=True`` (the kernels as XLA loops over their grids) and ``pltpu.InterpretParams``
(the TPU interpreter: simulated memory spaces, DMAs and cores).

Checked against the pure-JAX reference twin (outputs, logsumexp, max |logit|, gradients), against
JAX's splash attention on the same inputs, for data races on two simulated TensorCores, and for
its structural cost (grid steps, DMAs) vs splash, with the counting functions
(``kernels.pallas_tpu.plan.step_counts``, ``bench/splash_cost.py``) checked against
interpreted runs. Shapes are tiny: interpret mode runs
every grid step through Python callbacks.
"""

import collections
import contextlib
import dataclasses
import importlib.util
import itertools
import pathlib
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from ls_jax.kernels import DEFAULT_IMPLEMENTATION, ls_attention
from ls_jax.kernels.api import get_backend
from ls_jax.kernels.pallas_tpu import pallas_tpu_attention_parts, pallas_tpu_backend
from ls_jax.kernels.pallas_tpu.backward import dkdv_call, dq_call
from ls_jax.kernels.pallas_tpu.forward import forward_call
from ls_jax.kernels.pallas_tpu.plan import (
    ACTIVE,
    FIRST,
    LAST,
    MASKED,
    AttentionPlan,
    WorkList,
    column_worklist,
    make_plan,
    row_worklist,
    step_counts,
)
from ls_jax.kernels.reference import allowed_mask


def _bench_module(name: str):
    """A module of bench/ (scripts, not a package: tests load them by path)."""
    path = pathlib.Path(__file__).resolve().parents[1] / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_splash_cost = _bench_module("splash_cost")
splash_mask, splash_step_counts = _splash_cost.splash_mask, _splash_cost.splash_step_counts

from jitted_reference import reference_attention_parts  # tests/, beside this file

# The interpreter's race detector state (a private module, as in JAX's own interpret tests).
from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpreter  # noqa: E402


def seed_of(*case) -> int:
    """A seed that is the same in every process (``hash`` of a str is not)."""
    return zlib.crc32(repr(case).encode())


def rand_qkv(seed, B, T, Hq, Hkv, D, dtype=jnp.float32):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(kq, (B, T, Hq, D), dtype),
            jax.random.normal(kk, (B, T, Hkv, D), dtype),
            jax.random.normal(kv, (B, T, Hkv, D), dtype))


def rand_segments(seed, B, T, num_segments=3):
    ids_BxT = np.random.default_rng(seed).integers(0, num_segments, (B, T))
    return jnp.asarray(np.sort(ids_BxT, axis=1), jnp.int32)


def scalar_loss(parts_fn, D):
    """Weights every output element and lse differently, so every gradient entry matters."""
    w_D = jnp.cos(jnp.arange(D, dtype=jnp.float32))

    def loss(q, k, v):
        out, lse = parts_fn(q, k, v)
        return jnp.sum(out.astype(jnp.float32) * w_D) + 0.3 * jnp.sum(jnp.sin(lse))
    return loss


# ---------------------------------------------------------------------------------------------
# Work lists (host side, no kernel run)

def band_tiles(windows, T, bq, bk):
    """{(head, q_block, k_block): fully_allowed} from the dense mask, by brute force."""
    mask = np.asarray(allowed_mask(T, windows))[0]
    tiles = {}
    for h, i, j in itertools.product(range(len(windows)), range(T // bq), range(T // bk)):
        block = mask[h, i * bq:(i + 1) * bq, j * bk:(j + 1) * bk]
        if block.any():
            tiles[(h, i, j)] = bool(block.all())
    return tiles


def listed_tiles(wl: WorkList):
    active = (wl.flags & ACTIVE) != 0
    return {(int(h), int(i), int(j)): not (f & MASKED)
            for h, i, j, f in zip(wl.head[active], wl.q_block[active], wl.k_block[active],
                                  wl.flags[active])}


@pytest.mark.parametrize("windows,Hkv,T,bq,bk,chunks", [
    ((None, 3, 128, 300, 1, 129), 2, 512, 128, 128, 1),
    ((None, 3, 128, 300, 1, 129), 3, 512, 128, 256, 3),
    ((200, None, 64, 64), 1, 1024, 256, 128, 2),
    ((5,), 1, 384, 128, 128, 7),  # more chunks than runs: clipped to the runs
])
def test_worklists_list_exactly_the_band_tiles(windows, Hkv, T, bq, bk, chunks):
    want = band_tiles(windows, T, bq, bk)
    rows = row_worklist(windows, T, bq, bk, chunks)
    cols = column_worklist(windows, Hkv, T, bq, bk, chunks)
    for wl, run_key in ((rows, lambda h, i, j: (h, i)),
                        (cols, lambda h, i, j: (h // (len(windows) // Hkv), j))):
        assert listed_tiles(wl) == want  # same tiles, MASKED exactly on the band's edge
        assert wl.active_steps == len(want)  # each tile once
        owner = {}
        for c in range(wl.num_chunks):
            active_L = (wl.flags[c] & ACTIVE) != 0
            n = int(active_L.sum())
            assert active_L[:n].all() and not active_L[n:].any()  # padding only at the end
            keys = [run_key(*t) for t in zip(wl.head[c], wl.q_block[c], wl.k_block[c])]
            # padding repeats the chunk's last step: no new block, so no DMA and no write
            assert all(k == keys[n - 1] for k in keys[n:])
            for s in range(n):
                new_run = s == 0 or keys[s] != keys[s - 1]
                ends_run = s == n - 1 or keys[s] != keys[s + 1]
                assert bool(wl.flags[c, s] & FIRST) == new_run
                assert bool(wl.flags[c, s] & LAST) == ends_run
                if new_run:  # a run (one output block) is contiguous and owned by one chunk
                    assert keys[s] not in owner
                    owner[keys[s]] = c
        assert len(owner) == len({run_key(*t) for t in want})
        if wl.num_chunks > 1:  # chunks balanced up to the runs they cannot split
            lengths = [int(((wl.flags[c] & ACTIVE) != 0).sum()) for c in range(wl.num_chunks)]
            longest_run = max(collections.Counter(run_key(*t) for t in want).values())
            assert max(lengths) - min(lengths) <= 2 * longest_run


def test_local_head_key_steps_do_not_grow_with_seq_len():
    """The grid shrinking the issue asks for: per query block a local head runs about
    ceil(p / block) + 1 key steps at any T, a global head one per key block up to the diagonal."""
    p, b = 128, 128
    for T in (1024, 8192):
        wl = row_worklist((None, p), T, b, b)
        active = (wl.flags[0] & ACTIVE) != 0
        per_head = collections.Counter(wl.head[0][active].tolist())
        nq = T // b
        assert per_head[1] == 1 + (nq - 1) * (-(-p // b) + 1)  # block 0 sees only itself
        assert per_head[0] == nq * (nq + 1) // 2


def test_plan_rejects_bad_tunables():
    kwargs = dict(seq_len=256, head_dim=64, windows=(None, 4), num_kv_heads=1, scale=0.1,
                  has_segments=False, logit_stats=False)
    with pytest.raises(ValueError, match=r"block_q: expected a positive multiple of 128.*got 96"):
        make_plan(block_q=96, **kwargs)
    with pytest.raises(ValueError, match=r"block_k: expected a positive multiple of 128.*got 0"):
        make_plan(block_k=0, **kwargs)
    with pytest.raises(ValueError, match=r"num_chunks: expected an int >= 1, got 0"):
        make_plan(num_chunks=0, **kwargs)
    # 512 * 513 / 2 steps of a global head at 8 bytes each: more than the 512 KiB of tables
    big = dict(kwargs, seq_len=65536, windows=(None, 128))
    with pytest.raises(ValueError, match=r"block_q/block_k: the forward/dQ work list .* SMEM"):
        make_plan(block_q=128, block_k=128, **big)
    plan = make_plan(**big)  # default blocks (128 for p=128) double until the tables fit
    assert (plan.block_q, plan.block_k) == (256, 256)
    assert plan.forward_worklist().smem_bytes <= 512 * 1024


# ---------------------------------------------------------------------------------------------
# Numerics against the reference twin (interpret mode)

FWD_CASES = [
    # B, T, Hq, Hkv, D, windows, segments, block_q, block_k
    (2, 256, 4, 2, 64, (None, 5, 130, 1), False, 128, 128),
    (1, 384, 3, 1, 32, (1, None, 200), True, 128, 128),  # MQA, head_dim padded 32 -> 128
    (1, 200, 2, 2, 128, (64, None), True, 256, 128),  # T padded, block_q != block_k
]


@pytest.mark.parametrize("B,T,Hq,Hkv,D,windows,segments,bq,bk", FWD_CASES)
def test_forward_matches_reference(B, T, Hq, Hkv, D, windows, segments, bq, bk):
    seed = seed_of(B, T, Hq, windows)
    q, k, v = rand_qkv(seed, B, T, Hq, Hkv, D)
    seg = rand_segments(seed, B, T) if segments else None
    out, lse, max_abs = jax.jit(lambda q, k, v, seg: pallas_tpu_attention_parts(
        q, k, v, windows, seg, block_q=bq, block_k=bk, interpret=True))(q, k, v, seg)
    want_out, want_lse, want_max = reference_attention_parts(q, k, v, windows, seg)
    np.testing.assert_allclose(out, want_out, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(lse, want_lse, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(max_abs, want_max, rtol=2e-5)


GRAD_CASES = [
    (1, 256, 4, 2, 64, (None, 5, 130, 1), False, 128, 128),
    (2, 200, 3, 1, 32, (17, None, 150), True, 128, 128),
]


@pytest.mark.parametrize("B,T,Hq,Hkv,D,windows,segments,bq,bk", GRAD_CASES)
def test_gradients_match_reference(B, T, Hq, Hkv, D, windows, segments, bq, bk):
    seed = seed_of(B, T, Hq, windows, "grad")
    q, k, v = rand_qkv(seed, B, T, Hq, Hkv, D)
    seg = rand_segments(seed, B, T) if segments else None
    ours = scalar_loss(lambda q, k, v: pallas_tpu_attention_parts(
        q, k, v, windows, seg, block_q=bq, block_k=bk, interpret=True)[:2], D)
    ref = scalar_loss(lambda q, k, v: reference_attention_parts(q, k, v, windows, seg)[:2], D)
    got = jax.jit(jax.grad(ours, argnums=(0, 1, 2)))(q, k, v)
    want = jax.jit(jax.grad(ref, argnums=(0, 1, 2)))(q, k, v)
    for name, g, w in zip("qkv", got, want):
        scale = float(np.max(np.abs(w)))
        np.testing.assert_allclose(g, w, rtol=0, atol=2e-5 * scale, err_msg=f"d{name}")


@pytest.mark.slow
def test_bfloat16_forward_and_gradients_close_to_float32_reference():
    B, T, Hq, Hkv, D, windows = 1, 256, 2, 1, 128, (None, 100)
    q, k, v = rand_qkv(7, B, T, Hq, Hkv, D, jnp.bfloat16)
    out, lse, _ = pallas_tpu_attention_parts(q, k, v, windows, interpret=True)
    assert out.dtype == jnp.bfloat16
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    want_out, want_lse, _ = reference_attention_parts(*f32, windows)
    np.testing.assert_allclose(out.astype(jnp.float32), want_out, atol=3e-2)
    np.testing.assert_allclose(lse, want_lse, atol=3e-2)
    got = jax.grad(scalar_loss(lambda *a: pallas_tpu_attention_parts(
        *a, windows, interpret=True)[:2], D), argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(scalar_loss(lambda *a: reference_attention_parts(*a, windows)[:2], D),
                    argnums=(0, 1, 2))(*f32)
    for name, g, w in zip("qkv", got, want):
        assert g.dtype == jnp.bfloat16
        err = float(jnp.max(jnp.abs(g.astype(jnp.float32) - w)))
        assert err <= 4e-2 * float(jnp.max(jnp.abs(w))), f"d{name}: {err}"


def test_ls_attention_entry_point_selects_the_kernel():
    assert DEFAULT_IMPLEMENTATION["tpu"] == "pallas_tpu"
    assert get_backend("pallas_tpu") is pallas_tpu_backend
    B, T, Hq, Hkv, D, windows = 1, 256, 2, 2, 64, (None, 9)
    q, k, v = rand_qkv(3, B, T, Hq, Hkv, D)
    out, stats = jax.jit(lambda q, k, v: ls_attention(
        q, k, v, windows, implementation="pallas_tpu", interpret=pltpu.InterpretParams(),
        return_logit_stats=True))(q, k, v)
    want_out, _, want_max = reference_attention_parts(q, k, v, windows)
    np.testing.assert_allclose(out, want_out, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(stats.max_abs_logit, want_max, rtol=2e-5)
    out16 = jax.jit(lambda q, k, v: ls_attention(
        q, k, v, windows, implementation="pallas_tpu", interpret=True))(
        *(np.asarray(x, np.float16) for x in (q, k, v)))
    assert out16.dtype == jnp.float16
    np.testing.assert_allclose(out16.astype(jnp.float32), want_out, atol=5e-3)
    if jax.default_backend() != "tpu":
        with pytest.raises(ValueError, match=r"interpret: implementation='pallas_tpu' compiles "
                                             r"for TPU, but the JAX backend is"):
            ls_attention(q, k, v, windows, implementation="pallas_tpu")
    with pytest.raises(ValueError, match=r"interpret: expected a bool or a .*InterpretParams"):
        ls_attention(q, k, v, windows, implementation="pallas_tpu", interpret="yes")


# ---------------------------------------------------------------------------------------------
# Inside other JAX programs: vmap, checkpoint, x64 (the GPU kernel alongside: both must compose)

COMPOSE_WINDOWS = (None, 9, 130)


def _compose_inputs(seed, V=2, B=1, T=256, Hq=3, Hkv=1, D=64, dtype=jnp.float32):
    """q [V, B, T, Hq, D], k and v [B, T, Hkv, D] (shared by the V mapped calls), segment ids
    [V, B, T]."""
    q, _, _ = rand_qkv(seed, V * B, T, Hq, Hkv, D, dtype)
    _, k, v = rand_qkv(seed + 1, B, T, Hq, Hkv, D, dtype)
    seg = jnp.stack([rand_segments(seed + i, B, T) for i in range(V)])
    return q.reshape(V, B, T, Hq, D), k, v, seg


def _attention(implementation, windows=COMPOSE_WINDOWS, interpret=True):
    def f(q, k, v, seg):
        return ls_attention(q, k, v, windows, segment_ids=seg, implementation=implementation,
                            interpret=interpret)
    return f


def _reference(windows=COMPOSE_WINDOWS):
    return lambda q, k, v, seg: reference_attention_parts(q, k, v, windows, seg)[0]


def _output_and_grads(f, q, k, v, seg):
    """f's output and the gradients in q, k, v of a weighted sum of it, from one jitted
    forward pass."""
    w_D = jnp.cos(jnp.arange(q.shape[-1], dtype=jnp.float32))

    def run(q, k, v):
        out, pullback = jax.vjp(lambda q, k, v: f(q, k, v, seg), q, k, v)
        return out, pullback(jnp.broadcast_to(w_D, out.shape).astype(out.dtype))
    return jax.jit(run)(q, k, v)


def _assert_close_to(got, want, atol=2e-5):
    (out, grads), (want_out, want_grads) = got, want
    np.testing.assert_allclose(np.asarray(out, np.float32), want_out, rtol=0, atol=atol)
    for name, g, w in zip("qkv", grads, want_grads):
        scale = float(np.max(np.abs(w)))
        np.testing.assert_allclose(np.asarray(g, np.float32), w, rtol=0, atol=atol * scale,
                                   err_msg=f"d{name}")


@pytest.mark.parametrize("implementation", ["pallas_tpu", "pallas_gpu"])
def test_vmap_matches_the_reference(implementation):
    """A mapped axis over q and the segment ids, k and v shared (not mapped): output and
    gradients."""
    q, k, v, seg = _compose_inputs(seed_of("vmap", implementation))
    in_axes = (0, None, None, 0)
    got = _output_and_grads(jax.vmap(_attention(implementation), in_axes=in_axes), q, k, v, seg)
    want = _output_and_grads(jax.vmap(_reference(), in_axes=in_axes), q, k, v, seg)
    _assert_close_to(got, want)


@pytest.mark.parametrize("implementation", ["pallas_tpu", "pallas_gpu"])
def test_checkpoint_matches_the_reference(implementation):
    q, k, v, seg = _compose_inputs(seed_of("remat", implementation), V=1)
    q, seg = q[0], seg[0]
    got = _output_and_grads(jax.checkpoint(_attention(implementation)), q, k, v, seg)
    _assert_close_to(got, _output_and_grads(_reference(), q, k, v, seg))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_runs_with_x64_enabled(dtype):
    """``jax_enable_x64`` on: the kernels' index arithmetic stays int32; the output and the
    gradients keep q's dtype."""
    with jax.enable_x64(True):
        q, k, v, seg = _compose_inputs(seed_of("x64", str(dtype)), V=1, dtype=dtype)
        q, seg = q[0], seg[0]
        out, grads = _output_and_grads(_attention("pallas_tpu"), q, k, v, seg)
        assert [x.dtype for x in (out, *grads)] == [dtype] * 4
        f32 = [x.astype(jnp.float32) for x in (q, k, v)]
        _assert_close_to((out, grads), _output_and_grads(_reference(), *f32, seg),
                         atol=2e-5 if dtype == jnp.float32 else 4e-2)


# ---------------------------------------------------------------------------------------------
# Races on two simulated TensorCores

def _kernel_operands(plan: AttentionPlan, B, seed):
    ks = jax.random.split(jax.random.key(seed), 4)
    shape_q = (B, plan.num_q_heads, plan.seq_len_padded, plan.head_dim_padded)
    shape_k = (B, plan.num_kv_heads, plan.seq_len_padded, plan.head_dim_padded)
    return (jax.random.normal(ks[0], shape_q), jax.random.normal(ks[1], shape_k),
            jax.random.normal(ks[2], shape_k), jax.random.normal(ks[3], shape_q))


@pytest.mark.slow
def test_kernels_have_no_races_on_two_cores():
    """Chunks split each work list over the two simulated cores ("parallel" grid axis)."""
    params = pltpu.InterpretParams(detect_races=True, num_cores_or_threads=2)
    plan = make_plan(seq_len=256, head_dim=128, windows=(None, 130, 7, None), num_kv_heads=2,
                     scale=0.1, has_segments=False, logit_stats=True, block_q=128,
                     block_k=128, num_chunks=2, interpret=params)
    assert plan.forward_worklist().num_chunks == 2 and plan.dkdv_worklist().num_chunks == 2
    q, k, v, do = _kernel_operands(plan, 1, 0)
    o, lse, _ = jax.block_until_ready(forward_call(plan, q, k, v))
    assert not tpu_interpreter.races.races_found
    delta = jnp.sum(do * o, axis=-1)[:, :, None, :]
    jax.block_until_ready(dq_call(plan, q, k, v, do, lse, delta))
    assert not tpu_interpreter.races.races_found
    jax.block_until_ready(dkdv_call(plan, q, k, v, do, lse, delta))
    assert not tpu_interpreter.races.races_found


class _RowSplitAcrossChunks(AttentionPlan):
    """A broken plan: one output row's key blocks are split over the two chunks (cores)."""

    def forward_worklist(self):
        good = row_worklist(self.windows, self.seq_len_padded, self.block_q, self.block_k, 1)
        tables = [a[0] for a in (good.head, good.q_block, good.k_block, good.flags)]
        # steps 1, 2 are the two key blocks of head 0, query block 1; cut between them
        flags = tables[3].copy()
        flags[1] |= LAST
        flags[2] |= FIRST
        tables[3] = flags
        halves = [[t[:2], t[2:]] for t in tables]
        length = max(len(h) for h in halves[0])
        padded = []
        for n, (a, b) in enumerate(halves):
            fill = (lambda x: np.concatenate([x, np.zeros(length - len(x), np.int32)])) if n == 3 \
                else (lambda x: np.concatenate([x, np.full(length - len(x), x[-1], np.int32)]))
            padded.append(np.stack([fill(a), fill(b)]))
        return WorkList(*padded)


def test_race_detector_catches_a_row_split_across_cores():
    """The negative control of the race test: the detector does report a real race here."""
    params = pltpu.InterpretParams(detect_races=True, num_cores_or_threads=2)
    good = make_plan(seq_len=256, head_dim=128, windows=(None, 130), num_kv_heads=1,
                     scale=0.1, has_segments=False, logit_stats=False, block_q=128,
                     block_k=128, num_chunks=2, interpret=params)
    broken = _RowSplitAcrossChunks(**{f.name: getattr(good, f.name)
                                      for f in dataclasses.fields(good)})
    q, k, v, _ = _kernel_operands(broken, 1, 1)
    jax.block_until_ready(forward_call(broken, q, k, v))
    assert tpu_interpreter.races.races_found


# ---------------------------------------------------------------------------------------------
# Cross-check against JAX's splash attention (interpret mode, same inputs)

@pytest.mark.slow
@pytest.mark.parametrize("segments", [False, True])
def test_matches_splash_attention(segments):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    T, Hq, Hkv, D, windows = 256, 4, 2, 128, (None, 128, 40, None)
    q, k, v = rand_qkv(11 + segments, 1, T, Hq, Hkv, D)
    q = q / np.sqrt(D)  # splash has no logit scale: pre-scale q, run ours with scale=1
    seg = rand_segments(5, 1, T) if segments else None
    splash_seg = sk.SegmentIds(q=seg[0], kv=seg[0]) if segments else None
    params = pltpu.InterpretParams()
    splash = sk.make_splash_mha(splash_mask(windows, T), head_shards=1, q_seq_shards=1,
                                interpret=params)
    splash_res = sk.make_splash_mha(splash_mask(windows, T), head_shards=1, q_seq_shards=1,
                                    interpret=params, save_residuals=True)
    to_hTd = lambda x: jnp.transpose(x[0], (1, 0, 2))  # noqa: E731  [1, T, H, D] -> [H, T, D]

    s_out, (s_lse,) = splash_res(to_hTd(q), to_hTd(k), to_hTd(v), segment_ids=splash_seg)
    out, lse, _ = pallas_tpu_attention_parts(q, k, v, windows, seg, scale=1.0,
                                             block_q=128, block_k=128, interpret=params)
    np.testing.assert_allclose(to_hTd(out), s_out, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(lse[0], s_lse, rtol=2e-5, atol=2e-5)

    w_D = jnp.cos(jnp.arange(D, dtype=jnp.float32))
    ours = lambda q, k, v: jnp.sum(pallas_tpu_attention_parts(  # noqa: E731
        q, k, v, windows, seg, scale=1.0, block_q=128, block_k=128,
        interpret=params)[0] * w_D)
    theirs = lambda q, k, v: jnp.sum(  # noqa: E731
        splash(to_hTd(q), to_hTd(k), to_hTd(v), segment_ids=splash_seg) * w_D)
    got = jax.grad(ours, argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(theirs, argnums=(0, 1, 2))(q, k, v)
    for name, g, w in zip("qkv", got, want):
        np.testing.assert_allclose(g, w, rtol=0, atol=2e-5 * float(jnp.max(jnp.abs(w))),
                                   err_msg=f"d{name}")


# ---------------------------------------------------------------------------------------------
# Structural cost: grid steps and DMAs, counted vs interpreted

@contextlib.contextmanager
def count_interpreter_runs():
    """Counts grid points and block copies (HBM -> VMEM, by kernel argument name) of TPU
    interpret-mode kernels traced inside. Patches the interpreter's private ``get``: a kernel
    must be traced afresh (pass new InterpretParams) for the patch to be seen."""
    fetched = collections.Counter()
    points = []
    original_get = tpu_interpreter.get

    def counting_get(*args, input_name=None, **kwargs):
        if input_name is None:
            return original_get(*args, **kwargs)
        fetched[input_name] += 1
        return original_get(*args, input_name=input_name, **kwargs)

    def record(token, grid_point, core):
        points.append(tuple(int(x) for x in grid_point))
        return token

    tpu_interpreter.get = counting_get
    try:
        yield pltpu.InterpretParams(grid_point_recorder=record), points, fetched
    finally:
        tpu_interpreter.get = original_get


def test_step_counts_match_interpreted_runs():
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    T, Hq, Hkv, D, windows = 512, 4, 2, 128, (None, 128, 128, 5)
    q, k, v = rand_qkv(2, 1, T, Hq, Hkv, D)
    ours = step_counts(windows, Hkv, T, 128, 128)
    with count_interpreter_runs() as (params, points, fetched):
        jax.block_until_ready(pallas_tpu_attention_parts(
            q, k, v, windows, block_q=128, block_k=128, logit_stats=False, interpret=params))
    assert len(points) == ours["fwd_grid_steps"]
    assert fetched["refs[1]"] == ours["fwd_k_fetches"]  # refs: q, k, v after the tables
    assert ours["fwd_computed_tiles"] == len(band_tiles(windows, T, 128, 128))

    theirs = splash_step_counts(windows, Hkv, T, 128, 128)
    with count_interpreter_runs() as (params, points, fetched):
        splash = sk.make_splash_mha(splash_mask(windows, T), head_shards=1, q_seq_shards=1,
                                    interpret=params)
        jax.block_until_ready(splash(*(jnp.transpose(x[0], (1, 0, 2)) for x in (q, k, v))))
    assert len(points) == theirs["fwd_grid_steps"] == Hq * (T // 128) ** 2  # full key grid
    assert fetched["k_ref"] == theirs["fwd_k_fetches"]
    assert theirs["fwd_computed_tiles"] == ours["fwd_computed_tiles"]


@pytest.mark.slow
def test_target_case_runs_under_a_quarter_of_splash_steps():
    """1 global + 15 local heads, T=8192, p=128, splash's default 128 blocks (issue 4)."""
    windows, T = (None,) + (128,) * 15, 8192
    ours = step_counts(windows, 16, T, 128, 128)
    theirs = splash_step_counts(windows, 16, T, 128, 128)
    assert theirs["fwd_grid_steps"] == 16 * 64 * 64  # mixed heads: no shrinking in splash
    assert ours["fwd_grid_steps"] == 64 * 65 // 2 + 15 * (1 + 63 * 2)
    assert ours["fwd_grid_steps"] * 4 <= theirs["fwd_grid_steps"]
    assert ours["bwd_grid_steps"] * 4 <= theirs["bwd_grid_steps"]
    assert ours["fwd_computed_tiles"] == theirs["fwd_computed_tiles"]
