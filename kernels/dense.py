"""The dense layers of a decode step as single launches: a LayerNorm and the projections that
read it (``norm_dense``), a projection added to the residual stream (``dense_residual``).

Backends: "xla" (plain JAX, flax's LayerNorm and Linear arithmetic: the reference twin) and
"pallas_gpu" (``kernels/pallas_gpu/dense.py``: one launch each). The model's decode step
(``ls_jax.layers.transformer.Block``) calls them on the rows of one new token per sequence;
everything else runs flax's modules. Callers pass checked arrays: x [R, K], each weight
[K, N], biases [N], the LayerNorm's scale and shift [K].
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp

from ls_jax.kernels.band import cdiv

# Rows a pallas_gpu call takes: its programs hold 16 rows each (kernels/pallas_gpu/dense.py) and
# read their weight block once per 16 rows, so past 4 row blocks the product is a GEMM that XLA
# tiles better.
PALLAS_MAX_ROWS = 64
# Bytes of x a pallas_gpu launch's programs read together from L2 at most: each program reads
# all of x for its block of columns, so past this those reads cost more than the launches the
# kernel saves.
PALLAS_MAX_X_READS = 8 * 1024 * 1024


def x_reads(rows: int, row_bytes: int, N: int) -> int:
    """Bytes of x [rows, K] a pallas_gpu launch with N output columns reads, its programs
    together: ``row_bytes`` per row (K x itemsize, twice for a LayerNorm's statistics pass)."""
    from ls_jax.kernels.pallas_gpu.dense import BLOCK_N

    return rows * row_bytes * cdiv(N, BLOCK_N)


def choose_dense_implementation(rows: int, *, dtype, attention: str,
                                products: Sequence[tuple[int, int]]) -> str:
    """"pallas_gpu" where a decode step's attention runs our Pallas GPU kernel
    (``attention``, ``kernels.decode.choose_decode_implementation``'s choice), on at most
    ``PALLAS_MAX_ROWS`` rows computed in bfloat16 or float16, each launch reading at most
    ``PALLAS_MAX_X_READS`` of x (``products``: the (row bytes, N) of each launch, see
    ``x_reads``), else "xla".

    A decode step's products are small and the step is bound by its launches, which the
    Pallas kernel makes one per layer part; with more rows or wider layers the products are
    GEMMs that XLA tiles better; Triton's dot runs float32 inputs at reduced precision. With
    XLA's attention the step stays XLA's: its fusions of the attention read the projections'
    GEMM."""
    half = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    if (attention == "pallas_gpu" and half and rows <= PALLAS_MAX_ROWS
            and max(x_reads(rows, b, n) for b, n in products) <= PALLAS_MAX_X_READS):
        return "pallas_gpu"
    return "xla"


def layer_norm(x_RxK, scale_K, shift_K, eps: float):
    """flax's LayerNorm in float32 (variance as E[x^2] - E[x]^2)."""
    x = x_RxK.astype(jnp.float32)
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.maximum(jnp.mean(x * x, axis=-1, keepdims=True) - mean * mean, 0.0)
    return (x - mean) * (jax.lax.rsqrt(var + eps) * scale_K.astype(jnp.float32)) \
        + shift_K.astype(jnp.float32)


def _linear(x, w, b, compute_dtype):
    """flax's Linear: inputs, weight and bias in ``compute_dtype``."""
    y = jnp.dot(x.astype(compute_dtype), w.astype(compute_dtype))
    return y if b is None else y + b.astype(compute_dtype)


def norm_dense(x_RxK, scale_K, shift_K, weights: Sequence, biases: Sequence | None, *,
               eps: float, compute_dtype, activation: str | None = None,
               implementation: str = "xla", interpret: bool = False) -> tuple:
    """(act(LayerNorm(x) @ w + b) for each (w, b)), each [R, N] in ``compute_dtype``: the
    LayerNorm in float32 then cast, as flax's modules compute it; ``biases`` None: none."""
    compute_dtype = jnp.dtype(compute_dtype)
    if implementation == "pallas_gpu":
        from ls_jax.kernels.pallas_gpu.dense import pallas_gpu_dense

        return pallas_gpu_dense(x_RxK, tuple(weights), None if biases is None else tuple(biases),
                                norm=(scale_K, shift_K), eps=float(eps), activation=activation,
                                out_dtype=compute_dtype, compute_dtype=compute_dtype,
                                interpret=interpret)
    h = layer_norm(x_RxK, scale_K, shift_K, eps).astype(compute_dtype)
    outs = []
    for i, w in enumerate(weights):
        y = _linear(h, w, None if biases is None else biases[i], compute_dtype)
        outs.append(jax.nn.gelu(y, approximate=True) if activation == "gelu_tanh" else y)
    return tuple(outs)


def dense_residual(h_RxK, w_KxN, b_N, residual_RxN, *, compute_dtype,
                   implementation: str = "xla", interpret: bool = False):
    """residual + (h @ w + b), in the residual's dtype; ``b_N`` None: no bias."""
    compute_dtype = jnp.dtype(compute_dtype)
    if implementation == "pallas_gpu":
        from ls_jax.kernels.pallas_gpu.dense import pallas_gpu_dense

        return pallas_gpu_dense(h_RxK, (w_KxN,), None if b_N is None else (b_N,),
                                residual=residual_RxN, out_dtype=residual_RxN.dtype,
                                compute_dtype=compute_dtype, interpret=interpret)[0]
    return residual_RxN + _linear(h_RxK, w_KxN, b_N, compute_dtype)
