"""The local heads' backward as *strips* (Triton lowering): dQ, dK and dV in one pass.

The two Triton backward kernels (``backward.py``) each re-read the other side of the band
for every block they own: dK/dV streams the 2-3 query blocks (Q, dO) that reach its key
block, dQ streams the 2-3 key blocks (K, V) of its query block, and both recompute the
scores and dP. Here one program walks a *strip* of consecutive key blocks of one local head
and batch element, and for each key block j:

* loads K_j, V_j once and visits the ``ring`` query blocks i = j .. j + ring - 1 its band
  reaches (``kernels.band.q_block_range``; ring = 3 at p=128 with 64-row blocks);
* computes S^T, P^T, dP^T, dS^T once per (j, i) and all three products from them:
  dV_j += P^T dO_i, dK_j += dS^T Q_i, and dQ_i += dS K_j (five products, not seven);
* keeps dQ of the query blocks j .. j + ring - 1 in registers, one float32 accumulator per
  slot of a ring: query block j gets its last contribution at step j (the diagonal), so
  slot 0 is stored after the step and the ring shifts by one. Each row's
  ``delta = rowsum(O * dO)`` is computed once, when its block enters the ring.

A strip's first query blocks also take contributions from the ``ring - 1`` key blocks
before the strip; the program recomputes those pairs itself (dQ only) before its first
step, so every output element is written by exactly one program, in a fixed order: the
gradients are bit-reproducible, unlike a scheme with atomic or TMA reductions.

Needs one kv head per query head (no GQA), no segment ids and a ring of at most
``MAX_RING`` blocks (``strip_bwd_fits``); elsewhere ``backward.py`` runs the local heads.
In an LS mix the global heads' kernels run first and this one writes the local heads' rows
into the same buffers (``input_output_aliases``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ls_jax.kernels.band import cdiv, q_block_range, q_full_block_range, tile_allowed_KxQ
from ls_jax.kernels.pallas_gpu.plan import STRIP_BLOCK
from ls_jax.kernels.pallas_gpu.tiles import LOG2_E, MASKED_SCORE

MAX_RING = 5  # dQ accumulators held in registers (p <= 256 with 64-row blocks)
MAX_HEAD_DIM = 64  # ring x 64 x D float32 accumulators: D=128 would spill
DEFAULT_NUM_WARPS = 4
DEFAULT_NUM_STAGES = 2
DEFAULT_STRIP = 16  # key blocks per program


def ring_size(windows, block: int = STRIP_BLOCK) -> int:
    """Query blocks a key block's band reaches, at most, over the heads' effective windows."""
    return max(int(end - first) for first, end in
               (q_block_range(1, block, block, w, 1 << 30) for w in windows))


def full_slots(windows, block: int = STRIP_BLOCK) -> tuple[bool, ...]:
    """Per ring slot r (query block j + r of key block j): True when the tile lies wholly
    inside every head's band, so it needs no element mask."""
    ring = ring_size(windows, block)
    full = [True] * ring
    for w in windows:
        first, end = q_full_block_range(1, block, block, w, 1 << 30)
        full = [ok and first <= 1 + r < end for r, ok in enumerate(full)]
    return tuple(full)


def strip_bwd_fits(head_dim: int, windows, grouped: bool, has_segments: bool) -> bool:
    """True when this kernel takes these local heads (effective windows, padded D)."""
    return (len(windows) > 0 and not grouped and not has_segments
            and head_dim <= MAX_HEAD_DIM and ring_size(windows) <= MAX_RING)


