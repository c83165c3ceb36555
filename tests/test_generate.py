"""KV-cache decoding: prefill + cached steps equal one full forward pass; batching, sampling,
cache layout and size, bad input (CPU, tiny float32 models)."""

import functools
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ls_jax.config import ModelConfig
from ls_jax.inference.generate import (decode_step, generate, merge_flat, prefill_chunk_fn,
                                       prefill_compiler_options, sample_logits, split_flat)
from ls_jax.kernels.decode import ring_positions
from ls_jax.layers.kv_cache import CacheLayout, CacheStep
from ls_jax.layers.transformer import Transformer


def step_fn(graphdef, decode_implementation):
    """jit: (state, tokens_B, cache) -> (logits_BxV, cache), one token per row."""
    return jax.jit(lambda state, tokens_B, cache: decode_step(
        nnx.merge(graphdef, state), tokens_B, cache, decode_implementation=decode_implementation),
        donate_argnums=(2,))


def tiny_model(seed=0, **kw):
    base = dict(vocab_size=32, n_layer=2, d_model=32, n_head=4, head_dim=8, n_global_heads=1,
                window=3, max_seq_len=64, init_std=0.3)
    base.update(kw)
    return Transformer(ModelConfig(**base), rngs=nnx.Rngs(params=seed))


