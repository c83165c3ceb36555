"""Which launches a Pallas GPU attention call runs: the one place that decides.

Small pure functions from the case (dtype, head size, windows, length, batch, kv heads, the
GPU) to ``configs.Launches``. ``backend.py`` executes what ``launches`` returns and has no
choices of its own. Measurements behind the thresholds: docs/performance.md; the reasons:
docs/kernel-notes.md.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp

from ls_jax.kernels.band import band_blocks, cdiv
from ls_jax.kernels.heads import split_heads
from ls_jax.kernels.pallas_gpu.configs import (STRIP_BLOCK, HopperBackwardConfig,
                                               HopperForwardConfig, Launch, Launches,
                                               StripBackwardConfig, StripConfig, TritonConfig)
from ls_jax.kernels.pallas_gpu.mosaic import strip_backward
from ls_jax.kernels.pallas_gpu.mosaic.backward import dq_smem_bytes
from ls_jax.kernels.pallas_gpu.mosaic.strip import strip_smem_bytes

# The Mosaic GPU lowering's limits (why a call may not take it).
HOPPER_DTYPES = (jnp.bfloat16, jnp.float16)  # wgmma's 16-bit operands
HOPPER_HEAD_DIM_MULTIPLE = 64  # one 128-byte swizzled row of 16-bit elements
HOPPER_MAX_HEAD_DIM = 128  # the query tiles and the two-stage key/value ring fit shared memory
# Shared memory one Mosaic GPU program may take on Hopper (``shared_memory_per_block_optin``),
# and what the lowering adds to our buffers (barriers, alignment), rounded up.
SMEM_BYTES = 232448
SMEM_SPARE = 4096
REFERENCE_SMS = 132  # the SMs of the reference Hopper GPU, which interpret mode plans for

# The Triton kernels' larger tiles (128 rows with every head global; in float32, 64-row dQ and
# 64-key dK/dV tiles) fit shared memory with their pipeline stages up to this head size.
TRITON_LARGE_TILE_MAX_HEAD_DIM = 128
# Three forward consumers make tiles 1.5x longer, so fewer programs: they pay only from this
# many programs of the global heads (about two waves on the reference GPU).
THREE_CONSUMER_MIN_PROGRAMS = 256
# ... and from this many when the local heads share the launch (their programs are short).
EVERY_HEAD_THREE_CONSUMER_MIN_PROGRAMS = 1024
THREE_CONSUMER_MAX_HEAD_DIM = 128  # 160 registers hold a 64-row accumulator up to D=128
# Three backward consumers (64-row blocks) beat two on 128-row blocks from this many programs
# of the global heads' dQ kernel (about four waves), and only where their accumulators fit
# 160 registers. Below a program per SM, 128-row blocks leave SMs idle: 64-row ones double
# the programs.
THREE_BWD_CONSUMER_MIN_PROGRAMS = 512
THREE_BWD_CONSUMER_MAX_HEAD_DIM = 64
# The local heads take the Hopper backward at this head size; at D=64 the Triton kernels'
# 32-row tiles waste less of a narrow band.
LOCAL_HOPPER_BACKWARD_HEAD_DIM = 128
# ... and the Hopper forward where every local window spans at least this many of the
# launch's key blocks (``WIDE_BLOCK_K`` beside a global head, else at least two
# ``NARROW_BLOCK_K``); a narrower band leaves most of its blocks masked.
LOCAL_HOPPER_FORWARD_MIN_BLOCKS = 2
# The Hopper forward's key blocks: 128 keys with a global head or where every local band spans
# ``LOCAL_HOPPER_FORWARD_MIN_BLOCKS`` of them (fewer, wider products), else 64 (a short band
# leaves less of a narrow block masked).
WIDE_BLOCK_K, NARROW_BLOCK_K = 128, 64
# At D=64, from ``SPLIT_MIX_BACKWARD_MIN_SEQ_LEN``, the local heads run on the Hopper kernels
# where every window is at least this wide (a band of four of the forward's 128-key blocks):
# there Triton's small tiles save less masked work than they cost a tile. Forward and
# backward, any mix.
WIDE_LOCAL_HOPPER_MIN_WINDOW = 512
# D <= 64 LS mixes run the global heads on the Hopper backward beside a Triton launch for the
# local heads from this length; below it one Triton launch for every head is faster, from it
# the split keeps pace and gains with length.
SPLIT_MIX_BACKWARD_MIN_SEQ_LEN = 8192
# GQA mixes cannot split (a kv head's dK/dV sums heads of both kinds), so from that length
# every head runs on the Hopper backward, whose global heads gain more than its wide tiles
# lose on the local bands; up to this many query heads a kv head, as a dK/dV program sums its
# group in turn and wider groups leave the launch few programs.
GQA_MIX_HOPPER_BACKWARD_MAX_GROUP = 4
# The local heads' forward as strips (D=64) from this length; shorter calls are launch-bound.
STRIP_MIN_SEQ_LEN = 4096
STRIP_HEAD_DIM = 64  # three strip consumers' registers hold D=64 tiles; D=128 would spill
STRIP_CONSUMERS = 3
MAX_STRIP_BLOCKS = 128  # query blocks per strip
# O tiles of their own in the strip backward, where they fit: the O of a query block then loads
# once the block two before it has made its delta, under at least a key block's steps; in the
# dQ tiles it has only the steps between its tile's last share and its first.
STRIP_O_SLOTS = 2
# A strip consumer softmaxes a band of at most this many key blocks in one pass (heads of one
# window): their float32 score tiles (32 registers each) beside the accumulator fit its 160.
ONE_PASS_MAX_BLOCKS = 3


@dataclasses.dataclass(frozen=True)
class Gpu:
    """What the heuristics need to know of the GPU: Hopper's instructions, and its SMs."""

    hopper: bool
    sms: int


