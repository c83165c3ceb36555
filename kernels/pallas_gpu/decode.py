"""Pallas GPU (Triton lowering) decode kernel: one new query per row over a key/value cache.

Flash-decoding: the grid is (row, query head, split); each program streams its share of the
cache slots in blocks of ``block_s`` (masked loads, so the cache length needs no padding and
the cache is never copied), keeps an online softmax in float32, and writes a partial output
with its running max and sum; a few XLA ops merge the splits. Splits give a batch-1 step
enough programs to fill the GPU. Visibility per slot is the rule of ``kernels/decode.py``
(slot positions, -1 = empty, window per head). A decode step is bound by memory bandwidth
(each cached key and value is read once, 2 FLOPs per byte), so the kernel uses no matrix
units: q . k and p . v are elementwise products and sums.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ls_jax.kernels.band import allowed, window_array

_NEG = -1e30


def _decode_kernel(q_ref, k_ref, v_ref, qpos_ref, kpos_ref, win_ref, acc_ref, m_ref, l_ref, *,
                   group: int, num_slots: int, block_s: int, blocks_per_split: int,
                   scale: float):
    b, h, sp = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    g = jax.lax.div(h, group)
    D = q_ref.shape[-1]
    q_D = plgpu.load(q_ref.at[b, h, pl.ds(0, D)]).astype(jnp.float32) * scale
    q_pos = qpos_ref[b]
    window = win_ref[h]
    first = sp * blocks_per_split * block_s

    def body(j, carry):
        acc_D, m, l = carry
        start = first + j * block_s
        idx_S = start + jnp.arange(block_s)
        inside_S = idx_S < num_slots
        k_pos_S = plgpu.load(kpos_ref.at[b, pl.ds(start, block_s)], mask=inside_S, other=-1)
        ok_S = inside_S & (k_pos_S >= 0) & allowed(q_pos, k_pos_S, window)
        ok_SxD = jnp.broadcast_to(ok_S[:, None], (block_s, D))
        k_SxD = plgpu.load(k_ref.at[b, pl.ds(start, block_s), g, pl.ds(0, D)],
                           mask=ok_SxD, other=0.0).astype(jnp.float32)
        s_S = jnp.where(ok_S, jnp.sum(k_SxD * q_D[None, :], axis=1), _NEG)
        m_new = jnp.maximum(m, jnp.max(s_S))
        alpha = jnp.exp(m - m_new)
        p_S = jnp.where(ok_S, jnp.exp(s_S - m_new), 0.0)
        v_SxD = plgpu.load(v_ref.at[b, pl.ds(start, block_s), g, pl.ds(0, D)],
                           mask=ok_SxD, other=0.0).astype(jnp.float32)
        acc_D = acc_D * alpha + jnp.sum(p_S[:, None] * v_SxD, axis=0)
        return acc_D, m_new, l * alpha + jnp.sum(p_S)

    init = (jnp.zeros((D,), jnp.float32), jnp.float32(_NEG), jnp.float32(0.0))
    acc_D, m, l = jax.lax.fori_loop(0, blocks_per_split, body, init)
    plgpu.store(acc_ref.at[b, sp, h, pl.ds(0, D)], acc_D)
    plgpu.store(m_ref.at[b, sp, pl.ds(h, 1)], jnp.full((1,), m, jnp.float32))
    plgpu.store(l_ref.at[b, sp, pl.ds(h, 1)], jnp.full((1,), l, jnp.float32))


def _plan(B: int, Hq: int, S: int, block_s: int, target_programs: int = 528):
    """(splits, blocks per split): enough programs to fill the GPU, no empty split."""
    blocks = -(-S // block_s)
    splits = max(1, min(blocks, -(-target_programs // (B * Hq))))
    per_split = -(-blocks // splits)
    return -(-blocks // per_split), per_split


@functools.partial(jax.jit, static_argnames=("window_sizes", "scale", "interpret",
                                             "block_s", "num_warps"))
def pallas_gpu_cached_attention(q, k, v, q_pos, k_pos, *, window_sizes, scale,
                                interpret=False, block_s: int = 64, num_warps: int = 4):
    """``kernels.decode.cached_attention`` for one query per row (q [B, 1, Hq, D])."""
    B, T, Hq, D = q.shape
    if T != 1:
        raise ValueError(f"q: the pallas_gpu decode kernel takes one query per row (decode "
                         f"steps); got T={T}; use implementation='xla' for prefill chunks")
    if D & (D - 1):
        raise ValueError(f"q: the pallas_gpu decode kernel needs a power-of-two head_dim, got {D}")
    S, Hkv = k.shape[1], k.shape[2]
    block_s = min(block_s, max(16, 1 << (S - 1).bit_length()))
    splits, per_split = _plan(B, Hq, S, block_s)
    kernel = functools.partial(_decode_kernel, group=Hq // Hkv, num_slots=S, block_s=block_s,
                               blocks_per_split=per_split, scale=scale)
    acc, m, l = pl.pallas_call(
        kernel,
        grid=(B, Hq, splits),
        out_shape=[jax.ShapeDtypeStruct((B, splits, Hq, D), jnp.float32),
                   jax.ShapeDtypeStruct((B, splits, Hq), jnp.float32),
                   jax.ShapeDtypeStruct((B, splits, Hq), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=2),
        interpret=interpret,
        name="ls_decode",
    )(q[:, 0], k, v, q_pos[:, 0], k_pos, jnp.asarray(window_array(window_sizes)))
    m_max = jnp.max(m, axis=1, keepdims=True)
    w = jnp.where(l > 0, jnp.exp(m - m_max), 0.0)
    denom = jnp.sum(l * w, axis=1)
    out = jnp.sum(acc * w[..., None], axis=1) / jnp.where(denom > 0, denom, 1.0)[..., None]
    return out[:, None].astype(q.dtype)
