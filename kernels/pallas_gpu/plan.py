"""The static plan of a Pallas GPU attention call: tiles, head classes, program schedules.

Same style as ``kernels/pallas_tpu/plan.py``: a frozen ``AttentionPlan`` holds everything
static about one call (padded geometry, effective windows, scale, tile configuration) and is
built by ``make_plan``; per-kernel schedules are cached functions of it.

Heads come in two classes, each kernel compiling one tile path (``TilePath``) per class
present: "wide" heads (window >= ``KernelConfig.wide_window``; 0 means the padded length, i.e.
the global heads) and "narrow" heads. Programs run in schedule order, longest first, so long
global-head programs do not straggle behind a tail of short local ones. Which key (query)
blocks a program visits comes from ``kernels.band``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np

from ls_jax.kernels.band import (WindowSizes, cdiv, effective_windows, is_global,
                                 kv_block_range, q_block_range)

LOOP_MODES = ("split", "cond", "masked")
LOWERINGS = ("triton", "mosaic", "mixed")
LOCAL_FWD_LOWERINGS = ("triton", "strip")
# the strip forward's query and key blocks (``forward_strip.py``): one wgmma row block; and
# the head size it takes (three consumers' registers hold D=64 tiles; D=128 would spill)
STRIP_BLOCK = 64
STRIP_HEAD_DIM = 64
# the local heads' forward runs as strips by default from this length (H100 run O: 1g15l D=64
# p=128 forward 3-7% faster from n=4096; at n=1024-2048, where the call is about 0.05-0.09 ms,
# the benchmark's rows measured it 4-10% slower although the launches alone were faster)
STRIP_MIN_SEQ_LEN = 4096
# LS mixes with D <= 64 up to this length keep the Triton backward (``default_config``)
SHORT_MIX_TRITON_BWD = 8192
# the Hopper forward's three-consumer tiles (192 query rows) pay from this many programs of the
# global heads (batch x global heads x tiles). H100 runs L, Q (B=4) and R (B=1): 86-176
# programs 5-22% slower (e.g. B=4 1 global + 15 local n=8192, 172: 13%; B=1 n=16384-32768,
# 86-172: 17-22%); 342-2752 programs 3-11% faster (B=1 2 global + 14 local n=32768, 342: 3%)
# or a tie (B=4 1g15l D=128 n=16384, 344), 1408 once 3% slower (all global n=4096)
THREE_CONSUMER_MIN_PROGRAMS = 256
# ... and from this many programs when the local heads share the launch (D=128, windows >=
# LOCAL_ON_MOSAIC_FWD_MIN_WINDOW; batch x every head x tiles). Run U, H100, p=256-512:
# 1408-2752 programs forward 7-24% faster, f+b 1-10%; 352 (B=1 n=4096) a tie to 9% slower
EVERY_HEAD_THREE_CONSUMER_MIN_PROGRAMS = 1024
# ... and up to this head size (measured at 64 and 128, run Q)
THREE_CONSUMER_MAX_HEAD_DIM = 128
# the Hopper backward's three consumers (64-row blocks: tiles of 192 rows or keys): at D <= 64
# (at D=128 they spill, f+b 0.48-0.58x, run R) from this many programs of the global heads'
# dQ kernel (batch x global heads x tiles; about 4 waves on an H100's 132 SMs). H100 runs Q-R,
# f+b: 171 programs (1 global + 15 local n=32768, B=1) 1.9% and 344 (the same at n=16384,
# B=4) 1.4% slower; 684 (n=32768, B=4) 1.6-2.3%, 688 (2 global + 14 local n=16384) 2.8%, 704
# (all global n=2048) 5.2%, 1408-2752 (all global n=4096-32768) 2.2-4.6% faster
THREE_BWD_CONSUMER_MIN_PROGRAMS = 512
THREE_BWD_CONSUMER_MAX_HEAD_DIM = 64
# the head size at which the local heads run on the Hopper backward too (every head in one
# Mosaic launch per backward kernel; runs T on an H100 and an H200, at D=128, kernel-notes.md;
# at D=64 the Triton backward is faster, run R8) ...
LOCAL_ON_MOSAIC_HEAD_DIM = 128
# ... and on the Hopper forward when every local window is at least this wide (D=128. Run T:
# at p=512 the forward 8-28% faster than with the Triton forward for the local heads; at
# p=128 from 0.69x to 1.15x its speed. Run U, H100, B=4, p=256, against the Triton forward
# for the local heads: n=4096-8192 forward 1.11-1.24x, f+b 1.03-1.10x; n=32768 forward
# 1.03-1.07x, f+b 0.996-1.04x); narrower windows keep the Triton forward
LOCAL_ON_MOSAIC_FWD_MIN_WINDOW = 256

_BLOCK_FIELDS = ("fwd_block_q", "fwd_block_k", "dq_block_q", "dq_block_k", "dkdv_block_q",
                 "dkdv_block_k")
_WIDE_BLOCK_FIELDS = tuple("wide_" + name for name in _BLOCK_FIELDS)


@dataclasses.dataclass(frozen=True)
class TilePath:
    """Static description of how one class of programs walks its tiles: the tile
    block_q x block_k, and how boundary tiles get their mask (one of ``LOOP_MODES``)."""

    block_q: int
    block_k: int
    loop_mode: str


@dataclasses.dataclass(frozen=True)
class ClassPaths:
    """The tile paths one kernel compiles, one per class of head present (None: absent).

    A head's class is an int from a small table: 0 wide (``wide``), 1 narrow (``narrow``).
    """

    wide: TilePath | None = None
    narrow: TilePath | None = None


def _power_of_two(value, minimum: int) -> bool:
    """True for an int that is a power of two and at least ``minimum``."""
    return isinstance(value, int) and value >= minimum and not value & (value - 1)


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Tile sizes (powers of two >= 16) and Triton launch parameters of the three kernels.

    "wide" heads use the ``wide_*`` tiles (0: the same as the narrow ones); "narrow" heads use
    ``fwd_block_q/k`` (forward), ``dq_*`` (dQ) and ``dkdv_*`` (dK/dV). For the dK/dV kernel a
    kv head is wide when all its query heads are. Blocks larger than the (power-of-two
    rounded) sequence are shrunk to it. fwd_loop and bwd_loop: how the boundary tiles get
    their mask (``LOOP_MODES``, see ``kernels.pallas_gpu.tiles.run_band_loop``); wide_fwd_loop:
    the same for the wide forward path ("": as fwd_loop).
    delta_in_kernel: the dQ kernels compute ``delta = rowsum(O * dO)`` from their own O and
    dO tiles (else an XLA pass before them): the Triton one, and the Mosaic one where O's tile
    fits its shared memory (``backward_mosaic.delta_fits``: not beside 128-key dQ blocks at
    D=128, nor with the fused dQ). H100 run V, Mosaic, f+b: D=128 1 global + 15 local n=8192
    p=512 1.892 -> 1.817-1.863 ms, 2 global + 14 local 2.370 -> 2.166-2.176, the same with 4
    kv heads 2.245 -> 1.984-1.998; D=64 every head global n=8192 4.724 -> 4.591-4.650.
    fwd_lowering: "triton" (``forward.py``), "mosaic" (``forward_mosaic.py``, the Hopper
    forward) or "mixed" (the Hopper forward for the global heads, Triton for the local ones);
    where ``mosaic_ring.mosaic_fits`` says no, the Triton forward runs every head;
    mosaic_block_q: query rows per consumer warpgroup (a tile is ``mosaic_consumers`` times
    that), mosaic_block_k: keys per block, mosaic_stages: key/value blocks in flight
    (multiples of 64; stages >= 2); mosaic_consumers: the forward's consumer warpgroups, 2
    (taking turns on the tensor cores) or 3 (running free, 160 registers each).
    local_fwd_lowering: the local heads' forward where the Triton kernel would run them:
    "triton" or "strip" (``forward_strip.py``, Hopper, D=64, windows up to 256:
    ``forward_strip.strip_fits``; elsewhere Triton), strip_blocks: its query blocks per
    program (0: from the GPU's SM count, ``forward_strip.strip_length``).
    bwd_lowering: the same choice for the backward ("mixed" needs one kv head per query head,
    else the Triton kernels run every head): ``backward_mosaic.py`` with blocks
    mosaic_bwd_block_q x mosaic_bwd_block_k (a consumer owns one block of its side);
    mosaic_dq_block_k: the dQ kernel's streamed key blocks (0: mosaic_bwd_block_k);
    mosaic_fused_dq: dQ computed in the Mosaic dK/dV kernel, which then streams 64-row query
    blocks (float32 TMA reductions, five products per tile instead of seven; dQ is not
    bit-reproducible: the additions' order varies), instead of its own kernel. Off by
    default; on an H100 1.03-1.09x the f+b with every head global at D=64 against two
    unfused consumers, 1.026x against three (run R), 1.02x in long LS mixes, half as fast at
    D=128 (run P, docs/kernel-notes.md).
    mosaic_bwd_consumers: the Mosaic dQ and dK/dV kernels' consumer warpgroups, 2 (232
    registers each) or 3 (160 each; the fused dQ always takes 2; with ``interpret`` 2 where
    the interpreter cannot run four warpgroups, ``mosaic_ring.interpreter_fits``). The
    default takes 3, with 64-row query blocks, at D <= 64 where the global heads' dQ kernel
    launches at least 512 programs (``THREE_BWD_CONSUMER_MIN_PROGRAMS``): on an H100 the f+b
    1.02-1.05x with every head global at D=64, 1.02x for 1 global + 15 local at n=32768, B=4;
    fewer programs measured 1-2% slower; half as fast at D=128 (runs Q-R, kernel-notes.md).
    """

    fwd_block_q: int = 64
    fwd_block_k: int = 64
    dq_block_q: int = 64
    dq_block_k: int = 32
    dkdv_block_q: int = 32
    dkdv_block_k: int = 64
    fwd_num_warps: int = 4
    fwd_num_stages: int = 3
    bwd_num_warps: int = 4
    bwd_num_stages: int = 3
    fwd_loop: str = "cond"
    bwd_loop: str = "cond"
    wide_fwd_block_q: int = 0
    wide_fwd_block_k: int = 0
    wide_dq_block_q: int = 0
    wide_dq_block_k: int = 0
    wide_dkdv_block_q: int = 0
    wide_dkdv_block_k: int = 0
    wide_window: int = 0
    wide_fwd_loop: str = ""
    delta_in_kernel: bool = True
    fwd_lowering: str = "triton"
    bwd_lowering: str = "triton"
    mosaic_block_q: int = 64
    mosaic_block_k: int = 64
    mosaic_stages: int = 2
    mosaic_consumers: int = 2
    mosaic_bwd_block_q: int = 64
    mosaic_bwd_block_k: int = 64
    mosaic_dq_block_k: int = 0
    mosaic_fused_dq: bool = False
    mosaic_bwd_consumers: int = 2
    local_fwd_lowering: str = "triton"
    strip_blocks: int = 0

    def blocks(self) -> tuple[int, ...]:
        blocks = tuple(getattr(self, name) for name in _BLOCK_FIELDS + _WIDE_BLOCK_FIELDS
                       if getattr(self, name))
        if self.fwd_lowering != "triton":  # (three consumers take a ragged last tile)
            blocks += (2 * self.mosaic_block_q, self.mosaic_block_k)
        if self.local_fwd_lowering == "strip":
            blocks += (STRIP_BLOCK,)
        if self.bwd_lowering != "triton":
            blocks += (2 * self.mosaic_bwd_block_q, 2 * self.mosaic_bwd_block_k)
            blocks += (self.mosaic_dq_block_k,) if self.mosaic_dq_block_k else ()
        return blocks

    def validate(self):
        for name in _BLOCK_FIELDS + _WIDE_BLOCK_FIELDS:
            value = getattr(self, name)
            if name.startswith("wide_") and value == 0:
                continue
            if not _power_of_two(value, 16):
                raise ValueError(
                    f"config.{name}: expected a power of two >= 16"
                    f"{' (or 0)' if name.startswith('wide_') else ''}, got {value!r}")
        if not isinstance(self.wide_window, int) or self.wide_window < 0:
            raise ValueError(f"config.wide_window: expected an int >= 0, got "
                             f"{self.wide_window!r}")
        if self.wide_fwd_loop not in ("",) + LOOP_MODES:
            raise ValueError(f"config.wide_fwd_loop: expected '' or one of {LOOP_MODES}, got "
                             f"{self.wide_fwd_loop!r}")
        for name in ("fwd_lowering", "bwd_lowering"):
            if getattr(self, name) not in LOWERINGS:
                raise ValueError(f"config.{name}: expected one of {LOWERINGS}, got "
                                 f"{getattr(self, name)!r}")
        for name in ("mosaic_block_q", "mosaic_block_k", "mosaic_bwd_block_q",
                     "mosaic_bwd_block_k"):
            value = getattr(self, name)
            if not _power_of_two(value, 64):
                raise ValueError(f"config.{name}: expected a power of two >= 64, got {value!r}")
        value = self.mosaic_dq_block_k
        if not (_power_of_two(value, 64) or (isinstance(value, int) and value == 0)):
            raise ValueError(f"config.mosaic_dq_block_k: expected 0 or a power of two >= 64, "
                             f"got {value!r}")
        if self.local_fwd_lowering not in LOCAL_FWD_LOWERINGS:
            raise ValueError(f"config.local_fwd_lowering: expected one of "
                             f"{LOCAL_FWD_LOWERINGS}, got {self.local_fwd_lowering!r}")
        if not isinstance(self.strip_blocks, int) or self.strip_blocks < 0:
            raise ValueError(f"config.strip_blocks: expected an int >= 0, got "
                             f"{self.strip_blocks!r}")
        if not isinstance(self.mosaic_fused_dq, bool):
            raise ValueError(f"config.mosaic_fused_dq: expected a bool, got "
                             f"{self.mosaic_fused_dq!r}")
        for name in ("mosaic_consumers", "mosaic_bwd_consumers"):
            if getattr(self, name) not in (2, 3):
                raise ValueError(f"config.{name}: expected 2 or 3, got "
                                 f"{getattr(self, name)!r}")
        if not isinstance(self.mosaic_stages, int) or self.mosaic_stages < 2:
            raise ValueError(f"config.mosaic_stages: expected an int >= 2, got "
                             f"{self.mosaic_stages!r}")
        for name in ("fwd_loop", "bwd_loop"):
            if getattr(self, name) not in LOOP_MODES:
                raise ValueError(f"config.{name}: expected one of {LOOP_MODES}, got "
                                 f"{getattr(self, name)!r}")

    def fit_to(self, seq_len: int) -> "KernelConfig":
        """Shrinks every block to at most the sequence rounded up to a power of two."""
        cap = max(16, 1 << max(seq_len - 1, 0).bit_length())
        return dataclasses.replace(self, **{
            name: min(getattr(self, name), cap) for name in _BLOCK_FIELDS + _WIDE_BLOCK_FIELDS})

    def paths(self, kernel: str) -> tuple[TilePath, TilePath]:
        """(narrow, wide) tile paths of one kernel: "fwd", "dq" or "dkdv"."""
        bq, bk = getattr(self, f"{kernel}_block_q"), getattr(self, f"{kernel}_block_k")
        loop = self.fwd_loop if kernel == "fwd" else self.bwd_loop
        narrow = TilePath(bq, bk, loop)
        wide_loop = (self.wide_fwd_loop or loop) if kernel == "fwd" else loop
        wide = TilePath(getattr(self, f"wide_{kernel}_block_q") or bq,
                        getattr(self, f"wide_{kernel}_block_k") or bk, wide_loop)
        return narrow, wide