# The Hopper GPUs (compute capability 9.0, what the Mosaic GPU kernels are written for), by the
# model name in their ``device_kind``, and their SMs.
HOPPER_SMS = {
    "h100": 132,  # the SXM and NVL boards
    "h200": 132,  # the same die with more memory
    "h800": 132,  # the same die with less NVLink bandwidth
    "gh200": 132,  # the Grace Hopper superchip's GPU
}
HOPPER_PCIE_SMS = 114  # the PCIe boards of these models enable fewer SMs


def gpu_of_kind(device_kind: str, sms: int | None = None) -> Gpu:
    """The GPU of a ``device_kind`` (as ``jax.devices()[0].device_kind`` gives it): Hopper for
    the models in ``HOPPER_SMS``, with ``sms`` (what the device reports) or else the model's
    count. Any other kind, an unknown one included, is not Hopper: the Triton kernels run on
    every CUDA GPU, the Mosaic GPU ones only on Hopper; its SMs default to ``REFERENCE_SMS``
    (only the Hopper launches use the count)."""
    words = re.split(r"[\s_-]+", device_kind.lower())
    model = next((w for w in words if w in HOPPER_SMS), None)
    if model is None:
        return Gpu(hopper=False, sms=sms or REFERENCE_SMS)
    return Gpu(hopper=True, sms=sms or (HOPPER_PCIE_SMS if "pcie" in words else HOPPER_SMS[model]))


def current_gpu(interpret: bool = False) -> Gpu:
    """The GPU a call is planned for: in interpret mode the reference GPU (so the CPU tests
    run the Hopper launches in Pallas' GPU interpreter); else the GPU of the abstract mesh in
    context (an export names its target GPU so, ``ls_jax/interop/export.py``; ``gpu_of_kind``); else
    JAX's first device, by its compute capability; a machine without a GPU plans for a
    non-Hopper one."""
    if interpret:
        return Gpu(hopper=True, sms=REFERENCE_SMS)
    target = jax.sharding.get_abstract_mesh().abstract_device
    if target is not None and target.platform in ("gpu", "cuda"):
        return gpu_of_kind(target.device_kind, target.num_cores)
    device = jax.devices()[0]
    if device.platform != "gpu":
        return Gpu(hopper=False, sms=REFERENCE_SMS)
    # a real device says what it is: compute capability 9.x is Hopper, whatever its name
    hopper = str(getattr(device, "compute_capability", "")).startswith("9.")
    return Gpu(hopper=hopper, sms=int(getattr(device, "core_count", 0) or REFERENCE_SMS))


