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

from kernels.band import cdiv, kv_block_range, q_block_range
from kernels.pallas_gpu_bwd import flash_backward
from kernels.pallas_gpu_fwd import flash_forward
from kernels.pallas_gpu_tiles import LOOP_MODES

LOWERINGS = ("triton", "mosaic")


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Tile sizes (powers of two >= 16) and Triton launch parameters of the three kernels.

    fwd_block_q/fwd_block_k: forward query/key tile; dq_*: dQ kernel; dkdv_*: dK/dV kernel.
    Blocks larger than the (power-of-two rounded) sequence are shrunk to it. fwd_loop and
    bwd_loop: how the boundary tiles get their mask (``kernels.pallas_gpu_tiles.LOOP_MODES``).
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

    def blocks(self) -> tuple[int, ...]:
        return (self.fwd_block_q, self.fwd_block_k, self.dq_block_q, self.dq_block_k,
                self.dkdv_block_q, self.dkdv_block_k)

    def validate(self):
        for name in ("fwd_block_q", "fwd_block_k", "dq_block_q", "dq_block_k",
                     "dkdv_block_q", "dkdv_block_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 16 or value & (value - 1):
                raise ValueError(
                    f"config.{name}: expected a power of two >= 16, got {value!r}")
        for name in ("fwd_loop", "bwd_loop"):
            if getattr(self, name) not in LOOP_MODES:
                raise ValueError(f"config.{name}: expected one of {LOOP_MODES}, got "
                                 f"{getattr(self, name)!r}")

    def fit_to(self, seq_len: int) -> "KernelConfig":
        """Shrinks every block to at most the sequence rounded up to a power of two."""
        cap = max(16, 1 << max(seq_len - 1, 0).bit_length())
        return dataclasses.replace(self, **{
            name: min(getattr(self, name), cap)
            for name in ("fwd_block_q", "fwd_block_k", "dq_block_q", "dq_block_k",
                         "dkdv_block_q", "dkdv_block_k")})


def default_config(dtype, head_dim: int, window_sizes=None, seq_len: int | None = None
                   ) -> KernelConfig:
    """Tuned defaults (H200 measurements, docs/kernel-notes.md).

    Small tiles suit local heads (less work outside a narrow band, short loops); when every
    head is global all three kernels use longer tiles (128 query rows in the forward and dQ,
    128 keys in dK/dV).
    """
    if jnp.dtype(dtype) == jnp.float32:  # fp32 dots: small tiles, fewer stages
        return KernelConfig(fwd_block_q=64, fwd_block_k=32, dq_block_q=64, dq_block_k=32,
                            dkdv_block_q=32, dkdv_block_k=64, fwd_num_stages=2,
                            bwd_num_stages=2)
    config = KernelConfig()
    all_global = window_sizes is not None and all(
        p is None or (seq_len is not None and p >= seq_len) for p in window_sizes)
    if all_global:
        config = dataclasses.replace(config, fwd_block_q=128, dq_block_q=128, dkdv_block_k=128)
    if head_dim > 64:
        config = dataclasses.replace(config, fwd_num_warps=8, bwd_num_warps=8)
    return config


# ---------------------------------------------------------------------------------------------
# Schedules: the order in which programs run (longest first, so long global-head programs do
# not straggle behind a tail of short local ones).


@functools.lru_cache(maxsize=256)
def query_block_schedule(windows: tuple[int, ...], seq_len: int, block_q: int,
                         block_k: int) -> np.ndarray:
    """int32 [Hq * num_q_blocks]: items ``h * num_q_blocks + q_block``, most key blocks first."""
    n_q = seq_len // block_q
    items, costs = [], []
    for h, w in enumerate(windows):
        for i in range(n_q):
            first, end = kv_block_range(i, block_q, block_k, w, seq_len)
            items.append(h * n_q + i)
            costs.append(end - first)
    order = np.argsort(-np.asarray(costs), kind="stable")
    return np.asarray(items, np.int32)[order]


@functools.lru_cache(maxsize=256)
def key_block_schedule(windows: tuple[int, ...], num_kv_heads: int, seq_len: int,
                       block_q: int, block_k: int) -> np.ndarray:
    """int32 [Hkv * num_k_blocks]: items ``kv_head * num_k_blocks + k_block`` (dK/dV), the
    ones that visit the most query blocks (summed over the GQA group) first."""
    n_k = seq_len // block_k
    group = len(windows) // num_kv_heads
    items, costs = [], []
    for kvh in range(num_kv_heads):
        for j in range(n_k):
            cost = 0
            for h in range(kvh * group, (kvh + 1) * group):
                first, end = q_block_range(j, block_q, block_k, windows[h], seq_len)
                cost += end - first
            items.append(kvh * n_k + j)
            costs.append(cost)
    order = np.argsort(-np.asarray(costs), kind="stable")
    return np.asarray(items, np.int32)[order]


# ---------------------------------------------------------------------------------------------
# custom_vjp over padded inputs.


@dataclasses.dataclass(frozen=True)
class _Static:
    windows: tuple[int, ...]  # per query head, global heads as the padded length
    sm_scale: float
    config: KernelConfig
    with_stats: bool
    interpret: bool


def _forward(q, k, v, segment_ids, st: _Static):
    c = st.config
    Tp = q.shape[1]
    schedule = query_block_schedule(st.windows, Tp, c.fwd_block_q, c.fwd_block_k)
    return flash_forward(
        jnp.asarray(schedule), jnp.asarray(st.windows, jnp.int32), q, k, v, segment_ids,
        block_q=c.fwd_block_q, block_k=c.fwd_block_k, sm_scale=st.sm_scale,
        with_stats=st.with_stats, num_warps=c.fwd_num_warps, num_stages=c.fwd_num_stages,
        loop_mode=c.fwd_loop, interpret=st.interpret)


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
    delta_BxHxT = jnp.einsum("bthd,bthd->bht", out.astype(jnp.float32),
                             do.astype(jnp.float32))
    dq_schedule = query_block_schedule(st.windows, Tp, c.dq_block_q, c.dq_block_k)
    dkdv_schedule = key_block_schedule(st.windows, k.shape[2], Tp, c.dkdv_block_q,
                                       c.dkdv_block_k)
    dq, dk, dv = flash_backward(
        jnp.asarray(dq_schedule), jnp.asarray(dkdv_schedule),
        jnp.asarray(st.windows, jnp.int32), q, k, v, segment_ids, do, lse2, delta_BxHxT,
        dq_blocks=(c.dq_block_q, c.dq_block_k), dkdv_blocks=(c.dkdv_block_q, c.dkdv_block_k),
        sm_scale=st.sm_scale, num_warps=c.bwd_num_warps, num_stages=c.bwd_num_stages,
        loop_mode=c.bwd_loop, interpret=st.interpret)
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
