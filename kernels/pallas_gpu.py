"""The "pallas_gpu" backend: block-sparse LS-attention on NVIDIA GPUs, forward and backward.

Every head of a layer is computed in one launch per pass (forward; dQ; dK/dV), each head with
its own window, and every pass visits only the blocks that intersect the head's band. The
kernels are in ``kernels/pallas_gpu_fwd.py`` and ``kernels/pallas_gpu_bwd.py``; this file holds
the tile configuration, the program schedules, the padding, and the ``jax.custom_vjp`` wiring.

Lowering: Pallas' Triton lowering (``lowering="triton"``, the only one implemented; see
docs/kernel-notes.md for why). ``lowering="mosaic"`` is reserved for a Mosaic GPU version.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from ls_jax.kernels.band import cdiv, kv_block_range, q_block_range
from ls_jax.kernels.pallas_gpu_bwd import flash_backward
from ls_jax.kernels.pallas_gpu_fwd import flash_forward
from ls_jax.kernels.pallas_gpu_tiles import LOOP_MODES, ClassPaths, TilePath

LOWERINGS = ("triton", "mosaic")


_BLOCK_FIELDS = ("fwd_block_q", "fwd_block_k", "dq_block_q", "dq_block_k", "dkdv_block_q",
                 "dkdv_block_k")
_WIDE_BLOCK_FIELDS = tuple("wide_" + name for name in _BLOCK_FIELDS)

@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Tile sizes (powers of two >= 16) and Triton launch parameters of the three kernels.

    Heads come in two classes, each kernel compiling one tile path per class present:
    "wide" heads (window >= ``wide_window``; 0 means: the window covers the whole padded
    sequence, i.e. the global heads) use the ``wide_*`` tiles (0: the same as the narrow
    ones); "narrow" heads use ``fwd_block_q/k`` (forward), ``dq_*`` (dQ) and ``dkdv_*``
    (dK/dV). For the dK/dV kernel a kv head is wide when all its query heads are.
    Blocks larger than the (power-of-two rounded) sequence are shrunk to it. fwd_loop and
    bwd_loop: how the boundary tiles get their mask (``kernels.pallas_gpu_tiles.LOOP_MODES``);
    wide_fwd_loop: the same for the wide forward path ("": as fwd_loop).
    delta_in_kernel: the dQ kernel computes ``delta = rowsum(O * dO)`` (else an XLA pass).
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

    def blocks(self) -> tuple[int, ...]:
        return tuple(getattr(self, name) for name in _BLOCK_FIELDS + _WIDE_BLOCK_FIELDS
                     if getattr(self, name))

    def validate(self):
        for name in _BLOCK_FIELDS + _WIDE_BLOCK_FIELDS:
            value = getattr(self, name)
            if name.startswith("wide_") and value == 0:
                continue
            if not isinstance(value, int) or value < 16 or value & (value - 1):
                raise ValueError(
                    f"config.{name}: expected a power of two >= 16"
                    f"{' (or 0)' if name.startswith('wide_') else ''}, got {value!r}")
        if not isinstance(self.wide_window, int) or self.wide_window < 0:
            raise ValueError(f"config.wide_window: expected an int >= 0, got "
                             f"{self.wide_window!r}")
        if self.wide_fwd_loop not in ("",) + LOOP_MODES:
            raise ValueError(f"config.wide_fwd_loop: expected '' or one of {LOOP_MODES}, got "
                             f"{self.wide_fwd_loop!r}")
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


def default_config(dtype, head_dim: int, window_sizes=None, seq_len: int | None = None
                   ) -> KernelConfig:
    """Tuned defaults (H200 measurements, docs/kernel-notes.md).

    Small tiles suit local heads (less work outside a narrow band, short loops). When every
    head is global all three kernels use longer tiles (128 query rows in the forward and dQ,
    128 keys in dK/dV). A single global head among local ones keeps the small tiles: its
    longest program (the last query block, a whole row of key blocks) is the critical path
    of the launch, and longer tiles make it longer (measured, kernel-notes.md).
    """
    if jnp.dtype(dtype) == jnp.float32:  # fp32 dots: small tiles, fewer stages
        return KernelConfig(fwd_block_q=64, fwd_block_k=32, dq_block_q=64, dq_block_k=32,
                            dkdv_block_q=32, dkdv_block_k=64, fwd_num_stages=2,
                            bwd_num_stages=2)
    config = KernelConfig()
    all_global = window_sizes is not None and all(
        p is None or (seq_len is not None and p >= seq_len) for p in window_sizes)
    if all_global:  # split: 1.4% faster than cond on all-global fwd, twice (kernel-notes)
        config = dataclasses.replace(config, wide_fwd_block_q=128, wide_dq_block_q=128,
                                     wide_dkdv_block_k=128, wide_fwd_loop="split")
    if head_dim > 64:
        config = dataclasses.replace(config, fwd_num_warps=8, bwd_num_warps=8)
    return config


# ---------------------------------------------------------------------------------------------
# Plans: which heads take which tile path, and the order in which programs run (longest
# first, so long global-head programs do not straggle behind a tail of short local ones).


def _plan(head_windows, seq_len: int, narrow: TilePath, wide: TilePath, wide_threshold: int,
          per_key_block: bool):
    """Plan of one kernel over "heads" (query heads; for dK/dV, kv heads with the windows
    of their query heads): (schedule, classes, ClassPaths, num_slots).

    A head is wide (class 0) when its narrowest window is >= ``wide_threshold``, else narrow
    (class 1); when the two paths are the same, every head is class 0 (one path compiled).
    """
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
    return (np.asarray(items, np.int32)[order], np.asarray(classes, np.int32), paths,
            num_slots)


@functools.lru_cache(maxsize=256)
def query_plan(windows: tuple[int, ...], seq_len: int, narrow: TilePath, wide: TilePath,
               wide_threshold: int):
    """Plan of the forward or dQ kernel: schedule int32 [n_items] of items
    ``head * num_slots + slot`` (most work first), classes int32 [Hq], the ``ClassPaths``
    in use, num_slots."""
    return _plan([(w,) for w in windows], seq_len, narrow, wide, wide_threshold, False)


@functools.lru_cache(maxsize=256)
def key_plan(windows: tuple[int, ...], num_kv_heads: int, seq_len: int, narrow: TilePath,
             wide: TilePath, wide_threshold: int):
    """Plan of the dK/dV kernel: as ``query_plan`` over kv heads, items
    ``kv_head * num_slots + slot``; work summed over each GQA group."""
    group = len(windows) // num_kv_heads
    return _plan([windows[g * group:(g + 1) * group] for g in range(num_kv_heads)], seq_len,
                 narrow, wide, wide_threshold, True)


def query_block_schedule(windows: tuple[int, ...], seq_len: int, block_q: int,
                         block_k: int) -> np.ndarray:
    """int32 [Hq * num_q_blocks]: items ``h * num_q_blocks + q_block``, most key blocks first
    (one tile path for every head)."""
    path = TilePath(block_q, block_k, "cond")
    return query_plan(windows, seq_len, path, path, seq_len)[0]


def key_block_schedule(windows: tuple[int, ...], num_kv_heads: int, seq_len: int,
                       block_q: int, block_k: int) -> np.ndarray:
    """int32 [Hkv * num_k_blocks]: items ``kv_head * num_k_blocks + k_block`` (dK/dV), the
    ones that visit the most query blocks (summed over the GQA group) first."""
    path = TilePath(block_q, block_k, "cond")
    return key_plan(windows, num_kv_heads, seq_len, path, path, seq_len)[0]


# ---------------------------------------------------------------------------------------------
# custom_vjp over padded inputs.


@dataclasses.dataclass(frozen=True)
class _Static:
    windows: tuple[int, ...]  # per query head, global heads as the padded length
    sm_scale: float
    config: KernelConfig
    with_stats: bool
    interpret: bool


def _wide_threshold(st: _Static, seq_len: int) -> int:
    return st.config.wide_window or seq_len


def _query_plan(st: _Static, kernel: str, seq_len: int):
    narrow, wide = st.config.paths(kernel)
    schedule, classes, paths, num_slots = query_plan(
        st.windows, seq_len, narrow, wide, _wide_threshold(st, seq_len))
    return jnp.asarray(schedule), jnp.asarray(classes), paths, num_slots


def _forward(q, k, v, segment_ids, st: _Static):
    c = st.config
    schedule, classes, paths, num_slots = _query_plan(st, "fwd", q.shape[1])
    head_table = jnp.stack([jnp.asarray(st.windows, jnp.int32), classes])
    return flash_forward(
        schedule, head_table, q, k, v, segment_ids, paths=paths, num_slots=num_slots, sm_scale=st.sm_scale, with_stats=st.with_stats,
        num_warps=c.fwd_num_warps, num_stages=c.fwd_num_stages, interpret=st.interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _padded_attention(q, k, v, segment_ids, st: _Static):
    out, _, stats = _forward(q, k, v, segment_ids, st)
    return out, stats


def _padded_attention_fwd(q, k, v, segment_ids, st: _Static):
    out, lse2, stats = _forward(q, k, v, segment_ids, st)
    return (out, stats), (q, k, v, segment_ids, out, lse2)


def _padded_attention_bwd(st: _Static, residuals, cotangents):
    q, k, v, segment_ids, out, lse2 = residuals
    do, _ = cotangents
    do = do.astype(q.dtype)
    c = st.config
    Tp = q.shape[1]
    narrow, wide = c.paths("dkdv")
    schedule, classes, paths, num_slots = key_plan(
        st.windows, k.shape[2], Tp, narrow, wide, _wide_threshold(st, Tp))
    dkdv_plan = (jnp.asarray(schedule), jnp.asarray(classes), paths, num_slots)
    dq, dk, dv = flash_backward(
        _query_plan(st, "dq", Tp), dkdv_plan, jnp.asarray(st.windows, jnp.int32), q, k, v, segment_ids, do, out,
        lse2, sm_scale=st.sm_scale, num_warps=c.bwd_num_warps, num_stages=c.bwd_num_stages,
        delta_in_kernel=c.delta_in_kernel, interpret=st.interpret)
    return dq, dk, dv, None


_padded_attention.defvjp(_padded_attention_fwd, _padded_attention_bwd)


# ---------------------------------------------------------------------------------------------
# Public entry points.


def _prepare(q, k, v, window_sizes, segment_ids, sm_scale, config, with_stats, interpret):
    """Pads T to whole blocks and D to a matrix-unit size; returns padded arrays and statics."""
    B, T, Hq, D = q.shape
    if not interpret and jax.default_backend() != "gpu":
        raise ValueError(
            "implementation='pallas_gpu' needs a CUDA GPU (JAX backend 'gpu'), got backend "
            f"{jax.default_backend()!r}; pass interpret=True to run it in Pallas interpret "
            "mode, or use implementation='reference'")
    if config is None:
        config = default_config(q.dtype, D, window_sizes, T)
    config.validate()
    config = config.fit_to(T)
    if sm_scale is None:
        sm_scale = 1.0 / float(np.sqrt(D))
    Tp = cdiv(T, max(config.blocks())) * max(config.blocks())
    Dp = max(16, 1 << (D - 1).bit_length())
    windows = tuple(Tp if p is None else min(int(p), Tp) for p in window_sizes)
    pad = ((0, 0), (0, Tp - T), (0, 0), (0, Dp - D))
    if Tp != T or Dp != D:
        q, k, v = (jnp.pad(x, pad) for x in (q, k, v))
    if segment_ids is not None:
        # padded queries get their own segment; they are sliced off and their dO is zero
        segment_ids = jnp.pad(segment_ids.astype(jnp.int32), ((0, 0), (0, Tp - T)),
                              constant_values=-1)
    st = _Static(windows=windows, sm_scale=float(sm_scale), config=config,
                 with_stats=bool(with_stats), interpret=bool(interpret))
    return q, k, v, segment_ids, st


def pallas_gpu_attention(q, k, v, window_sizes, *, segment_ids=None, sm_scale=None,
                         return_logit_stats=False, config: KernelConfig | None = None,
                         interpret=False):
    """Differentiable LS-attention; returns (out [B,T,Hq,D], max_abs_logit [Hq] or None).

    Inputs are as for ``kernels.ls_attention`` (already validated). ``config`` overrides the
    tile sizes (tests use small ones); ``interpret`` runs the kernels in Pallas interpret mode.
    """
    B, T, Hq, D = q.shape
    qp, kp, vp, seg, st = _prepare(q, k, v, window_sizes, segment_ids, sm_scale, config,
                                   return_logit_stats, interpret)
    out, stats = _padded_attention(qp, kp, vp, seg, st)
    out = out[:, :T, :, :D]
    if not return_logit_stats:
        return out, None
    return out, jax.lax.stop_gradient(jnp.max(stats[:, :, :T], axis=(0, 2)))


def pallas_gpu_attention_parts(q, k, v, window_sizes, *, segment_ids=None, sm_scale=None,
                               config: KernelConfig | None = None, interpret=False):
    """Forward only: (out [B,T,Hq,D], lse float32 [B,Hq,T] natural log, max_abs_logit [Hq]).

    The same quantities as ``kernels.reference.reference_attention_parts``, for tests.
    """
    B, T, Hq, D = q.shape
    qp, kp, vp, seg, st = _prepare(q, k, v, window_sizes, segment_ids, sm_scale, config,
                                   True, interpret)
    out, lse2, stats = _forward(qp, kp, vp, seg, st)
    lse = lse2[:, :, :T] * float(np.log(2.0))
    return out[:, :T, :, :D], lse, jnp.max(stats[:, :, :T], axis=(0, 2))


def pallas_gpu_backend(q, k, v, *, window_sizes, segment_ids, sm_scale, return_logit_stats,
                       interpret, config: KernelConfig | None = None, lowering: str = "triton"):
    """Backend function registered as "pallas_gpu" in ``kernels.api._BACKENDS``."""
    if lowering not in LOWERINGS:
        raise ValueError(f"lowering: expected one of {LOWERINGS}, got {lowering!r}")
    if lowering == "mosaic":
        raise NotImplementedError(
            "lowering='mosaic': the Mosaic GPU version of the LS-attention kernels is not "
            "written yet; use lowering='triton' (see docs/kernel-notes.md)")
    return pallas_gpu_attention(q, k, v, window_sizes, segment_ids=segment_ids,
                                sm_scale=sm_scale, return_logit_stats=return_logit_stats,
                                config=config, interpret=interpret)