@dataclasses.dataclass(frozen=True)
class Case:
    """The static facts of one call that the launches depend on.

    windows: per query head, the window (int >= 1) or None (global); head_dim the padded head
    size the kernels see.
    """

    dtype: jnp.dtype
    head_dim: int
    windows: tuple[int | None, ...]
    seq_len: int
    batch: int
    num_kv_heads: int
    has_segments: bool
    gpu: Gpu
    interpret: bool = False

    @property
    def num_heads(self) -> int:
        return len(self.windows)

    def global_heads(self) -> tuple[int, ...]:
        return split_heads(self.windows, self.seq_len).global_heads

    def local_heads(self) -> tuple[int, ...]:
        return split_heads(self.windows, self.seq_len).local_heads


def mosaic_takes(case: Case) -> bool:
    """Whether the Mosaic GPU kernels can compute the call: 16-bit inputs, head size a
    multiple of 64 up to ``HOPPER_MAX_HEAD_DIM``, no segment ids."""
    return (jnp.dtype(case.dtype) in tuple(map(jnp.dtype, HOPPER_DTYPES))
            and case.head_dim % HOPPER_HEAD_DIM_MULTIPLE == 0
            and case.head_dim <= HOPPER_MAX_HEAD_DIM and not case.has_segments)


def hopper_runs(case: Case) -> bool:
    """Whether the Mosaic GPU kernels run the call: ``mosaic_takes`` it, on a Hopper GPU."""
    return case.gpu.hopper and mosaic_takes(case)


def triton_config(case: Case) -> TritonConfig:
    """The Triton tiles: small ones for narrow bands; with every head global, 128-row forward
    and dQ tiles and 128-key dK/dV tiles, the forward's interior tiles in a loop of their own,
    and 8 warps for D > 64; float32 dots take small tiles and fewer stages. Beyond
    ``TRITON_LARGE_TILE_MAX_HEAD_DIM`` the smaller tiles of each kind."""
    if jnp.dtype(case.dtype) == jnp.float32:
        if case.head_dim > TRITON_LARGE_TILE_MAX_HEAD_DIM:
            return TritonConfig(block_q=64, block_k=32, dq_block_q=32, dkdv_block_k=32,
                                num_stages=2)
        return TritonConfig(block_q=64, block_k=32, num_stages=2)
    if not case.local_heads() and case.head_dim <= TRITON_LARGE_TILE_MAX_HEAD_DIM:
        return TritonConfig(block_q=128, dq_block_q=128, dkdv_block_k=128, split_loop=True,
                            num_warps=8 if case.head_dim > 64 else 4)
    return TritonConfig()


def _head_rows(case: Case, num_heads: int) -> int:
    """(head, batch element) rows of a launch over ``num_heads`` heads; a symbolic batch
    (``jax.export``) counts as its least value, 1, so that a program exported once for every
    batch is planned for the smallest."""
    batch = case.batch if isinstance(case.batch, int) else 1
    return batch * num_heads


def _tile_programs(case: Case, num_heads: int, rows: int) -> int:
    """Programs of a launch over ``num_heads`` heads in tiles of ``rows`` query rows."""
    return _head_rows(case, num_heads) * cdiv(case.seq_len, rows)