def cached_logits(model, tokens_BxT, n_prefill, chunk, decode_implementation=None):
    """Logits at every position: prefill n_prefill tokens in chunks (all logits kept), then
    one cached decode step per remaining token."""
    B, T = tokens_BxT.shape
    cache = model.init_cache(B, T, dtype=jnp.float32)
    graphdef, state = nnx.split(model)

    @functools.partial(jax.jit, static_argnums=(3, 4))
    def chunk_fn(state, tokens, cache, start, fresh):
        pos = jnp.broadcast_to(start + jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        return nnx.merge(graphdef, state).decode(
            tokens, cache, positions_BxC=pos, new_lengths_B=pos[:, -1] + 1, fresh=fresh,
            decode_implementation=decode_implementation)

    out = []
    for c, start in enumerate(range(0, n_prefill, chunk)):
        stop = min(start + chunk, n_prefill)
        logits, cache = chunk_fn(state, tokens_BxT[:, start:stop], cache, start, c == 0)
        out.append(logits)
    step = step_fn(graphdef, decode_implementation)
    for t in range(n_prefill, T):
        logits, cache = step(state, tokens_BxT[:, t], cache)
        out.append(logits[:, None])
    return jnp.concatenate(out, axis=1), cache


CASES = {
    # name: (model overrides, n_prefill, chunk)
    "learned_mha": (dict(), 7, 64),
    "learned_chunked": (dict(), 13, 5),
    "rope_gqa_mixed_kv_head": (dict(pos_embedding="rope", n_kv_head=2), 9, 4),
    "rope_gqa_pure_groups": (dict(pos_embedding="rope", n_kv_head=2, n_global_heads=2), 6, 64),
    "rope_mqa_all_local": (dict(pos_embedding="rope", n_kv_head=1, n_global_heads=0), 5, 2),
    "mhsa_all_global": (dict(n_global_heads=4), 10, 3),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_cached_logits_equal_full_forward(name):
    overrides, n_prefill, chunk = CASES[name]
    model = tiny_model(**overrides)
    T = 24  # window 3: the ring buffer wraps 6+ times during decoding
    tokens = jax.random.randint(jax.random.key(1), (2, T), 0, 32)
    full = model(tokens)
    got, cache = cached_logits(model, tokens, n_prefill, chunk)
    np.testing.assert_allclose(got, full, atol=2e-5, rtol=2e-5)
    np.testing.assert_array_equal(cache.lengths_B, [T, T])


def naive_greedy(model, prompt, n, width=32):
    """Greedy decoding without a cache: the full forward pass over the growing sequence
    (zero-padded to ``width``; causal attention keeps the padding out of earlier rows)."""
    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda state, x: nnx.merge(graphdef, state)(x))
    seq = list(prompt)
    for _ in range(n):
        buf = np.zeros((1, width), np.int32)
        buf[0, :len(seq)] = seq
        seq.append(int(jnp.argmax(forward(state, jnp.asarray(buf))[0, len(seq) - 1])))
    return seq[len(prompt):]


def test_batch_of_unequal_prompts_equals_each_alone_and_no_cache():
    model = tiny_model()  # learned positions (RoPE: test_batch_rows_logits_equal_alone)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 32, size=n).astype(np.int32) for n in (5, 11, 8)]
    batch = generate(model, prompts, max_new_tokens=9, chunk_size=4, cache_dtype=jnp.float32)
    assert batch.steps == 9 and batch.prompt_lengths == [5, 11, 8]
    for p, row in zip(prompts, batch.tokens):
        alone = generate(model, p, max_new_tokens=9, chunk_size=4, max_len=24,
                         cache_dtype=jnp.float32)
        np.testing.assert_array_equal(row, alone.tokens[0])
        np.testing.assert_array_equal(row, naive_greedy(model, p, 9))


@pytest.mark.slow
def test_batch_rows_logits_equal_alone():
    """Right padding never leaks: each row's cached logits equal its own full forward pass."""
    from ls_jax.inference.generate import prefill
    model = tiny_model(pos_embedding="rope", n_kv_head=2)
    rng = np.random.default_rng(1)
    seqs = [rng.integers(0, 32, size=20).astype(np.int32) for _ in range(3)]
    plen = [4, 13, 9]
    cache = model.init_cache(3, 24, dtype=jnp.float32)
    logits, cache = prefill(model, [s[:n] for s, n in zip(seqs, plen)], cache, chunk_size=5)
    graphdef, state = nnx.split(model)
    step = step_fn(graphdef, None)
    got = [[logits[b]] for b in range(3)]
    for i in range(6):
        logits, cache = step(state, jnp.asarray([s[n + i] for s, n in zip(seqs, plen)]), cache)
        for b in range(3):
            got[b].append(logits[b])
    for b, (s, n) in enumerate(zip(seqs, plen)):
        full = model(jnp.asarray(s[None, :n + 6]))[0, n - 1:]
        np.testing.assert_allclose(jnp.stack(got[b]), full, atol=2e-5, rtol=2e-5)


def test_end_id_stops_rows_and_the_loop():
    model = tiny_model()
    prompt = np.arange(1, 6, dtype=np.int32)
    free = generate(model, prompt, max_new_tokens=8, cache_dtype=jnp.float32).tokens[0]
    end = int(free[3])
    first = int(np.argmax(free == end))
    out = generate(model, prompt, max_new_tokens=8, end_id=end, cache_dtype=jnp.float32)
    np.testing.assert_array_equal(out.tokens[0], free[:first])
    assert out.steps == first + 1


def test_sampling_rules():
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]] * 4000))
    keys = jax.random.key(0)
    greedy = sample_logits(logits, keys)
    assert (greedy == 0).all()
    assert (sample_logits(logits, keys, temperature=1.0, top_k=1) == 0).all()
    assert (sample_logits(logits, keys, temperature=1.0, top_p=0.4) == 0).all()
    k2 = np.asarray(sample_logits(logits, keys, temperature=1.0, top_k=2))
    assert set(k2) == {0, 1} and abs((k2 == 0).mean() - 0.5 / 0.8) < 0.03
    p = np.asarray(sample_logits(logits, keys, temperature=1.0, top_p=0.85))  # {0, 1, 2}
    assert set(p) == {0, 1, 2} and abs((p == 2).mean() - 0.15 / 0.95) < 0.03
    free = np.asarray(sample_logits(logits, keys, temperature=1.0))
    assert abs((free == 3).mean() - 0.05) < 0.015
    again = np.asarray(sample_logits(logits, jax.random.key(0), temperature=1.0))
    np.testing.assert_array_equal(free, again)


def test_generate_sampling_is_seeded():
    model = tiny_model()
    kw = dict(max_new_tokens=12, temperature=1.0, top_k=10, top_p=0.9)
    a = generate(model, [1, 2, 3], seed=3, **kw).tokens[0]
    b = generate(model, [1, 2, 3], seed=3, **kw).tokens[0]
    c = generate(model, [1, 2, 3], seed=4, **kw).tokens[0]
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_layout_gqa_groups():
    mixed = CacheLayout.build((None, 5, 5, 5), n_head=4, n_kv_head=2)
    assert (mixed.global_kv, mixed.local_kv, mixed.ring_size(100)) == ((0,), (1,), 5)
    assert mixed.global_windows == (None, 5) and mixed.local_windows == (5, 5)
    odd = CacheLayout.build((7, None, 3, 5), n_head=4, n_kv_head=4)
    assert odd.global_kv == (1,) and odd.local_kv == (0, 2, 3)
    assert odd.q_order == (1, 0, 2, 3) and odd.ring_size(4) == 4  # capped at max_len
    assert odd.q_inverse == (1, 0, 2, 3)