def default_config(dtype, head_dim: int, window_sizes=None, seq_len: int | None = None,
                   batch: int = 1) -> KernelConfig:
    """Tuned defaults (H200 measurements, docs/kernel-notes.md); ``batch``: the call's batch
    size (per device under ``shard_map``), which sets how many programs the kernels launch.

    Small tiles suit local heads (less work outside a narrow band, short loops). When every
    head is global all three kernels use longer tiles (128 query rows in the forward and dQ,
    128 keys in dK/dV). A single global head among local ones keeps the small tiles: its
    longest program (the last query block, a whole row of key blocks) is the critical path
    of the launch, and longer tiles make it longer (measured, kernel-notes.md).

    Global heads run on the Hopper (Mosaic GPU) kernels where they can (``fwd_lowering`` /
    ``bwd_lowering`` "mosaic" when every head is global, "mixed" in an LS mix; the Triton
    kernels elsewhere, see ``mosaic_ring.mosaic_fits``): H100 run J, docs/kernel-notes.md.
    At D=128 the local heads run on the Hopper forward and backward when every local window is
    >= ``LOCAL_ON_MOSAIC_FWD_MIN_WINDOW``, and on the Hopper backward alone for narrower
    windows (runs T-V).
    """
    if jnp.dtype(dtype) == jnp.float32:  # fp32 dots: small tiles, fewer stages
        return KernelConfig(fwd_block_q=64, fwd_block_k=32, dq_block_q=64, dq_block_k=32,
                            dkdv_block_q=32, dkdv_block_k=64, fwd_num_stages=2,
                            bwd_num_stages=2)
    config = KernelConfig()

    def three_consumer_programs(num_heads: int, block: int) -> int:
        """Programs of the Hopper forward over ``num_heads`` heads in three-consumer tiles."""
        return batch * num_heads * (cdiv(seq_len, 3 * block) if seq_len else 0)

    # per head: global? (unknown windows count as one global head)
    global_flags = [True] if window_sizes is None else [
        p is None or (seq_len is not None and is_global(p, seq_len)) for p in window_sizes]
    all_global = window_sizes is not None and all(global_flags)
    if all_global:  # split: 1.4% faster than cond on all-global fwd, twice (kernel-notes)
        config = dataclasses.replace(config, wide_fwd_block_q=128, wide_dq_block_q=128,
                                     wide_dkdv_block_k=128, wide_fwd_loop="split")
    if all_global and head_dim > 64:  # the 128-row tiles of the all-global path want 8 warps
        config = dataclasses.replace(config, fwd_num_warps=8, bwd_num_warps=8)
    # LS mixes keep 4 warps at D=128: with 8 (the earlier default for D > 64) the 1 global +
    # 15 local forward at p=512 took 1.243 ms against 0.627 ms (H100, docs/performance.md run H)
    if any(global_flags):
        # the Hopper forward (forward_mosaic.py; Triton where it does not fit: other GPUs,
        # float32, D not a multiple of 64, segment ids) for the global heads. H100, run J:
        # all global 1.00x cuDNN's forward (Triton 0.79x), D=64 and 128; LS mixes 4-35% faster
        # than the Triton forward (docs/kernel-notes.md). 128-key blocks: 1.33 vs 1.73 ms (64)
        # The Hopper backward likewise (run J: all global f+b 5.87 -> 5.22 ms at D=64, 11.32
        # -> 8.15 ms at D=128, n=8192; "mixed" needs one kv head per query head, else Triton)
        lowering = "mosaic" if all_global else "mixed"
        # except a short D=64 mix, where one Triton launch for every head measured 4-5% faster
        # (1 global + 15 local, n=8192: 0.827 vs 0.871 ms and 0.842 vs 0.873 ms f+b, run J)
        short_narrow_mix = (not all_global and head_dim <= 64 and seq_len is not None
                            and seq_len <= SHORT_MIX_TRITON_BWD)
        # the Hopper backward's query blocks: 128 at D <= 64 (all global f+b 5.21 -> 5.03 ms at
        # n=8192, 81.6 -> 78.9 ms at n=32768; 1 global + 15 local n=32768 6.79 -> 6.65 ms),
        # 64 at D=128 (128 spills: 8.25 -> 12.96 ms); and at D=128 with every head global,
        # 128-key blocks in dQ (f+b 1.2-3.4% faster in three runs, e.g. 127.7 -> 125.4 ms at
        # n=32768; not in mixes, where it measured slower), H100 runs J-K, kernel-notes.md
        wide_head = head_dim > 64
        # three forward consumers (192-row tiles) when the global heads fill enough of them
        # (programs: batch x heads x tiles; B=4 below unless noted). D=64 (run L): all
        # global n=8192 1.330 -> 1.215 ms, n=32768 19.65 -> 17.53 ms; 1 global + 15 local
        # 1.693 -> 1.583 ms at n=32768 (171 tiles), 0.562 -> 0.545 at n=16384 (86 tiles),
        # but 0.214 -> 0.242 ms at n=8192 (43 tiles: too few programs for the GPU). D=128
        # (run Q; with statistics its tiles spill 28 bytes): all global n=8192 1.995 -> 1.671
        # ms, n=32768 29.28 -> 26.57 ms; 2 global + 14 local n=32768 4.303 -> 3.911 (342
        # tiles), 1g15l n=16384 a tie (86), but at n=4096 0.196 -> 0.222 (22 tiles) and
        # 0.199 -> 0.206 (44). B=1 (run R): 1g15l n=32768 (171 tiles) 0.471 -> 0.553-0.560 at
        # D=64, 0.681 -> 0.815-0.824 at D=128; 2g14l n=32768 (342) 0.746 -> 0.721-0.724,
        # 1.127 -> 1.086-1.093. H100, kernel-notes.md. Not measured above D=128 (a
        # 128-register accumulator alone at D=256)
        def global_programs(block: int) -> int:  # of three-consumer tiles of these blocks
            return three_consumer_programs(sum(global_flags), block)

        consumers = (3 if head_dim <= THREE_CONSUMER_MAX_HEAD_DIM and global_programs(
            config.mosaic_block_q) >= THREE_CONSUMER_MIN_PROGRAMS else 2)
        # three backward consumers on 64-row blocks (160 registers each) against two on
        # 128-row query blocks where the global heads fill enough programs. H100, run R, f+b:
        # all global n=8192 5.053 -> 4.870 ms, n=32768 18.38 -> 17.98 (B=1); 1 global + 15
        # local n=32768 6.500 -> 6.397, n=16384 2.078 -> 2.108 (kept on two: too few programs)
        bwd_consumers = (3 if head_dim <= THREE_BWD_CONSUMER_MAX_HEAD_DIM
                         and global_programs(64) >= THREE_BWD_CONSUMER_MIN_PROGRAMS else 2)
        config = dataclasses.replace(config, fwd_lowering=lowering, mosaic_consumers=consumers,
                                     bwd_lowering="triton" if short_narrow_mix else lowering,
                                     mosaic_block_k=128, mosaic_bwd_consumers=bwd_consumers,
                                     mosaic_bwd_block_q=64 if wide_head or bwd_consumers == 3
                                     else 128,
                                     mosaic_dq_block_k=128 if wide_head and all_global else 0)
    if not all_global and head_dim == LOCAL_ON_MOSAIC_HEAD_DIM and window_sizes is not None:
        # D=128: the local heads on the Hopper kernels too, the backward always, the forward
        # from LOCAL_ON_MOSAIC_FWD_MIN_WINDOW. Run T, f+b ms, old default -> this one: H100,
        # B=4: 1 global + 15 local n=4096 p=128 0.836 -> 0.724, p=512 1.263 -> 0.940; n=32768
        # p=128 11.087 -> 10.838, p=512 14.505 -> 13.456; 2 global + 14 local n=32768 p=512
        # 21.290 -> 19.990, n=65536 (B=1) 17.677 -> 17.015; 16 local heads n=8192 p=128 1.056
        # -> 1.008, p=512 1.923 -> 1.610. A tie at 1 global + 15 local n=8192 p=128 (1.471 ->
        # 1.469; H200 1.447 -> 1.396)
        local_windows = [p for p, glob in zip(window_sizes, global_flags) if not glob]
        wide_local = min(local_windows) >= LOCAL_ON_MOSAIC_FWD_MIN_WINDOW
        # GQA too (run V): the Hopper dK/dV kernel sums each group in its accumulators. Run U
        # had kept GQA mixes with windows under 256 on Triton, when that kernel wrote one
        # gradient per query head for XLA to sum (5-10% slower than Triton at p=128). H100
        # run V4, B=4, 4 kv heads, n=8192, f+b ms, Triton -> Hopper: 1 global + 15 local
        # p=128 1.438 / 1.639 -> 1.258 / 1.243, 2 global + 14 local 2.052 / 2.361 -> 1.663 /
        # 1.681, 16 local heads 0.951 / 0.928 -> 0.837 / 0.855
        config = dataclasses.replace(config, bwd_lowering="mosaic")
        if wide_local:
            # every head in the Hopper forward's launch: three consumers counted over all of
            # them (U2-U3, H100, B=4, p=512, ms fwd / f+b, two -> three consumers: 1 global +
            # 15 local n=8192 0.551 / 1.994 -> 0.496 / 1.974, 2 global + 14 local n=4096
            # 0.304 / 1.035 -> 0.282 / 0.999, 16 local heads n=8192 0.476 / 1.643 -> 0.465 /
            # 1.559 and 0.431 / 1.570; B=1 1 global + 15 local n=4096 0.115 / 0.318 -> 0.119
            # / 0.332 and 0.113 / 0.347, hence the higher threshold)
            consumers = (3 if three_consumer_programs(len(window_sizes), config.mosaic_block_q)
                         >= EVERY_HEAD_THREE_CONSUMER_MIN_PROGRAMS else 2)
            config = dataclasses.replace(config, fwd_lowering="mosaic",
                                         mosaic_consumers=consumers)
    if (not all_global and head_dim == STRIP_HEAD_DIM and seq_len is not None
            and seq_len >= STRIP_MIN_SEQ_LEN):
        # the local heads' forward as strips (forward_strip.py; Triton where it does not run:
        # other GPUs, windows over 256, segment ids). H100 run O, B=4, D=64, p=128, forward:
        # 1 global + 15 local 0.211 vs 0.224 ms (n=8192), 1.489 vs 1.535 (n=32768); 16 local
        # heads 0.134 vs 0.162 (n=8192); f+b unchanged (the backward is the same)
        config = dataclasses.replace(config, local_fwd_lowering="strip")
    return config


