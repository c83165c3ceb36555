"""The launch decisions (``pallas_gpu/heuristics.py``) and their configs, without running a kernel.

Invariants are checked over a grid of cases (head size, length, batch, mixes of global and
local heads, GQA, windows, dtype, segment ids, GPU): every head covered once in each pass, the
Hopper kernels where they can run and Triton where they cannot, strips (forward and backward)
only where their buffers fit, shared memory and registers within the hardware's limits,
padding to whole blocks. The thresholds are tested by the switch they cause (a case on either
side of the named constant), never restated. Shared memory is counted here from each kernel's
buffers, independently of the heuristics' own counts.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools

import jax.numpy as jnp
import numpy as np
import pytest

from ls_jax.kernels.band import cdiv
from ls_jax.kernels.pallas_gpu import heuristics
from ls_jax.kernels.pallas_gpu.configs import (STRIP_BLOCK, HopperBackwardConfig,
                                               HopperForwardConfig, Launch, Launches,
                                               StripBackwardConfig, StripConfig, TritonConfig)
from ls_jax.kernels.pallas_gpu.heuristics import SMEM_BYTES, SMEM_SPARE, Case, Gpu
from ls_jax.kernels.pallas_gpu.mosaic.backward import dq_smem_bytes
from ls_jax.kernels.pallas_gpu.mosaic.ring import (REGISTERS, STAGES, WARPGROUP_THREADS,
                                                   launch_registers)
from ls_jax.kernels.pallas_gpu.mosaic import strip_backward
from ls_jax.kernels.pallas_gpu.mosaic.strip import strip_stages
from ls_jax.kernels.pallas_gpu.plan import make_plan, padded_head_dim

HEADS = 16
SMEM_USABLE = SMEM_BYTES - SMEM_SPARE
SM_REGISTERS = 65536  # 32-bit registers of one SM (every CUDA GPU since compute capability 5)
HOPPER = Gpu(hopper=True, sms=heuristics.REFERENCE_SMS)
HOPPER_HALF = Gpu(hopper=True, sms=heuristics.REFERENCE_SMS // 2)
OTHER_GPU = Gpu(hopper=False, sms=108)


# ---------------------------------------------------------------------------------------------
# The kernels' shared memory and live registers, counted from their buffers and tiles.

def forward_smem(config: HopperForwardConfig, head_dim: int, itemsize: int) -> int:
    """The Hopper forward's buffers with the logit statistics: a query tile per consumer, the
    key and value rings, lse and statistics rows per consumer."""
    tiles = config.consumers * config.block_q + 2 * STAGES * config.block_k
    return tiles * head_dim * itemsize + 2 * config.consumers * config.block_q * 4


def dq_smem(config: HopperBackwardConfig, head_dim: int, itemsize: int) -> int:
    """The dQ kernel's buffers: Q, dO (and O, for delta) tiles per consumer, the key and value
    rings, lse and delta rows per consumer (and a placeholder row where delta comes in)."""
    c, bq = config.consumers, config.block_q
    tiles = (3 if config.dq_delta else 2) * c * bq + 2 * STAGES * config.dq_block_k
    return tiles * head_dim * itemsize + (2 if config.dq_delta else 3) * c * bq * 4


def dkdv_smem(config: HopperBackwardConfig, head_dim: int, itemsize: int) -> int:
    """The dK/dV kernel's buffers: K and V tiles per consumer, Q and dO rings, lse and delta
    rows per ring slot."""
    tiles = 2 * config.consumers * config.block_k + 2 * STAGES * config.block_q
    return tiles * head_dim * itemsize + 2 * STAGES * config.block_q * 4


def strip_smem(window: int, head_dim: int, itemsize: int, consumers: int) -> int:
    """The strip forward's buffers: two query slots and an output tile per consumer, the key and
    value rings (``strip_stages`` slots), lse and statistics rows per consumer."""
    tiles = 3 * consumers + 2 * strip_stages(window, consumers)
    return tiles * STRIP_BLOCK * head_dim * itemsize + 2 * consumers * STRIP_BLOCK * 4


def strip_backward_smem(window: int, head_dim: int, itemsize: int, kv_slots: int = 2,
                        o_slots: int = 0) -> int:
    """The fused strip backward's buffers, two consumers each: K and V
    (``kv_slots`` of each: the current key block's and with two the next one's), a ring of Q
    and dO tiles with lse and delta rows (as many slots as query blocks meet one key block), a
    dS staging tile, float32 dQ tiles (one fewer than the ring's slots, at least one) and
    ``o_slots`` O tiles (with none, each O tile takes half a dQ tile)."""
    tile = STRIP_BLOCK * head_dim * itemsize
    slots = (STRIP_BLOCK - 1 + window - 1) // STRIP_BLOCK + 1  # the key block's last key's band
    per_consumer = (2 * kv_slots * tile + slots * (2 * tile + 2 * STRIP_BLOCK * 4) + tile
                    + max(slots - 1, 1) * STRIP_BLOCK * head_dim * 4 + o_slots * tile)
    return 2 * per_consumer


def live_f32_registers(launch: Launch, head_dim: int) -> int:
    """Registers per thread that one consumer warpgroup's float32 accumulators and score tiles
    take while live (a lower bound of what it needs: no spill needs at least this many)."""
    config = launch.config
    if isinstance(config, HopperForwardConfig):  # acc [bq, D], s [bq, bk]
        elements = config.block_q * (head_dim + config.block_k)
    elif isinstance(config, StripConfig):  # s over the whole band in one pass
        band = heuristics.ONE_PASS_MAX_BLOCKS if config.one_pass else 1
        elements = STRIP_BLOCK * (head_dim + band * STRIP_BLOCK)
    else:  # dQ: acc [bq, D], s and dp [bq, dq_bk]; dK/dV: dk, dv [bk, D], s^T, dp^T [bk, bq]
        elements = max(config.block_q * (head_dim + 2 * config.dq_block_k),
                       2 * config.block_k * (head_dim + config.block_q))
    return cdiv(elements, WARPGROUP_THREADS)


def triton_smem(config: TritonConfig, head_dim: int, itemsize: int) -> dict[str, int]:
    """Each Triton kernel's pipelined buffers: its own tiles (the forward's query tile; dQ's Q
    and dO tiles; dK/dV's K and V tiles) and ``num_stages`` of each streamed pair (K and V;
    K and V; Q and dO)."""
    stages = config.num_stages
    rows = {"forward": config.block_q + 2 * stages * config.block_k,
            "dq": 2 * config.dq_block_q + 2 * stages * config.dq_block_k,
            "dkdv": 2 * config.dkdv_block_k + 2 * stages * config.dkdv_block_q}
    return {name: n * head_dim * itemsize for name, n in rows.items()}


# ---------------------------------------------------------------------------------------------
# The grid

def mix_windows(mix: str, window) -> tuple:
    """16 heads: "all-global", "<g>g" (g global heads first, the rest local) or "all-local";
    window an int, or a pair that alternates over the local heads."""
    pair = window if isinstance(window, tuple) else (window, window)
    local = tuple(pair[h % 2] for h in range(HEADS))
    if mix == "all-global":
        return (None,) * HEADS
    if mix == "all-local":
        return local
    g = int(mix[:-1])
    return (None,) * g + local[g:]


PLATFORMS = {  # name: (dtype, has_segments, gpu)
    "bf16": (jnp.bfloat16, False, HOPPER),
    "fp16": (jnp.float16, False, HOPPER),
    "bf16-fewer-sms": (jnp.bfloat16, False, HOPPER_HALF),
    "fp32": (jnp.float32, False, HOPPER),
    "bf16-segments": (jnp.bfloat16, True, HOPPER),
    "bf16-not-hopper": (jnp.bfloat16, False, OTHER_GPU),
    "fp32-not-hopper": (jnp.float32, False, OTHER_GPU),
}
HEAD_DIMS = (32, 64, 96, 128, 256)
SEQ_LENS = (1000, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
BATCHES = (1, 2, 4, 8)
MIXES = ("all-global", "1g", "2g", "3g", "4g", "all-local")
WINDOWS = (50, 128, 256, 512, (50, 256), (128, 512))
KV_HEADS = (16, 4, 2, 1)


def make_case(platform: str, D: int, T: int, B: int, mix: str, window, kv: int) -> Case:
    dtype, segments, gpu = PLATFORMS[platform]
    return Case(dtype=dtype, head_dim=padded_head_dim(D), windows=mix_windows(mix, window),
                seq_len=T, batch=B, num_kv_heads=kv, has_segments=segments, gpu=gpu)


def describe(case: Case) -> str:
    w = sorted({x for x in case.windows if x is not None and x < case.seq_len})
    return (f"{jnp.dtype(case.dtype).name} D={case.head_dim} T={case.seq_len} B={case.batch} "
            f"{len(case.global_heads())}g{len(case.local_heads())}l w={w} "
            f"kv={case.num_kv_heads} seg={case.has_segments} {case.gpu}")


@functools.lru_cache(maxsize=1)
def grid() -> tuple[tuple[Case, Launches], ...]:
    """Every (D, T, mix, window) on 16-bit inputs on Hopper (batch and kv heads drawn), and a
    seeded sample of the whole product (every platform), each with its launches."""
    rng = np.random.default_rng(34)
    cases = []
    for D, T, mix, window in itertools.product(HEAD_DIMS, SEQ_LENS, MIXES, WINDOWS):
        if mix == "all-global" and window != WINDOWS[0]:
            continue
        cases.append(make_case(str(rng.choice(["bf16", "fp16"])), D, T,
                               int(rng.choice(BATCHES)), mix, window,
                               int(rng.choice(KV_HEADS))))
    axes = (tuple(PLATFORMS), HEAD_DIMS, SEQ_LENS, BATCHES, MIXES, WINDOWS, KV_HEADS)
    for _ in range(500):
        cases.append(make_case(*(axis[rng.integers(len(axis))] for axis in axes)))
    return tuple((case, heuristics.launches(case)) for case in cases)


def hopper_capable(case: Case) -> bool:
    """What the Mosaic GPU kernels need: a Hopper GPU, 16-bit inputs (wgmma), a padded head
    size of whole 128-byte rows up to ``HOPPER_MAX_HEAD_DIM``, no segment ids."""
    return (case.gpu.hopper and jnp.dtype(case.dtype) in (jnp.bfloat16, jnp.float16)
            and case.head_dim % 64 == 0 and case.head_dim <= heuristics.HOPPER_MAX_HEAD_DIM
            and not case.has_segments)


def lowering_of(launches: tuple[Launch, ...], head: int) -> Launch:
    (launch,) = [l for l in launches if head in l.heads]
    return launch


def all_launches(launches: Launches):
    return [("forward", l) for l in launches.forward] + [("backward", l)
                                                         for l in launches.backward]


def test_grid_reaches_every_lowering_and_config():
    """The grid is not vacuous: it holds strips, both consumer counts in both passes, delta in
    and out of the dQ kernel, split and whole passes."""
    seen = collections.Counter()
    for case, launches in grid():
        for name, launch in all_launches(launches):
            seen[name, launch.lowering] += 1
            if hasattr(launch.config, "consumers"):
                seen[name, launch.lowering, launch.config.consumers] += 1
            if isinstance(launch.config, HopperBackwardConfig):
                seen["dq_delta", launch.config.dq_delta] += 1
        seen["split forward" if len(launches.forward) > 1 else "one forward"] += 1
        seen["split backward" if len(launches.backward) > 1 else "one backward"] += 1
    for key in [("forward", "triton"), ("forward", "hopper", 2), ("forward", "hopper", 3),
                ("forward", "strip", 3), ("backward", "strip"), ("backward", "triton"),
                ("backward", "hopper", 2),
                ("backward", "hopper", 3), ("dq_delta", True), ("dq_delta", False),
                "split forward", "one forward", "split backward", "one backward"]:
        assert seen[key] > 0, key


# ---------------------------------------------------------------------------------------------
# Invariants over the grid

def test_every_head_once_in_each_pass():
    for case, launches in grid():
        assert (launches.num_heads, launches.num_kv_heads) == (HEADS, case.num_kv_heads)
        for name in ("forward", "backward"):
            heads = [h for launch in getattr(launches, name) for h in launch.heads]
            assert sorted(heads) == list(range(HEADS)), (name, describe(case))
        split = len(launches.backward) > 1 or launches.backward[0].lowering == "strip"
        if split:  # dK/dV sums a GQA group in one kernel
            assert case.num_kv_heads == HEADS, describe(case)


def test_hopper_kernels_take_the_global_heads_where_they_run():
    """Where the Mosaic GPU kernels can run, the global heads run on them in the forward, and
    in the backward but for the documented exception: an LS mix at D <= 64 that is short
    (below ``SPLIT_MIX_BACKWARD_MIN_SEQ_LEN``) or GQA with groups wider than
    ``GQA_MIX_HOPPER_BACKWARD_MAX_GROUP`` (a split backward needs one kv head per query head)
    runs its whole backward on Triton, unless its local windows are all wide
    (``WIDE_LOCAL_HOPPER_MIN_WINDOW``: every head on the Hopper backward)."""
    for case, launches in grid():
        if not hopper_capable(case):
            continue
        glob, local = case.global_heads(), case.local_heads()
        for h in glob:
            assert lowering_of(launches.forward, h).lowering == "hopper", describe(case)
        short = case.seq_len < heuristics.SPLIT_MIX_BACKWARD_MIN_SEQ_LEN
        wide = bool(local) and min(case.windows[h] for h in local) >= (
            heuristics.WIDE_LOCAL_HOPPER_MIN_WINDOW)
        wide_groups = HEADS // case.num_kv_heads > heuristics.GQA_MIX_HOPPER_BACKWARD_MAX_GROUP
        whole_triton = bool(local) and case.head_dim <= 64 and (
            short or wide_groups) and not (wide and not short)
        if whole_triton and glob:
            assert [l.lowering for l in launches.backward] == ["triton"], describe(case)
        else:
            for h in glob:
                assert lowering_of(launches.backward, h).lowering == "hopper", describe(case)
        if not local:  # every head global: one Hopper launch a pass
            assert [l.lowering for l in launches.forward] == ["hopper"], describe(case)
            assert [l.lowering for l in launches.backward] == ["hopper"], describe(case)


def test_triton_only_where_the_hopper_kernels_cannot_run():
    """Not Hopper, float32, a head size not a multiple of 64 (D=32), or segment ids: every
    launch of both passes is a Triton one."""
    count = 0
    for case, launches in grid():
        if hopper_capable(case):
            continue
        count += 1
        assert {l.lowering for _, l in all_launches(launches)} == {"triton"}, describe(case)
    assert count > 100


def test_strips_only_for_d64_local_heads_whose_ring_fits():
    for case, launches in grid():
        for launch in launches.forward:
            if launch.lowering != "strip":
                continue
            assert hopper_capable(case) and case.head_dim == 64, describe(case)
            assert set(launch.heads) <= set(case.local_heads()), describe(case)
            assert case.seq_len >= heuristics.STRIP_MIN_SEQ_LEN, describe(case)
            widest = max(case.windows[h] for h in launch.heads)
            itemsize = jnp.dtype(case.dtype).itemsize
            assert strip_smem(widest, case.head_dim, itemsize,
                              launch.config.consumers) <= SMEM_USABLE, describe(case)


def test_strip_backward_only_for_d64_local_heads_whose_buffers_fit():
    """The local heads' backward runs as fused strips exactly where the Hopper kernels run, at
    D=64, from ``SPLIT_MIX_BACKWARD_MIN_SEQ_LEN``, with one kv head per query head, and where
    the buffers for the widest local window with two K/V slots fit shared memory, or with one
    for heads of one window of at least two blocks; the global heads then run on the Hopper
    backward before it. The O tiles have two of their own where they fit beside those."""
    count = {1: 0, 2: 0}
    for case, launches in grid():
        local = case.local_heads()
        itemsize = jnp.dtype(case.dtype).itemsize
        windows = {case.windows[h] for h in local}
        fits = {n: bool(local) and strip_backward_smem(max(windows), 64, itemsize, n)
                <= SMEM_USABLE for n in (1, 2)}
        want = (hopper_capable(case) and case.head_dim == 64 and bool(local)
                and case.seq_len >= heuristics.SPLIT_MIX_BACKWARD_MIN_SEQ_LEN
                and case.num_kv_heads == HEADS
                and (fits[2] or (fits[1] and len(windows) == 1
                                 and min(windows) >= 2 * STRIP_BLOCK)))
        strips = [l for l in launches.backward if l.lowering == "strip"]
        assert bool(strips) == want, describe(case)
        if strips:
            kv_slots = 2 if fits[2] else 1
            assert strips[0].config.kv_slots == kv_slots, describe(case)
            own_o = strip_backward_smem(max(windows), 64, itemsize, kv_slots, 2) <= SMEM_USABLE
            assert strips[0].config.o_slots == (2 if own_o else 0), describe(case)
            count[strips[0].config.kv_slots] += 1
            assert strips[0].heads == local and launches.backward[-1] is strips[0]
            if case.global_heads():
                assert lowerings(launches.backward)[0] == ("hopper", case.global_heads())
    assert count[1] > 0 and count[2] > 0


@pytest.mark.parametrize("o_slots", [0, 2])
@pytest.mark.parametrize("kv_slots", [1, 2])
def test_strip_backward_smem_bytes_counts_its_buffers(kv_slots, o_slots):
    """``strip_backward.smem_bytes`` (what ``strip_backward_fits`` decides by) is the kernel's
    buffers as counted here, for windows 1 to 300."""
    for window in range(1, 300):
        assert (strip_backward.smem_bytes(window, 64, 2, kv_slots, o_slots)
                == strip_backward_smem(window, 64, 2, kv_slots, o_slots)), window


@pytest.mark.parametrize("window,want", [
    pytest.param(1, ("strip", 2), id="one-key"), pytest.param(65, ("strip", 2), id="65-two-slots"),
    pytest.param(66, ("triton", None), id="66-every-block-masked"),
    pytest.param(127, ("triton", None), id="127-every-block-masked"),
    pytest.param(128, ("strip", 1), id="128-one-slot-middle-block-unmasked"),
    pytest.param(129, ("strip", 1), id="129-one-slot-middle-block-unmasked"),
    pytest.param(130, ("triton", None), id="130-no-room"),
    pytest.param((128, 100), ("triton", None), id="two-windows-128-100")])
def test_strip_backward_window_limit(window, want):
    """Windows up to 65 (two query blocks meet a key block) take the fused strip backward with
    two K/V slots; heads of one window of 128 or 129 take it with one (the band's middle block
    needs no mask); other windows the Triton kernels."""
    launches = heuristics.launches(make_case("bf16", 64, 8192, 4, "1g", window, HEADS))
    local = launches.backward[-1]
    assert [l.lowering for l in launches.backward] == ["hopper", want[0]]
    assert (local.config.kv_slots if local.lowering == "strip" else None) == want[1]


def test_strip_backward_fills_at_most_one_wave():
    """A strip backward launch (two consumers a program, each on one sub-strip, over the rows
    in turn) has at most one program per SM unless each (head, batch element) row is one
    sub-strip already."""
    for case, launches in grid():
        for launch in launches.backward:
            if launch.lowering != "strip":
                continue
            subs = cdiv(cdiv(case.seq_len, STRIP_BLOCK), launch.config.sub_blocks)
            if subs > 1:
                programs = cdiv(case.batch * len(launch.heads) * subs, 2)
                assert programs <= case.gpu.sms, describe(case)


def test_hopper_shared_memory_fits():
    """Every Hopper launch's buffers fit one program's shared memory with the lowering's spare
    left; delta is computed in the dQ kernel exactly where O's tile fits too."""
    for case, launches in grid():
        itemsize = jnp.dtype(case.dtype).itemsize
        D = case.head_dim
        for name, launch in all_launches(launches):
            config = launch.config
            if isinstance(config, HopperForwardConfig):
                assert forward_smem(config, D, itemsize) <= SMEM_USABLE, describe(case)
            if isinstance(config, HopperBackwardConfig):
                assert dq_smem(config, D, itemsize) <= SMEM_USABLE, describe(case)
                assert dkdv_smem(config, D, itemsize) <= SMEM_USABLE, describe(case)
                with_delta = dataclasses.replace(config, dq_delta=True)
                fits = dq_smem(with_delta, D, itemsize) <= SMEM_USABLE
                assert config.dq_delta == fits, describe(case)
                if config.dq_delta:
                    assert dq_smem_bytes(config, D, itemsize) <= SMEM_USABLE, describe(case)