def test_ring_positions_by_hand():
    # P = 3, lengths 0, 2, 7: slot s holds the last position < length congruent to s mod 3
    got = ring_positions(jnp.asarray([0, 2, 7]), 3)
    np.testing.assert_array_equal(got, [[-1, -1, -1], [0, 1, -1], [6, 4, 5]])


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_cache_bytes_match_the_formula(dtype):
    H, p, T, D, L, B = 6, 5, 40, 8, 3, 2
    kw = dict(vocab_size=16, n_layer=L, d_model=16, n_head=H, head_dim=D, window=p,
              max_seq_len=T)
    # the cache comes from the config: models of abstract parameters (none drawn)
    ls, mhsa = (nnx.eval_shape(lambda: Transformer(ModelConfig(n_global_heads=g, **kw),
                                                   rngs=nnx.Rngs(0))) for g in (1, H))
    ls_cache, mhsa_cache = ls.init_cache(B, T, dtype), mhsa.init_cache(B, T, dtype)
    item = jnp.dtype(dtype).itemsize
    # by hand: k and v per layer; LS: 1 head x T slots + 5 heads x p slots; MHSA: 6 heads x T
    assert ls_cache.nbytes() == L * 2 * B * (1 * T + 5 * p) * D * item == 2 * 3 * 2 * 65 * 8 * item
    assert mhsa_cache.nbytes() == L * 2 * B * H * T * D * item
    ratio = Fraction(ls_cache.nbytes(), mhsa_cache.nbytes())
    assert ratio == (1 + Fraction((H - 1) * p, T)) / H
    arrays = ls_cache.arrays()
    assert sum(x.nbytes for x in arrays) == ls_cache.nbytes()


def test_bad_input_one_clear_error_each():
    model = tiny_model()
    with pytest.raises(ValueError, match=r"prompt_tokens: .*empty"):
        generate(model, [], max_new_tokens=2)
    with pytest.raises(ValueError, match=r"prompt_tokens: expected non-empty"):
        generate(model, [[1, 2], []], max_new_tokens=2)
    with pytest.raises(ValueError, match=r"max_len: the cache holds 8 positions, but the "
                                         r"longest prompt has 10 tokens"):
        generate(model, list(range(10)), max_new_tokens=2, max_len=8)
    with pytest.raises(ValueError, match=r"max_new_tokens: prompt \(10 tokens\) \+ "
                                         r"max_new_tokens \(60\) = 70 exceeds model.max_seq_len=64"):
        generate(model, list(range(10)), max_new_tokens=60)
    with pytest.raises(ValueError, match=r"prompt_tokens: expected ids in \[0, 32\)"):
        generate(model, [1, 40], max_new_tokens=2)
    with pytest.raises(ValueError, match=r"top_p: expected"):
        generate(model, [1, 2], max_new_tokens=2, top_p=1.5)


def test_rope_generates_past_the_trained_length():
    model = tiny_model(pos_embedding="rope", max_seq_len=16)
    out = generate(model, list(range(1, 10)), max_new_tokens=20, cache_dtype=jnp.float32)
    assert len(out.tokens[0]) == 20
    np.testing.assert_array_equal(out.tokens[0],
                                  naive_greedy(model, list(range(1, 10)), 20, width=29))


def test_split_flat_round_trips_and_keys_one_compiled_loop_per_model():
    """The jitted pieces take the state's arrays as a list (flattened without Python); the
    structure half is equal for every split of one model, so each piece is built once."""
    from ls_jax.inference import generate as gen
    model = tiny_model()
    structure, arrays = split_flat(model)
    assert isinstance(arrays, list) and all(isinstance(a, jax.Array) for a in arrays)
    x = jnp.arange(12, dtype=jnp.int32).reshape(2, 6) % model.cfg.vocab_size
    np.testing.assert_array_equal(merge_flat(structure, arrays)(x), model(x))
    assert split_flat(model)[0] == structure
    fn = prefill_chunk_fn(structure, fresh=True, decode_implementation=None)
    assert prefill_chunk_fn(split_flat(model)[0], fresh=True, decode_implementation=None) is fn
    before = len(gen._FNS)
    generate(model, [1, 2, 3], max_new_tokens=2)
    built = len(gen._FNS)
    generate(model, [4, 5, 6], max_new_tokens=2)
    assert len(gen._FNS) == built >= before


