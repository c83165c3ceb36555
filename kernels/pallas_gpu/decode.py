"""Pallas GPU (Triton lowering) decode step: one new token per row, written into its cache
groups and attended with every query head in two launches (attend, then merge).

``kernels.decode.decode_step_attention`` for GPUs. Flash-decoding: the grid is (row,
program), a program being one (query head, split) pair of a static table; each program streams
its share of its kv head's cache group in blocks of ``block_s`` slots (masked loads, so no
padding or copy of the cache; the caches hold every layer's, the step reads one), keeps an
online softmax in float32 and writes a partial output with its running max and sum. A second
launch, one program per (row, query head), merges that head's splits into its output: a
step is a chain of small launches, so the merge is one launch rather than the several XLA
fusions its reductions would make. Each group has its own split count (``_plan`` of its slots
and heads), so a batch-1 step splits a global head's full history over enough programs to fill
the GPU while a local head's ring gets one program per block it has, and no program has an
empty share. A group whose positions follow a ``kernels.decode.SlotRule`` passes each row's
length, and a program computes its slots' positions (``kernels.band.slot_positions``): its
key and value loads then wait on no other load, and the step reads no position array. The
static tables (windows, groups, each program's head and split) are one int32 operand. Split 0 of each head
also counts the new key (visible at offset 0), and split 0 of the first query head of each kv
head writes the new key and value into the group's slot: the cache arrays are aliased to the
outputs, so the write happens in place, and no program reads that slot (it is masked out), so
the write races with nothing. A step is bound by memory bandwidth and launches (each cached
key and value is read once, 2 FLOPs per byte), so the kernel uses no matrix units: q . k and
p . v are elementwise products and sums.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ls_jax.kernels.band import allowed, cdiv, slot_positions, window_array
from ls_jax.kernels.pallas_gpu.common import triton_block

_NEG = -1e30
# Programs a step should have at least: 8 per SM of a 132-SM GPU. A program keeps one block of
# loads in flight, so an SM streams its share of the cache at its bandwidth only with several
# resident.
TARGET_PROGRAMS = 1056
# Slots a program loads per iteration: a step is bound by memory bandwidth, and 128 slots of
# keys and values keep enough bytes in flight per program for it.
BLOCK_S = 128


def merge_warps(block_splits: int, D: int) -> int:
    """Warps of a merge program: each thread holds at most 128 elements of its [block_splits,
    D] float32 partials (both powers of two, so the warps are one too), 1 to 8 warps."""
    return min(8, max(1, block_splits * D // (32 * 128)))


# A program that loads at most this many blocks waits mostly on their latency: four warps
# share each block's loads, so its blocks arrive sooner. A program streaming more keeps its SM
# busy with two, which leaves room for twice the programs resident.
SHORT_PROGRAM_BLOCKS = 8


def num_warps(D: int, blocks_per_program: int) -> int:
    """A warp per 32 columns of the head (each thread then holds at most 128 elements of a
    [BLOCK_S, D] tile, which stay in registers), at least two, and at least four when no
    program loads more than ``SHORT_PROGRAM_BLOCKS`` blocks."""
    return max(4 if blocks_per_program <= SHORT_PROGRAM_BLOCKS else 2, D // 32)


def _plan(B: int, heads: int, S: int, block_s: int, target_programs: int = TARGET_PROGRAMS):
    """(splits, blocks per split) of one group: enough programs (rows x its query heads x
    splits) to fill the GPU, no empty split."""
    blocks = cdiv(S, block_s)
    splits = max(1, min(blocks, cdiv(target_programs, B * heads)))
    per_split = cdiv(blocks, splits)
    return cdiv(blocks, per_split), per_split


def programs(B: int, Hq: int, group_of_head: Sequence[int], slots: Sequence[int],
             block_s: int, target_programs: int = TARGET_PROGRAMS
             ) -> tuple[tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]]:
    """(the (query head, split) of each program of a row, the (splits, blocks per split) of
    each group): group i (``slots[i]`` slots, the query heads h with ``group_of_head[h] == i``)
    is split by ``_plan``, so every program's share holds at least one slot of its group."""
    plans = tuple(_plan(B, sum(1 for g in group_of_head if g == i), S, block_s, target_programs)
                  for i, S in enumerate(slots))
    table = tuple((h, sp) for h in range(Hq) for sp in range(plans[group_of_head[h]][0]))
    return table, plans