def test_dq_smem_bytes_counts_the_dq_kernels_buffers():
    """``dq_smem_bytes`` (what ``delta_fits`` decides by) counts the dQ kernel's tiles and rows
    (all but the placeholder row where delta comes in, which the spare covers)."""
    for consumers, block_q, dq_block_k, dq_delta, head_dim in itertools.product(
            (2, 3), (64, 128), (64, 128), (False, True), (64, 128, 256)):
        config = HopperBackwardConfig(block_q=block_q, dq_block_k=dq_block_k,
                                      consumers=consumers, dq_delta=dq_delta)
        counted = dq_smem_bytes(config, head_dim, 2)
        exact = dq_smem(config, head_dim, 2)
        slack = consumers * block_q * 4
        assert counted <= exact <= counted + slack <= counted + SMEM_SPARE, config


def test_consumers_fit_their_registers():
    """A consumer's live float32 tiles fit the registers ``set_max_registers`` gives it (else it
    spills); three consumers only at D <= 128 in the forward and D <= 64 in the backward."""
    for case, launches in grid():
        for name, launch in all_launches(launches):
            if not hasattr(launch.config, "consumers"):  # Triton; the strip backward's pairs
                continue
            consumers = launch.config.consumers
            assert consumers in REGISTERS, describe(case)
            budget = REGISTERS[consumers][0]
            assert live_f32_registers(launch, case.head_dim) <= budget, (name, describe(case))
            if consumers == 3:
                assert case.head_dim <= (128 if name == "forward" else 64), describe(case)


