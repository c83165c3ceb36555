"""In-kernel pieces of the Triton kernels: element masks, band loops, launch parameters."""

from __future__ import annotations

import typing

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ls_jax.kernels.band import tile_allowed_KxQ, tile_allowed_QxK
from ls_jax.kernels.pallas_gpu.common import MASKED_SCORE
from ls_jax.kernels.pallas_gpu.configs import TritonConfig

LOOP_MODES = ("split", "cond", "masked")


class TilePath(typing.NamedTuple):
    """How a kernel walks its tiles: block_q x block_k, and how boundary tiles get their mask
    (one of ``LOOP_MODES``, see ``run_band_loop``)."""

    block_q: int
    block_k: int
    loop_mode: str


def compiler_params(config: TritonConfig):
    return plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages)


def allowed_QxK(q_first, k_first, block_q: int, block_k: int, window, segment_ref=None,
                batch=None):
    """bool [block_q, block_k]: the band (``kernels.band``) and, with a segment-id ref
    [B, T], the same segment."""
    seg_Q1 = seg_1K = None
    if segment_ref is not None:
        seg_Q1 = segment_ref[batch, pl.ds(q_first, block_q)][:, None]
        seg_1K = segment_ref[batch, pl.ds(k_first, block_k)][None, :]
    return tile_allowed_QxK(q_first, k_first, block_q, block_k, window, seg_Q1, seg_1K)


def allowed_KxQ(q_first, k_first, block_q: int, block_k: int, window, segment_ref=None,
                batch=None):
    """bool [block_k, block_q]: the transpose of ``allowed_QxK`` (for the dK/dV tiles)."""
    seg_K1 = seg_1Q = None
    if segment_ref is not None:
        seg_K1 = segment_ref[batch, pl.ds(k_first, block_k)][:, None]
        seg_1Q = segment_ref[batch, pl.ds(q_first, block_q)][None, :]
    return tile_allowed_KxQ(q_first, k_first, block_q, block_k, window, seg_K1, seg_1Q)


def mask_scores(s, ok_fn, masking):
    """Applies the element mask ``ok_fn()`` to scores ``s`` as ``masking`` says.

    masking: "none" (interior tile), "always" (boundary tile), or a traced bool scalar that
    says at run time whether this tile needs the mask (one loop over all tiles).
    """
    if isinstance(masking, str):
        if masking == "none":
            return s
        return jnp.where(ok_fn(), s, MASKED_SCORE)
    return jax.lax.cond(masking, lambda x: jnp.where(ok_fn(), x, MASKED_SCORE),
                        lambda x: x, s)


def run_band_loop(first, lo, hi, end, tile, carry, mode: str):
    """Runs ``carry = tile(j, carry, masking)`` for j in [first, end).

    [lo, hi) are the interior tiles (no element mask). mode "split": three loops, masks
    compiled only into the outer two; "cond": one loop, the mask behind a run-time branch
    (one software pipeline for short loops); "masked": one loop, every tile masked (needed
    when a segment mask applies everywhere).
    """
    if mode == "masked":
        return jax.lax.fori_loop(first, end, lambda j, c: tile(j, c, "always"), carry)
    if mode == "cond":
        return jax.lax.fori_loop(
            first, end, lambda j, c: tile(j, c, (j < lo) | (j >= hi)), carry)
    if mode != "split":
        raise ValueError(f"loop mode: expected one of {LOOP_MODES}, got {mode!r}")
    carry = jax.lax.fori_loop(first, lo, lambda j, c: tile(j, c, "always"), carry)
    carry = jax.lax.fori_loop(lo, hi, lambda j, c: tile(j, c, "none"), carry)
    return jax.lax.fori_loop(hi, end, lambda j, c: tile(j, c, "always"), carry)