_FIXED_INPUTS = 6  # q, k_new, v_new, q_pos, layer, tables


def lookup(x, values: Sequence[int]):
    """``values[x]`` for a traced int32 scalar ``x`` and a static sequence: one select per run of
    equal values, no load."""
    out = jnp.int32(values[0])
    for i in range(1, len(values)):
        if values[i] != values[i - 1]:
            out = jnp.where(x >= i, jnp.int32(values[i]), out)
    return out


def _step_kernel(*refs, n_groups: int, slots: tuple[int, ...], blocks_per_split: tuple[int, ...],
                 block_s: int, group: int, scale: float, rules: tuple[str | None, ...],
                 offsets: tuple[int, ...]):
    q_ref, kn_ref, vn_ref, qpos_ref, layer_ref, tab_ref = refs[:_FIXED_INPUTS]
    n = _FIXED_INPUTS
    group_refs = [refs[n + 4 * i: n + 4 + 4 * i] for i in range(n_groups)]
    acc_ref, m_ref, l_ref = refs[n + 4 * n_groups: n + 3 + 4 * n_groups]
    out_refs = [refs[n + 3 + 4 * n_groups + 2 * i: n + 5 + 4 * n_groups + 2 * i]
                for i in range(n_groups)]
    b, j = pl.program_id(0), pl.program_id(1)
    layer = layer_ref[0]  # the caches are [L, B, S, G, D]: this step's layer
    # tables: each head's window, group and index in its group, each program's head and split
    at_win, at_grp, at_head, at_ph, at_ps = offsets
    h, sp = tab_ref[at_ph + j], tab_ref[at_ps + j]  # this program's query head and split
    D = q_ref.shape[-1]
    kv = jax.lax.div(h, jnp.int32(group))  # the new token's kv head that query head h reads
    q_D = plgpu.load(q_ref.at[b, h, pl.ds(0, D)]).astype(jnp.float32) * scale
    q_pos = qpos_ref[b]
    real = q_pos >= 0
    window = tab_ref[at_win + h]
    cache_head = tab_ref[at_head + h]  # kv's index among its group's heads

    def attend(i):
        # pos_ref: the slots' positions [B, S], or the rows' lengths [B] under a rule
        k_ref, v_ref, pos_ref, slot_ref = group_refs[i]
        k_out_ref, v_out_ref = out_refs[i]
        S, per_split = slots[i], blocks_per_split[i]
        # the new key and value as the cache holds them (its dtype)
        k_new_D = plgpu.load(kn_ref.at[b, kv, pl.ds(0, D)]).astype(k_ref.dtype)
        v_new_D = plgpu.load(vn_ref.at[b, kv, pl.ds(0, D)]).astype(v_ref.dtype)
        slot = slot_ref[b]

        @pl.when(real & (sp == 0) & (jax.lax.rem(h, group) == 0) & (slot >= 0) & (slot < S))
        def _write():
            plgpu.store(k_out_ref.at[layer, b, slot, cache_head, pl.ds(0, D)], k_new_D)
            plgpu.store(v_out_ref.at[layer, b, slot, cache_head, pl.ds(0, D)], v_new_D)

        first = sp * per_split * block_s

        def body(j, carry):
            acc_D, m, l = carry
            start = first + j * block_s
            idx_S = start + jnp.arange(block_s)
            inside_S = (idx_S < S) & (idx_S != slot)  # the replaced slot: the new key now
            if rules[i] is None:
                k_pos_S = plgpu.load(pos_ref.at[b, pl.ds(start, block_s)], mask=inside_S,
                                     other=-1)
            else:  # computed: the loads below then wait on no other load
                k_pos_S = slot_positions(rules[i], pos_ref[b], idx_S, S)
            ok_S = inside_S & (k_pos_S >= 0) & allowed(q_pos, k_pos_S, window)
            ok_SxD = jnp.broadcast_to(ok_S[:, None], (block_s, D))
            k_SxD = plgpu.load(k_ref.at[layer, b, pl.ds(start, block_s), cache_head,
                                        pl.ds(0, D)],
                               mask=ok_SxD, other=0.0).astype(jnp.float32)
            s_S = jnp.where(ok_S, jnp.sum(k_SxD * q_D[None, :], axis=1), _NEG)
            m_new = jnp.maximum(m, jnp.max(s_S))
            alpha = jnp.exp(m - m_new)
            p_S = jnp.where(ok_S, jnp.exp(s_S - m_new), 0.0)
            v_SxD = plgpu.load(v_ref.at[layer, b, pl.ds(start, block_s), cache_head,
                                        pl.ds(0, D)],
                               mask=ok_SxD, other=0.0).astype(jnp.float32)
            acc_D = acc_D * alpha + jnp.sum(p_S[:, None] * v_SxD, axis=0)
            return acc_D, m_new, l * alpha + jnp.sum(p_S)

        # split 0 starts from the new key (its own query always sees it); the others from 0
        own = real & (sp == 0)
        s_new = jnp.sum(k_new_D.astype(jnp.float32) * q_D)
        init = (jnp.where(own, v_new_D.astype(jnp.float32), 0.0),
                jnp.where(own, s_new, _NEG), own.astype(jnp.float32))
        acc_D, m, l = jax.lax.fori_loop(0, per_split, body, init)
        plgpu.store(acc_ref.at[b, h, sp, pl.ds(0, D)], acc_D)
        plgpu.store(m_ref.at[b, h, pl.ds(sp, 1)], jnp.full((1,), m, jnp.float32))
        plgpu.store(l_ref.at[b, h, pl.ds(sp, 1)], jnp.full((1,), l, jnp.float32))

    grp = tab_ref[at_grp + h]
    for i in range(n_groups):
        pl.when(grp == i)(functools.partial(attend, i))