@pytest.mark.parametrize("consumers", sorted(REGISTERS))
def test_register_budgets_fit_what_a_program_launches_with(consumers):
    """``set_max_registers`` moves registers between a program's warpgroups and cannot add any:
    the consumers' and the producer's budgets fit the SM's registers and what the program
    starts with; each is a multiple of 8 in [24, 256] (what setmaxnreg takes)."""
    consumer, producer = REGISTERS[consumers]
    warpgroups = consumers + 1
    total = consumers * consumer + producer
    assert total <= SM_REGISTERS // WARPGROUP_THREADS
    assert total <= warpgroups * launch_registers(warpgroups)
    assert warpgroups * launch_registers(warpgroups) * WARPGROUP_THREADS <= SM_REGISTERS
    for budget in (consumer, producer):
        assert budget % 8 == 0 and 24 <= budget <= 256
    assert producer < consumer


def test_strip_backward_consumers_launch_with_every_register_a_thread_may_hold():
    """The strip backward's program is its consumers alone (they issue their own loads): two
    warpgroups, which start with the 255 registers a thread may hold, no budget to move."""
    assert strip_backward.CONSUMERS == 2
    assert launch_registers(strip_backward.CONSUMERS) >= 255


def test_padded_length_is_a_multiple_of_every_block():
    """``make_plan`` pads T to a whole number of every block of every launch (the kernels load
    whole blocks unmasked), by less than the largest block; Triton tiles are cut to the
    sequence, so a short call is not padded to a long tile."""
    for case, launches in grid()[::3]:
        plan = make_plan(seq_len=case.seq_len, head_dim=case.head_dim, windows=case.windows,
                         num_kv_heads=case.num_kv_heads, dtype=case.dtype, scale=0.1,
                         logit_stats=True, interpret=False, batch=case.batch,
                         has_segments=case.has_segments, launches=launches)
        Tp = plan.seq_len_padded
        blocks = []
        for _, launch in all_launches(plan.launches):
            config = launch.config
            if isinstance(config, TritonConfig):
                sizes = [config.block_q, config.block_k, config.dq_block_q, config.dq_block_k,
                         config.dkdv_block_q, config.dkdv_block_k]
                assert max(sizes) < 2 * max(case.seq_len, 16), describe(case)
            elif isinstance(config, (StripConfig, StripBackwardConfig)):
                sizes = [STRIP_BLOCK]
            elif isinstance(config, HopperForwardConfig):
                sizes = [config.block_q, config.block_k]
            else:
                sizes = [config.block_q, config.block_k, config.dq_block_k]
            blocks += sizes
        assert all(Tp % b == 0 for b in blocks), (Tp, blocks, describe(case))
        assert case.seq_len <= Tp < case.seq_len + max(plan.launches.blocks())
        assert all(w == Tp for h, w in enumerate(plan.windows) if h in case.global_heads())
        hash(plan)  # the custom_vjp's static argument


