"""Pallas GPU (Triton lowering) dense layers of a decode step, each one launch.

``kernels.dense`` for GPUs. A decode step has a few rows (one token per sequence), so each
matrix product is small and a step of a small model is bound by its launches: XLA runs a
LayerNorm as a reduction and an elementwise pass, a product of a few rows as a split-K GEMM
(or a reduction) whose bias, activation and residual go into the next fusion, and the merged
q/k/v product as one GEMM and three slices. Here a LayerNorm and the products that read it
(``norm_dense``), or a product and the residual it is added to (``dense_residual``), are one
launch: a program owns ``BLOCK_M`` rows and ``BLOCK_N`` columns of one output, computes its rows'
statistics itself (recomputed per column block from L2, which costs less than a launch), then
streams the weight in blocks of ``block_k`` rows through Triton's dot, and adds bias,
activation and residual before its one store.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ls_jax.kernels.band import cdiv
from ls_jax.kernels.pallas_gpu.common import triton_block

# Columns of one output a program computes. A few rows make a product bound by the latency of
# its loads, not by its FLOPs: narrow column blocks give more programs, each streaming less.
BLOCK_N = 16
# Weight rows a loop step reads at most: the largest power of two up to it that divides K (a
# step without masks), 64 with masks where none does.
BLOCK_K = 128
# Loop steps whose loads are in flight together.
NUM_STAGES = 4
# Rows of x a program holds, the fewest Triton's dot takes: more programs, each with less of x
# to read, finish sooner than fewer holding more rows.
BLOCK_M = 16
_GELU_C = math.sqrt(2.0 / math.pi)


def _pow2_block(n: int, most: int) -> int:
    """``n`` rounded up to a power of two, 16 (Triton's dot) to ``most``."""
    return min(most, triton_block(n))


def block_k(K: int, most: int = BLOCK_K) -> int:
    """Weight rows per loop step: the largest power of two from 16 to ``most`` that divides
    ``K``, else 64 (steps then mask the last rows)."""
    for bk in (most, most // 2, most // 4, most // 8):
        if bk >= 16 and K % bk == 0:
            return bk
    return min(64, _pow2_block(K, most))


def _gelu_tanh(x):
    return 0.5 * x * (1.0 + jnp.tanh(_GELU_C * (x + 0.044715 * x * x * x)))


def _kernel(*refs, n_out: int, starts: tuple[int, ...], rows: int, K: int, bm: int, bk: int,
            block_n: int, eps: float | None, has_bias: bool, activation: str | None,
            residual: bool, compute_dtype):
    """Program (i, j): rows i*bm .. of every output, column block j of the outputs laid end to
    end (output o owns blocks starts[o] .. starts[o+1] - 1)."""
    it = iter(refs)
    x_ref = next(it)
    scale_ref, shift_ref = (next(it), next(it)) if eps is not None else (None, None)
    w_refs = [next(it) for _ in range(n_out)]
    b_refs = [next(it) for _ in range(n_out)] if has_bias else [None] * n_out
    res_ref = next(it) if residual else None
    out_refs = [next(it) for _ in range(n_out)]
    i, j = pl.program_id(0), pl.program_id(1)
    r0 = i * bm
    row_ok = (r0 + jnp.arange(bm)) < rows
    steps = cdiv(K, bk)

    def load(ref, mask, f32=True):  # zeros where masked out; Triton takes no fill without a mask
        x = plgpu.load(ref) if mask is None else plgpu.load(ref, mask=mask, other=0.0)
        return x.astype(jnp.float32) if f32 else x

    def cols_ok(k0):
        return (k0 + jnp.arange(bk)) < K

    def x_block(k0):
        mask = row_ok[:, None] if K % bk == 0 else row_ok[:, None] & cols_ok(k0)[None, :]
        mask = jnp.broadcast_to(mask, (bm, bk))
        return load(x_ref.at[pl.ds(r0, bm), pl.ds(k0, bk)], mask)

    def vec(ref, k0):  # a [bk] slice of a [K] vector
        return load(ref.at[pl.ds(k0, bk)], None if K % bk == 0 else cols_ok(k0))

    if eps is not None:  # the rows' mean and variance, as flax's LayerNorm: E[x^2] - E[x]^2
        def stats(s, carry):
            total, squares = carry
            x = x_block(s * bk)
            return total + jnp.sum(x, axis=1), squares + jnp.sum(x * x, axis=1)

        zeros = jnp.zeros((bm,), jnp.float32)
        total, squares = jax.lax.fori_loop(0, steps, stats, (zeros, zeros))
        mean = total / K
        rstd = jax.lax.rsqrt(jnp.maximum(squares / K - mean * mean, 0.0) + eps)

    def output(o):
        w_ref, out_ref = w_refs[o], out_refs[o]
        N = out_ref.shape[-1]
        bn = _pow2_block(N, block_n)
        n0 = (j - starts[o]) * bn
        col_n = n0 + jnp.arange(bn)
        n_ok = None if N % bn == 0 else col_n < N

        def body(s, acc):
            k0 = s * bk
            x = x_block(k0)
            if eps is not None:
                x = (x - mean[:, None]) * (rstd[:, None] * vec(scale_ref, k0)[None, :]) \
                    + vec(shift_ref, k0)[None, :]
            mask = None
            if K % bk or n_ok is not None:
                k_ok = cols_ok(k0) if K % bk else jnp.ones((bk,), bool)
                mask = k_ok[:, None] & (jnp.ones((bn,), bool) if n_ok is None else n_ok)[None]
            w = load(w_ref.at[pl.ds(k0, bk), pl.ds(n0, bn)], mask, f32=False)
            return acc + plgpu.dot(x.astype(compute_dtype), w.astype(compute_dtype))

        y = jax.lax.fori_loop(0, steps, body, jnp.zeros((bm, bn), jnp.float32))
        if has_bias:
            y = y + load(b_refs[o].at[pl.ds(n0, bn)], n_ok)[None, :]
        if activation == "gelu_tanh":
            y = _gelu_tanh(y)
        store_mask = jnp.broadcast_to(
            row_ok[:, None] if n_ok is None else row_ok[:, None] & n_ok[None, :], (bm, bn))
        if residual:
            y = y + load(res_ref.at[pl.ds(r0, bm), pl.ds(n0, bn)], store_mask)
        plgpu.store(out_ref.at[pl.ds(r0, bm), pl.ds(n0, bn)], y.astype(out_ref.dtype),
                    mask=store_mask)

    if n_out == 1:
        output(0)
    else:
        for o in range(n_out):
            pl.when((j >= starts[o]) & (j < starts[o + 1]))(functools.partial(output, o))


@functools.partial(jax.jit, static_argnames=(
    "eps", "activation", "out_dtype", "compute_dtype", "interpret", "block_n", "max_block_k",
    "num_stages", "num_warps"))
def pallas_gpu_dense(x, weights, biases, *, norm=None, eps=None, residual=None,
                     activation=None, out_dtype, compute_dtype, interpret=False,
                     block_n: int = BLOCK_N, max_block_k: int = BLOCK_K,
                     num_stages: int = NUM_STAGES, num_warps: int = 4):
    """``kernels.dense`` (validated inputs): x [R, K]; weights (w [K, N_o], ...); biases
    (b [N_o], ...) or None; norm (scale [K], shift [K]) with ``eps``, or None; residual [R, N]
    (one output) or None. Returns (out [R, N_o] in ``out_dtype``, ...). The block sizes,
    stages and warps: the defaults unless a benchmark compares others."""
    R, K = x.shape
    bm = BLOCK_M
    bk = block_k(K, max_block_k)
    widths = [int(w.shape[1]) for w in weights]
    starts = tuple(int(s) for s in np.cumsum([0] + [cdiv(n, _pow2_block(n, block_n))
                                                    for n in widths]))
    kernel = functools.partial(
        _kernel, n_out=len(weights), starts=starts, rows=R, K=K, bm=bm, bk=bk, block_n=block_n,
        eps=None if norm is None else float(eps), has_bias=biases is not None,
        activation=activation, residual=residual is not None,
        compute_dtype=jnp.dtype(compute_dtype))
    inputs = [x, *(norm or ()), *weights, *(biases or ()),
              *(() if residual is None else (residual,))]
    return tuple(pl.pallas_call(
        kernel,
        grid=(cdiv(R, bm), starts[-1]),
        out_shape=[jax.ShapeDtypeStruct((R, n), out_dtype) for n in widths],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="ls_dense",
    )(*inputs))