def _merge_kernel(acc_ref, m_ref, l_ref, out_ref, *, block_splits: int,
                  splits_H: tuple[int, ...]):
    """Program (b, h): head h's splits (``splits_H[h]`` of them) merged into out[b, h]."""
    b, h = pl.program_id(0), pl.program_id(1)
    D = acc_ref.shape[-1]
    launched = jnp.arange(block_splits) < lookup(h, splits_H)  # the others were never written
    m = plgpu.load(m_ref.at[b, h, pl.ds(0, block_splits)], mask=launched, other=_NEG)
    l = plgpu.load(l_ref.at[b, h, pl.ds(0, block_splits)], mask=launched, other=0.0)
    acc = plgpu.load(acc_ref.at[b, h, pl.ds(0, block_splits), pl.ds(0, D)],
                     mask=jnp.broadcast_to(launched[:, None], (block_splits, D)), other=0.0)
    w = jnp.where(l > 0, jnp.exp(m - jnp.max(m)), 0.0)  # a split that saw nothing weighs 0
    denom = jnp.sum(l * w)
    out = jnp.sum(acc * w[:, None], axis=0) / jnp.where(denom > 0, denom, 1.0)
    plgpu.store(out_ref.at[b, h, pl.ds(0, D)], out.astype(out_ref.dtype))


def merge_splits(acc, m, l, splits_H: Sequence[int], dtype, *, interpret: bool = False):
    """out [B, H, D] (``dtype``) of the attend launch's partials, acc [B, H, splits, D] and
    m, l [B, H, splits] float32, of which head h wrote the first ``splits_H[h]`` splits."""
    B, H, most, D = acc.shape
    block_splits = max(2, 1 << (most - 1).bit_length())
    return pl.pallas_call(
        functools.partial(_merge_kernel, block_splits=block_splits,
                          splits_H=tuple(int(x) for x in splits_H)),
        grid=(B, H),
        out_shape=jax.ShapeDtypeStruct((B, H, D), dtype),
        compiler_params=plgpu.CompilerParams(num_warps=merge_warps(block_splits, D),
                                             num_stages=1),
        interpret=interpret,
        name="ls_decode_merge",
    )(acc, m, l)