def test_strips_fill_at_most_one_wave():
    """A strip launch has at most one program per SM unless each (head, batch element) row is
    one strip already, or its strips are as long as they may be."""
    count = 0
    for case, launches in grid():
        for launch in launches.forward:
            if launch.lowering != "strip":
                continue
            count += 1
            strip = launch.config.strip_blocks
            rows = case.batch * len(launch.heads)
            per_row = cdiv(cdiv(case.seq_len, STRIP_BLOCK), strip)
            assert 1 <= strip <= heuristics.MAX_STRIP_BLOCKS
            if strip < heuristics.MAX_STRIP_BLOCKS and per_row > 1:
                assert rows * per_row <= case.gpu.sms, describe(case)
    assert count > 0


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("mix", ["all-global", "1g", "4g", "all-local"])
def test_more_work_never_takes_fewer_consumers(D, mix):
    """Consumers (and strip lengths' programs) never drop as the batch or the length grows."""
    def consumers(T, B):
        launches = heuristics.launches(make_case("bf16", D, T, B, mix, 128, HEADS))
        return [l.config.consumers for l in launches.forward + launches.backward
                if l.lowering == "hopper"]

    for T in SEQ_LENS:
        by_batch = [consumers(T, B) for B in BATCHES]
        assert all(a <= b for a, b in zip(by_batch, by_batch[1:])), (T, by_batch)
    for B in (1, 4):
        by_len = [consumers(T, B) for T in SEQ_LENS]
        assert all(a <= b for a, b in zip(by_len, by_len[1:])), (B, by_len)


def test_launches_are_deterministic_and_hashable():
    for case, launches in grid()[::50]:
        again = heuristics.launches(dataclasses.replace(case))
        assert again == launches and hash(again) == hash(launches)


# ---------------------------------------------------------------------------------------------
# Each threshold switches where its constant says

def lowerings(launches: tuple[Launch, ...]) -> list[tuple[str, tuple[int, ...]]]:
    return [(l.lowering, l.heads) for l in launches]


