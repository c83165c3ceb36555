"""kernels/decode.py: cached attention (prefill chunks) and the decode step (write + attend)
against explicit per-query loops on CPU, the Pallas GPU decode step in interpret mode, its
lowering to Triton for a Hopper GPU (no GPU needed), and the backend choice."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ls_jax.kernels.decode import (ALL_GLOBAL_XLA_MIN_BATCH, CacheGroup, SlotRule,
                                   cached_attention, choose_decode_implementation,
                                   decode_step_attention, global_positions, ring_positions)
from triton_lowering import TRITON_CALL, lower_for_hopper  # tests/, beside this file


def loop_attention(q, k, v, q_pos, k_pos, windows):
    """numpy, one (row, query, head) at a time."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    B, T, Hq, D = q.shape
    r = Hq // k.shape[2]
    out = np.zeros_like(q)
    for b in range(B):
        for i in range(T):
            for h in range(Hq):
                w = np.inf if windows[h] is None else windows[h]
                qp = int(q_pos[b, i])
                slots = [s for s in range(k.shape[1])
                         if 0 <= k_pos[b, s] <= qp and qp - k_pos[b, s] < w]
                if not slots:
                    continue
                logits = np.array([q[b, i, h] @ k[b, s, h // r] / np.sqrt(D) for s in slots])
                p = np.exp(logits - logits.max())
                out[b, i, h] = (p / p.sum()) @ np.stack([v[b, s, h // r] for s in slots])
    return out


def normal(rng, *shape):
    """float32 inputs from numpy (no JAX program to compile per shape)."""
    return jnp.asarray(rng.standard_normal(shape, np.float32))


def attend(q, k, v, q_pos, k_pos, windows, implementation):
    """cached_attention as one jitted program (eagerly, each op would compile on its own)."""
    return jax.jit(lambda *a: cached_attention(*a, windows, implementation=implementation))(
        q, k, v, q_pos, k_pos)


def step(q, k_new, v_new, q_pos, groups, windows, implementation):
    """decode_step_attention as one jitted program (the groups' arrays as its arguments)."""
    def fn(q, k_new, v_new, q_pos, arrays):
        return decode_step_attention(
            q, k_new, v_new, q_pos,
            [CacheGroup(*a, g.kv_heads) for a, g in zip(arrays, groups)], windows,
            implementation=implementation)
    return jax.jit(fn)(q, k_new, v_new, q_pos, [(g.k, g.v, g.k_pos, g.slot_B) for g in groups])


def case(T, S=37, B=2, Hq=4, Hkv=2, D=16):
    rng = np.random.default_rng(0)
    q, k, v = normal(rng, B, T, Hq, D), normal(rng, B, S, Hkv, D), normal(rng, B, S, Hkv, D)
    # row 0: a global-style cache (slot = position, 30 written); row 1: scrambled positions
    k_pos = np.stack([np.where(np.arange(S) < 30, np.arange(S), -1),
                      np.arange(S)[::-1] - 3]).astype(np.int32)
    q_pos = np.stack([np.arange(29 - T + 1, 30), np.arange(20 - T + 1, 21)]).astype(np.int32)
    return q, k, v, jnp.asarray(q_pos), jnp.asarray(k_pos)


WINDOWS = (None, 5, 3, None)


@pytest.mark.parametrize("impl", ["reference", "xla"])
@pytest.mark.parametrize("T", [1, 4])
def test_chunk_backends_match_the_loop(impl, T):
    q, k, v, q_pos, k_pos = case(T)
    want = loop_attention(q, k, v, np.asarray(q_pos), np.asarray(k_pos), WINDOWS)
    got = attend(q, k, v, q_pos, k_pos, WINDOWS, impl)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_chunk_bf16_cache_close_to_float32():
    q, k, v, q_pos, k_pos = case(4)
    ref = attend(q, k, v, q_pos, k_pos, WINDOWS, "reference")
    got = attend(q, k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), q_pos, k_pos, WINDOWS,
                 "xla")
    np.testing.assert_allclose(got, ref, atol=3e-2)


# -- the decode step ------------------------------------------------------------------------

STEP_WINDOWS = (None, 4, 8, None, 3, 6)  # 6 query heads over 3 kv heads (GQA groups of 2)


def step_case(S_global=37, P=5, D=16, B=3):
    """Two groups: kv heads (0, 2) in a 37-slot cache, kv head 1 in a 5-slot ring. Row 0: slot
    = position, 30 written, the token at 30; row 1: scrambled positions, the token at 20, and
    the ring slot it replaces holds position 18, inside kv head 1's windows (so a slot that
    were not left out would change the result); row 2: padding."""
    rng = np.random.default_rng(1)
    q, k_new, v_new = normal(rng, B, 6, D), normal(rng, B, 3, D), normal(rng, B, 3, D)
    kg, vg = normal(rng, B, S_global, 2, D), normal(rng, B, S_global, 2, D)
    kr, vr = normal(rng, B, P, 1, D), normal(rng, B, P, 1, D)
    s = np.arange(S_global)
    pos_g = np.stack([np.where(s < 30, s, -1), s[::-1] - 3, np.where(s < 9, s, -1)])
    pos_r = np.array([[25, 26, 27, 28, 29], [15, 16, 17, 18, 19], [5, 6, 7, 8, -1]])
    q_pos = np.array([30, 20, -1])
    groups = (CacheGroup(kg, vg, jnp.asarray(pos_g, jnp.int32), jnp.asarray([30, 36, 9]),
                         (0, 2)),
              CacheGroup(kr, vr, jnp.asarray(pos_r, jnp.int32), jnp.asarray([0, 3, 4]), (1,)))
    return q, k_new, v_new, jnp.asarray(q_pos, jnp.int32), groups


def loop_step(q, k_new, v_new, q_pos, groups, windows):
    """numpy: (out [B, H, D], [(k, v) per group]) of one decode step, one head at a time."""
    q, k_new, v_new = (np.asarray(x, np.float64) for x in (q, k_new, v_new))
    B, Hq, D = q.shape
    r = Hq // k_new.shape[1]
    written = []
    for g in groups:
        k, v = np.array(g.k, np.float64), np.array(g.v, np.float64)
        for b in range(B):
            slot = int(g.slot_B[b])
            if q_pos[b] >= 0 and 0 <= slot < k.shape[1]:
                k[b, slot], v[b, slot] = k_new[b, list(g.kv_heads)], v_new[b, list(g.kv_heads)]
        written.append((k, v))
    out = np.zeros_like(q)
    for b in range(B):
        qp = int(q_pos[b])
        if qp < 0:
            continue
        for h in range(Hq):
            w = np.inf if windows[h] is None else windows[h]
            i = next(i for i, g in enumerate(groups) if h // r in g.kv_heads)
            g, j = groups[i], groups[i].kv_heads.index(h // r)
            slot, k_pos = int(g.slot_B[b]), np.asarray(g.k_pos[b])
            keys = [(np.asarray(g.k[b, s, j], np.float64), np.asarray(g.v[b, s, j], np.float64))
                    for s in range(k_pos.size)
                    if s != slot and 0 <= k_pos[s] <= qp and qp - k_pos[s] < w]
            keys.append((k_new[b, h // r], v_new[b, h // r]))  # its own key: offset 0
            logits = np.array([q[b, h] @ kk / np.sqrt(D) for kk, _ in keys])
            p = np.exp(logits - logits.max())
            out[b, h] = (p / p.sum()) @ np.stack([vv for _, vv in keys])
    return out, written


@pytest.mark.parametrize("impl, block_s", [("reference", None), ("xla", None),
                                           ("pallas_gpu", 16),  # 3 splits, a ragged tail
                                           ("pallas_gpu", 64)])  # one block
def test_decode_step_matches_the_loop(impl, block_s):
    q, k_new, v_new, q_pos, groups = step_case()
    want_out, want_kv = loop_step(q, k_new, v_new, np.asarray(q_pos), groups, STEP_WINDOWS)
    if impl == "pallas_gpu":
        from ls_jax.kernels.pallas_gpu.decode import pallas_gpu_decode_step

        out, kv = pallas_gpu_decode_step(  # the caches as the one layer of [1, ...] arrays
            q, k_new, v_new, q_pos,
            tuple((g.k[None], g.v[None], g.k_pos, g.slot_B) for g in groups),
            kv_heads=tuple(g.kv_heads for g in groups), window_sizes=STEP_WINDOWS, scale=0.25,
            layer=jnp.int32(0), interpret=True, block_s=block_s)
        kv = tuple((k[0], v[0]) for k, v in kv)
    else:
        out, kv = step(q, k_new, v_new, q_pos, groups, STEP_WINDOWS, impl)
    np.testing.assert_allclose(out, want_out, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(out[2], 0.0)  # the padding row
    for (k, v), (wk, wv) in zip(kv, want_kv):
        np.testing.assert_array_equal(k, wk)
        np.testing.assert_array_equal(v, wv)


@pytest.mark.parametrize("impl", ["reference", "xla", "pallas_gpu"])
def test_decode_step_on_one_layer_of_stacked_caches(impl):
    """With ``layer``, the groups hold L layers' caches: the step equals the one-layer step
    on that layer's arrays, writes only that layer, and leaves the others as they were."""
    q, k_new, v_new, q_pos, groups = step_case()
    want_out, want_kv = loop_step(q, k_new, v_new, np.asarray(q_pos), groups, STEP_WINDOWS)
    L, layer = 3, 1
    rng = np.random.default_rng(7)
    stacked = tuple(
        CacheGroup(*(jnp.stack([normal(rng, *x.shape), x, normal(rng, *x.shape)])
                     for x in (g.k, g.v)), g.k_pos, g.slot_B, g.kv_heads) for g in groups)

    def fn(q, k_new, v_new, q_pos, arrays, layer):
        return decode_step_attention(
            q, k_new, v_new, q_pos,
            [CacheGroup(*a, g.kv_heads) for a, g in zip(arrays, stacked)], STEP_WINDOWS,
            layer=layer, implementation=impl, interpret=impl == "pallas_gpu")
    out, kv = jax.jit(fn)(q, k_new, v_new, q_pos,
                          [(g.k, g.v, g.k_pos, g.slot_B) for g in stacked], jnp.int32(layer))
    np.testing.assert_allclose(out, want_out, atol=1e-5, rtol=1e-5)
    for (k, v), (wk, wv), g in zip(kv, want_kv, stacked):
        assert k.shape == g.k.shape and v.shape == g.v.shape
        np.testing.assert_array_equal(k[layer], wk)
        np.testing.assert_array_equal(v[layer], wv)
        for other in set(range(L)) - {layer}:
            np.testing.assert_array_equal(k[other], g.k[other])
            np.testing.assert_array_equal(v[other], g.v[other])


def ruled_case(S_global=37, P=5, D=16):
    """A model's cache: kv heads (0, 2) global, kv head 1 in a P-slot ring, rows of lengths
    30 (the ring wrapped), 3 (not yet), 0 (empty), and a padding row; each row's token at
    position = its length, in slot = position (mod P in the ring)."""
    rng = np.random.default_rng(2)
    lengths = jnp.asarray([30, 3, 0, 6], jnp.int32)
    q_pos = jnp.asarray([30, 3, 0, -1], jnp.int32)
    B = lengths.shape[0]
    q, k_new, v_new = normal(rng, B, 6, D), normal(rng, B, 3, D), normal(rng, B, 3, D)
    kg, vg = normal(rng, B, S_global, 2, D), normal(rng, B, S_global, 2, D)
    kr, vr = normal(rng, B, P, 1, D), normal(rng, B, P, 1, D)
    ruled = (CacheGroup(kg, vg, SlotRule("global", lengths), lengths, (0, 2)),
             CacheGroup(kr, vr, SlotRule("ring", lengths), lengths % P, (1,)))
    explicit = (CacheGroup(kg, vg, global_positions(lengths, S_global), lengths, (0, 2)),
                CacheGroup(kr, vr, ring_positions(lengths, P), lengths % P, (1,)))
    return q, k_new, v_new, q_pos, ruled, explicit


@pytest.mark.parametrize("impl", ["reference", "xla", "pallas_gpu"])
def test_decode_step_slot_rules_match_explicit_positions(impl):
    """A group whose positions are a SlotRule (the pallas kernel computes them, the others
    build them) attends and writes as with the positions given as arrays."""
    q, k_new, v_new, q_pos, ruled, explicit = ruled_case()
    want_out, want_kv = loop_step(q, k_new, v_new, np.asarray(q_pos), explicit, STEP_WINDOWS)

    def fn(q, k_new, v_new, q_pos, arrays):
        groups = [CacheGroup(k, v, SlotRule(g.k_pos.kind, n), slot, g.kv_heads)
                  for (k, v, n, slot), g in zip(arrays, ruled)]
        return decode_step_attention(q, k_new, v_new, q_pos, groups, STEP_WINDOWS,
                                     implementation=impl, interpret=impl == "pallas_gpu")
    out, kv = jax.jit(fn)(q, k_new, v_new, q_pos,
                          [(g.k, g.v, g.k_pos.lengths_B, g.slot_B) for g in ruled])
    np.testing.assert_allclose(out, want_out, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(out[3], 0.0)  # the padding row
    for (k, v), (wk, wv) in zip(kv, want_kv):
        np.testing.assert_array_equal(k, wk)
        np.testing.assert_array_equal(v, wv)


@pytest.mark.parametrize("rule, S, lengths", [("global", 37, [0, 1, 30, 37, 50]),
                                              ("ring", 5, [0, 1, 4, 5, 6, 30, 31]),
                                              ("ring", 1, [0, 1, 9])])
def test_kernel_slot_positions_match_the_rules(rule, S, lengths):
    """The positions a kernel program computes from one row's length (a scalar) equal
    ``SlotRule.positions`` of the rows."""
    from ls_jax.kernels.band import slot_positions

    n = jnp.asarray(lengths, jnp.int32)
    want = SlotRule(rule, n).positions(S)
    got = jax.vmap(lambda x: slot_positions(rule, x, jnp.arange(S, dtype=jnp.int32), S))(n)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("values", [(7,), (0, 0, 3, 3, 3, 1), (5, 4, 3, 2, 1), (2, 2, 2)])
def test_lookup_reads_a_static_table(values):
    from ls_jax.kernels.pallas_gpu.decode import lookup

    got = jax.vmap(lambda x: lookup(x, values))(jnp.arange(len(values), dtype=jnp.int32))
    np.testing.assert_array_equal(got, values)


@pytest.mark.parametrize("B, n_local, P", [(1, 5, 128), (64, 5, 128), (1, 11, 50),
                                          (64, 11, 128), (3, 0, 0)])
def test_decode_programs_each_read_their_own_group(B, n_local, P):
    """Per group its own split: every program's share of its group holds at least one slot,
    a head's splits cover its group's slots once, and a global head's 8320-slot history is
    split over at least as many programs as its blocks or the programs the GPU wants."""
    from ls_jax.kernels.pallas_gpu.decode import BLOCK_S, TARGET_PROGRAMS, programs

    S, block_s = 8320, BLOCK_S
    group_of_head = [0] + [1] * n_local
    slots = (S, P) if n_local else (S,)
    table, plans = programs(B, len(group_of_head), group_of_head, slots, block_s)
    for h, g in enumerate(group_of_head):
        splits, per_split = plans[g]
        starts = [sp * per_split * block_s for hh, sp in table if hh == h]
        assert starts == [i * per_split * block_s for i in range(splits)]
        assert all(start < slots[g] for start in starts)  # no empty share
        assert splits * per_split * block_s >= slots[g]  # every slot in some share
    global_programs = B * plans[0][0]
    assert global_programs >= min(-(-S // block_s) * B, TARGET_PROGRAMS)


@pytest.mark.parametrize("splits_H", [(3, 1, 1), (1, 1, 1), (5, 2, 5)])
def test_decode_merge_reads_only_the_written_splits(splits_H):
    """The merge launch equals the softmax-weighted sum of each head's written splits; the
    splits a head did not write hold NaN here (their memory is undefined) and change nothing;
    a row whose splits all saw nothing (l = 0) gets 0."""
    from ls_jax.kernels.pallas_gpu.decode import merge_splits

    rng = np.random.default_rng(3)
    B, H, most, D = 2, 3, max(splits_H), 16
    acc = rng.standard_normal((B, H, most, D)).astype(np.float32)
    m = rng.standard_normal((B, H, most)).astype(np.float32)
    l = rng.uniform(0.5, 2.0, (B, H, most)).astype(np.float32)
    l[1] = 0.0  # row 1 saw no key
    written = np.arange(most)[None, None, :] < np.array(splits_H)[None, :, None]
    want = np.zeros((B, H, D), np.float64)
    for b in range(B):
        for h in range(H):
            n = splits_H[h]
            w = np.exp(m[b, h, :n] - m[b, h, :n].max()) * (l[b, h, :n] > 0)
            if (l[b, h, :n] * w).sum() > 0:
                want[b, h] = (acc[b, h, :n] * w[:, None]).sum(0) / (l[b, h, :n] * w).sum()
    poison = lambda x, mask: np.where(mask, x, np.nan).astype(np.float32)
    got = merge_splits(jnp.asarray(poison(acc, written[..., None])),
                       jnp.asarray(poison(m, written)), jnp.asarray(poison(l, written)),
                       splits_H, jnp.float32, interpret=True)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_decode_step_bf16_cache_close_to_float32():
    q, k_new, v_new, q_pos, groups = step_case()
    ref, _ = step(q, k_new, v_new, q_pos, groups, STEP_WINDOWS, "reference")
    bf16 = tuple(CacheGroup(g.k.astype(jnp.bfloat16), g.v.astype(jnp.bfloat16), g.k_pos,
                            g.slot_B, g.kv_heads) for g in groups)
    got, kv = step(q, k_new, v_new, q_pos, bf16, STEP_WINDOWS, "xla")
    np.testing.assert_allclose(got, ref, atol=3e-2)
    assert all(k.dtype == jnp.bfloat16 and v.dtype == jnp.bfloat16 for k, v in kv)


@pytest.mark.parametrize("blocks", [1, 8, 9, 65])
@pytest.mark.parametrize("D", [16, 32, 64, 128, 256])
def test_decode_warps_bound_the_registers_per_thread(D, blocks):
    from ls_jax.kernels.pallas_gpu.decode import BLOCK_S, SHORT_PROGRAM_BLOCKS, num_warps

    warps = num_warps(D, blocks)
    assert warps >= (4 if blocks <= SHORT_PROGRAM_BLOCKS else 2)
    assert BLOCK_S * D / (32 * warps) <= 128  # tile elements per thread


@pytest.mark.parametrize("block_splits", [2, 16, 128, 256])
@pytest.mark.parametrize("D", [16, 32, 64, 128, 256])
def test_merge_warps_bound_the_registers_per_thread(block_splits, D):
    from ls_jax.kernels.pallas_gpu.decode import merge_warps

    warps = merge_warps(block_splits, D)
    assert warps in (1, 2, 4, 8)
    assert block_splits * D / (32 * warps) <= 128 or warps == 8  # partials per thread


@pytest.mark.parametrize("D, S_global, layers, rules", [
    (32, 37, 1, None),  # one block of 64 (the clamp)
    (64, 300, 1, None),  # three blocks of 128
    (64, 300, 4, None),  # one layer of a model's 4
    (32, 300, 4, ("global", "ring")),  # positions computed from the lengths
])
def test_pallas_decode_step_lowers_to_triton_for_an_h100(D, S_global, layers, rules):
    """The kernel's Triton lowering (jaxpr -> Triton IR, run by JAX in Python) for an abstract
    Hopper GPU, without a GPU: what interpret mode does not exercise."""
    from ls_jax.kernels.pallas_gpu.decode import pallas_gpu_decode_step

    q, k_new, v_new, q_pos, groups = step_case(S_global=S_global, D=D)
    args = [x.astype(jnp.bfloat16) for x in (q, k_new, v_new)]
    flat = tuple((jnp.stack([g.k.astype(jnp.bfloat16)] * layers),
                  jnp.stack([g.v.astype(jnp.bfloat16)] * layers),
                  g.k_pos if rules is None else q_pos, g.slot_B)
                 for g in groups)

    def step(q, k_new, v_new, q_pos, flat):
        return pallas_gpu_decode_step(q, k_new, v_new, q_pos, flat,
                                      kv_heads=tuple(g.kv_heads for g in groups),
                                      position_rules=rules, window_sizes=STEP_WINDOWS,
                                      scale=0.2, layer=jnp.int32(layers - 1))

    text = lower_for_hopper(step, *args, q_pos, flat)
    # one launch attends over both groups, one merges the splits
    assert text.count(TRITON_CALL) == 2
    assert "ls_decode_step" in text and "ls_decode_merge" in text


MIN = ALL_GLOBAL_XLA_MIN_BATCH


@pytest.mark.parametrize("name, requested, one_query, head_dim, batch, all_global, platform, want", [
    ("ls_step_on_cuda", None, True, 32, 64, False, "cuda", "pallas_gpu"),
    ("all_global_few_rows", None, True, 32, MIN - 1, True, "cuda", "pallas_gpu"),
    ("all_global_many_rows", None, True, 32, MIN, True, "cuda", "xla"),
    ("all_global_many_rows_wide_heads", None, True, 64, MIN, True, "cuda", "pallas_gpu"),
    ("all_global_named_kernel", "pallas_gpu", True, 32, MIN, True, "cuda", "pallas_gpu"),
    ("head_dim_not_pow2", None, True, 48, 1, False, "cuda", "xla"),  # no Triton block shape
    ("cpu", None, True, 32, 1, False, "cpu", "xla"),
    ("tpu", None, True, 32, 1, False, "tpu", "xla"),
    ("rocm", None, True, 32, 1, False, "rocm", "xla"),
    ("prefill_chunk", None, False, 32, 1, False, "cuda", "xla"),
    ("prefill_chunk_named_kernel", "pallas_gpu", False, 32, 1, False, "cuda", "xla"),
    ("prefill_chunk_reference", "reference", False, 32, 1, False, "cuda", "reference"),
    ("named_xla", "xla", True, 32, 1, False, "cuda", "xla"),
    ("named_kernel_on_cpu", "pallas_gpu", True, 32, 1, False, "cpu", "pallas_gpu"),  # interpret
])
def test_choose_decode_implementation(name, requested, one_query, head_dim, batch, all_global,
                                      platform, want):
    assert choose_decode_implementation(requested, one_query=one_query, head_dim=head_dim,
                                        batch=batch, all_global=all_global,
                                        platform=platform) == want


def test_bad_input():
    q, k, v, q_pos, k_pos = case(1)
    with pytest.raises(ValueError, match="implementation: expected None or one of"):
        cached_attention(q, k, v, q_pos, k_pos, WINDOWS, implementation="cudnn")
    with pytest.raises(ValueError, match=r"k_pos: expected int \[B=2, S=37\]"):
        cached_attention(q, k, v, q_pos, k_pos[:, :5], WINDOWS)
    with pytest.raises(ValueError, match="window_sizes: expected one entry per query head"):
        cached_attention(q, k, v, q_pos, k_pos, (None, 5))
    q, k_new, v_new, q_pos, (g0, g1) = step_case()
    with pytest.raises(ValueError, match=r"groups: expected every kv head 0..2 in exactly one"):
        decode_step_attention(q, k_new, v_new, q_pos, (g0,), STEP_WINDOWS)
    with pytest.raises(ValueError, match=r"groups\[1\].k/v: expected \[B=3, S, G=1, D=16\]"):
        decode_step_attention(q, k_new, v_new, q_pos,
                              (g0, CacheGroup(g1.k[:, :, :, :8], g1.v, g1.k_pos, g1.slot_B,
                                              g1.kv_heads)), STEP_WINDOWS)
    with pytest.raises(ValueError, match=r"q_pos: expected int \[B=3\]"):
        decode_step_attention(q, k_new, v_new, q_pos[:2], (g0, g1), STEP_WINDOWS)
    with pytest.raises(ValueError, match="implementation: expected None or one of"):
        decode_step_attention(q, k_new, v_new, q_pos, (g0, g1), STEP_WINDOWS,
                              implementation="cudnn")
    stacked = tuple(CacheGroup(g.k[None], g.v[None], g.k_pos, g.slot_B, g.kv_heads)
                    for g in (g0, g1))
    with pytest.raises(ValueError, match=r"layer: expected None or an int scalar, got 0.5"):
        decode_step_attention(q, k_new, v_new, q_pos, stacked, STEP_WINDOWS, layer=0.5)
    with pytest.raises(ValueError, match=r"layer: expected None or an int scalar, got Array"):
        decode_step_attention(q, k_new, v_new, q_pos, stacked, STEP_WINDOWS,
                              layer=jnp.zeros((2,), jnp.int32))
    with pytest.raises(ValueError, match=r"layer: expected 0 <= layer < 1 \(the layers of "
                                         r"groups\[0\]\), got 1"):
        decode_step_attention(q, k_new, v_new, q_pos, stacked, STEP_WINDOWS, layer=1)
    with pytest.raises(ValueError, match=r"groups\[0\].k/v: expected \[L, B=3, S, G=2, D=16\]"):
        decode_step_attention(q, k_new, v_new, q_pos, (g0, g1), STEP_WINDOWS, layer=0)
    with pytest.raises(ValueError, match=r"groups\[1\].k_pos: expected a SlotRule kind of"):
        decode_step_attention(q, k_new, v_new, q_pos,
                              (g0, CacheGroup(g1.k, g1.v, SlotRule("linear", q_pos), g1.slot_B,
                                              g1.kv_heads)), STEP_WINDOWS)
    with pytest.raises(ValueError, match=r"groups\[1\].k_pos.lengths_B: expected int \[B=3\]"):
        decode_step_attention(q, k_new, v_new, q_pos,
                              (g0, CacheGroup(g1.k, g1.v, SlotRule("ring", q_pos[:2]),
                                              g1.slot_B, g1.kv_heads)), STEP_WINDOWS)


@pytest.mark.gpu
def test_pallas_gpu_decode_step_on_gpu():
    q, k_new, v_new, q_pos, groups = step_case(S_global=300, D=32)
    ref, ref_kv = decode_step_attention(q, k_new, v_new, q_pos, groups, STEP_WINDOWS,
                                        implementation="reference")
    for dtype in (jnp.float32, jnp.bfloat16):
        cast = tuple(CacheGroup(g.k.astype(dtype), g.v.astype(dtype), g.k_pos, g.slot_B,
                                g.kv_heads) for g in groups)
        got, kv = decode_step_attention(q.astype(dtype), k_new.astype(dtype),
                                        v_new.astype(dtype), q_pos, cast, STEP_WINDOWS,
                                        implementation="pallas_gpu")
        np.testing.assert_allclose(got.astype(jnp.float32), ref,
                                   atol=3e-2 if dtype == jnp.bfloat16 else 1e-4)
        for (k, v), (rk, rv) in zip(kv, ref_kv):
            np.testing.assert_array_equal(k, rk.astype(dtype))
            np.testing.assert_array_equal(v, rv.astype(dtype))