@functools.partial(jax.jit, static_argnames=("kv_heads", "position_rules", "window_sizes",
                                             "scale", "interpret", "block_s", "target_programs"))
def pallas_gpu_decode_step(q, k_new, v_new, q_pos, groups, *, kv_heads, window_sizes, scale,
                           layer, position_rules=None, interpret=False, block_s: int = BLOCK_S,
                           target_programs: int = TARGET_PROGRAMS):
    """``kernels.decode.decode_step_attention`` (validated inputs): q [B, Hq, D], k/v_new
    [B, Hkv, D], q_pos [B], groups ((k, v [L, B, S, G, D], k_pos [B, S], slot [B]), ...) with
    kv_heads ((kv heads of each group), ...); with ``position_rules[i]`` a ``SlotRule`` kind
    (not None), group i gives its rows' lengths [B] in place of k_pos. The step reads and
    writes layer ``layer`` (an int32 scalar) of every group's k and v, in place. Returns
    (out [B, Hq, D], ((k, v), ...)). ``block_s`` and ``target_programs``: the defaults
    unless a benchmark compares others."""
    B, Hq, D = q.shape
    if D & (D - 1):
        raise ValueError(f"q: the pallas_gpu decode kernel needs a power-of-two head_dim, got {D}")
    Hkv = k_new.shape[1]
    group = Hq // Hkv
    # per query head: its kv head's group and index within the group
    where = {kv: (i, j) for i, heads in enumerate(kv_heads) for j, kv in enumerate(heads)}
    grp_H = np.array([where[h // group][0] for h in range(Hq)], np.int32)
    head_H = np.array([where[h // group][1] for h in range(Hq)], np.int32)
    slots = tuple(int(k.shape[2]) for k, _, _, _ in groups)
    block_s = min(block_s, triton_block(max(slots)))
    table, plans = programs(B, Hq, grp_H.tolist(), slots, block_s, target_programs)
    splits, per_split = zip(*plans)
    n = len(groups)
    rules = tuple(position_rules) if position_rules is not None else (None,) * n
    # one int32 operand holds every table: a constant XLA cannot turn into an iota launch
    parts = (window_array(window_sizes), grp_H, head_H, [h for h, _ in table],
             [sp for _, sp in table])
    offsets = tuple(int(x) for x in np.cumsum([0] + [len(p) for p in parts[:-1]]))
    tables = np.concatenate([np.asarray(p, np.int32) for p in parts])
    kernel = functools.partial(_step_kernel, n_groups=n, slots=slots,
                               blocks_per_split=per_split, block_s=block_s, group=group,
                               scale=scale, rules=rules, offsets=offsets)
    flat = [x for g in groups for x in g]
    most = max(splits)
    out_shape = [jax.ShapeDtypeStruct((B, Hq, most, D), jnp.float32),
                 jax.ShapeDtypeStruct((B, Hq, most), jnp.float32),
                 jax.ShapeDtypeStruct((B, Hq, most), jnp.float32)]
    aliases = {}
    for i, (k, v, _, _) in enumerate(groups):
        aliases[_FIXED_INPUTS + 4 * i] = len(out_shape)
        out_shape.append(jax.ShapeDtypeStruct(k.shape, k.dtype))
        aliases[_FIXED_INPUTS + 1 + 4 * i] = len(out_shape)
        out_shape.append(jax.ShapeDtypeStruct(v.shape, v.dtype))
    acc, m, l, *caches = pl.pallas_call(
        kernel,
        grid=(B, len(table)),
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps(D, max(per_split)),
                                             num_stages=2),
        interpret=interpret,
        name="ls_decode_step",
    )(q, k_new, v_new, q_pos, jnp.reshape(jnp.asarray(layer, jnp.int32), (1,)),
      jnp.asarray(tables), *flat)
    out = merge_splits(acc, m, l, np.array(splits)[grp_H], q.dtype, interpret=interpret)
    return out, tuple(zip(caches[0::2], caches[1::2]))