def test_strips_from_strip_min_seq_len():
    """STRIP_MIN_SEQ_LEN: from it the local heads' forward (D=64) runs as strips, below it on
    Triton; the global head stays on the Hopper forward either way."""
    local = tuple(range(1, HEADS))
    for T, want in [(heuristics.STRIP_MIN_SEQ_LEN, "strip"),
                    (heuristics.STRIP_MIN_SEQ_LEN - STRIP_BLOCK, "triton")]:
        launches = heuristics.launches(make_case("bf16", 64, T, 4, "1g", 128, HEADS))
        assert lowerings(launches.forward) == [("hopper", (0,)), (want, local)], T


def test_strip_window_limit_is_the_widest_ring_that_fits():
    """Every local window from 1 runs as strips exactly while the strip ring for it fits shared
    memory; windows up to 256 do (the range tests/test_strip_ring.py replays)."""
    took = {}
    for window in list(range(1, 300, 7)) + [255, 256, 257, 320, 384, 512]:
        launches = heuristics.launches(make_case("bf16", 64, 65536, 1, "all-local", window, 16))
        took[window] = [l.lowering for l in launches.forward] == ["strip"]
        fits = strip_smem(window, 64, 2, heuristics.STRIP_CONSUMERS) <= SMEM_USABLE
        assert took[window] == fits, window
    assert all(took[w] for w in took if w <= 256) and not all(took.values())


@pytest.mark.parametrize("windows,one_pass", [
    pytest.param((128,) * 15, True, id="one-window-three-blocks"),
    pytest.param((1,) * 15, True, id="one-window-one-block"),
    pytest.param((129,) * 15, True, id="one-window-past-two-blocks"),
    pytest.param((192,) * 15, False, id="one-window-four-blocks"),
    pytest.param((128, 64) * 7 + (128,), False, id="two-windows"),
])
def test_one_pass_strips_for_one_window_of_at_most_three_blocks(windows, one_pass):
    """The strips softmax a band in one pass when the local heads share a window whose band
    spans at most ``ONE_PASS_MAX_BLOCKS`` key blocks (a query block's band: 1 + ceil((p - 1) /
    64) blocks)."""
    case = Case(dtype=jnp.bfloat16, head_dim=64, windows=(None,) + windows, seq_len=8192,
                batch=4, num_kv_heads=16, has_segments=False, gpu=HOPPER)
    (strip,) = [l for l in heuristics.launches(case).forward if l.lowering == "strip"]
    assert strip.config.one_pass == one_pass


def _forward_consumers(T, B, windows, D=64):
    case = Case(dtype=jnp.bfloat16, head_dim=D, windows=windows, seq_len=T, batch=B,
                num_kv_heads=len(windows), has_segments=False, gpu=HOPPER)
    (hopper,) = [l for l in heuristics.launches(case).forward if l.lowering == "hopper"]
    return hopper.config


def test_three_forward_consumers_from_enough_programs():
    """THREE_CONSUMER_MIN_PROGRAMS: the global heads' forward takes three consumers from that
    many programs of the three-consumer grid (batch x heads x tiles of 3 x block_q rows), two
    below it; with local heads in the launch (D=128, wide windows) every head's programs count
    against EVERY_HEAD_THREE_CONSUMER_MIN_PROGRAMS."""
    tile = 3 * _forward_consumers(1024, 1, (None,) * HEADS).block_q
    need = heuristics.THREE_CONSUMER_MIN_PROGRAMS
    assert need % HEADS == 0  # (so that T below is a whole number of tiles)
    T = tile * need // HEADS
    assert _forward_consumers(T, 1, (None,) * HEADS).consumers == 3
    assert _forward_consumers(T - tile, 1, (None,) * HEADS).consumers == 2
    # one global head of 16: the local heads' tiles do not count
    assert _forward_consumers(T, 1, (None,) + (128,) * 15).consumers == 2
    assert _forward_consumers(T * HEADS, 1, (None,) + (128,) * 15).consumers == 3

    wide = heuristics.LOCAL_HOPPER_FORWARD_MIN_BLOCKS * 128  # beside a global head
    windows = (None,) + (wide,) * 15
    need = heuristics.EVERY_HEAD_THREE_CONSUMER_MIN_PROGRAMS
    assert need % HEADS == 0
    T = tile * need // HEADS
    assert _forward_consumers(T, 1, windows, D=128).consumers == 3
    assert _forward_consumers(T - tile, 1, windows, D=128).consumers == 2


def test_three_backward_consumers_from_enough_programs():
    """THREE_BWD_CONSUMER_MIN_PROGRAMS: every head global at D=64, the backward takes three
    consumers on 64-row blocks from that many programs of the global heads' dQ grid, two
    below; at D=128 never (their tiles spill)."""
    def config(T, D=64):
        launches = heuristics.launches(make_case("bf16", D, T, 1, "all-global", 128, HEADS))
        (launch,) = launches.backward
        return launch.config

    tile = 3 * 64
    assert heuristics.THREE_BWD_CONSUMER_MIN_PROGRAMS % HEADS == 0
    T = tile * heuristics.THREE_BWD_CONSUMER_MIN_PROGRAMS // HEADS
    assert config(T).consumers == 3 and config(T).block_q == 64
    assert config(T - tile).consumers == 2
    assert config(4 * T, D=128).consumers == 2