@pytest.mark.gpu
def test_cached_logits_with_the_pallas_gpu_decode_kernel():
    model = tiny_model(pos_embedding="rope", n_kv_head=2, head_dim=16)
    tokens = jax.random.randint(jax.random.key(1), (2, 24), 0, 32)
    got, _ = cached_logits(model, tokens, 7, 64, decode_implementation="pallas_gpu")
    # GPU float32 matmuls may run in TF32: a loose tolerance (a wrong kernel is off by O(1))
    np.testing.assert_allclose(got, model(tokens), atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
def test_prefill_writes_q_k_v_as_three_products_not_slices_of_one():
    """With XLA's dot merger the chunk's q, k, v come from one product and are copied out of it
    (slice fusions); the prefill's compiler options keep them three products."""
    import re
    model = tiny_model(d_model=64, n_head=4, head_dim=16)
    structure, arrays = split_flat(model)
    B, T = 2, 32
    cache = model.init_cache(B, T, dtype=jnp.float32)
    args = (arrays, jnp.zeros((B, T), jnp.int32), cache, jnp.int32(0), jnp.full((B,), T, jnp.int32),
            jnp.zeros((B, 32), jnp.float32))
    fn = prefill_chunk_fn(structure, fresh=True, decode_implementation=None)
    slices = lambda text: len(re.findall(rf"= f32\[(?:{B},{T}|{B * T}),64\]\S* fusion\([^)]*\), "
                                         rf"kind=kLoop, calls=%fused_slice", text))
    # a compile's own options come after the jit's: this one turns the merger back on
    merged = fn.lower(*args).compile(compiler_options={"xla_disable_hlo_passes": ""}).as_text()
    assert prefill_compiler_options() is not None
    assert slices(merged) == 3 * model.cfg.n_layer  # what the option is for: still true of XLA
    assert slices(fn.lower(*args).compile().as_text()) == 0


def test_a_fresh_prefill_chunk_is_partitioned_like_training(monkeypatch):
    """Under a mesh, the first prefill chunk's kernel call gets the partition spec of the
    training forward's (one kernel call per shard), not a whole-array call."""
    from ls_jax import sharding
    from ls_jax.inference.generate import prefill
    from ls_jax.layers import attention as attention_lib

    specs = []
    kernel = attention_lib.ls_attention_validated

    def recording(*args, partition_spec=None, **kwargs):
        specs.append(partition_spec)
        return kernel(*args, partition_spec=partition_spec, **kwargs)

    monkeypatch.setattr(attention_lib, "ls_attention_validated", recording)
    model = tiny_model()
    with jax.set_mesh(sharding.make_mesh(devices=jax.devices()[:1])):
        model(jnp.zeros((2, 8), jnp.int32))
        training = specs[-1]
        prefill(model, [[1, 2, 3], [4, 5]], model.init_cache(2, 16, dtype=jnp.float32),
                chunk_size=8)
    assert training is not None and specs[-1] == training


@pytest.mark.parametrize("n_global_heads", [1, 4], ids=["ls", "mhsa"])
def test_decode_step_writes_every_layer_in_place(n_global_heads):
    """A decode step runs the blocks' scan unrolled (no loop) and each layer's write lands in
    the donated cache arrays [L, ...]: no copy of a cache array in the compiled step, and each
    block reads a static slice of them (its layer index a constant)."""
    import re
    model = tiny_model(n_layer=3, n_global_heads=n_global_heads)
    graphdef, state = nnx.split(model)
    cache = model.init_cache(2, 48, dtype=jnp.bfloat16)
    text = step_fn(graphdef, None).lower(state, jnp.zeros((2,), jnp.int32), cache).compile()\
        .as_text()
    assert " while(" not in text
    shapes = {",".join(map(str, x.shape)) for x in cache.arrays() if x.size}
    copies = [line for line in text.splitlines()
              if re.search(r"= bf16\[([\d,]+)\]\S* copy\(", line)
              and re.search(r"= bf16\[([\d,]+)\]", line).group(1) in shapes]
    assert copies == []
    layer_shapes = {",".join(map(str, (1,) + x.shape[1:])) for x in cache.arrays() if x.size}
    dynamic = [line for line in text.splitlines()
               if re.search(r"= bf16\[([\d,]+)\]\S* dynamic-slice\(", line)
               and re.search(r"= bf16\[([\d,]+)\]", line).group(1) in layer_shapes]
    assert dynamic == []


def test_a_cached_call_names_a_layer_of_the_cache():
    model = tiny_model(n_layer=2)
    cache = model.init_cache(1, 8)
    step = CacheStep(cache.lengths_B, cache.lengths_B + 1)
    x = jnp.zeros((1, 1, model.cfg.d_model))
    with pytest.raises(ValueError, match=r"layer: expected 0 <= layer < 2"):
        model.blocks[0].attn(x, positions=jnp.zeros((1, 1), jnp.int32), cache=cache, step=step,
                             layer=2)