def _per_row(case: Case, heads: tuple[int, ...], per_sm: int = 1) -> int:
    """Of the ``per_sm`` workers each SM runs in one wave (programs, or a program's
    warpgroups), how many each (head, batch element) row of a strip launch over ``heads`` may
    take while the launch stays within that wave (at least one)."""
    return max(1, per_sm * case.gpu.sms // max(_head_rows(case, len(heads)), 1))


def hopper_forward(case: Case, heads: tuple[int, ...]) -> HopperForwardConfig:
    """The Hopper forward for ``heads``: three consumers where the launch has programs enough
    (counted over the global heads, or over every head when local heads share it)."""
    block_q = 64
    n_global = len(set(heads) & set(case.global_heads()))
    if len(heads) > n_global:
        programs, needed = _tile_programs(case, len(heads), 3 * block_q), \
            EVERY_HEAD_THREE_CONSUMER_MIN_PROGRAMS
    else:
        programs, needed = _tile_programs(case, n_global, 3 * block_q), \
            THREE_CONSUMER_MIN_PROGRAMS
    three = case.head_dim <= THREE_CONSUMER_MAX_HEAD_DIM and programs >= needed
    return HopperForwardConfig(block_q=block_q, block_k=_forward_block_k(case, heads),
                               consumers=3 if three else 2)


def _forward_block_k(case: Case, heads: tuple[int, ...]) -> int:
    """The Hopper forward's key blocks over ``heads`` (``WIDE_BLOCK_K``, ``NARROW_BLOCK_K``)."""
    wide = bool(set(heads) & set(case.global_heads())) or (
        min(case.windows[h] for h in heads) >= LOCAL_HOPPER_FORWARD_MIN_BLOCKS * WIDE_BLOCK_K)
    return WIDE_BLOCK_K if wide else NARROW_BLOCK_K


def delta_fits(config: HopperBackwardConfig, head_dim: int, itemsize: int) -> bool:
    """Whether the Hopper dQ kernel has the shared memory for O's tile (to compute delta
    itself) with ``SMEM_SPARE`` left."""
    return (dq_smem_bytes(dataclasses.replace(config, dq_delta=True), head_dim, itemsize)
            <= SMEM_BYTES - SMEM_SPARE)


def hopper_backward(case: Case) -> HopperBackwardConfig:
    """The Hopper backward: three consumers on 64-row blocks where the global heads' dQ
    kernel has programs enough and D <= 64; else two, on 128-row query blocks where the dQ
    kernel keeps a program per SM with them and D <= 64 (at D > 64 they spill), else on
    64-row blocks; 128-key dQ blocks at D > 64 with every head global; delta in the dQ
    kernel where it fits."""
    wide = case.head_dim > 64
    n_global = len(case.global_heads())
    three = (case.head_dim <= THREE_BWD_CONSUMER_MAX_HEAD_DIM
             and _tile_programs(case, n_global, 3 * 64) >= THREE_BWD_CONSUMER_MIN_PROGRAMS)
    tall = (not (wide or three) and n_global
            and _tile_programs(case, n_global, 2 * 128) >= case.gpu.sms)
    dq_block_k = 128 if wide and not case.local_heads() else 64
    config = HopperBackwardConfig(block_q=128 if tall else 64, block_k=64,
                                  dq_block_k=dq_block_k, consumers=3 if three else 2)
    itemsize = jnp.dtype(case.dtype).itemsize
    return dataclasses.replace(config, dq_delta=delta_fits(config, case.head_dim, itemsize))


def strip_fits(case: Case, heads: tuple[int, ...]) -> bool:
    """The strip kernel takes these local heads: D=64, and a ring for the widest window that
    fits shared memory with ``SMEM_SPARE`` left (windows up to 256)."""
    widest = max(case.windows[h] for h in heads)
    return (case.head_dim == STRIP_HEAD_DIM and strip_smem_bytes(
        widest, case.head_dim, jnp.dtype(case.dtype).itemsize, STRIP_CONSUMERS)
        <= SMEM_BYTES - SMEM_SPARE)


def strip_config(case: Case, heads: tuple[int, ...]) -> StripConfig:
    """Each (head, batch element) row cut into as many strips as keep the programs within one
    wave of the SMs (at least one strip a row), at most ``MAX_STRIP_BLOCKS`` blocks each: a
    longer strip reads each key/value block fewer times. Heads of one window whose band
    spans at most ``ONE_PASS_MAX_BLOCKS`` key blocks take it in one pass."""
    num_blocks = cdiv(case.seq_len, STRIP_BLOCK)
    strip = max(1, min(MAX_STRIP_BLOCKS, cdiv(num_blocks, _per_row(case, heads))))
    windows = {case.windows[h] for h in heads}
    one_pass = (len(windows) == 1
                and band_blocks(windows.pop(), STRIP_BLOCK) <= ONE_PASS_MAX_BLOCKS)
    return StripConfig(strip_blocks=strip, consumers=STRIP_CONSUMERS, one_pass=one_pass)


def strip_backward_fits(case: Case, heads: tuple[int, ...], kv_slots: int,
                        o_slots: int = 0) -> bool:
    """The fused strip backward with ``kv_slots`` K/V slots and ``o_slots`` O tiles a consumer
    takes these local heads: D=64, and buffers for the widest window that fit shared memory
    with ``SMEM_SPARE`` left. With two K/V slots (the next key block's loads under the current
    one) that is windows up to 65, a band of two query blocks; with one, windows up to 129."""
    widest = max(case.windows[h] for h in heads)
    return (case.head_dim == STRIP_HEAD_DIM and strip_backward.smem_bytes(
        widest, case.head_dim, jnp.dtype(case.dtype).itemsize, kv_slots, o_slots)
        <= SMEM_BYTES - SMEM_SPARE)


def one_slot_strip_backward(case: Case, heads: tuple[int, ...]) -> bool:
    """The fused strip backward with one K/V slot (``strip_backward_fits`` with one) takes
    heads of one window of at least ``2 * STRIP_BLOCK``: each key block's band then holds a
    query block that no mask bound cuts. It waits on each key block's loads; where every
    query block of the band is masked, that costs more than the Triton kernels save."""
    windows = {case.windows[h] for h in heads}
    return (len(windows) == 1 and min(windows) >= 2 * STRIP_BLOCK
            and strip_backward_fits(case, heads, 1))


def strip_backward_config(case: Case, heads: tuple[int, ...]) -> StripBackwardConfig:
    """Each (head, batch element) row cut into as many sub-strips as keep the consumers (two a
    program, each on one sub-strip, taking the rows in turn) within one wave of the SMs, at
    least one a row; two K/V slots where they fit, else one; ``STRIP_O_SLOTS`` O tiles of their
    own where they fit too, else O in the dQ tiles."""
    num_blocks = cdiv(case.seq_len, STRIP_BLOCK)
    sub = max(1, cdiv(num_blocks, _per_row(case, heads, strip_backward.CONSUMERS)))
    kv_slots = 2 if strip_backward_fits(case, heads, 2) else 1
    o_slots = STRIP_O_SLOTS if strip_backward_fits(case, heads, kv_slots, STRIP_O_SLOTS) else 0
    return StripBackwardConfig(sub_blocks=sub, kv_slots=kv_slots, o_slots=o_slots)


def _wide_local(case: Case) -> bool:
    """D=64 from ``SPLIT_MIX_BACKWARD_MIN_SEQ_LEN``, every local head's window at least
    ``WIDE_LOCAL_HOPPER_MIN_WINDOW``."""
    local = case.local_heads()
    return (bool(local) and case.head_dim == STRIP_HEAD_DIM
            and case.seq_len >= SPLIT_MIX_BACKWARD_MIN_SEQ_LEN
            and min(case.windows[h] for h in local) >= WIDE_LOCAL_HOPPER_MIN_WINDOW)


def _long_gqa_mix(case: Case) -> bool:
    """A GQA mix with global heads from ``SPLIT_MIX_BACKWARD_MIN_SEQ_LEN``, groups of at most
    ``GQA_MIX_HOPPER_BACKWARD_MAX_GROUP`` query heads."""
    group = case.num_heads // case.num_kv_heads
    return (1 < group <= GQA_MIX_HOPPER_BACKWARD_MAX_GROUP and bool(case.global_heads())
            and case.seq_len >= SPLIT_MIX_BACKWARD_MIN_SEQ_LEN)


def _local_on_hopper_forward(case: Case) -> bool:
    local = case.local_heads()
    if not local:
        return False
    if case.head_dim == STRIP_HEAD_DIM:
        return _wide_local(case)
    if case.head_dim != LOCAL_HOPPER_BACKWARD_HEAD_DIM:
        return False
    block_k = _forward_block_k(case, tuple(range(case.num_heads)))
    return min(case.windows[h] for h in local) >= LOCAL_HOPPER_FORWARD_MIN_BLOCKS * block_k


def forward_launches(case: Case) -> tuple[Launch, ...]:
    """The forward: the global heads on the Hopper forward, the local heads as strips (D=64,
    from ``STRIP_MIN_SEQ_LEN``) or on the Hopper forward too (wide windows:
    ``LOCAL_HOPPER_FORWARD_MIN_BLOCKS`` at D=128, ``WIDE_LOCAL_HOPPER_MIN_WINDOW`` at D=64),
    the rest on the Triton forward."""
    everything = tuple(range(case.num_heads))
    if not hopper_runs(case):
        return (Launch("triton", everything, triton_config(case)),)
    glob, local = case.global_heads(), case.local_heads()
    if not local or _local_on_hopper_forward(case):
        return (Launch("hopper", everything, hopper_forward(case, everything)),)
    launches = [Launch("hopper", glob, hopper_forward(case, glob))] if glob else []
    if case.seq_len >= STRIP_MIN_SEQ_LEN and strip_fits(case, local):
        launches.append(Launch("strip", local, strip_config(case, local)))
    else:
        launches.append(Launch("triton", local, triton_config(case)))
    return tuple(launches)


def backward_launches(case: Case) -> tuple[Launch, ...]:
    """The backward: every head on the Hopper kernels with every head global, at D=128, at
    D=64 with wide windows (``WIDE_LOCAL_HOPPER_MIN_WINDOW``) or in long GQA mixes
    (``GQA_MIX_HOPPER_BACKWARD_MAX_GROUP``); in other mixes with one kv head
    per query head, from ``SPLIT_MIX_BACKWARD_MIN_SEQ_LEN`` at D <= 64, the global heads on
    them and the local heads as fused strips
    (``strip_backward_fits``, ``one_slot_strip_backward``) or on the Triton kernels; else
    every head on the Triton kernels."""
    everything = tuple(range(case.num_heads))
    triton_all = (Launch("triton", everything, triton_config(case)),)
    if not hopper_runs(case):
        return triton_all
    glob, local = case.global_heads(), case.local_heads()
    if (not local or case.head_dim == LOCAL_HOPPER_BACKWARD_HEAD_DIM or _wide_local(case)
            or _long_gqa_mix(case)):
        return (Launch("hopper", everything, hopper_backward(case)),)
    short_narrow = case.head_dim <= 64 and case.seq_len < SPLIT_MIX_BACKWARD_MIN_SEQ_LEN
    if short_narrow or case.num_kv_heads != case.num_heads:
        return triton_all
    if strip_backward_fits(case, local, 2) or one_slot_strip_backward(case, local):
        local_launch = Launch("strip", local, strip_backward_config(case, local))
    elif glob:
        local_launch = Launch("triton", local, triton_config(case))
    else:
        return triton_all
    return ((Launch("hopper", glob, hopper_backward(case)),) if glob else ()) + (local_launch,)


def launches(case: Case) -> Launches:
    """The call's launches (``configs.Launches`` checks that they cover every head once)."""
    return Launches(forward=forward_launches(case), backward=backward_launches(case),
                    num_heads=case.num_heads, num_kv_heads=case.num_kv_heads)