@pytest.mark.parametrize("gpu", [HOPPER, HOPPER_HALF], ids=["sms132", "sms66"])
def test_two_backward_consumers_take_128_rows_from_a_program_per_sm(gpu):
    """Two backward consumers (D=64, below THREE_BWD_CONSUMER_MIN_PROGRAMS) take 128-row
    query blocks where the global heads' dQ kernel still has a program per SM with them
    (tiles of 256 rows), 64-row blocks below: a lone global head's batch of few rows."""
    def config(T, batch):
        case = dataclasses.replace(make_case("bf16", 64, T, batch, "1g", 128, HEADS),
                                   gpu=gpu)
        return heuristics.hopper_backward(case)

    tile = 2 * 128
    T = tile * gpu.sms  # one batch row: a program per SM
    assert config(T, 1) == dataclasses.replace(config(T, 1), block_q=128, consumers=2)
    assert config(T - tile, 1).block_q == 64 and config(T - tile, 1).consumers == 2
    assert config(T // 2, 2).block_q == 128


def test_short_d64_mixes_run_one_triton_backward():
    """SPLIT_MIX_BACKWARD_MIN_SEQ_LEN: an LS mix at D=64 below it runs its whole backward on
    Triton; from it, the global heads on the Hopper backward and the local ones on Triton; at
    D=128 every head on the Hopper backward at any length, GQA too."""
    T = heuristics.SPLIT_MIX_BACKWARD_MIN_SEQ_LEN
    every = tuple(range(HEADS))
    short = heuristics.launches(make_case("bf16", 64, T - STRIP_BLOCK, 4, "2g", 128, HEADS))
    assert lowerings(short.backward) == [("triton", every)]
    long = heuristics.launches(make_case("bf16", 64, T, 4, "2g", 100, HEADS))
    assert lowerings(long.backward) == [("hopper", (0, 1)), ("triton", every[2:])]
    for kv in (16, 4):
        for T_ in (T, 4 * T):
            d128 = heuristics.launches(make_case("bf16", 128, T_, 4, "2g", 128, kv))
            assert lowerings(d128.backward) == [("hopper", every)], (kv, T_)


@pytest.mark.parametrize("kv,mix,T,hopper", [
    (4, "2g", 8192, True), (4, "1g", 32768, True), (8, "1g", 8192, True),
    (4, "2g", 8192 - STRIP_BLOCK, False), (2, "1g", 8192, False), (1, "1g", 8192, False),
    (4, "all-local", 8192, False),
], ids=["groups-of-4", "groups-of-4-long", "groups-of-2", "shorter", "groups-of-8", "mqa",
        "no-global-head"])
def test_long_d64_gqa_mixes_take_the_hopper_backward(kv, mix, T, hopper):
    """GQA_MIX_HOPPER_BACKWARD_MAX_GROUP: a GQA mix with global heads (which cannot split)
    runs every head on the Hopper backward from SPLIT_MIX_BACKWARD_MIN_SEQ_LEN with groups up
    to that many query heads; shorter, wider groups or no global head keep Triton's."""
    every = tuple(range(HEADS))
    launches = heuristics.launches(make_case("bf16", 64, T, 4, mix, 128, kv))
    assert lowerings(launches.backward) == [("hopper" if hopper else "triton", every)]


@pytest.mark.parametrize("mix,block_k", [("1g", 128), ("all-local", 64)],
                         ids=["beside-a-global-head", "every-head-local"])
def test_wide_local_windows_share_the_hopper_forward(mix, block_k):
    """LOCAL_HOPPER_FORWARD_MIN_BLOCKS (at D=LOCAL_HOPPER_BACKWARD_HEAD_DIM): local heads whose
    windows all span at least that many of the Hopper forward's key blocks (128 keys beside a
    global head, 64 without) run on it, in one launch with the global heads; one narrower
    window sends the local heads to a Triton launch of their own."""
    D = heuristics.LOCAL_HOPPER_BACKWARD_HEAD_DIM
    wide = heuristics.LOCAL_HOPPER_FORWARD_MIN_BLOCKS * block_k
    every = tuple(range(HEADS))
    for window in (wide, (wide, 2 * wide)):
        launches = heuristics.launches(make_case("bf16", D, 8192, 4, mix, window, HEADS))
        assert lowerings(launches.forward) == [("hopper", every)], window
        assert launches.forward[0].config.block_k == block_k
    launches = heuristics.launches(make_case("bf16", D, 8192, 4, mix, (wide, wide - 1), HEADS))
    glob = (0,) if mix == "1g" else ()
    assert lowerings(launches.forward) == (
        [("hopper", glob)] if glob else []) + [("triton", every[len(glob):])]


@pytest.mark.parametrize("kv", [HEADS, 4], ids=["mha", "gqa"])
@pytest.mark.parametrize("mix", ["1g", "all-local"])
def test_wide_d64_local_windows_run_on_the_hopper_kernels(mix, kv):
    """WIDE_LOCAL_HOPPER_MIN_WINDOW (D=64, from SPLIT_MIX_BACKWARD_MIN_SEQ_LEN): local heads
    whose windows are all at least that wide take the Hopper kernels with every other head,
    GQA too; one narrower window, or a shorter sequence, keeps the narrow bands' launches."""
    wide, T = heuristics.WIDE_LOCAL_HOPPER_MIN_WINDOW, heuristics.SPLIT_MIX_BACKWARD_MIN_SEQ_LEN
    every = tuple(range(HEADS))
    launches = heuristics.launches(make_case("bf16", 64, T, 4, mix, (wide, 2 * wide), kv))
    assert lowerings(launches.backward) == [("hopper", every)]
    assert lowerings(launches.forward) == [("hopper", every)]
    for window, length in (((wide, wide - 1), T), (wide, T - STRIP_BLOCK)):
        launches = heuristics.launches(make_case("bf16", 64, length, 4, mix, window, kv))
        if not (mix == "1g" and kv != HEADS and length >= T):  # a long GQA mix's own rule
            assert ("hopper", every) not in lowerings(launches.backward), (window, length)
        assert [l.lowering for l in launches.forward][-1] == "triton", (window, length)


@pytest.mark.parametrize("D", [64, 128])
def test_hopper_forward_key_blocks_follow_the_narrowest_band(D):
    """WIDE_BLOCK_K with a global head in the launch, or where every local window spans
    LOCAL_HOPPER_FORWARD_MIN_BLOCKS of them; NARROW_BLOCK_K for a narrower band."""
    wide = heuristics.LOCAL_HOPPER_FORWARD_MIN_BLOCKS * heuristics.WIDE_BLOCK_K
    every = tuple(range(HEADS))
    for mix, window, block_k in (("all-local", (wide, 4 * wide), heuristics.WIDE_BLOCK_K),
                                 ("all-local", (wide, wide - 1), heuristics.NARROW_BLOCK_K),
                                 ("1g", wide - 1, heuristics.WIDE_BLOCK_K)):
        case = make_case("bf16", D, 8192, 4, mix, window, HEADS)
        assert heuristics.hopper_forward(case, every).block_k == block_k, (mix, window)


def test_the_padded_head_size_decides():
    """D=96 is computed padded to 128, a whole number of 64-element rows: the Hopper kernels
    take it (the plan decides on the padded size)."""
    plan = make_plan(seq_len=1024, head_dim=96, windows=(None, None), num_kv_heads=2,
                     dtype=jnp.bfloat16, scale=0.1, logit_stats=False, interpret=True, batch=1,
                     has_segments=False)
    assert plan.head_dim_padded == 128
    assert [l.lowering for l in plan.launches.forward + plan.launches.backward] == [
        "hopper", "hopper"]


def test_interpret_mode_plans_for_a_hopper_gpu():
    """So that the CPU tests run the Mosaic kernels in Pallas' GPU interpreter."""
    assert heuristics.current_gpu(interpret=True).hopper


# (device_kind as the card reports it, Hopper?, its SMs per NVIDIA's datasheet or None where
# only the Hopper launches would read it)
@pytest.mark.parametrize("kind,hopper,sms", [
    pytest.param("NVIDIA H100 80GB HBM3", True, 132, id="h100-sxm"),
    pytest.param("NVIDIA H100 PCIe", True, 114, id="h100-pcie"),
    pytest.param("NVIDIA H100 NVL", True, 132, id="h100-nvl"),
    pytest.param("NVIDIA H200", True, 132, id="h200"),
    pytest.param("NVIDIA H800", True, 132, id="h800"),
    pytest.param("NVIDIA GH200 480GB", True, 132, id="gh200"),
    pytest.param("NVIDIA A100-SXM4-80GB", False, None, id="a100-ampere"),
    pytest.param("NVIDIA GeForce RTX 4090", False, None, id="rtx4090-ada"),
    pytest.param("NVIDIA B200", False, None, id="b200-blackwell"),
    pytest.param("Tesla V100-SXM2-16GB", False, None, id="v100-volta"),
    pytest.param("an unknown GPU", False, None, id="unknown"),
])
def test_gpu_of_kind(kind, hopper, sms):
    gpu = heuristics.gpu_of_kind(kind)
    assert gpu.hopper is hopper
    if sms is not None:
        assert gpu.sms == sms


def test_gpu_of_kind_takes_the_sms_the_device_reports():
    """A device that reports its SMs (a MIG slice has fewer) is planned with that count."""
    assert heuristics.gpu_of_kind("NVIDIA H100 80GB HBM3", sms=16) == Gpu(hopper=True, sms=16)


@pytest.mark.parametrize("kind,platform,hopper", [
    pytest.param("NVIDIA H100 80GB HBM3", "gpu", True, id="hopper"),
    pytest.param("NVIDIA H100 80GB HBM3", "cuda", True, id="hopper-named-cuda"),
    pytest.param("NVIDIA A100-SXM4-80GB", "gpu", False, id="ampere"),
])
def test_current_gpu_is_the_abstract_meshs_gpu(kind, platform, hopper):
    """The GPU of the abstract mesh in context (an export's target), not this CPU machine's."""
    import jax

    device = jax.sharding.AbstractDevice(device_kind=kind, num_cores=None, platform=platform)
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
    with jax.sharding.use_abstract_mesh(mesh):
        assert heuristics.current_gpu().hopper is hopper
    assert not heuristics.current_gpu().hopper  # this machine has no GPU


# ---------------------------------------------------------------------------------------------
# Validation at construction: one line naming the field

@pytest.mark.parametrize("make,message", [
    pytest.param(lambda: TritonConfig(block_q=24),
                 "TritonConfig.block_q: expected a power of two >= 16, got 24", id="triton-24"),
    pytest.param(lambda: TritonConfig(dkdv_block_k=8),
                 "TritonConfig.dkdv_block_k: expected a power of two >= 16, got 8",
                 id="triton-8"),
    pytest.param(lambda: TritonConfig(num_warps=2), "TritonConfig.num_warps: expected one of",
                 id="triton-warps"),
    pytest.param(lambda: TritonConfig(num_stages=0), "TritonConfig.num_stages: expected one of",
                 id="triton-stages"),
    pytest.param(lambda: HopperForwardConfig(block_q=32),
                 "HopperForwardConfig.block_q: expected a power of two >= 64, got 32",
                 id="hopper-fwd-block-q"),
    pytest.param(lambda: HopperForwardConfig(consumers=4),
                 "HopperForwardConfig.consumers: expected one of (2, 3), got 4",
                 id="hopper-fwd-consumers"),
    pytest.param(lambda: HopperBackwardConfig(dq_block_k=96),
                 "HopperBackwardConfig.dq_block_k: expected a power of two >= 64, got 96",
                 id="hopper-bwd-dq-block-k"),
    pytest.param(lambda: HopperBackwardConfig(consumers=1),
                 "HopperBackwardConfig.consumers: expected one of (2, 3), got 1",
                 id="hopper-bwd-consumers"),
    pytest.param(lambda: StripConfig(strip_blocks=0),
                 "StripConfig.strip_blocks: expected an int >= 1, got 0", id="strip-blocks"),
    pytest.param(lambda: StripConfig(one_pass=1), "StripConfig.one_pass: expected one of",
                 id="strip-one-pass"),
    pytest.param(lambda: StripConfig(consumers=4), "StripConfig.consumers: expected one of",
                 id="strip-consumers"),
    pytest.param(lambda: Launch("cuda", (0,), TritonConfig()),
                 "Launch.lowering: expected one of ('triton', 'hopper', 'strip'), got 'cuda'",
                 id="launch-lowering"),
    pytest.param(lambda: Launch("triton", (1, 0), TritonConfig()),
                 "Launch.heads: expected distinct head indices in increasing order",
                 id="launch-heads-order"),
    pytest.param(lambda: Launch("triton", (), TritonConfig()),
                 "Launch.heads: expected distinct head indices", id="launch-no-heads"),
    pytest.param(lambda: StripBackwardConfig(sub_blocks=0),
                 "StripBackwardConfig.sub_blocks: expected an int >= 1, got 0",
                 id="strip-backward-sub-blocks"),
    pytest.param(lambda: StripBackwardConfig(kv_slots=3),
                 "StripBackwardConfig.kv_slots: expected one of (1, 2), got 3",
                 id="strip-backward-kv-slots"),
    pytest.param(lambda: StripBackwardConfig(o_slots=3),
                 "StripBackwardConfig.o_slots: expected one of (0, 1, 2), got 3",
                 id="strip-backward-o-slots"),
    pytest.param(lambda: Launch("strip", (0,), HopperForwardConfig()),
                 "Launch.config: expected StripConfig or StripBackwardConfig for lowering "
                 "'strip'", id="launch-config-type"),
])
def test_bad_config_names_the_field(make, message):
    with pytest.raises(ValueError) as error:
        make()
    assert str(error.value).startswith(message)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("make", [
    pytest.param(lambda: TritonConfig(split_loop=1), id="bool-as-int"),
    pytest.param(lambda: TritonConfig(num_warps=4.0), id="int-as-float"),
    pytest.param(lambda: HopperBackwardConfig(dq_delta=0), id="bool-as-zero"),
])
def test_config_fields_take_their_own_type(make):
    """A value equal to a choice but of another type (1 for True, 4.0 for 4) is refused."""
    with pytest.raises(ValueError, match=r"^\w+Config\.\w+: expected one of"):
        make()


TRITON = TritonConfig()
FWD, BWD, STRIP = HopperForwardConfig(), HopperBackwardConfig(), StripConfig()


@pytest.mark.parametrize("make,message", [
    pytest.param(lambda: Launches(forward=(Launch("triton", (0, 1), TRITON),),
                                  backward=(Launch("triton", (0, 1, 2), TRITON),),
                                  num_heads=3, num_kv_heads=3),
                 "Launches.forward: expected every head of 3 exactly once, got [(0, 1)]",
                 id="missing-head"),
    pytest.param(lambda: Launches(forward=(Launch("triton", (0, 1, 2), TRITON),),
                                  backward=(Launch("hopper", (0, 1), BWD),
                                            Launch("triton", (1, 2), TRITON)),
                                  num_heads=3, num_kv_heads=3),
                 "Launches.backward: expected every head of 3 exactly once", id="duplicate-head"),
    pytest.param(lambda: Launches(forward=(Launch("triton", (1,), TRITON),
                                           Launch("hopper", (0,), FWD)),
                                  backward=(Launch("triton", (0, 1), TRITON),),
                                  num_heads=2, num_kv_heads=2),
                 "Launches.forward: a hopper launch must come first", id="hopper-second"),
    pytest.param(lambda: Launches(forward=(Launch("hopper", (0, 1), BWD),),
                                  backward=(Launch("hopper", (0, 1), BWD),),
                                  num_heads=2, num_kv_heads=2),
                 "Launches.forward: expected a HopperForwardConfig", id="backward-config-fwd"),
    pytest.param(lambda: Launches(forward=(Launch("strip", (0, 1), STRIP),),
                                  backward=(Launch("strip", (0, 1), STRIP),),
                                  num_heads=2, num_kv_heads=2),
                 "Launches.backward: expected a StripBackwardConfig, got StripConfig",
                 id="strip-forward-config-backward"),
    pytest.param(lambda: Launches(forward=(Launch("strip", (0, 1), StripBackwardConfig()),),
                                  backward=(Launch("triton", (0, 1), TRITON),),
                                  num_heads=2, num_kv_heads=2),
                 "Launches.forward: expected a StripConfig, got StripBackwardConfig",
                 id="strip-backward-config-forward"),
    pytest.param(lambda: Launches(forward=(Launch("triton", (0, 1), TRITON),),
                                  backward=(Launch("strip", (0, 1), StripBackwardConfig()),),
                                  num_heads=2, num_kv_heads=1),
                 "Launches.backward: the strip lowering needs one kv head per query head, got "
                 "1 kv heads for 2", id="strip-backward-gqa"),
    pytest.param(lambda: Launches(forward=(Launch("triton", (0, 1, 2, 3), TRITON),),
                                  backward=(Launch("hopper", (0, 1), BWD),
                                            Launch("triton", (2, 3), TRITON)),
                                  num_heads=4, num_kv_heads=2),
                 "Launches.backward: several launches need one kv head per query head, got 2 "
                 "kv heads for 4", id="split-backward-gqa"),
])
def test_bad_launches_are_one_clear_line(make, message):
    with pytest.raises(ValueError) as error:
        make()
    assert str(error.value).startswith(message)
    assert "\n" not in str(error.value)


def test_launches_for_another_head_count_are_refused():
    launches = Launches(forward=(Launch("triton", (0, 1, 2), TRITON),),
                        backward=(Launch("triton", (0, 1, 2), TRITON),), num_heads=3,
                        num_kv_heads=3)
    with pytest.raises(ValueError, match=r"^launches: expected launches for 4 query heads and "
                                         r"2 kv heads, got 3 and 3$"):
        make_plan(seq_len=64, head_dim=64, windows=(None,) * 4, num_kv_heads=2,
                  dtype=jnp.bfloat16, scale=0.1, logit_stats=False, interpret=True, batch=1,
                  has_segments=False, launches=launches)


@pytest.mark.parametrize("dtype,has_segments", [
    pytest.param(jnp.bfloat16, True, id="segment-ids"),
    pytest.param(jnp.float32, False, id="float32"),
])
def test_given_launches_the_mosaic_kernels_cannot_run_are_refused(dtype, has_segments):
    """The Mosaic GPU kernels take no segment ids (they would be ignored) and no float32: a
    "hopper" launch given for such a call is one line, not a wrong result."""
    chosen = Launches(forward=(Launch("hopper", (0, 1), FWD),),
                      backward=(Launch("hopper", (0, 1), BWD),), num_heads=2, num_kv_heads=2)
    with pytest.raises(ValueError, match=r"^launches: ") as error:
        make_plan(seq_len=256, head_dim=64, windows=(None, 8), num_kv_heads=2, dtype=dtype,
                  scale=0.1, logit_stats=False, interpret=True, batch=1,
                  has_segments=has_segments, launches=chosen)
    assert "\n" not in str(error.value)


def test_one_pass_strips_over_two_windows_are_refused():
    """A one-pass strip launch assumes one window for its heads: given launches over two are
    one line, not a wrong result."""
    chosen = Launches(forward=(Launch("strip", (0, 1), StripConfig(one_pass=True)),),
                      backward=(Launch("triton", (0, 1), TRITON),), num_heads=2, num_kv_heads=2)
    with pytest.raises(ValueError, match=r"^launches: a strip launch with one_pass=True takes "
                                         r"heads of one window; got windows \[64, 128\] for "
                                         r"heads \[0, 1\]$"):
        make_plan(seq_len=256, head_dim=64, windows=(64, 128), num_kv_heads=2,
                  dtype=jnp.bfloat16, scale=0.1, logit_stats=False, interpret=True, batch=1,
                  has_segments=False, launches=chosen)


@pytest.mark.parametrize("mix", ["all-global", "1g", "4g"])
def test_hopper_launches_fit_at_head_size_256(mix):
    """Shared memory at the largest head size the dispatcher sends to this backend (D=129..256
    pad to 256): whatever Hopper launch is decided fits, and the smallest Hopper backward
    does not (so the Triton kernels take such calls)."""
    assert dkdv_smem(HopperBackwardConfig(), 256, 2) > SMEM_USABLE
    for T in (1024, 8192, 65536):
        case = make_case("bf16", 256, T, 4, mix, 512, HEADS)
        for name, launch in all_launches(heuristics.launches(case)):
            config = launch.config
            if isinstance(config, HopperForwardConfig):
                assert forward_smem(config, 256, 2) <= SMEM_USABLE, (name, T)
            if isinstance(config, HopperBackwardConfig):
                assert dq_smem(config, 256, 2) <= SMEM_USABLE, (name, T)
                assert dkdv_smem(config, 256, 2) <= SMEM_USABLE, (name, T)


@pytest.mark.parametrize("n, block", [(0, 16), (1, 16), (16, 16), (17, 32), (32, 32), (33, 64),
                                      (192, 256), (4096, 4096), (4097, 8192)])
def test_triton_block_is_the_least_power_of_two_from_16(n, block):
    from ls_jax.kernels.pallas_gpu.common import triton_block

    assert triton_block(n) == block


def test_triton_tiles_fit_shared_memory():
    """Every Triton launch's pipelined buffers (``triton_smem``) fit shared memory, at every
    head size of the grid (up to 256)."""
    widest = 0
    for case, launches in grid():
        itemsize = jnp.dtype(case.dtype).itemsize
        for name, launch in all_launches(launches):
            if launch.lowering != "triton":
                continue
            widest = max(widest, case.head_dim)
            for kernel, size in triton_smem(launch.config, case.head_dim, itemsize).items():
                assert size <= SMEM_BYTES, (name, kernel, size, describe(case))
    assert widest == max(HEAD_DIMS)