def _kernel(heads_ref, window_ref, q_ref, k_ref, v_ref, do_ref, o_ref, lse_ref, *refs,
            block, ring, full, strip, num_blocks, score_scale, scale, num_prefilled):
    dq_ref, dk_ref, dv_ref = refs[num_prefilled:]  # aliased inputs (unread) come first
    b = pl.program_id(0)
    h = heads_ref[pl.program_id(1)]
    first = pl.program_id(2) * strip
    end = jnp.minimum(first + strip, num_blocks)
    window = window_ref[h]
    head_dim = q_ref.shape[-1]
    c = score_scale

    def rows(i):
        return pl.ds(jnp.minimum(i, num_blocks - 1) * block, block)  # clamped: never read out

    def delta_of(i):
        o_QxD = o_ref[b, rows(i), h, :].astype(jnp.float32)
        return jnp.sum(o_QxD * do_ref[b, rows(i), h, :].astype(jnp.float32), axis=1)

    def pair(j, i, slot, kv, dq_QxD, delta_Q, grads):
        """Key block j with query block i (ring slot ``slot``): dQ_i, and with ``grads`` dK_j
        and dV_j, take this tile's contributions."""
        k_KxD, v_KxD = kv
        q_QxD = q_ref[b, rows(i), h, :]
        do_QxD = do_ref[b, rows(i), h, :]
        lse_Q = lse_ref[b, h, rows(i)]
        sT_KxQ = plgpu.dot(k_KxD, q_QxD, trans_b=True)
        if not full[slot]:
            ok_KxQ = tile_allowed_KxQ(i * block, j * block, block, block, window)
            sT_KxQ = jnp.where(ok_KxQ, sT_KxQ, MASKED_SCORE)
        pT_KxQ = jnp.exp2(sT_KxQ * c - lse_Q[None, :])
        if grads is not None:
            dk_KxD, dv_KxD = grads
            dv_KxD = dv_KxD + plgpu.dot(pT_KxQ.astype(do_QxD.dtype), do_QxD)
        dpT_KxQ = plgpu.dot(v_KxD, do_QxD, trans_b=True)
        dsT_KxQ = (pT_KxQ * (dpT_KxQ - delta_Q[None, :])).astype(q_QxD.dtype)
        if grads is not None:
            grads = (dk_KxD + plgpu.dot(dsT_KxQ, q_QxD), dv_KxD)
        dq_QxD = dq_QxD + plgpu.dot(dsT_KxQ, k_KxD, trans_a=True)
        return dq_QxD, grads

    def load_kv(j):
        cols = pl.ds(jnp.maximum(j, 0) * block, block)
        return k_ref[b, cols, h, :], v_ref[b, cols, h, :]

    zeros_QxD = jnp.zeros((block, head_dim), jnp.float32)
    dq_ring = [zeros_QxD] * ring  # slot r: query block first + r
    delta_ring = [delta_of(first + r) for r in range(ring)]

    # the key blocks before the strip reach its first query blocks: their dQ share only
    for back in range(1, ring):
        j = first - back
        kv = load_kv(j)
        for slot in range(back, ring):  # query block j + slot = first + slot - back
            i = j + slot
            target = slot - back
            dq_ring[target] = lax.cond(
                (j >= 0) & (i < num_blocks),
                lambda dq, kv=kv, j=j, i=i, slot=slot, target=target: pair(
                    j, i, slot, kv, dq, delta_ring[target], None)[0],
                lambda dq: dq, dq_ring[target])

    def step(j, carry, checked: bool):
        dq_ring, delta_ring = carry
        kv = load_kv(j)
        grads = (zeros_QxD, zeros_QxD)
        dq_ring = list(dq_ring)
        for slot in range(ring):
            i = j + slot
            if checked and slot:  # past the sequence's last block: nothing to add

                def add(operands, j=j, i=i, slot=slot):
                    return pair(j, i, slot, kv, *operands[:2], operands[2])

                dq_ring[slot], grads = lax.cond(
                    i < num_blocks, lambda ops: add(ops),
                    lambda ops: (ops[0], ops[2]), (dq_ring[slot], delta_ring[slot], grads))
            else:
                dq_ring[slot], grads = pair(j, i, slot, kv, dq_ring[slot], delta_ring[slot],
                                            grads)
        dk_KxD, dv_KxD = grads
        cols = pl.ds(j * block, block)
        dk_ref[b, cols, h, :] = (dk_KxD * scale).astype(dk_ref.dtype)
        dv_ref[b, cols, h, :] = dv_KxD.astype(dv_ref.dtype)
        dq_ref[b, cols, h, :] = (dq_ring[0] * scale).astype(dq_ref.dtype)  # query block j
        return (tuple(dq_ring[1:]) + (zeros_QxD,),
                tuple(delta_ring[1:]) + (delta_of(j + ring),))

    carry = (tuple(dq_ring), tuple(delta_ring))
    # steps whose whole ring lies inside the sequence, then the last ring - 1 blocks' steps
    safe_end = jnp.clip(num_blocks - ring + 1, first, end)
    carry = lax.fori_loop(first, safe_end, functools.partial(step, checked=False), carry)
    lax.fori_loop(safe_end, end, functools.partial(step, checked=True), carry)


def backward_call_strip(plan, q, k, v, do, out, lse2, heads: tuple[int, ...], prefilled=None,
                        *, strip: int = DEFAULT_STRIP, num_warps: int = DEFAULT_NUM_WARPS,
                        num_stages: int = DEFAULT_NUM_STAGES):
    """dq, dk, dv of the local ``heads`` on padded inputs (Tp a multiple of ``STRIP_BLOCK``,
    one kv head per query head; ``strip_bwd_fits``).

    prefilled: None or the (dq, dk, dv) of an earlier launch (the global heads'), into which
    this one writes its heads' rows (aliased); without it the other heads' rows are left
    unwritten. strip: key blocks per program; num_warps, num_stages: Triton's.
    """
    B, Tp, H, Dp = q.shape
    assert Tp % STRIP_BLOCK == 0 and k.shape[2] == H, (Tp, k.shape)
    num_blocks = Tp // STRIP_BLOCK
    windows = plan.window_table()
    local = [windows[h] for h in heads]
    strip = max(1, min(strip, num_blocks))
    kernel = functools.partial(
        _kernel, block=STRIP_BLOCK, ring=ring_size(local), full=full_slots(local),
        strip=strip, num_blocks=num_blocks, score_scale=plan.scale * LOG2_E,
        scale=plan.scale, num_prefilled=0 if prefilled is None else 3)
    inputs = (jnp.asarray(heads, jnp.int32), jnp.asarray(windows, jnp.int32), q, k, v, do, out,
              lse2)
    aliased = () if prefilled is None else tuple(prefilled)
    return pl.pallas_call(
        kernel,
        grid=(B, len(heads), cdiv(num_blocks, strip)),
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                   jax.ShapeDtypeStruct(k.shape, k.dtype),
                   jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=plan.interpret,
        input_output_aliases={len(inputs) + i: i for i in range(len(aliased))},
        name="ls_attention_bwd_strip",
    )(*inputs, *aliased)