# ---------------------------------------------------------------------------------------------
# Program schedules: which heads take which tile path, and the order in which programs run.


@dataclasses.dataclass(frozen=True, eq=False)
class ProgramPlan:
    """The programs of one kernel.

    schedule: int32 [n_items], program order (most work first); item = head * num_slots +
      block (query block for forward / dQ, key block for dK/dV, in the block size of the
      head's class). head_class: int32 [heads] (0 wide, 1 narrow; per kv head for dK/dV).
    """

    schedule: np.ndarray
    head_class: np.ndarray
    paths: ClassPaths
    num_slots: int

    def schedule_of(self, heads=None) -> np.ndarray:
        """The schedule's items whose head (query head; kv head for dK/dV) is in ``heads``
        (None: all), in schedule order."""
        if heads is None:
            return self.schedule
        return self.schedule[np.isin(self.schedule // self.num_slots, list(heads))]


def _program_plan(head_windows, seq_len: int, narrow: TilePath, wide: TilePath,
                  wide_threshold: int, per_key_block: bool) -> ProgramPlan:
    """Plan of one kernel over "heads" (query heads; for dK/dV, kv heads with the windows
    of their query heads). A head is wide (class 0) when its narrowest window is >=
    ``wide_threshold``, else narrow (class 1); when the two paths are the same, every head is
    class 0 (one path compiled)."""
    classes = [0 if narrow == wide or min(ws) >= wide_threshold else 1 for ws in head_windows]
    paths = ClassPaths(wide=wide if 0 in classes else None,
                       narrow=narrow if 1 in classes else None)
    num_slots = max(seq_len // (p.block_k if per_key_block else p.block_q)
                    for p in (paths.wide, paths.narrow) if p is not None)
    block_range = q_block_range if per_key_block else kv_block_range
    items, costs = [], []
    for h, (ws, cls) in enumerate(zip(head_windows, classes)):
        path = narrow if cls else wide
        bq, bk = path.block_q, path.block_k
        for i in range(seq_len // (bk if per_key_block else bq)):
            visits = sum(np.subtract(*block_range(i, bq, bk, w, seq_len)[::-1]) for w in ws)
            items.append(h * num_slots + i)
            costs.append(int(visits) * bq * bk)  # work, comparable across tile shapes
    order = np.argsort(-np.asarray(costs), kind="stable")
    return ProgramPlan(np.asarray(items, np.int32)[order], np.asarray(classes, np.int32), paths,
                       num_slots)


@functools.lru_cache(maxsize=256)
def query_plan(windows: tuple[int, ...], seq_len: int, narrow: TilePath, wide: TilePath,
               wide_threshold: int) -> ProgramPlan:
    """Plan of the forward or dQ kernel over query heads (effective windows)."""
    return _program_plan([(w,) for w in windows], seq_len, narrow, wide, wide_threshold, False)


@functools.lru_cache(maxsize=256)
def key_plan(windows: tuple[int, ...], num_kv_heads: int, seq_len: int, narrow: TilePath,
             wide: TilePath, wide_threshold: int) -> ProgramPlan:
    """Plan of the dK/dV kernel: as ``query_plan`` over kv heads, items
    ``kv_head * num_slots + key block``; work summed over each GQA group."""
    group = len(windows) // num_kv_heads
    return _program_plan([windows[g * group:(g + 1) * group] for g in range(num_kv_heads)],
                         seq_len, narrow, wide, wide_threshold, True)


# ---------------------------------------------------------------------------------------------
# The plan of one call.


@dataclasses.dataclass(frozen=True)
class AttentionPlan:
    """Everything static about one call (hashable: the ``jax.custom_vjp`` static argument).

    Sequences are padded to ``seq_len_padded`` (a multiple of every block) and the head
    dimension to ``head_dim_padded`` (a power of two >= 16) with zeros; padding keys are never
    visible to real queries, padding queries are sliced away.
    """

    seq_len: int
    seq_len_padded: int
    head_dim: int
    head_dim_padded: int
    windows: WindowSizes  # per query head: int >= 1 (local) or None (global)
    num_kv_heads: int
    scale: float
    config: KernelConfig
    logit_stats: bool
    interpret: bool

    @property
    def wide_threshold(self) -> int:
        return self.config.wide_window or self.seq_len_padded

    def window_table(self) -> tuple[int, ...]:
        """Each query head's effective window over the padded length."""
        return effective_windows(self.windows, self.seq_len_padded)

    def global_heads(self) -> tuple[int, ...]:
        """The query heads that see every earlier key (window None or >= the length)."""
        return tuple(h for h, w in enumerate(self.window_table())
                     if is_global(w, self.seq_len_padded))

    def local_heads(self) -> tuple[int, ...]:
        """The other query heads (a window shorter than the length)."""
        return tuple(h for h, w in enumerate(self.window_table())
                     if not is_global(w, self.seq_len_padded))

    def query_plan(self, kernel: str) -> ProgramPlan:
        """Programs of the forward ("fwd") or dQ ("dq") kernel."""
        narrow, wide = self.config.paths(kernel)
        return query_plan(self.window_table(), self.seq_len_padded, narrow, wide,
                          self.wide_threshold)

    def key_plan(self) -> ProgramPlan:
        """Programs of the dK/dV kernel."""
        narrow, wide = self.config.paths("dkdv")
        return key_plan(self.window_table(), self.num_kv_heads, self.seq_len_padded, narrow,
                        wide, self.wide_threshold)


def make_plan(*, seq_len: int, head_dim: int, windows: WindowSizes, num_kv_heads: int,
              dtype, scale: float, config: KernelConfig | None, logit_stats: bool,
              interpret: bool, batch: int = 1) -> AttentionPlan:
    """Validates ``config`` (default: ``default_config``), fits it to the sequence, pads."""
    if config is None:
        config = default_config(dtype, head_dim, windows, seq_len, batch)
    config.validate()
    config = config.fit_to(seq_len)
    seq_len_padded = cdiv(seq_len, max(config.blocks())) * max(config.blocks())
    return AttentionPlan(
        seq_len=seq_len, seq_len_padded=seq_len_padded, head_dim=head_dim,
        head_dim_padded=max(16, 1 << (head_dim - 1).bit_length()),
        windows=tuple(windows), num_kv_heads=num_kv_heads, scale=float(scale),
        config=config, logit_stats=bool(logit_stats), interpret=bool(interpret))
